"""Tests for collector.live: a real pyzmq publisher and ROUTER replay socket feed the collector."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import msgspec
import pytest
import zmq
from engine_frames import (
    BlockRemoved,
    BlockRemoved23,
    BlockStored,
    BlockStored23,
    EventBatch,
    FakeEngine,
    SgBlockRemoved,
    SgBlockStored,
    SgEventBatch,
    encode,
    signed,
)

from kvlens.collector.capture import import_capture
from kvlens.collector.live import GAP_METRIC, CollectorOptions, LiveCollector, Source, writer_id_for
from kvlens.config import load_config
from kvlens.errors import ConfigError
from kvlens.lake import latest_checkpoint
from kvlens.query import query

REPO = Path(__file__).resolve().parents[1]
U64 = (1 << 64) - 1


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


def _query(lake: Path, sql: str) -> list[tuple[Any, ...]]:
    return query(sql, lake=lake)[1]


def _wait(cond: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.02)


class Running:
    """A LiveCollector in a thread of this process."""

    def __init__(self, ctx: zmq.Context[Any], lake: Path, sources: list[Source], **kw: Any) -> None:
        opts = CollectorOptions(lake=lake, sources=sources, flush_age_s=kw.pop("flush_age_s", 0.2),
                                replay_timeout_s=kw.pop("replay_timeout_s", 1.0), **kw)
        self.c = LiveCollector(opts, context=ctx)
        self.thread = threading.Thread(target=self.c.run, daemon=True)
        self.thread.start()
        assert self.c.ready.wait(5)

    def value(self, name: str, **labels: str) -> float:
        return self.c.metrics.value(name, **labels)

    def stop(self) -> None:
        self.c.stop()
        self.thread.join(20)
        assert not self.thread.is_alive()


# -- the three engine formats, with drops, duplicates, a restart and malformed frames ----------

class Stream:
    """One engine's batches and the rows they must produce: (replica, seq, kind, block_hash)."""

    def __init__(self, engine: FakeEngine, replica: str, fmt: str) -> None:
        self.engine, self.replica, self.fmt = engine, replica, fmt
        self.expected: list[tuple[str, int, str, int | None]] = []
        self.ts = 1_796_000_000.0
        self.bad_frames = 0

    def batch(self, hashes: list[int], *, send: bool = True, parent: int | None = None) -> int:
        self.ts += 0.001
        if self.fmt == "vllm033":
            tokens = list(range(4 * len(hashes)))
            events: list[Any] = [BlockStored(hashes, parent, tokens, 4, None, "GPU", None,
                                             extra_keys=[None] * len(hashes), group_idx=0,
                                             kv_cache_spec_kind="full_attention"),
                                 BlockRemoved(hashes[:1], "GPU", group_idx=0)]
            payload = encode(EventBatch(self.ts, events, 0))
        elif self.fmt == "vllm023":
            events = [BlockStored23(hashes, parent, list(range(4 * len(hashes))), 4, None, "GPU", None, None,
                                    0, "full_attention", None),
                      BlockRemoved23(hashes[:1], "GPU", 0)]
            payload = encode(EventBatch(self.ts, events, 0))
        else:
            events = [SgBlockStored([signed(h) for h in hashes], None if parent is None else signed(parent),
                                    list(range(4 * len(hashes))), 4, medium="CPU_PINNED"),
                      SgBlockRemoved([signed(hashes[0])], "EXTERNAL")]
            payload = encode(SgEventBatch(self.ts, events, None))
        seq = self.engine.publish(payload, send=send)
        self.expected += [(self.replica, seq, "stored", h) for h in hashes]
        self.expected.append((self.replica, seq, "removed", hashes[0]))
        return seq

    def bad(self, payload: bytes) -> None:
        """A malformed batch with its own sequence number (an engine that sent garbage)."""
        self.engine.publish(payload)
        self.bad_frames += 1


