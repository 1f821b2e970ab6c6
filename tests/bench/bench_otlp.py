"""Benchmark: OTLP/HTTP receiver ingest, spans sent in batches of 512 from another process on loopback.

Target (issue 5): >= 20,000 spans/s, end to end: from the sender's first POST until the
receiver's clean stop has committed every row to the lake (the sender waits for each 200,
one keep-alive connection, as an OTLP exporter does). Baseline, measured in the same run:
bare protobuf parsing (``ExportTraceServiceRequest.ParseFromString``) of the same bodies, the
floor any Python receiver starts from. The spans are vLLM's real ``llm_request`` spans from
tests/data (13 attributes each), given fresh request ids.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvlens.collector.otlp_server import OtlpReceiver, ReceiverOptions
from kvlens.lake import segment_files

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
SPANS_PER_BODY = 512
BODIES = int(os.environ.get("KVLENS_BENCH_OTLP_BODIES", 200))
TARGET_SPANS_PER_S = 20_000

# The sender: its own process; one keep-alive connection; each body waits for its response.
_SENDER = r"""
import http.client, struct, sys, time
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
data = open(path, "rb").read()
bodies, i = [], 0
while i < len(data):
    (n,) = struct.unpack_from("<I", data, i)
    bodies.append(data[i + 4:i + 4 + n])
    i += 4 + n
conn = http.client.HTTPConnection(host, port, timeout=60)
t0 = time.monotonic()
for body in bodies:
    conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
    resp = conn.getresponse()
    resp.read()
    if resp.status != 200:
        sys.exit(f"status {resp.status}")
print(t0, time.monotonic())
"""


def _bodies() -> list[bytes]:
    template = []
    for name in ("vllm-cpu-capture/otlp_000.pb", "vllm-cpu-capture/otlp_001.pb"):
        msg = ExportTraceServiceRequest.FromString((DATA / name).read_bytes())
        template.extend(msg.resource_spans[0].scope_spans[0].spans)
    base = ExportTraceServiceRequest.FromString((DATA / "vllm-cpu-capture" / "otlp_000.pb").read_bytes())
    out, k = [], 0
    for _ in range(BODIES):
        msg = ExportTraceServiceRequest()
        rs = msg.resource_spans.add()
        rs.resource.CopyFrom(base.resource_spans[0].resource)
        ss = rs.scope_spans.add()
        ss.scope.CopyFrom(base.resource_spans[0].scope_spans[0].scope)
        for _ in range(SPANS_PER_BODY):
            span = ss.spans.add()
            span.CopyFrom(template[k % len(template)])
            for a in span.attributes:
                if a.key == "gen_ai.request.id":
                    a.value.string_value = f"cmpl-bench{k:012d}-0"
            k += 1
        out.append(msg.SerializeToString())
    return out


def _baseline(bodies: list[bytes]) -> float:
    t0 = time.perf_counter()
    for b in bodies:
        ExportTraceServiceRequest().ParseFromString(b)
    return time.perf_counter() - t0


def _receive(bodies: list[bytes], tmp: Path) -> tuple[float, float, float]:
    """(seconds until every body was answered, seconds until every row was committed, CPU seconds)."""
    blob = tmp / "bodies.bin"
    blob.write_bytes(b"".join(struct.pack("<I", len(b)) + b for b in bodies))
    rec = OtlpReceiver(ReceiverOptions(lake=tmp / "lake", port=0, flush_age_s=1.0)).start()
    c0 = time.process_time()
    host, port = rec.address
    try:
        out = subprocess.run([sys.executable, "-c", _SENDER, host, str(port), str(blob)],
                             capture_output=True, text=True, check=True, timeout=600).stdout
    finally:
        rec.stop()
    done = time.monotonic()
    cpu_s = time.process_time() - c0
    t0, t_sent = map(float, out.split())
    written = rec.metrics.value("kvlens_otlp_written_rows_total")
    assert written == len(bodies) * SPANS_PER_BODY, written
    rows = sum(pq.read_metadata(f).num_rows for f in segment_files(tmp / "lake", "requests"))
    assert rows == written, (rows, written)
    return t_sent - t0, done - t0, cpu_s


def main() -> bool:
    bodies = _bodies()
    spans = len(bodies) * SPANS_PER_BODY
    base_s = _baseline(bodies)
    with tempfile.TemporaryDirectory() as tmp:
        sent_s, total_s, cpu_s = _receive(bodies, Path(tmp))
    mib = sum(map(len, bodies)) / 2**20
    rate = spans / total_s
    print(f"   bodies / spans           {len(bodies):>12,} / {spans:,}  ({mib:.1f} MiB protobuf, "
          f"{SPANS_PER_BODY} spans each)")
    print(f"   answered (all 200)       {spans / sent_s:>12,.0f} spans/s  ({sent_s:.2f} s)")
    print(f"   answered + committed     {rate:>12,.0f} spans/s  ({total_s:.2f} s wall)")
    print(f"     receiver CPU           {cpu_s:>12.2f} s   ({spans / cpu_s:,.0f} spans per CPU second)")
    print(f"   bare protobuf parse      {spans / base_s:>12,.0f} spans/s  ({base_s:.2f} s)")
    print(f"   receiver / bare speed    {base_s / total_s:>12.3f}x   (target {TARGET_SPANS_PER_S:,} spans/s)")
    return rate >= TARGET_SPANS_PER_S


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
