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
  paths; 503 (retryable, ``Retry-After``) while the queue stays full or the receiver is shutting down.

``GET /metrics`` serves the receiver's own counters. ``stop()`` refuses new bodies, waits
for those in flight, drains the queue and commits: a clean shutdown loses nothing accepted.
"""

from __future__ import annotations

import logging
import queue
import re
import socket
import threading
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from collector.otlp import OtlpDecodeError, SpanBatch, parse_otlp_json, parse_otlp_protobuf
from kvlens.errors import ConfigError
from kvlens.lake import SegmentWriter

__all__ = [
    "DEFAULT_MAX_BODY_BYTES", "OtlpReceiver", "ReceiverMetrics", "ReceiverOptions", "inflate_bounded",
    "parse_listen",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
_PROTOBUF, _JSON = "application/x-protobuf", "application/json"
_STOP = object()
_APPEND_ROWS = 8192


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


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port)."""
    m = re.fullmatch(r"\[(?P<v6>[^\]]+)\]:(?P<p>\d+)|(?P<h>[^:\[\]]+):(?P<port>\d+)", text.strip())
    port = int(m.group("p") or m.group("port")) if m else -1
    if not m or not 0 <= port <= 65535:
        raise ConfigError(f"--listen {text!r} is not HOST:PORT: give e.g. 127.0.0.1:4318 or [::1]:4318")
    return m.group("v6") or m.group("h"), port


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

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (tests, logs); 0 when it was never set."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v


class _HttpError(Exception):
    def __init__(self, status: int, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.close = status, close


def inflate_bounded(data: bytes, limit_bytes: int, *, encoding: str = "gzip") -> bytes:
    """Gunzip (all members) or inflate (``deflate``: zlib) to at most ``limit_bytes``; _HttpError 413/400."""
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    out: list[bytes] = []
    total = 0
    while data:
        d = zlib.decompressobj(wbits)
        try:
            chunk = d.decompress(data, limit_bytes - total + 1)
        except zlib.error as e:
            raise _HttpError(400, f"broken {encoding} body: {e}") from None
        total += len(chunk)
        if total > limit_bytes:
            raise _HttpError(413, f"body inflates past the limit of {limit_bytes} bytes")
        if not d.eof or (d.unused_data and encoding != "gzip"):
            raise _HttpError(400, f"truncated or trailing data in the {encoding} body")
        out.append(chunk)
        data = d.unused_data
    return b"".join(out)


def _status_body(content_type: str, message: str) -> bytes:
    """A ``google.rpc.Status`` (code 3, INVALID_ARGUMENT) in the request's encoding."""
    if content_type == _JSON:
        import json

        return json.dumps({"code": 3, "message": message}).encode()
    msg = message.encode()[:4096]
    return b"\x08\x03\x12" + _varint(len(msg)) + msg


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 receiver: OtlpReceiver) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.receiver = receiver
        super().__init__(address, handler)


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
        try:
            status, body = rec.handle_post(self.path, content_type, self.headers, reader)
        except _HttpError as e:
            if not _drain(reader, self.headers):
                e.close = True
            rec.metrics.responses.labels(str(e.status)).inc()
            log.info("OTLP %s from %s: %s", e.status, self.address_string(), e)
            body_type = content_type if content_type in (_PROTOBUF, _JSON) else "text/plain"
            payload = (str(e).encode() + b"\n" if body_type == "text/plain"
                       else _status_body(body_type, str(e)))
            self._send(e.status, payload, body_type, close=e.close,
                       extra={"Retry-After": "1"} if e.status == 503 else None)
            return
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


# An error answered before the body was read still reads (and drops) up to this much of it, so
# that a client still writing its body reads the status instead of a broken pipe; a larger
# declared body is refused with the connection closed.
_DRAIN_MAX_BYTES = 16 << 20


