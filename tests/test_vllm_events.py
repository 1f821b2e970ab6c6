"""Tests for collector.vllm_events: engine frames (every format) -> kv_events columns."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import duckdb
import msgspec
import pytest
from engine_frames import (
    U64,
    AllBlocksCleared,
    AllBlocksCleared23,
    BlockRemoved,
    BlockRemoved09,
    BlockRemoved23,
    BlockStored,
    BlockStored09,
    BlockStored23,
    EventBatch,
    EventBatch09,
    EventBatchWithPublisher,
    SgBlockRemoved,
    SgBlockStored,
    SgEventBatch,
    encode,
    signed,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.collector.capture import import_capture, read_capture
from kvlens.collector.hashing import content_hashes
from kvlens.collector.vllm_events import (
    DecodeError,
    EventDecoder,
    KvColumns,
    medium_of,
    split_frames,
    topic_replica,
)
from kvlens.lake import open_lake

DATA = Path(__file__).parent / "data"
CAPTURE = DATA / "vllm032_capture_head.frames.jsonl"
TS = 1_796_064_004.5


def _decode(payload: bytes, **kw: Any) -> tuple[dict[str, list[Any]], list[str]]:
    cols = KvColumns(kw.pop("keep_tokens", False))
    info = EventDecoder(keep_tokens=cols.keep_tokens, **kw).decode(payload, cols, replica="r", seq=7,
                                                                   recv_ns=1)
    return cols.take(), info.bad_events


def _rows(cols: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(cols, vals, strict=True)) for vals in zip(*cols.values(), strict=True)]


# -- the real capture ---------------------------------------------------------------------------

def test_capture_frames_decode_byte_exact() -> None:
    dec, cols = EventDecoder(), KvColumns()
    raw_stored = raw_removed = 0
    for _, frames in read_capture(CAPTURE):
        topic, seq, payload = split_frames(frames)
        assert topic == b"kv@replica-a@tiny"
        raw = msgspec.msgpack.decode(payload)
        for ev in raw[1]:
            n = len(ev["block_hashes"])
            raw_stored += n if ev["type"] == "BlockStored" else 0
            raw_removed += n if ev["type"] == "BlockRemoved" else 0
        info = dec.decode(payload, cols, replica="replica-a", seq=seq, recv_ns=0)
        assert info.bad_events == [] and info.dp_rank == 0
    rows = _rows(cols.take())
    assert sum(r["kind"] == "stored" for r in rows) == raw_stored > 0
    assert sum(r["kind"] == "removed" for r in rows) == raw_removed > 0
    first = msgspec.msgpack.decode(split_frames(next(read_capture(CAPTURE))[1])[2])
    ev = first[1][0]
    got = [r for r in rows if r["seq"] == 0]
    assert [r["block_hash"] for r in got] == ev["block_hashes"]
    assert [r["parent_hash"] for r in got] == [None, *ev["block_hashes"][:-1]]
    assert [r["position"] for r in got] == list(range(len(got)))
    assert got[0]["ts_ns"] == int(first[0] * 1e9)
    assert {r["medium"] for r in rows} == {"gpu"}
    assert {r["spec_kind"] for r in rows if r["kind"] == "stored"} == {"full_attention"}
    assert [r["content_hash"] for r in got] == content_hashes(ev["token_ids"], 32)
    # every stored block of a later event chains onto a known parent: positions continue
    later = [r for r in rows if r["kind"] == "stored" and r["seq"] > 0 and r["parent_hash"] is not None]
    assert later and all(r["position"] is not None and r["position"] > 0 for r in later)


def test_topic_names_replica_and_model() -> None:
    assert topic_replica(b"kv@replica-a@tiny") == ("replica-a", "tiny")
    assert topic_replica(b"kv@10.0.0.5@org/model@v2") == ("10.0.0.5", "org/model@v2")
    assert topic_replica(b"kv-events") == (None, None)


# -- every engine's encoding --------------------------------------------------------------------

HASHES = [11, 2**63 + 5, U64]


def _stored_rows(cols: dict[str, list[Any]]) -> list[tuple[Any, ...]]:
    return [(r["kind"], r["block_hash"], r["parent_hash"], r["block_tokens"], r["medium"])
            for r in _rows(cols)]


def test_vllm_033_map_events() -> None:
    payload = encode(EventBatch(TS, [
        BlockStored(HASHES, None, list(range(12)), 4, None, "GPU", "ad", extra_keys=[None, ["s"], None],
                    group_idx=1, kv_cache_spec_kind="full_attention", session_id="sess", locality="LOCAL"),
        BlockRemoved([HASHES[0]], "CPU", group_idx=1),
        AllBlocksCleared(),
    ], 3))
    assert payload[:1] == b"\x93"  # a 3-element array, as vLLM sends it
    cols, bad = _decode(payload)
    assert bad == []
    rows = _rows(cols)
    assert _stored_rows(cols) == [
        ("stored", 11, None, 4, "gpu"), ("stored", 2**63 + 5, 11, 4, "gpu"),
        ("stored", U64, 2**63 + 5, 4, "gpu"), ("removed", 11, None, None, "cpu"),
        ("cleared", None, None, None, None)]
    assert [r["extra_key"] for r in rows[:3]] == [None, '["s"]', None]
    assert rows[0]["lora_name"] == "ad" and rows[0]["session_id"] == "sess" and rows[0]["locality"] == "LOCAL"
    assert {r["dp_rank"] for r in rows} == {3} and {r["group_idx"] for r in rows[:4]} == {1}
    assert rows[3]["position"] == 0 and rows[3]["content_hash"] == rows[0]["content_hash"]


def test_vllm_023_positional_events() -> None:
    payload = encode(EventBatch(TS, [
        BlockStored23([5, 6], None, list(range(8)), 4, None, "GPU", None, None, 0, "full_attention", None),
        BlockRemoved23([5], "STORAGE", 0),
        AllBlocksCleared23(),
    ], 0))
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][0] == "BlockStored" and len(raw[1][0]) == 12 and len(raw[1][1]) == 4
    cols, bad = _decode(payload)
    assert bad == []
    assert _stored_rows(cols) == [("stored", 5, None, 4, "gpu"), ("stored", 6, 5, 4, "gpu"),
                                  ("removed", 5, None, None, "disk"), ("cleared", None, None, None, None)]
    assert cols["spec_kind"][:2] == ["full_attention"] * 2


def test_vllm_09_two_element_batch() -> None:
    payload = encode(EventBatch09(TS, [BlockStored09([1], None, [1, 2], 2, None), BlockRemoved09([1])]))
    assert len(msgspec.msgpack.decode(payload)) == 2
    cols, bad = _decode(payload)
    assert bad == []
    assert _stored_rows(cols) == [("stored", 1, None, 2, "gpu"), ("removed", 1, None, None, "gpu")]
    assert cols["dp_rank"] == [None, None]


def test_trailing_batch_element_and_digest_hashes() -> None:
    digest = hashlib.sha256(b"x").digest()
    payload = encode(EventBatchWithPublisher(TS, [
        BlockStored([digest], digest, [1, 2], 2, None, "GPU", None)], 0, b"\x01" * 16))
    cols, bad = _decode(payload)
    assert bad == []
    assert cols["block_hash"] == [int.from_bytes(digest[-8:], "big")] == cols["parent_hash"]


def test_sglang_signed_hashes_and_media() -> None:
    h = [2**63 + 9, 17]
    payload = encode(SgEventBatch(TS, [
        SgBlockStored([signed(h[0])], None, [1, 2, 3, 4], 4, medium="GPU", cache_salt="tenant-a"),
        SgBlockStored([signed(h[1])], signed(h[0]), [5, 6, 7, 8], 4, medium="CPU_PINNED"),
        SgBlockRemoved([signed(h[0])], "DISK"),
        SgBlockRemoved([signed(h[1])], "EXTERNAL"),
    ], None))
    assert msgspec.msgpack.decode(payload)[1][0]["block_hashes"][0] < 0
    cols, bad = _decode(payload)
    assert bad == []
    assert _stored_rows(cols) == [
        ("stored", h[0], None, 4, "gpu"), ("stored", h[1], h[0], 4, "cpu"),
        ("removed", h[0], None, None, "disk"), ("removed", h[1], None, None, "pool")]
    assert cols["extra_key"][:2] == ["tenant-a", None]
    assert cols["position"] == [0, 1, 0, 1]


@pytest.mark.parametrize(("medium", "tier"), [
    ("GPU", "gpu"), ("CPU", "cpu"), ("STORAGE", "disk"), ("CPU_PINNED", "cpu"), ("DISK", "disk"),
    ("EXTERNAL", "pool"), ("Disk", "disk"), (None, "gpu"), ("NVME-OF", "unknown")])
def test_media_of_both_engines(medium: str | None, tier: str) -> None:
    assert medium_of(medium) == tier


def test_tokens_dropped_unless_kept() -> None:
    payload = encode(EventBatch(TS, [BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None)], 0))
    assert "token_ids" not in _decode(payload)[0]
    kept, _ = _decode(payload, keep_tokens=True)
    assert kept["token_ids"] == [[1, 2], [3, 4]]


def test_unaligned_tokens_give_no_content_hash() -> None:
    # sliding-window groups skip masked blocks in block_hashes but not in token_ids
    payload = encode(EventBatch(TS, [BlockStored([1], None, [1, 2, 3, 4], 2, None, "GPU", None)], 0))
    cols, bad = _decode(payload)
    assert bad == [] and cols["content_hash"] == [None] and cols["position"] == [0]


# -- malformed input ----------------------------------------------------------------------------

GOOD = encode(EventBatch(TS, [BlockStored([1], None, [1, 2], 2, None, "GPU", None)], 0))


@pytest.mark.parametrize(("payload", "reason"), [
    (GOOD[:-3], "msgpack"),
    (b"", "msgpack"),
    (msgspec.msgpack.encode({"ts": 1}), "batch_shape"),
    (msgspec.msgpack.encode([TS]), "batch_shape"),
    (msgspec.msgpack.encode(["soon", []]), "batch_types"),
    (msgspec.msgpack.encode([TS, {"a": 1}]), "batch_types"),
    (msgspec.msgpack.encode([TS, [], "rank"]), "batch_types"),
    (msgspec.msgpack.encode([TS, [], 0, b"x" * 2000]), "oversize"),
])
def test_bad_batches_raise_decode_error(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        _decode(payload, max_payload_bytes=1000)
    assert info.value.reason == reason


def test_bad_events_are_counted_and_the_rest_kept() -> None:
    payload = msgspec.msgpack.encode([TS, [
        {"type": "BlockStored", "block_hashes": ["nope"], "parent_block_hash": None, "token_ids": [],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": "two", "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": 5, "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [5], "medium": 3},
        {"type": "Mystery"}, 42, [],
        {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"},
    ], 0])
    cols, bad = _decode(payload)
    assert cols["block_hash"] == [9]
    assert sorted(bad) == sorted(["field:block_hashes", "field:block_size", "field:block_hashes",
                                  "field:medium", "event_type", "event_shape", "event_shape"])


def test_split_frames_checks_shape() -> None:
    assert split_frames([b"t", (5).to_bytes(8, "big"), b"p"]) == (b"t", 5, b"p")
    for frames in ([b"t", b"p"], [b"t", b"\x00" * 7, b"p"]):
        with pytest.raises(DecodeError):
            split_frames(frames)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_decoder_never_crashes_on_arbitrary_bytes(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        _decode(data)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=5)
                    | st.binary(max_size=9) | st.floats(allow_nan=False),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
                        st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids",
                                         "block_size", "medium", "extra_keys", "group_idx"]), inner,
                        max_size=6),
                    max_leaves=30))
def test_decoder_never_crashes_on_arbitrary_msgpack(obj: Any) -> None:
    for batch in (obj, [TS, [obj], 0], [TS, obj]):
        with contextlib.suppress(DecodeError):
            _decode(msgspec.msgpack.encode(batch))


# -- import of a capture ------------------------------------------------------------------------

def test_import_capture_writes_kv_events(tmp_path: Path) -> None:
    lines = CAPTURE.read_text().splitlines()
    dup = tmp_path / "cap.jsonl"
    bad = json.dumps([base64.b64encode(b"kv@replica-a@tiny").decode(), base64.b64encode(b"\0" * 8).decode()])
    dup.write_text("\n".join([*lines, lines[3], bad]) + "\n")  # a repeated batch and a 2-frame message
    counts = import_capture([dup], tmp_path / "lake", scenario="cap")
    assert counts["batches"] == len(lines) and counts["duplicates"] == 1 and counts["bad_frames"] == 1
    con = duckdb.connect()
    open_lake(con, tmp_path / "lake")
    got = con.execute("SELECT replica, count(*), count(DISTINCT seq), min(namespace) FROM kv_events "
                      "WHERE scenario = 'cap' GROUP BY 1").fetchall()
    assert got == [("replica-a", counts["rows"], len(lines), "tiny")]


def test_import_vllm_events_command(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvlens.cli import cli

    result = CliRunner().invoke(cli, ["import", "vllm-events", str(CAPTURE), "--lake", str(tmp_path / "lake"),
                                      "--scenario", "cap"])
    assert result.exit_code == 0, result.output
    assert "imported 40 batches" in result.output
    con = duckdb.connect()
    open_lake(con, tmp_path / "lake")
    assert con.execute("SELECT count(DISTINCT seq) FROM kv_events WHERE scenario = 'cap'").fetchone() == (40,)