def _drive(s: Stream, base: int, settle: Callable[[int], None]) -> None:
    e = s.engine
    s.batch([base + 1, base + 2])
    s.batch([base + 3], send=False)  # dropped on the way: must be replayed
    s.batch([base + 4])
    s.batch([U64 - base, 2**63 + base])  # large hashes (SGLang: negative on the wire)
    last = e.ring[-1]
    e.send_raw([e.topic, last[0].to_bytes(8, "big"), last[1]])  # a duplicate
    s.bad(b"\x93\xcb\x41\xda")  # truncated msgpack
    s.bad(msgspec.msgpack.encode(["ts", "events", 0]))  # wrong types
    s.bad(msgspec.msgpack.encode([s.ts, [], 0, b"x" * 70_000]))  # oversize (limit 64 KiB below)
    e.send_raw([e.topic, b"\x00\x01"])  # wrong frame count: no sequence at all
    s.batch([base + 5], send=False)
    s.batch([base + 6], send=False)
    s.batch([base + 7])
    # seq 0..9 reached the collector (replays included) before the engine restarts; the three bad
    # batches are not accepted batches (their replayed copies only move the sequence on)
    settle(10 - s.bad_frames)
    e.restart()  # a new engine process: seq 0 again, fresh ring
    s.expected.append((s.replica, 1, "cleared", None))  # the clear, stamped with the first seq seen
    s.batch([base + 8], send=False)  # the new process's seq 0 is dropped too: replayed from its ring
    s.batch([base + 9])
    s.batch([base + 10])


@pytest.mark.parametrize("old_replay", [False, True], ids=["replay-topic-seq-payload", "replay-seq-payload"])
def test_three_engines_every_valid_event_exactly_once(ctx: zmq.Context[Any], tmp_path: Path,
                                                      old_replay: bool) -> None:
    engines = {
        "v033": (FakeEngine(ctx, b"kv-events", old_replay=old_replay), "vllm033"),
        "v023": (FakeEngine(ctx, b"kv-events", old_replay=old_replay), "vllm023"),
        "sgl": (FakeEngine(ctx, b"kv@sgl-pod@qwen"), "sglang"),
    }
    sources = [Source(e.endpoint, e.replay, None if name == "sgl" else name, "" if name == "sgl" else "kv-")
               for name, (e, _) in engines.items()]
    lake = tmp_path / "lake"
    run = Running(ctx, lake, sources, max_payload_bytes=64 * 1024)
    streams = []
    try:
        for i, (name, (e, fmt)) in enumerate(engines.items()):
            e.wait_subscribed()
            s = Stream(e, "sgl-pod" if name == "sgl" else name, fmt)
            _drive(s, 1000 * (i + 1), lambda k, r=s.replica: _wait(
                lambda: run.value("kvlens_collector_received_batches_total", replica=r) >= k))
            streams.append(s)
        # A last batch per engine, after everything else on its stream: once each is in, anything
        # extra sent before it (a duplicate let through) is in too.
        for i, s in enumerate(streams):
            s.batch([1000 * (i + 1) + 11])
        total = sum(len(s.expected) - 1 for s in streams)  # the clears are the collector's own rows
        _wait(lambda: sum(run.value("kvlens_collector_block_events_total", replica=s.replica)
                          for s in streams) >= total, 120)
    finally:
        run.stop()
        for e, _ in engines.values():
            e.close()
    rows = _query(lake, "SELECT replica, seq, kind, block_hash FROM kv_events WHERE scenario = 'live'")
    expected = [x for s in streams for x in s.expected]
    assert sorted(rows, key=str) == sorted(expected, key=str)
    assert len(rows) == len(set(rows))
    v = run.value
    assert v("kvlens_collector_decode_errors_total", reason="msgpack") == 3
    assert v("kvlens_collector_decode_errors_total", reason="batch_types") == 3
    assert v("kvlens_collector_decode_errors_total", reason="oversize") == 3
    assert v("kvlens_collector_decode_errors_total", reason="frames") == 3
    for s in streams:
        assert v("kvlens_collector_duplicate_batches_total", replica=s.replica) >= 1
        assert v("kvlens_collector_publisher_restarts_total", replica=s.replica) == 1
        assert v("kvlens_collector_replayed_batches_total", replica=s.replica) >= 4
        assert v("kvlens_collector_unrecoverable_gap_batches_total", replica=s.replica) == 0
    assert v("kvlens_collector_segments_committed_total") >= 1
    assert v("kvlens_collector_written_bytes_total") > 0
    media = _query(lake, "SELECT DISTINCT replica, medium FROM kv_events WHERE kind <> 'cleared'")
    assert sorted(media) == [("sgl-pod", "cpu"), ("sgl-pod", "pool"), ("v023", "gpu"), ("v033", "gpu")]
    ns = _query(lake, "SELECT DISTINCT namespace FROM kv_events WHERE replica = 'sgl-pod'")
    assert ns == [("qwen",)]


