"""Collector for live engine traces: OTLP/HTTP ``POST /v1/traces`` -> bounded queue -> ``requests`` segments.

A stdlib ``ThreadingHTTPServer`` (one thread per connection, keep-alive) decodes each body
(collector/otlp.py) and puts its rows on a queue bounded in batches; one writer thread
appends them to a ``SegmentWriter`` (scenario ``live``) that commits a segment at least every
``flush_age_s``. Responses follow the OTLP/HTTP spec:

- 200 with an empty ``ExportTraceServiceResponse``, protobuf or JSON like the request;
- 400 for a body that does not decode (bad protobuf, bad JSON, broken gzip), with a
  ``google.rpc.Status`` body; 411 without a Content-Length (chunked bodies are refused);
- 413 for a body over ``max_body_bytes``, compressed or, read through a bounded gunzip that
  stops at the limit, uncompressed (a gzip bomb costs at most the limit in memory);
- 415 for a Content-Type other than ``application/x-protobuf`` / ``application/json``, or a
  Content-Encoding other than gzip or deflate (what OTLP exporters send); 404 for other
  paths; 503 (retryable, ``Retry-After``) while the queue stays full, the memory budget is
  spent, or the receiver is shutting down; 500 for a body the decoder failed on (a bug: logged
  with its first bytes, counted, and the receiver goes on).

Bounded memory: bodies read and inflated, of all requests together, hold at most
``memory_budget_bytes``: a request reserves its body and, when compressed, the most it may
inflate to, in one step before it reads, and gives back what it did not use; one that cannot
reserve in ``put_timeout_s`` gets 503. So 32 concurrent gzip bombs cost the
budget, not 32 times the body limit. The listen backlog is ``listen_backlog`` (the stdlib's 5
made 500 quick connections wait seconds each).

A body answered with an error before it was read is still read (a Content-Length body up to
16 MiB, a chunked body up to the same, by its framing) and any connection closed with unread
bytes is closed gracefully (half-closed, then drained for a bounded time), so a client still
sending reads its status instead of a broken pipe or a reset. A client that hangs up is logged
at debug level, never a traceback.

The writer thread survives any single batch: rows the lake cannot hold are written aside to
``LAKE/.quarantine/`` (counted) and the rest of their batch is written; a lake write that fails
is retried with back-off, the rows kept (at most ``max_buffered_rows``; past it the queue fills
and clients get 503, which OTLP exporters retry). ``GET /metrics`` serves the receiver's own
counters. ``stop()`` refuses new bodies, waits for those in flight, drains the queue and
commits (or, if the lake still refuses, spills the rows to the quarantine): a clean shutdown
loses nothing accepted.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from kvlens.collector.otlp import OtlpDecodeError, SpanBatch, parse_otlp_json, parse_otlp_protobuf
from kvlens.collector.otlp_http import (
    _JSON,
    _PROTOBUF,
    _Budget,
    _CountingReader,
    _drain,
    _Grant,
    _HttpError,
    _status_body,
    inflate_bounded,
)
from kvlens.collector.otlp_writer import RowWriter
from kvlens.errors import ConfigError
from kvlens.supervise import parse_listen

__all__ = [
    "DEFAULT_MAX_BODY_BYTES", "OtlpReceiver", "ReceiverMetrics", "ReceiverOptions", "inflate_bounded",
    "parse_listen",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 2**20


@dataclass
class ReceiverOptions:
    lake: str | Path
    host: str = "127.0.0.1"
    port: int = 4318
    scenario: str = "live"
    replica: str | None = None
    model: str | None = None
    writer_id: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    flush_age_s: float = 5.0
    queue_batches: int = 1024
    put_timeout_s: float = 5.0
    memory_budget_bytes: int | None = None  # bodies in memory, all requests: default 4 x max_body_bytes
    listen_backlog: int = 1024
    max_buffered_rows: int = 1_000_000  # while the lake refuses writes; past it the queue fills (503)


class ReceiverMetrics:
    """The receiver's own Prometheus metrics, unit-suffixed, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        p = "kvlens_otlp_"
        self.spans = Counter(p + "spans", "Spans received, by kind (llm_request, other, bad)", ["kind"],
                             registry=r)
        self.requests = Counter(p + "requests", "requests rows accepted from llm_request spans", registry=r)
        self.responses = Counter(p + "http_responses", "HTTP responses, by status code", ["status"],
                                 registry=r)
        self.received_bytes = Counter(p + "received_body_bytes", "Request body bytes read (on the wire)",
                                      registry=r)
        self.rows_written = Counter(p + "written_rows", "requests rows committed to the lake", registry=r)
        self.queue_batches = Gauge(p + "queue_batches", "Bodies waiting for the writer", registry=r)
        self.write_errors = Counter(p + "write_errors", "Lake writes that failed (retried)", registry=r)
        self.quarantined = Counter(p + "quarantined_rows", "Rows the lake refused, written to .quarantine",
                                   registry=r)
        self.internal_errors = Counter(p + "internal_errors", "Bodies or batches a bug failed on (skipped)",
                                       registry=r)
        self.budget_bytes = Gauge(p + "body_memory_bytes", "Body bytes held by requests in progress",
                                  registry=r)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (tests, logs); 0 when it was never set."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v


