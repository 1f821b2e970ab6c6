"""collector.live against one bad input (issue 19, items 3 and 4): poison batches, stray sequence
numbers and a lake that refuses writes, from a real pyzmq publisher and ROUTER replay socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from engine_frames import BlockStored, EventBatch, FakeEngine, encode
from test_live_collector import REPO, Running, Stream, _free_port, _query, _spawn, _wait, stop_or_kill

from kvlens.collector.live import GAP_METRIC, CollectorOptions, LiveCollector, Source
from kvlens.schema import EventKind

STRAY = 2**62


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


def _stored(ts: float, h: int, **fields: Any) -> bytes:
    dp_rank = fields.pop("dp_rank", 0)
    event = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
             "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, **fields}
    return msgspec.msgpack.encode([ts, [event], dp_rank])


# -- item 4: a stray sequence number -----------------------------------------------------------

@pytest.mark.parametrize("replay", [True, False], ids=["with-replay", "without-replay"])
def test_stray_sequence_numbers_are_dropped(ctx: zmq.Context[Any], tmp_path: Path, replay: bool) -> None:
    """seq 2**62 (a valid batch, then an unreadable one) and, with a replay to ask, a lower seq
    with a newer time: no gap of 4.6e18, no false restart or clear, the ring never re-ingested."""
    e = FakeEngine(ctx, b"t", ring=1000)
    lake = tmp_path / "lake"
    run = Running(ctx, lake, [Source(e.endpoint, e.replay if replay else None, "r1")])
    s = Stream(e, "r1", "vllm033")
    try:
        e.wait_subscribed()
        for h in range(1, 21):
            s.batch([h])  # seq 0..19
        received = lambda: run.value("kvlens_collector_received_batches_total", replica="r1")  # noqa: E731
        _wait(lambda: received() == 20)
        e.send_raw([b"t", STRAY.to_bytes(8, "big"), _stored(s.ts + 1, 777)])
        e.send_raw([b"t", (STRAY + 5).to_bytes(8, "big"), b"\x93\xcb\x41"])  # unreadable: never trusted
        if replay:  # a lower seq with a newer time that the publisher's ring does not hold: not a restart
            e.send_raw([b"t", (3).to_bytes(8, "big"), _stored(s.ts + 2, 778)])
        for h in range(21, 41):
            s.batch([h])  # seq 20..39: the real stream goes on
        _wait(lambda: received() == 40)
        _wait(lambda: run.value("kvlens_collector_decode_errors_total", reason="msgpack") == 1)
    finally:
        run.stop()
        e.close()
    rows = _query(lake, "SELECT replica, seq, kind, block_hash FROM kv_events")
    assert sorted(rows, key=str) == sorted(s.expected, key=str)  # 80 rows for 80 real ones
    assert len(rows) == 80
    v = run.value
    assert v("kvlens_collector_decode_errors_total", reason="stray_seq") == (2 if replay else 1)
    assert v("kvlens_collector_publisher_restarts_total", replica="r1") == 0
    assert v("kvlens_collector_unrecoverable_gap_batches_total", replica="r1") == 0
    assert v("kvlens_collector_sequence_gaps_total", replica="r1") == 0
    assert _query(lake, f"SELECT count(*) FROM metric_samples WHERE name = '{GAP_METRIC}'") == [(0,)]
    assert _query(lake, "SELECT count(*) FROM kv_events WHERE kind = 'cleared'") == [(0,)]


def test_a_real_jump_past_the_limit_is_taken_once_the_stream_goes_on(ctx: zmq.Context[Any],
                                                                     tmp_path: Path) -> None:
    """Without a replay, a jump past max_gap_batches is refused once, then taken when the next frame
    continues it (an engine met mid-life), with the batches between recorded as lost."""
    e = FakeEngine(ctx, b"t")
    lake = tmp_path / "lake"
    run = Running(ctx, lake, [Source(e.endpoint, None, "r1")], max_gap_batches=100)
    try:
        e.wait_subscribed()
        e.send_raw([b"t", (0).to_bytes(8, "big"), _stored(1_796_000_000.0, 1)])
        for i in range(3):
            e.send_raw([b"t", (5000 + i).to_bytes(8, "big"), _stored(1_796_000_001.0 + i, 10 + i)])
        _wait(lambda: run.value("kvlens_collector_received_batches_total", replica="r1") == 3)
    finally:
        run.stop()
        e.close()
    got = _query(lake, "SELECT seq, block_hash FROM kv_events ORDER BY seq")
    assert got == [(0, 1), (5001, 11), (5002, 12)]
    assert run.value("kvlens_collector_decode_errors_total", reason="stray_seq") == 1
    assert run.value("kvlens_collector_unrecoverable_gap_batches_total", replica="r1") == 5000


# -- item 3: one poison batch among good ones, through the CLI and a restart --------------------

def _metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return str(r.read().decode())
    except OSError:  # not listening yet
        return ""


def test_poison_batches_are_skipped_and_a_restart_skips_them_again(ctx: zmq.Context[Any],
                                                                   tmp_path: Path) -> None:
    e = FakeEngine(ctx, b"kv@r1@m", ring=1000)
    lake = tmp_path / "lake"
    log = tmp_path / "collector.log"
    good, poison = [], {17: _stored(1e300, 0), 53: _stored(1_796_000_000.0, 0, dp_rank=2**31),
                        71: _stored(1_796_000_000.0, 0, group_idx=2**31)}
    port = _free_port()
    proc = _spawn(lake, e, log, port)
    try:
        e.wait_subscribed(20)
        for i in range(100):
            if i in poison:
                e.publish(poison[i])
            else:
                e.publish(_stored(1_796_000_000.0 + i, 1000 + i))
                good.append(1000 + i)
        _wait(lambda: "kvlens_collector_received_batches_total" in _metrics(port)
              and _rows(lake) == len(good), 30)
        text = _metrics(port)
        assert stop_or_kill(proc) == 0, log.read_text()[-3000:]
        assert 'reason="ts"' in text and 'reason="dp_rank"' in text and 'reason="field:group_idx"' in text
        # A restart with no checkpoint of its own (another writer id) asks the replay ring for every
        # batch, the poison ones included: it skips them again and exits cleanly.
        proc = _spawn(tmp_path / "lake2", e, log, port)
        _wait_subscribe(e)
        e.publish(_stored(1_796_000_200.0, 5000))  # reveals the gap: the whole ring is replayed
        good.append(5000)
        _wait(lambda: _rows(tmp_path / "lake2") == len(good), 30)
    finally:
        code = stop_or_kill(proc)
        e.close()
    assert code == 0, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()
    for where in (lake, tmp_path / "lake2"):
        hashes = [r[0] for r in _query(where, "SELECT block_hash FROM kv_events ORDER BY seq")]
        assert hashes == (good if where != lake else good[:-1])


def _wait_subscribe(e: FakeEngine) -> None:
    """Until a subscription arrives (the XPUB also reports the previous subscriber's unsubscribe)."""
    for _ in range(10):
        if not e.pub.poll(20_000):
            break
        if e.pub.recv()[:1] == b"\x01":
            return
    raise TimeoutError("no subscriber joined")


def _rows(lake: Path) -> int:
    from test_live_collector import _rows as rows

    return rows(lake) if (lake / "kv_events").exists() else 0


# -- a lake that refuses writes --------------------------------------------------------------------

def test_a_refused_write_is_retried_and_loses_nothing(ctx: zmq.Context[Any], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlens import lake as lake_mod

    real = lake_mod.SegmentWriter._write_segment
    refusals = {"left": 3}

    def flaky(self: Any, date: str, part: Any) -> None:
        if self.table.name == "kv_events" and part.num_rows and refusals["left"]:
            refusals["left"] -= 1
            raise OSError(28, "No space left on device")
        real(self, date, part)

    monkeypatch.setattr(lake_mod.SegmentWriter, "_write_segment", flaky)
    e = FakeEngine(ctx, b"t")
    lake = tmp_path / "lake"
    run = Running(ctx, lake, [Source(e.endpoint, e.replay, "r1")], flush_age_s=0.05)
    try:
        e.wait_subscribed()
        for i in range(50):
            stored = BlockStored([i + 1], None, [1, 2, 3, 4], 4, None, "GPU", None)
            e.publish(encode(EventBatch(1_796_000_000.0 + i, [stored], 0)))
        _wait(lambda: run.value("kvlens_collector_received_batches_total", replica="r1") == 50)
        _wait(lambda: refusals["left"] == 0 and run.value("kvlens_collector_segments_committed_total") >= 1)
    finally:
        run.stop()
        e.close()
    assert run.value("kvlens_collector_write_errors_total") == 3
    assert _query(lake, "SELECT count(*), count(DISTINCT block_hash) FROM kv_events") == [(50, 50)]


def test_rows_arrow_refuses_go_to_the_quarantine(tmp_path: Path) -> None:
    """A row that slipped past the decoder's checks: the rest of its chunk is written, it is kept aside."""
    c = LiveCollector.__new__(LiveCollector)  # only the parts _take_rows uses
    from kvlens.collector.live import CollectorMetrics, CollectorOptions
    from kvlens.collector.vllm_events import KvColumns
    from kvlens.lake import SegmentWriter

    c.opt = CollectorOptions(lake=tmp_path / "lake", sources=[Source("tcp://x")])
    c.metrics, c.writer_id, c.cols = CollectorMetrics(), "w", KvColumns()
    c.cols.add(ts_ns=1, recv_ns=1, replica="r", seq=1, kind=EventKind.STORED.value, block_hash=5)
    c.cols.add(ts_ns=2**70, recv_ns=1, replica="r", seq=2, kind=EventKind.STORED.value, block_hash=6)
    with SegmentWriter(tmp_path / "lake", "kv_events", writer_id="w") as kv:
        c._kv = kv  # type: ignore[assignment]
        c._take_rows()
    assert _query(tmp_path / "lake", "SELECT seq, block_hash FROM kv_events") == [(1, 5)]
    assert c.metrics.value("kvlens_collector_quarantined_rows_total") == 1
    spilled = list((tmp_path / "lake" / ".quarantine").glob("w-*.jsonl"))
    assert len(spilled) == 1 and '"seq": 2' in spilled[0].read_text()


# -- a stop that hangs is bounded -------------------------------------------------------------

def _stopped(code: str, grace_s: float) -> tuple[int | None, str, str]:
    """Run ``code`` (it prints "ready" inside its signal scope), SIGTERM it: (status, stdout, stderr);
    status None when it outlived 30 s (then it is killed)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVLENS_STOP_GRACE_S": str(grace_s)}
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=env, cwd=REPO) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return None, out.decode(), err.decode()
        return proc.returncode, out.decode(), err.decode()


def _stops_then_sleeps(sleep_s: float, *, owned: bool) -> str:
    """A program whose signal scope stops at once; it then sleeps ``sleep_s`` and prints "stopped"."""
    own = "from kvlens.cli_kit import own_the_process\nown_the_process()\n" if owned else ""
    return ("import threading, time\n"
            "from kvlens.cli_kit import stopped_by_signals\n"
            f"{own}"
            "stop = threading.Event()\n"
            "with stopped_by_signals(stop.set):\n"
            "    print('ready', flush=True)\n"
            "    stop.wait(60)\n"
            f"time.sleep({sleep_s})\n"
            "print('stopped', flush=True)\n")


def test_a_stop_that_hangs_prints_the_stacks_and_exits() -> None:
    """SIGTERM to a command whose loop ignores the stop: past KVLENS_STOP_GRACE_S the process prints
    every thread's stack and exits 1, instead of living on (the collectors' supervisor and systemd
    would otherwise wait, then SIGKILL it with no word of where it hung)."""
    code = ("import threading\n"
            "from kvlens.cli_kit import own_the_process, stopped_by_signals\n"
            "own_the_process()\n"
            "def stuck_forever():\n"
            "    threading.Event().wait()\n"
            "with stopped_by_signals(lambda: None):\n"
            "    print('ready', flush=True)\n"
            "    stuck_forever()\n")
    status, _, err = _stopped(code, 1)
    assert status == 1, err
    assert "Timeout (0:00:01)!" in err and "stuck_forever" in err, err


def test_a_stop_within_the_grace_exits_cleanly() -> None:
    """The watchdog only bounds a stop: a command that ends within the grace exits 0, and the armed
    watchdog does not fire after the scope (the interpreter's exit cancels it)."""
    status, out, err = _stopped(_stops_then_sleeps(0.5, owned=True), 3)
    assert (status, out) == (0, "stopped\n"), err
    assert "Timeout" not in err


def test_the_collector_ends_the_zmq_context_it_made(tmp_path: Path) -> None:
    """A collector given no context makes its own and ends it when ``run`` ends: nothing is left for
    zmq_ctx_term to wait on at the interpreter's exit."""
    ctx: zmq.Context[Any] = zmq.Context()
    e = FakeEngine(ctx, b"t", ring=10)
    try:
        sources = [Source(e.endpoint, e.replay, "r1")]
        c = LiveCollector(CollectorOptions(lake=tmp_path / "lake", sources=sources, flush_age_s=0.05,
                                           replay_timeout_s=0.5))
        c.run(duration_s=0.3)
        assert c.ctx.closed
        c.run(duration_s=0.2)  # a second run makes a new one, and ends it too
        assert c.ctx.closed
    finally:
        e.close()
        ctx.destroy(linger=0)


def test_a_library_callers_process_is_never_ended_by_a_stop() -> None:
    """In a process kvlens does not own (a test runner, an embedding program), a signal scope only
    calls ``stop``: a slow stop there is the caller's, and no watchdog ends the caller's process."""
    status, out, err = _stopped(_stops_then_sleeps(2.5, owned=False), 1)  # sleeps past the grace
    assert (status, out) == (0, "stopped\n"), err


def test_a_signal_handler_that_outlasts_the_wait_does_not_hang_the_queue() -> None:
    """The collector's main thread waits in ``_ByteQueue.get(timeout=0.05)`` and also runs the signal
    handlers. A SIGTERM whose handler returned after that deadline (a busy CI machine) once left the
    wait blocked for ever (CPython's SimpleQueue.get, Modules/_queuemodule.c) and the stop watchdog
    ended the collector with status 1. Here a handler sleeps past the timeout: get returns None,
    and an item put while a later handler runs is still delivered. In a child process, so a hang
    fails this test instead of the whole run."""
    code = ("import signal, threading, time\n"
            "from kvlens.collector.live import _ByteQueue\n"
            "q = _ByteQueue(4, 1000)\n"
            "signal.signal(signal.SIGALRM, lambda *_: time.sleep(0.1))\n"
            "signal.setitimer(signal.ITIMER_REAL, 0.01)\n"
            "print(q.get(timeout=0.05), flush=True)\n"
            "stop = threading.Event()\n"
            "threading.Timer(0.05, q.put, ('batch', 10, stop)).start()\n"
            "signal.setitimer(signal.ITIMER_REAL, 0.01)\n"
            "print(q.get(timeout=5), q.items, q.bytes, flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                             timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("_ByteQueue.get did not return within 60 s of a signal handler outlasting its wait")
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == ["None", "batch 0 0"]
