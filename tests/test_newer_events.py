"""Newer vLLM event semantics, decoded from byte-exact frames: remaining copies, BlockInactive,
snapshot bootstrap, parents never announced.

None of these is in a vLLM release yet (0.32/0.33 have none); the structs below mirror the open
pull requests' msgspec definitions, encoded with msgspec as the engine encodes its events:

- ``BlockRemoved.remaining_copy_counts`` (vllm-project/vllm#48933: an optional list aligned with
  ``block_hashes``; its test ``test_block_removed_optional_metadata_is_wire_compatible``);
- ``BlockInactive`` (vllm-project/vllm#50732, issue #50730: a cached GPU block whose last
  reference was released; it stays cached);
- snapshots (vllm-project/vllm#57789; examples/features/kv_events/kv_events_snapshot_subscriber.py):
  the reply ``[seq (8 bytes signed), publisher_id (16 bytes), chunk...]``, chunks being batches;
- a parent never announced (a P/D decode instance stores blocks whose prefix came from the
  prefill side): vLLM 0.32's own ``BlockStored`` with a ``parent_block_hash`` nobody stored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import msgspec
import pytest
from click.testing import CliRunner

from kvlens.analyzers import block_outcomes
from kvlens.cli import cli
from kvlens.collector.capture import capture_line, import_capture
from kvlens.collector.vllm_events import (
    DecodeError,
    EventDecoder,
    KvColumns,
    split_snapshot_reply,
)
from kvlens.lake import SegmentWriter, open_lake


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):  # vLLM 0.32's fields (vllm/distributed/kv_events.py)
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):  # with vllm-project/vllm#48933's field
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    remaining_copy_counts: list[int] | None = None


class BlockInactive(KVCacheEvent):  # vllm-project/vllm#50732
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None
    publisher_id: bytes | None = None


PUBLISHER = bytes(range(16))
TS = 1_790_000_000.0
H1, H2, H3, H9 = 11, 12, 13, 99


def _stored(hashes: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(16 * len(hashes))),
                       block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                       kv_cache_spec_kind="full_attention")


def _payload(ts: float, *events: Any) -> bytes:
    batch = Batch(ts=ts, events=list(events), data_parallel_rank=0, publisher_id=PUBLISHER)
    return msgspec.msgpack.encode(batch)


def _frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"kv@replica-a@m", seq.to_bytes(8, "big"), payload]


def test_remaining_copy_counts_are_decoded_per_hash() -> None:
    removed = BlockRemoved(block_hashes=[H1, H2], medium="GPU", group_idx=0, remaining_copy_counts=[2, 0])
    payload = _payload(TS, removed)
    assert msgspec.msgpack.decode(payload)[1][0]["remaining_copy_counts"] == [2, 0]  # the wire carries it
    out = KvColumns()
    info = EventDecoder().decode(payload, out, replica="r", seq=1, recv_ns=0)
    rows = out.take()
    assert info.rows == 2 and not info.bad_events
    assert list(zip(rows["kind"], rows["block_hash"], rows["remaining_copies"], strict=True)) == [
        ("removed", H1, 2), ("removed", H2, 0)]
    # Without the field (every release so far), the rows say nothing of copies.
    out = KvColumns()
    plain = _payload(TS, BlockRemoved(block_hashes=[H1], medium="GPU"))
    EventDecoder().decode(plain, out, replica="r", seq=1, recv_ns=0)
    assert out.take()["remaining_copies"] == [None]


def test_a_misaligned_count_list_is_a_bad_event_not_a_bad_batch() -> None:
    bad = BlockRemoved(block_hashes=[H1, H2], medium="GPU", remaining_copy_counts=[1])
    out = KvColumns()
    info = EventDecoder().decode(_payload(TS, bad, _stored([H3])), out, replica="r", seq=1, recv_ns=0)
    assert info.bad_events == ["remaining_copy_counts"] and out.take()["block_hash"] == [H3]


def test_block_inactive_is_kept_and_leaves_residency_alone(tmp_path: Path) -> None:
    out = KvColumns()
    EventDecoder().decode(_payload(TS, BlockInactive(block_hashes=[H1], medium="GPU", group_idx=0)), out,
                          replica="r", seq=1, recv_ns=0)
    rows = out.take()
    assert (rows["kind"], rows["block_hash"], rows["medium"]) == (["inactive"], [H1], ["gpu"])
    # Through the lake: stored, then inactive, then looked up: still a hit.
    capture = tmp_path / "frames.jsonl"
    inactive = BlockInactive(block_hashes=[H1], medium="GPU", group_idx=0)
    capture.write_bytes(capture_line(_frames(0, _payload(TS, _stored([H1]))))
                        + capture_line(_frames(1, _payload(TS + 1, inactive))))
    assert _outcomes_after(capture, tmp_path, [H1]) == ["hit_local"]


def test_copies_left_decide_residency_through_the_lake(tmp_path: Path) -> None:
    # H1 stored twice (two physical copies); one removal with one copy left keeps it; H2's removal
    # with none left drops it, although it too was stored twice.
    capture = tmp_path / "frames.jsonl"
    removed = BlockRemoved(block_hashes=[H1, H2], medium="GPU", group_idx=0, remaining_copy_counts=[1, 0])
    capture.write_bytes(capture_line(_frames(0, _payload(TS, _stored([H1, H2]), _stored([H1, H2]))))
                        + capture_line(_frames(1, _payload(TS + 1, removed))))
    assert _outcomes_after(capture, tmp_path, [H1, H2]) == ["hit_local", "miss_evicted"]


def test_a_parent_never_announced_keeps_the_blocks_without_a_chain(tmp_path: Path) -> None:
    decoder = EventDecoder()
    out = KvColumns()
    info = decoder.decode(_payload(TS, _stored([H2, H3], parent=H9)), out, replica="decode-0", seq=0,
                          recv_ns=0)
    rows = out.take()
    assert info.rows == 2 and decoder.unannounced_parents == 1
    assert rows["block_hash"] == [H2, H3] and rows["parent_hash"] == [H9, H2]
    assert rows["position"] == [None, None] and rows["content_hash"] == [None, None]
    # The blocks are resident all the same: a request whose chain starts with them hits.
    capture = tmp_path / "frames.jsonl"
    capture.write_bytes(capture_line(_frames(0, _payload(TS, _stored([H2, H3], parent=H9)))))
    assert _outcomes_after(capture, tmp_path, [H2, H3], replica="decode-0") == ["hit_local", "hit_local"]
    counts = import_capture([capture], tmp_path / "lake2", scenario="c")
    assert counts["unannounced_parents"] == 1
    result = CliRunner().invoke(cli, ["import", "vllm-events", str(capture), "--lake",
                                      str(tmp_path / "lake3")])
    assert result.exit_code == 0 and "1 stores whose parent was never announced" in result.output


def test_a_snapshot_reply_bootstraps_the_replica_state() -> None:
    chunk1 = _payload(TS, _stored([H1, H2]))
    chunk2 = _payload(TS, _stored([H3], parent=H2))
    reply = [(41).to_bytes(8, "big", signed=True), PUBLISHER, chunk1, chunk2]
    seq, publisher, payloads = split_snapshot_reply(reply)
    assert (seq, publisher, len(payloads)) == (41, PUBLISHER, 2)
    out = KvColumns()
    info = EventDecoder().decode_snapshot(payloads, out, replica="r", seq=seq, recv_ns=7)
    rows = out.take()
    # What was known before is cleared, then the snapshot's blocks are stored, parents first.
    assert rows["kind"] == ["cleared", "stored", "stored", "stored"] and info.rows == 4
    assert rows["block_hash"] == [None, H1, H2, H3] and rows["position"] == [None, 0, 1, 2]
    assert set(rows["seq"]) == {41}
    with pytest.raises(DecodeError, match="no snapshot"):
        split_snapshot_reply([(-2).to_bytes(8, "big", signed=True), PUBLISHER])
    with pytest.raises(DecodeError, match="16 bytes"):
        split_snapshot_reply([(1).to_bytes(8, "big", signed=True), b"short"])


def _outcomes_after(capture: Path, tmp: Path, blocks: list[int], replica: str = "replica-a") -> list[str]:
    lake = tmp / "lake"
    import_capture([capture], lake, scenario="s", replica=replica)
    rows = [{"request_id": "q", "arrival_ns": int((TS + 10) * 1e9), "position": i, "block_hash": h,
             "block_tokens": 16, "block_size_tokens": 16} for i, h in enumerate(blocks)]
    rows.append({"request_id": "q", "arrival_ns": int((TS + 10) * 1e9), "position": len(blocks),
                 "block_hash": 1, "block_tokens": 1, "block_size_tokens": 16})
    with SegmentWriter(lake, "request_blocks", scenario="s", writer_id="t") as w:
        w.append_rows(rows)
    with SegmentWriter(lake, "requests", scenario="s", writer_id="t") as w:
        w.append_rows([{"request_id": "q", "arrival_ns": int((TS + 10) * 1e9), "replica": replica,
                        "prompt_tokens": 16 * len(blocks) + 1}])
    con = duckdb.connect()
    open_lake(con, lake)
    out = block_outcomes(requests=con.table("requests"), request_blocks=con.table("request_blocks"),
                         kv_events=con.table("kv_events"), transfers=con.table("transfers"), scenario="s",
                         bytes_per_token=1)
    con.close()
    return list(out["outcome"])