# Exceptions of a client that went away mid-request: logged at debug level, never a traceback.
_HANGUPS = (ConnectionError, TimeoutError, socket.timeout)
_LINGER_S = 2.0  # how long a closing connection is drained of what the client still sends
_LINGER_BYTES = 64 << 20


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 receiver: OtlpReceiver) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.receiver = receiver
        self.request_queue_size = receiver.opt.listen_backlog
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, _HANGUPS):
            log.debug("OTLP client %s went away: %s", client_address, exc)
            return
        self.receiver.metrics.internal_errors.inc()
        log.error("OTLP connection from %s failed", client_address, exc_info=exc)

    def shutdown_request(self, request: Any) -> None:
        """Close gracefully: send FIN, drain what the client still sends (bounded), then close; a
        plain close with unread bytes would reset the connection under the client's last write."""
        try:
            request.shutdown(socket.SHUT_WR)
            request.settimeout(0.2)
            deadline, drained = time.monotonic() + _LINGER_S, 0
            while time.monotonic() < deadline and drained < _LINGER_BYTES:
                data = request.recv(1 << 16)
                if not data:
                    break
                drained += len(data)
        except OSError:
            pass
        self.close_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 60  # an idle keep-alive connection is dropped after this

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == "/metrics":
            self._send(200, generate_latest(self.server.receiver.metrics.registry), CONTENT_TYPE_LATEST)
        else:
            self._send(404, b"not found\n", "text/plain", close=True)

    def do_POST(self) -> None:
        rec = self.server.receiver
        content_type = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        reader = _CountingReader(self.rfile)
        grant = _Grant(rec.budget, rec.opt.put_timeout_s)
        try:
            status, body = rec.handle_post(self.path, content_type, self.headers, reader, grant)
        except _HttpError as e:
            grant.release()
            if not _drain(reader, self.headers):
                e.close = True
            rec.metrics.responses.labels(str(e.status)).inc()
            log.info("OTLP %s from %s: %s; body starts %r", e.status, self.address_string(), e, reader.head)
            body_type = content_type if content_type in (_PROTOBUF, _JSON) else "text/plain"
            payload = (str(e).encode() + b"\n" if body_type == "text/plain"
                       else _status_body(body_type, str(e)))
            self._send(e.status, payload, body_type, close=e.close,
                       extra={"Retry-After": "1"} if e.status == 503 else None)
            return
        except _HANGUPS:
            grant.release()
            raise
        except Exception as e:  # a bug on this body: count it, log its first bytes, answer, go on
            grant.release()
            rec.metrics.internal_errors.inc()
            rec.metrics.responses.labels("500").inc()
            log.exception("OTLP body from %s failed the decoder (%s); body starts %r", self.address_string(),
                          e, reader.head)
            self._send(500, b"internal error on this body; it was not stored\n", "text/plain", close=True)
            return
        grant.release()
        rec.metrics.responses.labels(str(status)).inc()
        self._send(status, body, content_type)

    def _send(self, status: int, body: bytes, content_type: str, *, close: bool = False,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        if close:  # the request body was not read: the connection cannot be reused
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)


