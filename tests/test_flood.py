"""Flood tests (issue 19): the CLI's long-running collectors, each in its own process on loopback, fed
valid traffic mixed with garbage, poison values, gzip bombs, hang-ups and stray sequence numbers.
Every accepted row lands exactly once, and the collector's peak RSS (VmHWM) stays bounded."""

from __future__ import annotations

import gzip
import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from engine_frames import FakeEngine
from test_live_collector import _free_port, _query, _rows, _wait
from test_otlp_reliability import spans_body

REPO = Path(__file__).resolve().parents[1]
# Peak RSS growth over the collector's own peak once it is ready (the event collector starts near
# 250 MiB with numba, the receiver near 150 MiB): a flood may not add more than this.
RSS_GROWTH_MIB = 150


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _cli(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "kvlens.cli", *args], cwd=REPO, stdout=out, stderr=out,
                                env={**os.environ, "PYTHONPATH": str(REPO)})


def _stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


# -- the OTLP receiver ---------------------------------------------------------------------------

def _bomb() -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return b"".join([*(c.compress(bytes(1 << 20)) for _ in range(64)), c.flush()])  # 64 MiB of zeros


class _Client:
    """One exporter: a keep-alive connection, reopened after errors; 503 answers are retried."""

    def __init__(self, port: int) -> None:
        self.port, self.conn = port, http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, body: bytes, headers: dict[str, str]) -> int:
        for _ in range(20):
            try:
                self.conn.request("POST", "/v1/traces", body, headers)
                resp = self.conn.getresponse()
                resp.read()
                status = resp.status
                if resp.will_close:
                    self.reopen()
            except (ConnectionError, http.client.HTTPException):
                self.reopen()
                continue
            if status != 503:
                return status
            time.sleep(0.2)  # an exporter's back-off before it retries
        raise AssertionError("503 twenty times")

    def reopen(self) -> None:
        self.conn.close()
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)


def _hang_up(port: int, rng: random.Random) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                  b"Content-Length: 90000\r\n\r\n" + bytes(rng.randrange(0, 5000)))


