"""Tests for collector.otlp_server: the OpenTelemetry SDK's own OTLP/HTTP exporter and urllib posts
feed a receiver on a random loopback port; bad bodies get their status and it keeps serving."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvlens.collector.otlp import parse_otlp_protobuf
from kvlens.collector.otlp_server import OtlpReceiver, ReceiverOptions, inflate_bounded, parse_listen
from kvlens.errors import ConfigError
from kvlens.lake import segment_files
from kvlens.query import query

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
BODY_001 = (DATA / "vllm-cpu-capture" / "otlp_001.pb").read_bytes()  # 70 real llm_request spans
LIMIT = 1 << 20
T0_NS = 1_796_000_000_000_000_000


def _query(lake: Path, sql: str) -> list[tuple[Any, ...]]:
    return query(sql, lake=lake)[1]


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[OtlpReceiver]:
    # A flush age of an hour: every row in the lake below was committed by the clean stop().
    rec = OtlpReceiver(ReceiverOptions(lake=tmp_path / "lake", port=0, max_body_bytes=LIMIT,
                                       flush_age_s=3600)).start()
    try:
        yield rec
    finally:
        rec.stop()


def _url(rec: OtlpReceiver, path: str = "/v1/traces") -> str:
    host, port = rec.address
    return f"http://{host}:{port}{path}"


def _post(url: str, body: bytes, content_type: str = "application/x-protobuf",
          encoding: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": content_type, **({"Content-Encoding": encoding} if encoding else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:  # an unclosed error response leaks its socket into a later test's warnings
            return e.code, e.read()


def _sdk_spans(n: int) -> list[ReadableSpan]:
    """n finished llm_request spans (vLLM's attributes, request i: ttft i ms) and 2 other spans."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.instance.id": "vllm-7"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("vllm.llm_engine")
    for i in range(n):
        start = T0_NS + i * 1_000_000_000
        attrs = {"gen_ai.request.id": f"cmpl-{i:04d}-0", "gen_ai.latency.time_to_first_token": (i + 1) / 1000,
                 "gen_ai.latency.time_in_queue": 0.0005, "gen_ai.latency.time_in_model_prefill": i / 2000,
                 "gen_ai.usage.prompt_tokens": 100 + i, "gen_ai.usage.completion_tokens": 7}
        tracer.start_span("llm_request", start_time=start, attributes=attrs).end(end_time=start + 90_000_000)
    for name in ("Overall Loading", "Allocate KV cache"):
        tracer.start_span(name).end()
    provider.shutdown()
    return list(memory.get_finished_spans())


def test_sdk_exporter_spans_land_once_with_their_timings(receiver: OtlpReceiver, tmp_path: Path) -> None:
    spans = _sdk_spans(300)
    parts = (spans[:100], spans[100:200], spans[200:])
    for part, compression in zip(parts, (None, Compression.Gzip, Compression.Deflate), strict=True):
        exporter = OTLPSpanExporter(endpoint=_url(receiver), timeout=10, compression=compression)
        assert exporter.export(part) is SpanExportResult.SUCCESS
        exporter.shutdown()
    receiver.stop()
    rows = _query(tmp_path / "lake",
                  "SELECT request_id, arrival_ns, first_token_ns, end_ns, ttft_ms, queue_ms, prefill_ms, "
                  "prompt_tokens, output_tokens, replica, scenario, source FROM requests ORDER BY request_id")
    assert len(rows) == 300
    for i, row in enumerate(rows):
        start = T0_NS + i * 1_000_000_000
        assert row[0] == f"cmpl-{i:04d}-0"  # the engine's id, as sent
        assert row[1:4] == (start, start + (i + 1) * 1_000_000, start + 90_000_000)
        assert row[4:7] == pytest.approx((i + 1, 0.5, i / 2))
        assert row[7:] == (100 + i, 7, "vllm-7", "live", "otlp")
    m = receiver.metrics
    assert m.value("kvlens_otlp_spans_total", kind="other") == 2
    assert m.value("kvlens_otlp_written_rows_total") == 300
    assert m.value("kvlens_otlp_http_responses_total", status="200") == 3


def _json_body(body: bytes) -> bytes:
    doc = MessageToDict(ExportTraceServiceRequest.FromString(body))  # camelCase, int64 as strings
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:  # the OTLP JSON mapping writes ids as hex, not base64
                span["traceId"] = "0" * 31 + "1"
                span["spanId"] = "0" * 15 + "2"
    return json.dumps(doc).encode()


def test_json_posts_land_once(receiver: OtlpReceiver, tmp_path: Path) -> None:
    status, reply = _post(_url(receiver), _json_body(BODY_001), "application/json; charset=utf-8")
    assert (status, json.loads(reply)) == (200, {})
    status, reply = _post(_url(receiver), gzip.compress(_json_body(BODY_001)[:-1]), "application/json",
                          "gzip")
    assert status == 400 and json.loads(reply)["code"] == 3  # truncated JSON: nothing lands
    receiver.stop()
    got = _query(tmp_path / "lake", "SELECT request_id, arrival_ns, first_token_ns, end_ns, prompt_tokens "
                                    "FROM requests ORDER BY arrival_ns")
    expected = [tuple(r[k] for k in ("request_id", "arrival_ns", "first_token_ns", "end_ns", "prompt_tokens"))
                for r in parse_otlp_protobuf(BODY_001).rows]
    assert len(got) == 70 and got == sorted(expected, key=lambda r: r[1])


def _bomb(size: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = bytes(1 << 20)
    return b"".join([*(c.compress(chunk) for _ in range(size >> 20)), c.flush()])


def test_bad_bodies_get_their_status_and_the_receiver_keeps_serving(receiver: OtlpReceiver,
                                                                   tmp_path: Path) -> None:
    url = _url(receiver)
    bomb = _bomb(256 << 20)  # 256 MiB of zeros in ~250 KiB of gzip
    assert len(bomb) < LIMIT
    cases: list[tuple[Callable[[], tuple[int, bytes]], int]] = [
        (lambda: _post(url, b"\xff\xfe garbage \x00"), 400),
        (lambda: _post(url, b"{not json", "application/json"), 400),
        (lambda: _post(url, b"\x1f\x8b not really gzip", encoding="gzip"), 400),
        (lambda: _post(url, bomb, encoding="gzip"), 413),
        (lambda: _post(url, bytes(LIMIT + 1)), 413),
        (lambda: _post(url, BODY_001, "text/plain"), 415),
        (lambda: _post(url, BODY_001, encoding="br"), 415),
        (lambda: _post(_url(receiver, "/v1/metrics"), BODY_001), 404),
    ]
    for send, expected in cases:
        status, reply = send()
        assert status == expected, reply
        assert _post(url, BODY_001)[0] == 200  # and the next good body is accepted
    conn = http.client.HTTPConnection(*receiver.address, timeout=10)  # chunked: no Content-Length
    conn.request("POST", "/v1/traces", iter([BODY_001]), {"Content-Type": "application/x-protobuf"},
                 encode_chunked=True)
    assert conn.getresponse().status == 411
    conn.close()
    status, reply = _post(url, b"\xff" * 3)
    assert reply[:2] == b"\x08\x03"  # a google.rpc.Status, code INVALID_ARGUMENT
    with urllib.request.urlopen(_url(receiver, "/metrics"), timeout=10) as r:
        metrics = r.read().decode()
    assert 'kvlens_otlp_http_responses_total{status="413"} 2.0' in metrics
    receiver.stop()
    assert _query(tmp_path / "lake", "SELECT count(*), count(DISTINCT request_id) FROM requests") == [
        (70 * len(cases), 70)]


def test_inflate_stops_at_the_limit() -> None:
    assert inflate_bounded(gzip.compress(b"a" * 100) + gzip.compress(b"b"), 101) == b"a" * 100 + b"b"
    assert inflate_bounded(zlib.compress(b"abc"), 3, encoding="deflate") == b"abc"
    for data, limit in ((gzip.compress(b"a" * 100), 99), (gzip.compress(b"a" * 60) * 2, 100)):
        with pytest.raises(Exception, match="limit") as info:
            inflate_bounded(data, limit)
        assert info.value.status == 413  # type: ignore[attr-defined]


def test_rows_are_committed_while_running(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    with OtlpReceiver(ReceiverOptions(lake=lake, port=0, flush_age_s=0.2, replica="r9")) as rec:
        assert _post(_url(rec), BODY_001)[0] == 200
        deadline = time.monotonic() + 10
        while not segment_files(lake, "requests") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _query(lake, "SELECT count(*), min(replica) FROM requests") == [(70, "r9")]


def test_listen_addresses() -> None:
    assert parse_listen("127.0.0.1:4318") == ("127.0.0.1", 4318)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("4318", "host:", "h:70000"):
        with pytest.raises(ConfigError):
            parse_listen(bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_receiver_flushes_on_sigterm(tmp_path: Path) -> None:
    port, lake = _free_port(), tmp_path / "lake"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlens.cli", "collect", "otlp", "--listen", f"127.0.0.1:{port}",
         "--lake", str(lake), "--flush-seconds", "3600"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline, status = time.monotonic() + 30, 0
        while time.monotonic() < deadline and status != 200:
            try:
                status = _post(f"http://127.0.0.1:{port}/v1/traces", BODY_001)[0]
            except OSError:
                time.sleep(0.1)
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "70 requests from 70 llm_request spans" in out
    assert _query(lake, "SELECT count(*) FROM requests") == [(70,)]