def test_unfillable_gap_is_recorded(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    e = FakeEngine(ctx, b"t", ring=2)  # the engine buffers only two batches
    lake = tmp_path / "lake"
    run = Running(ctx, lake, [Source(e.endpoint, e.replay, "r1")])
    try:
        e.wait_subscribed()
        s = Stream(e, "r1", "vllm033")
        s.batch([1])
        for h in range(2, 7):
            s.batch([h], send=False)  # seq 1..5 dropped
        s.batch([7])  # seq 6: the ring now holds only 5 and 6
        _wait(lambda: run.value("kvlens_collector_received_batches_total", replica="r1") >= 3)
    finally:
        run.stop()
        e.close()
    assert run.value("kvlens_collector_unrecoverable_gap_batches_total", replica="r1") == 4
    got = _query(lake, "SELECT replica, name, value, labels['from_seq'], labels['to_seq'] "
                       "FROM metric_samples")
    assert got == [("r1", GAP_METRIC, 4.0, "1", "4")]
    seqs = _query(lake, "SELECT DISTINCT seq FROM kv_events ORDER BY 1")
    assert seqs == [(0,), (5,), (6,)]


def test_bind_mode_names_replicas_from_llmd_topics(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    run = Running(ctx, lake, [Source("tcp://127.0.0.1:*", bind=True, topic="kv@")])
    engines = [FakeEngine(ctx, f"kv@pod-{i}@llama".encode(), connect_to=run.c.bound[0]) for i in range(2)]
    try:
        for i, e in enumerate(engines):
            e.wait_subscribed()
            Stream(e, f"pod-{i}", "vllm033").batch([10 + i])
        _wait(lambda: all(run.value("kvlens_collector_received_batches_total", replica=f"pod-{i}") == 1
                          for i in range(2)))
    finally:
        run.stop()
        for e in engines:
            e.close()
    assert _query(lake, "SELECT DISTINCT replica, namespace, block_hash FROM kv_events ORDER BY 1") == [
        ("pod-0", "llama", 10), ("pod-1", "llama", 11)]


def test_restart_resumes_from_the_checkpoint(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    e = FakeEngine(ctx, b"t")
    lake = tmp_path / "lake"
    src = [Source(e.endpoint, e.replay, "r1")]
    s = Stream(e, "r1", "vllm033")
    run = Running(ctx, lake, src, record=tmp_path / "frames.jsonl")
    e.wait_subscribed()
    for h in range(1, 4):
        s.batch([h])
    _wait(lambda: run.value("kvlens_collector_received_batches_total", replica="r1") == 3)
    run.stop()
    assert latest_checkpoint(lake, writer_id_for(src))["publishers"]["r1|t"]["seq"] == 2  # type: ignore[index]
    for h in range(4, 7):
        s.batch([h])  # published while no collector runs: only the replay ring has them
    run = Running(ctx, lake, src)
    _wait(lambda: run.value("kvlens_collector_received_batches_total", replica="r1") == 3)
    run.stop()
    e.close()
    rows = _query(lake, "SELECT replica, seq, kind, block_hash FROM kv_events")
    assert sorted(rows, key=str) == sorted(s.expected, key=str)
    # the first run's recording imports back to the same rows
    counts = import_capture([tmp_path / "frames.jsonl"], lake, scenario="rec", replica="r1")
    assert counts["batches"] == 3 and counts["rows"] == 6


# -- bounded memory ----------------------------------------------------------------------------

def test_slow_disk_and_flood_stay_bounded(ctx: zmq.Context[Any], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood against a slow writer: the queue never passes its bounds, and the PUB side's drops
    come back through the replay, so every event still lands once."""
    from kvlens.collector import live_sequence

    real_accept = live_sequence.SequenceTracker._accept

    def slow_accept(self: live_sequence.SequenceTracker, *a: Any) -> None:
        time.sleep(0.0005)  # a slow disk: about 2,000 batches/s at most
        real_accept(self, *a)

    monkeypatch.setattr(live_sequence.SequenceTracker, "_accept", slow_accept)
    e = FakeEngine(ctx, b"t", ring=5000, hwm=50, sndbuf=4096)  # small buffers: the flood reaches the HWMs
    lake = tmp_path / "lake"
    run = Running(ctx, lake, [Source(e.endpoint, e.replay, "r1")], queue_batches=20, queue_bytes=32_768,
                  rcvhwm=20)
    n = 3000
    hashes = [[(i << 5) + j for j in range(1, 17)] for i in range(n + 1)]
    tokens = list(range(100_000, 102_048))  # 10 kB a batch: 30 MB in all, past the kernel's buffers
    payloads = [encode(EventBatch(1_796_000_000 + i / 1000, [BlockStored(h, None, tokens, 4, None,
                                                                          "GPU", None)], 0))
                for i, h in enumerate(hashes)]  # encoded first, so that the flood is fast
    try:
        e.wait_subscribed()
        for p in payloads[:n]:
            e.publish(p)
        received = lambda: run.value("kvlens_collector_received_batches_total", replica="r1")  # noqa: E731
        last = e.publish(payloads[n])  # a later batch, as an engine always sends one: it reveals the last gap
        again = [e.topic, last.to_bytes(8, "big"), payloads[n]]
        # While the flood still fills the pipes the PUB side may drop that one too, so it goes again
        # at each look until every batch is in (a repeat is a duplicate: dropped by (replica, seq)).
        _wait(lambda: received() >= n + 1 or bool(e.send_raw(again)), 120)
    finally:
        run.stop()
        e.close()
    q = run.c.queue
    assert q.peak_items <= 20 and q.peak_bytes <= 32_768
    assert run.value("kvlens_collector_sequence_gaps_total", replica="r1") >= 1  # the PUB side dropped
    assert run.value("kvlens_collector_unrecoverable_gap_batches_total", replica="r1") == 0
    rows = 16 * (n + 1)
    assert _query(lake, "SELECT count(*), count(DISTINCT (seq, block_hash)) FROM kv_events") == [(rows, rows)]


# -- kill -9 of the CLI collector in the middle of a 100k-batch stream --------------------------

def _spawn(lake: Path, e: FakeEngine, log: Path, port: int | None = None) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "kvlens.cli", "collect", "vllm", "--endpoint", e.endpoint,
            "--replay", e.replay, "--replica", "r1", "--lake", str(lake), "--flush-seconds", "0.2"]
    if port:
        args += ["--metrics-port", str(port)]
    with open(log, "ab") as err:
        # a stop that hangs prints every thread's stack into the log before the tests' 20 s wait ends
        env = {**os.environ, "PYTHONPATH": str(REPO), "KVLENS_STOP_GRACE_S": "15"}
        return subprocess.Popen(args, cwd=REPO, stdout=err, stderr=err, env=env)


def stop_or_kill(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> int | None:
    """SIGTERM, then the exit status; None (and SIGKILL, so no later test meets it) past the timeout."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_kill_9_mid_stream_then_restart_exactly_once(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    n = 100_000
    e = FakeEngine(ctx, b"kv@r1@m", ring=n)
    lake = tmp_path / "lake"
    port = _free_port()
    log = tmp_path / "collector.log"
    proc = _spawn(lake, e, log, port)
    payloads = [encode(EventBatch(1_796_000_000.0 + i * 1e-4, [BlockRemoved([i + 1], "GPU")], 0))
                for i in range(n)]
    try:
        e.wait_subscribed(120)
        for i in range(n // 2):
            e.publish(payloads[i])
        _wait(lambda: (lake / "kv_events").exists() and any((lake / "kv_events").rglob("*.parquet")), 120)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "kvlens_collector_received_batches_total" in text
        assert "kvlens_collector_ingest_lag_seconds" in text
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for i in range(n // 2, n):
            e.publish(payloads[i])  # nobody listens: only the replay ring keeps these
        proc = _spawn(lake, e, log)
        e.wait_subscribed(120)
        _wait(lambda: _rows(lake) >= n, 180)
    finally:
        code = stop_or_kill(proc, 60)
        e.close()
    assert code == 0, log.read_text()[-2000:]
    got = _query(lake, "SELECT count(*), count(DISTINCT seq), min(seq), max(seq), "
                       "count(DISTINCT block_hash) FROM kv_events")
    assert got == [(n, n, 0, n - 1, n)]


def _rows(lake: Path) -> int:
    try:
        return int(_query(lake, "SELECT count(*) FROM kv_events")[0][0])
    except duckdb.Error:
        return 0  # a segment renamed in while the glob ran


# -- configuration -----------------------------------------------------------------------------

def test_fleet_config(tmp_path: Path) -> None:
    from kvlens.collector.live import build_sources

    toml = tmp_path / "kvlens.toml"
    toml.write_text('[[fleet.replicas]]\nname = "a"\nendpoint = "tcp://10.0.0.1:5557"\n'
                    'replay_endpoint = "tcp://10.0.0.1:5558"\nmodel = "m"\n'
                    '[[fleet.replicas]]\nendpoint = "tcp://127.0.0.1:6000"\nbind = true\ntopic = "kv@"\n')
    cfg = load_config(toml)
    assert [r.name for r in cfg.replicas] == ["a", None]
    sources = build_sources(endpoint=None, replay=None, topic="", replica=None, model=None, bind=False,
                            config=str(toml))
    assert sources == [Source("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "a", "", "m", False),
                       Source("tcp://127.0.0.1:6000", None, None, "kv@", None, True)]
    assert writer_id_for(sources) == "live-127.0.0.1_6000_a"
    toml.write_text('[[fleet.replicas]]\nendpoint = "nowhere"\n')
    with pytest.raises(ConfigError, match="endpoint"):
        load_config(toml)


def _joined(e: FakeEngine) -> None:
    """Wait for a subscription (XPUB also hands over the unsubscriptions stopped collectors left)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if e.pub.poll(100) and e.pub.recv()[:1] == b"\x01":
            return
    raise TimeoutError("no subscriber joined")


def test_fleet_change_keeps_every_other_replicas_checkpoint(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    """A replica added, then one removed: the writer id changes each time (it names the replica
    set), and every replica that stays resumes from its own checkpoint: no batch lost or doubled."""
    lake = tmp_path / "lake"
    engines = {name: FakeEngine(ctx, b"t") for name in ("a", "b", "c")}
    for e in engines.values():  # every subscription, even one the last collector's still covers
        e.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    streams = {name: Stream(e, name, "vllm033") for name, e in engines.items()}
    src = {name: Source(e.endpoint, e.replay, name) for name, e in engines.items()}
    got = "kvlens_collector_received_batches_total"

    def run_with(names: str, live: dict[str, int], backlog: dict[str, int]) -> None:
        """Follow ``names``; wait for each replica's ``backlog`` (replayed) then send ``live`` batches."""
        run = Running(ctx, lake, [src[n] for n in names])
        try:
            for n in names:
                _joined(engines[n])
            for n, count in backlog.items():
                _wait(lambda n=n, count=count: run.value(got, replica=n) == count)  # type: ignore[misc]
            for n, count in live.items():
                for i in range(count):
                    streams[n].batch([1000 * ord(n) + len(streams[n].expected) + i])
                _wait(lambda n=n, count=count: run.value(got, replica=n) == backlog.get(n, 0) + count)  # type: ignore[misc]
        finally:
            run.stop()
        assert run.value("kvlens_collector_duplicate_batches_total", replica="a") == 0

    try:
        run_with("ab", {"a": 3, "b": 2}, {})
        for n in "ab":
            streams[n].batch([7000 + ord(n)])  # published while nothing collects: only the rings hold them
        run_with("abc", {"a": 1, "c": 2}, {"a": 1, "b": 1})  # c joins
        streams["a"].batch([8000])
        run_with("ac", {"a": 1, "c": 1}, {"a": 1})  # b leaves; a and c keep their places
    finally:
        for e in engines.values():
            e.close()
    rows = _query(lake, "SELECT replica, seq, kind, block_hash FROM kv_events")
    expected = [r for s in streams.values() for r in s.expected]
    assert sorted(rows, key=str) == sorted(expected, key=str)
    assert _query(lake, "SELECT count(*) FROM metric_samples") == [(0,)]  # nothing was lost