class OtlpReceiver:
    """An OTLP/HTTP trace receiver writing ``requests`` rows; ``start``/``stop`` or a ``with`` block."""

    def __init__(self, options: ReceiverOptions, *, metrics: ReceiverMetrics | None = None) -> None:
        self.opt = options
        self.metrics = metrics or ReceiverMetrics()
        budget = options.memory_budget_bytes or 4 * options.max_body_bytes
        self.budget = _Budget(max(budget, options.max_body_bytes), self.metrics)
        self._lock = threading.Lock()
        self._inflight = 0
        self._closing = False
        self._server: _Server | None = None
        self._http: threading.Thread | None = None
        self._writer: RowWriter | None = None
        self.writer_id = options.writer_id or f"otlp-{options.host}_{options.port}".replace(":", "_")

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); the port is the real one when 0 was asked for."""
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def writer_error(self) -> BaseException | None:
        """Set when the last commit could neither be written nor spilled (then stop() raises it)."""
        return self._writer.error if self._writer else None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> OtlpReceiver:
        o = self.opt
        writer = RowWriter(o.lake, scenario=o.scenario, writer_id=self.writer_id, flush_age_s=o.flush_age_s,
                           queue_batches=o.queue_batches, max_buffered_rows=o.max_buffered_rows,
                           metrics=self.metrics)
        try:
            self._server = _Server((o.host, o.port), _Handler, self)
        except OSError as e:
            raise ConfigError(f"cannot listen on {o.host}:{o.port} ({e}): pick a free port") from None
        self._writer = writer
        writer.start()
        self._http = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                      name="kvlens-otlp-http", daemon=True)
        self._http.start()
        log.info("OTLP receiver on http://%s:%d/v1/traces -> %s", *self.address, o.lake)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Refuse new bodies, finish those in flight, drain the queue, commit."""
        if self._server is None or self._writer is None:
            return
        with self._lock:
            self._closing = True
        self._server.shutdown()
        deadline = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        self._writer.stop(max(0.1, deadline - time.monotonic()))
        if self._http is not None:
            self._http.join(max(0.0, deadline - time.monotonic()))
        self._server.server_close()
        self._server = None
        if self.writer_error is not None:
            raise self.writer_error

    def run(self, duration_s: float | None = None, stop_event: threading.Event | None = None) -> None:
        """Serve until ``stop_event`` is set or ``duration_s`` passes; then stop cleanly."""
        event = stop_event or threading.Event()
        self.start()
        try:
            event.wait(duration_s)
        finally:
            self.stop()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- one request -------------------------------------------------------------------------

    def handle_post(self, path: str, content_type: str, headers: Any, rfile: Any,
                    grant: _Grant | None = None) -> tuple[int, bytes]:
        """Read, decode and enqueue one body: (status, response body), or _HttpError."""
        grant = grant or _Grant(None, 0.0)
        if path.split("?", 1)[0] != "/v1/traces":
            raise _HttpError(404, f"no such path {path!r}: OTLP traces go to /v1/traces", close=True)
        if content_type not in (_PROTOBUF, _JSON):
            raise _HttpError(415, f"unsupported Content-Type {content_type!r}: send {_PROTOBUF} or {_JSON}",
                             close=True)
        encoding = (headers.get("Content-Encoding") or "identity").strip().lower()
        if encoding not in ("gzip", "deflate", "identity"):
            raise _HttpError(415, f"unsupported Content-Encoding {encoding!r}: send gzip, deflate or none",
                             close=True)
        # One reservation, taken before anything is held (no request waits while holding, so no
        # deadlock): the body, and for a compressed one what it may inflate to; the unused part
        # goes back once it has inflated.
        inflating = encoding != "identity"
        body: bytes | bytearray = self._read_body(headers, rfile, grant,
                                                  self.opt.max_body_bytes if inflating else 0)
        if inflating:
            body = inflate_bounded(body, self.opt.max_body_bytes, encoding=encoding)
            grant.keep(grant.held - self.opt.max_body_bytes + len(body))
        batch = self._decode(body, content_type)
        self._enqueue(batch)
        return 200, (b"{}" if content_type == _JSON else b"")

    def _read_body(self, headers: Any, rfile: Any, grant: _Grant, extra_bytes: int) -> bytes:
        try:
            length = int(headers.get("Content-Length", ""))
        except ValueError:
            raise _HttpError(411, "a Content-Length is required (chunked bodies are not read)",
                             close=True) from None
        if length < 0:
            raise _HttpError(400, "negative Content-Length", close=True)
        if length > self.opt.max_body_bytes:
            raise _HttpError(413, f"body of {length} bytes is over the limit of {self.opt.max_body_bytes}",
                             close=True)
        grant.take(length + extra_bytes)
        body: bytes = rfile.read(length)
        if len(body) != length:
            raise _HttpError(400, f"body ended after {len(body)} of {length} bytes", close=True)
        self.metrics.received_bytes.inc(length)
        return body

    def _decode(self, body: bytes | bytearray, content_type: str) -> SpanBatch:
        parse = parse_otlp_json if content_type == _JSON else parse_otlp_protobuf
        try:
            batch = parse(body, replica=self.opt.replica, model=self.opt.model)
        except OtlpDecodeError as e:
            raise _HttpError(400, str(e)) from None
        m = self.metrics.spans
        m.labels("llm_request").inc(len(batch.rows))
        m.labels("other").inc(batch.other_spans)
        m.labels("bad").inc(batch.bad_spans)
        if batch.bad_spans:
            log.warning("OTLP: skipped %d llm_request spans that cannot be rows (%s)", batch.bad_spans,
                        "; ".join(batch.bad_reasons))
        return batch

    def _enqueue(self, batch: SpanBatch) -> None:
        if not batch.rows:
            return
        assert self._writer is not None
        with self._lock:
            if self._closing:
                raise _HttpError(503, "the receiver is shutting down; retry later")
            self._inflight += 1
        try:
            if not self._writer.put(batch.rows, self.opt.put_timeout_s):
                raise _HttpError(503, "the receiver is behind (queue full); retry later")
        finally:
            with self._lock:
                self._inflight -= 1
        self.metrics.requests.inc(len(batch.rows))
