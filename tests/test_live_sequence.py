"""The live collector's sequence machine (collector/live_sequence.py), frame by frame, with no sockets."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from engine_frames import BlockStored, EventBatch, encode

from kvlens.collector.live_metrics import CollectorMetrics
from kvlens.collector.live_sequence import GAP_METRIC, SequenceTracker
from kvlens.collector.vllm_events import END_SEQ, EventDecoder, KvColumns


@dataclass(frozen=True)
class Src:
    endpoint: str = "tcp://engine:5557"
    replay: str | None = "tcp://engine:5558"
    name: str | None = "r1"
    model: str | None = None


class Ring:
    """A publisher's replay ring as its ROUTER answers: [b"", topic, seq, payload]..., then the end."""

    def __init__(self) -> None:
        self.held: list[tuple[int, bytes]] = []
        self.asked: list[int] = []

    def ask(self, endpoint: str, start: int, *, warn_timeout: bool = True) -> Iterator[list[bytes]]:
        self.asked.append(start)
        for seq, payload in self.held:
            if seq >= start:
                yield [b"", b"t", seq.to_bytes(8, "big"), payload]
        yield [b"", b"", END_SEQ, b""]


def _batch(seq: int, ts: float | None = None) -> bytes:
    stored = BlockStored(block_hashes=[1000 + seq], parent_block_hash=None, token_ids=list(range(16)),
                         block_size=16, lora_id=None, medium=None, lora_name=None)
    return encode(EventBatch(ts=ts if ts is not None else 1000.0 + seq, events=[stored]))


def _frames(seq: int, ts: float | None = None) -> list[bytes]:
    return [b"t", seq.to_bytes(8, "big"), _batch(seq, ts)]


def _machine(ring: Ring, src: Src | None = None) -> tuple[SequenceTracker, CollectorMetrics, list[int]]:
    metrics = CollectorMetrics()
    spilled: list[int] = []
    cols = KvColumns()
    m = SequenceTracker([src or Src()], metrics=metrics, decoder=EventDecoder(), cols=cols, transport=ring,
                        spill=lambda: spilled.append(len(cols)), clock_ns=lambda: 7)
    return m, metrics, spilled


def _seqs(m: SequenceTracker) -> list[int]:
    return [int(s) for s in m.cols.take_arrow().column("seq").to_pylist()]


def test_in_order_batches_are_taken_and_a_duplicate_is_dropped() -> None:
    m, metrics, _ = _machine(Ring())
    for seq in (0, 1, 2, 2):
        m.handle(0, _frames(seq), recv_ns=5)
    assert _seqs(m) == [0, 1, 2]
    assert metrics.value("kvlens_collector_duplicate_batches_total", replica="r1") == 1
    assert m.checkpoint()["publishers"]["r1|t"]["seq"] == 2 and m.dirty


def test_a_gap_is_filled_from_the_replay_then_the_live_copy_is_a_duplicate() -> None:
    ring = Ring()
    ring.held = [(s, _batch(s)) for s in range(6)]
    m, metrics, _ = _machine(ring)
    m.handle(0, _frames(0), recv_ns=5)
    m.handle(0, _frames(4), recv_ns=5)  # 1..3 were dropped on the way; the ring still holds them
    assert ring.asked == [0]  # from the last batch taken: a ring holding it answers with it
    assert _seqs(m) == [0, 1, 2, 3, 4, 5]
    assert metrics.value("kvlens_collector_sequence_gaps_total", replica="r1") == 1
    assert metrics.value("kvlens_collector_duplicate_batches_total", replica="r1") == 1
    assert m.gap_rows == []


def test_what_the_replay_no_longer_holds_is_recorded_as_lost() -> None:
    ring = Ring()
    ring.held = [(s, _batch(s)) for s in range(3, 6)]  # 1 and 2 fell out of the ring
    m, metrics, _ = _machine(ring)
    m.handle(0, _frames(0), recv_ns=5)
    m.handle(0, _frames(5), recv_ns=5)
    assert _seqs(m) == [0, 3, 4, 5]
    assert metrics.value("kvlens_collector_unrecoverable_gap_batches_total", replica="r1") == 2
    (row,) = m.gap_rows
    assert (row["name"], row["value"], row["ts_ns"]) == (GAP_METRIC, 2.0, 7)
    assert ("from_seq", "1") in row["labels"] and ("to_seq", "2") in row["labels"]


def test_a_jump_the_replay_does_not_hold_is_a_stray() -> None:
    ring = Ring()
    ring.held = [(s, _batch(s)) for s in range(2)]
    m, metrics, _ = _machine(ring)
    m.handle(0, _frames(0), recv_ns=5)
    m.handle(0, _frames(1), recv_ns=5)
    m.handle(0, _frames(900), recv_ns=5)  # a corrupt sequence number: the ring's newest is 1
    assert _seqs(m) == [0, 1]
    assert metrics.value("kvlens_collector_decode_errors_total", reason="stray_seq") == 1
    assert m.pubs["r1|t"].last_seq == 1


def test_a_lower_seq_with_a_newer_time_and_held_by_the_replay_is_a_restart() -> None:
    ring = Ring()
    m, metrics, _ = _machine(ring)
    for seq in range(3):
        m.handle(0, _frames(seq), recv_ns=5)
    ring.held = [(0, _batch(0, ts=5000.0))]  # the new process's ring
    m.handle(0, [b"t", (0).to_bytes(8, "big"), _batch(0, ts=5000.0)], recv_ns=9)
    assert metrics.value("kvlens_collector_publisher_restarts_total", replica="r1") == 1
    kinds = m.cols.take_arrow().column("kind").to_pylist()
    assert kinds.count("cleared") == 1 and kinds[-2:] == ["cleared", "stored"]


def test_a_checkpoint_resumes_and_asks_the_replay_for_what_follows() -> None:
    ring = Ring()
    ring.held = [(s, _batch(s)) for s in range(10)]
    first, _, _ = _machine(ring)
    for seq in range(4):
        first.handle(0, _frames(seq), recv_ns=5)
    m, _, _ = _machine(ring)
    m.resume(first.checkpoint())
    m.replay_checkpointed()
    assert ring.asked[-1] == 3 and _seqs(m) == [4, 5, 6, 7, 8, 9]


def test_rows_are_spilled_at_the_chunk_size_and_frames_recorded() -> None:
    m, _, spilled = _machine(Ring(), Src(replay=None))
    m.chunk_rows = 2
    seen: list[list[bytes]] = []
    m.record = seen.append
    for seq in range(3):
        m.handle(0, _frames(seq), recv_ns=5)
    assert spilled == [2, 3] and len(seen) == 3
