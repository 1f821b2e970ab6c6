"""Benchmark: what `kvlens gateway` adds to a request, against direct calls to a stub engine on loopback.

Target (issue 14): under 2 ms added P50 per request. Baseline, measured in the same run: the same
requests sent straight to the stub engine (tests/gateway_stub.py, a real HTTP server in its own
process). The gateway runs as `kvlens gateway` in its own process pinned to one core; one client
connection (keep-alive) sends the requests one after another, so each latency is one request's.
Two prompts: 512 token ids (16 full blocks hashed per request, no tokenize call) and a 512-character
text (one `POST /tokenize` round trip to the stub first). Then requests/s through the gateway on
its one core, from 8 concurrent client connections.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
N = int(os.environ.get("KVLENS_BENCH_GATEWAY_REQUESTS", 1000))
THROUGHPUT_S = float(os.environ.get("KVLENS_BENCH_GATEWAY_SECONDS", 5))
TARGET_ADDED_P50_MS = 2.0

_STUB = r"""
import sys, threading
sys.path.insert(0, sys.argv[1])
from gateway_stub import StubEngine
with StubEngine(block_size=32) as stub:
    print(stub.server_address[1], flush=True)
    sys.stdin.read()  # until the parent closes our stdin
"""


def _pin(cpu: int) -> Any:
    def pin() -> None:
        if hasattr(os, "sched_setaffinity") and cpu < (os.cpu_count() or 1):
            os.sched_setaffinity(0, {cpu})
    return pin


def _stub() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", _STUB, str(REPO / "tests")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, preexec_fn=_pin(1))
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _gateway(stub_port: int, work: Path) -> tuple[subprocess.Popen[bytes], int]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = work / "kvlens.toml"
    config.write_text(f'[[fleet.replicas]]\nname = "stub"\nendpoint = "tcp://127.0.0.1:1"\n'
                      f'url = "http://127.0.0.1:{stub_port}"\nblock_size = 32\nhash_algo = "sha256_cbor"\n'
                      f'hash_seed = "0"\n')
    proc = subprocess.Popen([sys.executable, "-m", "kvlens.cli", "gateway", "--config", str(config),
                             "--listen", f"127.0.0.1:{port}", "--lake", str(work / "lake")], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_pin(0))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            conn.getresponse().read()
            conn.close()
            return proc, port
        except OSError:
            time.sleep(0.1)  # polling a child's startup
    proc.kill()
    raise SystemExit("the gateway did not start")


def _latencies(port: int, body: dict[str, Any], n: int) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = json.dumps(body)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            out.append((time.perf_counter() - t0) * 1000)
            assert r.status == 200, r.status
    finally:
        conn.close()
    return out


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def _throughput(port: int, body: dict[str, Any], seconds: float, clients: int = 8) -> float:
    stop = time.monotonic() + seconds
    counts = [0] * clients

    def loop(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        data = json.dumps(body)
        try:
            while time.monotonic() < stop:
                conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
                conn.getresponse().read()
                counts[k] += 1
        finally:
            conn.close()

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - t0)


def main() -> bool:
    prompts = {"512 token ids": {"model": "tiny", "prompt": list(range(1000, 1512)), "max_tokens": 4},
               "512-char text": {"model": "tiny", "prompt": "k" * 512, "max_tokens": 4}}
    stub, stub_port = _stub()
    with tempfile.TemporaryDirectory() as tmp:
        gw, gw_port = _gateway(stub_port, Path(tmp))
        ok = True
        try:
            for label, body in prompts.items():
                _latencies(stub_port, body, 50)  # warm both paths (connections, numba, caches)
                _latencies(gw_port, body, 50)
                direct = _latencies(stub_port, body, N)
                via = _latencies(gw_port, body, N)
                p50, p99 = _p(via, 50) - _p(direct, 50), _p(via, 99) - _p(direct, 99)
                print(f"   {label}: direct P50 {_p(direct, 50):.2f} ms, P99 {_p(direct, 99):.2f} ms; via the "
                      f"gateway P50 {_p(via, 50):.2f} ms, P99 {_p(via, 99):.2f} ms; added P50 {p50:.2f} ms, "
                      f"P99 {p99:.2f} ms ({N} requests each, measured)")
                if label == "512 token ids":
                    ok = p50 < TARGET_ADDED_P50_MS
            rps = _throughput(gw_port, prompts["512 token ids"], THROUGHPUT_S)
            direct_rps = _throughput(stub_port, prompts["512 token ids"], THROUGHPUT_S)
            print(f"   throughput through the gateway on one core: {rps:,.0f} requests/s "
                  f"(stub direct: {direct_rps:,.0f} requests/s; 8 client connections, {THROUGHPUT_S:g} s "
                  f"each, "
                  f"measured); target: added P50 < {TARGET_ADDED_P50_MS} ms for the token-id prompt")
        finally:
            gw.terminate()
            gw.wait(60)
            assert stub.stdin is not None
            stub.stdin.close()
            stub.wait(60)
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