def test_otlp_receiver_flood(tmp_path: Path) -> None:
    port, lake, log = _free_port(), tmp_path / "lake", tmp_path / "otlp.log"
    proc = _cli(["collect", "otlp", "--listen", f"127.0.0.1:{port}", "--lake", str(lake),
                 "--max-body-bytes", str(2 << 20), "--flush-seconds", "0.5"], log)
    accepted: set[str] = set()
    lock = threading.Lock()
    bomb = _bomb()
    pb = {"Content-Type": "application/x-protobuf"}

    def client(t: int) -> None:
        rng, c = random.Random(t), _Client(port)
        for k in range(30):
            first, kind = (t * 100 + k) * 20, rng.random()
            if kind < 0.55:  # valid, with two impossible spans among twenty now and then
                poison = {3: "start", 11: "ttft"} if rng.random() < 0.3 else {}
                body = spans_body(first, 20, poison=poison)
                gz = rng.random() < 0.3
                status = c.post(gzip.compress(body) if gz else body, {**pb, **({"Content-Encoding": "gzip"}
                                                                          if gz else {})})
                assert status == 200
                with lock:
                    accepted.update(f"req{first + i}" for i in range(20) if i not in poison)
            elif kind < 0.70:
                assert c.post(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 600))), pb) == 400
            elif kind < 0.82:
                assert c.post(bomb, {**pb, "Content-Encoding": "gzip"}) == 413
            elif kind < 0.90:
                assert c.post(b"{not json", {"Content-Type": "application/json"}) == 400
            else:
                _hang_up(port, rng)
        c.conn.close()

    try:
        _wait(lambda: _listening(port), 30)
        base = _peak_rss_mib(proc.pid)
        threads = [threading.Thread(target=client, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)
        peak = _peak_rss_mib(proc.pid)
    finally:
        _stop(proc, log)
    rows = _query(lake, "SELECT request_id FROM requests")
    assert len(rows) == len(accepted) and {r[0] for r in rows} == accepted
    print(f"\nOTLP flood: {len(accepted):,} rows accepted and written once; receiver peak RSS {base:.0f} MiB "
          f"ready, {peak:.0f} MiB after the flood")
    assert peak - base < RSS_GROWTH_MIB


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


# -- the event collector ---------------------------------------------------------------------------

@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


def _batch(ts: float, hashes: list[int], *, dp_rank: int = 0, bad_group: bool = False) -> bytes:
    events: list[dict[str, Any]] = [
        {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
         "token_ids": list(range(4 * len(hashes))), "block_size": 4, "lora_id": None, "medium": "GPU",
         "lora_name": None, "group_idx": 0}]
    if bad_group:  # one impossible event beside a good one: only it is dropped
        events.append({**events[0], "block_hashes": [1], "group_idx": 2**31})
    return msgspec.msgpack.encode([ts, events, dp_rank])


def test_event_collector_flood(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    e = FakeEngine(ctx, b"kv@r1@m", ring=20_000)
    port, lake, log = _free_port(), tmp_path / "lake", tmp_path / "vllm.log"
    proc = _cli(["collect", "vllm", "--endpoint", e.endpoint, "--replay", e.replay, "--replica", "r1",
                 "--lake", str(lake), "--flush-seconds", "0.2", "--metrics-port", str(port)], log)
    rng = random.Random(7)
    expected: set[tuple[int, int]] = set()
    strays = 0
    try:
        e.wait_subscribed(30)
        base = _peak_rss_mib(proc.pid)
        ts = 1_796_000_000.0
        for i in range(3000):
            ts += 0.001
            kind = rng.random()
            if kind < 0.75:
                hashes = [10 * i + j + 1 for j in range(4)]
                seq = e.publish(_batch(ts, hashes, bad_group=rng.random() < 0.05), send=rng.random() > 0.1)
                expected.update((seq, h) for h in hashes)
            elif kind < 0.83:
                e.publish(rng.randbytes(rng.randrange(1, 80)))  # garbage with its own seq
            elif kind < 0.90:
                e.publish(_batch(1e300 if rng.random() < 0.5 else ts, [1], dp_rank=rng.choice((0, 2**31))))
                if e.ring[-1][1] == _batch(ts, [1]):  # drew neither poison: a valid batch after all
                    expected.add((e.ring[-1][0], 1))
            else:  # a stray sequence number, valid payload or not, high or (newer time) low
                seq = rng.choice((2**62 + i, rng.randrange(0, max(1, i // 2))))
                payload = _batch(ts + 1, [9_000_000 + i]) if rng.random() < 0.7 else b"\x93\xcb"
                e.send_raw([e.topic, seq.to_bytes(8, "big"), payload])
                strays += 1
        hashes = [99_999_991]
        expected.add((e.publish(_batch(ts + 0.01, hashes)), hashes[0]))  # reveals any trailing gap
        _wait(lambda: _rows(lake) >= len(expected), 120)
        peak = _peak_rss_mib(proc.pid)
    finally:
        _stop(proc, log)
        e.close()
    got = _query(lake, "SELECT seq, block_hash FROM kv_events")
    assert len(got) == len(set(got)) == len(expected) and set(got) == expected
    assert _query(lake, "SELECT count(*) FROM kv_events WHERE kind = 'cleared'") == [(0,)]
    assert _query(lake, "SELECT count(*) FROM metric_samples") == [(0,)]  # no batch recorded as lost
    print(f"\nevent flood: {len(expected):,} rows from 3,001 batches ({strays} stray seqs) written once; "
          f"collector peak RSS {base:.0f} MiB ready, {peak:.0f} MiB after the flood")
    assert peak - base < RSS_GROWTH_MIB