class _CountingReader:
    """The request body stream, counting what the handler has read."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.count = raw, 0

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.raw.read(n)
        self.count += len(data)
        return data


def _drain(reader: _CountingReader, headers: Any) -> bool:
    """Read and drop the unread rest of a declared body; False when that is not possible."""
    try:
        rest = int(headers.get("Content-Length", "")) - reader.count
    except ValueError:
        return False
    if rest < 0 or rest > _DRAIN_MAX_BYTES:
        return False
    while rest > 0:
        chunk = reader.raw.read(min(rest, 1 << 16))
        if not chunk:
            return False
        rest -= len(chunk)
    return True


class OtlpReceiver:
    """An OTLP/HTTP trace receiver writing ``requests`` rows; ``start``/``stop`` or a ``with`` block."""

    def __init__(self, options: ReceiverOptions, *, metrics: ReceiverMetrics | None = None) -> None:
        self.opt = options
        self.metrics = metrics or ReceiverMetrics()
        self.queue: queue.Queue[Any] = queue.Queue(options.queue_batches)
        self._lock = threading.Lock()
        self._inflight = 0
        self._closing = False
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self.writer_error: BaseException | None = None
        self._rows_counted = 0
        self.writer_id = options.writer_id or f"otlp-{options.host}_{options.port}".replace(":", "_")

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); the port is the real one when 0 was asked for."""
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> OtlpReceiver:
        o = self.opt
        writer = SegmentWriter(o.lake, "requests", scenario=o.scenario, writer_id=self.writer_id,
                               flush_rows=1 << 62, flush_age_s=o.flush_age_s)
        try:
            self._server = _Server((o.host, o.port), _Handler, self)
        except OSError as e:
            raise ConfigError(f"cannot listen on {o.host}:{o.port} ({e}): pick a free port") from None
        self._threads = [threading.Thread(target=self._write_loop, args=(writer,), name="kvlens-otlp-writer"),
                         threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                          name="kvlens-otlp-http", daemon=True)]
        for t in self._threads:
            t.start()
        log.info("OTLP receiver on http://%s:%d/v1/traces -> %s", *self.address, o.lake)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Refuse new bodies, finish those in flight, drain the queue, commit."""
        if self._server is None:
            return
        with self._lock:
            self._closing = True
        self._server.shutdown()
        deadline = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._threads[0].is_alive():
            self.queue.put(_STOP, timeout=max(0.1, deadline - time.monotonic()))
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
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

    def handle_post(self, path: str, content_type: str, headers: Any, rfile: Any) -> tuple[int, bytes]:
        """Read, decode and enqueue one body: (status, response body), or _HttpError."""
        if path.split("?", 1)[0] != "/v1/traces":
            raise _HttpError(404, f"no such path {path!r}: OTLP traces go to /v1/traces", close=True)
        if content_type not in (_PROTOBUF, _JSON):
            raise _HttpError(415, f"unsupported Content-Type {content_type!r}: send {_PROTOBUF} or {_JSON}",
                             close=True)
        encoding = (headers.get("Content-Encoding") or "identity").strip().lower()
        if encoding not in ("gzip", "deflate", "identity"):
            raise _HttpError(415, f"unsupported Content-Encoding {encoding!r}: send gzip, deflate or none",
                             close=True)
        body = self._read_body(headers, rfile)
        if encoding != "identity":
            body = inflate_bounded(body, self.opt.max_body_bytes, encoding=encoding)
        batch = self._decode(body, content_type)
        self._enqueue(batch)
        return 200, (b"{}" if content_type == _JSON else b"")

    def _read_body(self, headers: Any, rfile: Any) -> bytes:
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
        body: bytes = rfile.read(length)
        if len(body) != length:
            raise _HttpError(400, f"body ended after {len(body)} of {length} bytes", close=True)
        self.metrics.received_bytes.inc(length)
        return body

    def _decode(self, body: bytes, content_type: str) -> SpanBatch:
        parse = parse_otlp_json if content_type == _JSON else parse_otlp_protobuf
        try:
            batch = parse(body, replica=self.opt.replica, model=self.opt.model)
        except OtlpDecodeError as e:
            raise _HttpError(400, str(e)) from None
        m = self.metrics.spans
        m.labels("llm_request").inc(len(batch.rows))
        m.labels("other").inc(batch.other_spans)
        m.labels("bad").inc(batch.bad_spans)
        return batch

    def _enqueue(self, batch: SpanBatch) -> None:
        if self.writer_error is not None:
            raise _HttpError(503, f"the lake writer failed ({self.writer_error}); retry later")
        if not batch.rows:
            return
        with self._lock:
            if self._closing:
                raise _HttpError(503, "the receiver is shutting down; retry later")
            self._inflight += 1
        try:
            self.queue.put(batch.rows, timeout=self.opt.put_timeout_s)
        except queue.Full:
            raise _HttpError(503, "the receiver is behind (queue full); retry later") from None
        finally:
            with self._lock:
                self._inflight -= 1
        self.metrics.requests.inc(len(batch.rows))
        self.metrics.queue_batches.set(self.queue.qsize())

    # -- the writer thread ----------------------------------------------------------------------

    def _write_loop(self, writer: SegmentWriter) -> None:
        pending: list[dict[str, Any]] = []
        tick = min(0.2, self.opt.flush_age_s)
        try:
            while True:
                try:
                    item = self.queue.get(timeout=tick)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    break
                if item:
                    pending.extend(item)
                if pending and (item is None or len(pending) >= _APPEND_ROWS or self.queue.empty()):
                    writer.append_rows(pending)
                    pending = []
                self._flush(writer, force=False)
            writer.append_rows(pending)
            self._flush(writer, force=True)
        except BaseException as e:  # the disk is full or gone: report it, refuse new bodies
            log.exception("OTLP receiver: lake writer failed")
            self.writer_error = e
            writer.abort()

    def _flush(self, writer: SegmentWriter, *, force: bool) -> None:
        if force:
            writer.commit()
        else:
            writer.maybe_flush()
        # append_rows may have flushed too (age reached): count from the writer's own total.
        self.metrics.rows_written.inc(writer.rows_written - self._rows_counted)
        self._rows_counted = writer.rows_written
        self.metrics.queue_batches.set(self.queue.qsize())
