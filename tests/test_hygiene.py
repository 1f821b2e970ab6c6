"""Tests for analyzers.hygiene: planted early divergences, imported through the gateway collector."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow.parquet as pq

from kvlens.analyzers.hygiene import hygiene
from kvlens.collector.hashing import content_hashes, token_hashes
from kvlens.collector.importer import import_files
from kvlens.lake import open_lake, segment_files

B = 16
BYTES_PER_TOKEN = 1000
T0 = 1_700_000_000_000_000_000


def _line(rid: str, i: int, tokens: list[int]) -> dict[str, Any]:
    return {"request_id": rid, "arrival_ns": T0 + i * 1_000_000, "prompt_tokens": len(tokens),
            "token_ids": tokens, "tenant": "acme", "model": "m"}


def _question(n: int) -> list[int]:
    return [50_000 + 100 * n + k for k in range(20)]  # 1 full block + a tail of 4, unique per request


# App A: a 4-token timestamp opens block 0 of a 64-token system prompt (4 blocks).
STABLE_A = list(range(1000, 1060))  # 12 tokens finish block 0, then blocks 1-3 (48 tokens)
# App B: 2 stable blocks, a request id filling block 2, 2 more stable blocks.
HEAD_B, TAIL_B = list(range(2000, 2032)), list(range(3000, 3032))
# App C: a clean shared 3-block prompt, then the question: nothing lost.
STABLE_C = list(range(4000, 4048))


def _trace() -> list[dict[str, Any]]:
    lines, i = [], 0
    for n in range(5):
        stamp = [9000 + 10 * n + k for k in range(4)]
        lines.append(_line(f"a{n}", i, stamp + STABLE_A + _question(i)))
        i += 1
    for n in range(3):
        rid_block = [7000 + 20 * n + k for k in range(B)]
        lines.append(_line(f"b{n}", i, HEAD_B + rid_block + TAIL_B + _question(i)))
        i += 1
    for _ in range(3):
        lines.append(_line(f"c{i}", i, STABLE_C + _question(i)))
        i += 1
    return lines


def _analyze(tmp_path: Path, write_jsonl: Callable[..., Path], lines: list[dict[str, Any]]) -> pl.DataFrame:
    lake = tmp_path / "lake"
    import_files("gateway", [write_jsonl("gw.jsonl", lines)], lake, scenario="gw")
    con = duckdb.connect()
    open_lake(con, lake)
    return hygiene(request_blocks=con.table("request_blocks"), scenario="gw", bytes_per_token=BYTES_PER_TOKEN)


def test_importer_writes_unchained_token_hashes(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    lines = _trace()[:2]
    lake = tmp_path / "lake"
    import_files("gateway", [write_jsonl("gw.jsonl", lines)], lake, scenario="gw")
    con = duckdb.connect()
    open_lake(con, lake)
    rows = con.sql("SELECT request_id, position, content_hash, token_hash FROM request_blocks "
                   "ORDER BY request_id, position").fetchall()
    a0, a1 = (content_hashes(x["token_ids"], B) for x in lines)
    t0, t1 = (token_hashes(x["token_ids"], B) for x in lines)
    assert a0 is not None and a1 is not None and t0 is not None and t1 is not None
    # 84 tokens: 5 full blocks with both hashes (the tail of 4 is not hashed, as vLLM does)
    assert [r[1:] for r in rows if r[0] == "a0"] == [(i, *h) for i, h in enumerate(zip(a0, t0, strict=True))]
    assert len(a0) == 5
    # after the timestamp block the chained hashes all differ, the block contents do not
    assert all(x != y for x, y in zip(a0, a1, strict=True))
    assert t0[1:4] == t1[1:4] and t0[0] != t1[0] and t0[4] != t1[4]
    assert t0[0] == a0[0]  # a root block's content hash is its token hash


def test_planted_timestamp_and_request_id_are_found_with_exact_tokens(
        tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    got = _analyze(tmp_path, write_jsonl, _trace())
    # App A: a1..a4 each lose blocks 1-3 (3 x 16 = 48 tokens) to the timestamp in block 0;
    # a0 carried the content first and loses nothing. Group total 4 x 48 = 192.
    # App B: b1, b2 diverge at block 2 (the request id) and lose blocks 3-4 = 32 tokens each
    # (their questions differ); group total 64. App C shares its prefix cleanly: no rows.
    expected = [(f"a{n}", 0, 48, 48_000, 3, "a0", 1, 4, 192) for n in range(1, 5)]
    expected += [(f"b{n}", 2, 32, 32_000, 2, "b0", 2, 2, 64) for n in range(1, 3)]
    cols = ["request_id", "split_position", "lost_tokens", "lost_bytes", "lost_blocks", "first_request_id",
            "offender_rank", "offender_requests", "offender_lost_tokens"]
    assert got.select(cols).rows() == expected
    assert set(got["scenario"]) == {"gw"}
    stable_a_block1 = token_hashes(STABLE_A[12:28], B)
    assert stable_a_block1 is not None and got["repeated_token_hash"][0] == stable_a_block1[0]


def test_moving_the_timestamp_to_the_end_loses_nothing(tmp_path: Path,
                                                       write_jsonl: Callable[..., Path]) -> None:
    lines = []
    for n in range(4):
        stamp = [9000 + 10 * n + k for k in range(4)]
        lines.append(_line(f"a{n}", n, STABLE_A + _question(n) + stamp))
    got = _analyze(tmp_path, write_jsonl, lines)
    assert got.is_empty() and "offender_rank" in got.columns


def test_no_token_hashes_gives_an_empty_frame(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    lines = [{"request_id": f"r{i}", "arrival_ns": T0 + i, "prompt_tokens": 32, "block_hashes": [i, 7]}
             for i in range(3)]
    got = _analyze(tmp_path, write_jsonl, lines)
    assert got.is_empty() and got.columns[:5] == ["scenario", "request_id", "split_position", "lost_tokens",
                                                   "lost_bytes"]


def test_a_repeat_needs_the_same_prefix_before_the_split(tmp_path: Path,
                                                         write_jsonl: Callable[..., Path]) -> None:
    # y0 carries x1's blocks 2-3 exactly, but after another block 0: moving x1's block 1 would
    # not make them a shared prefix with y0. Only x0 (same block 0) is an earlier carrier, and
    # it shares block 2 alone.
    shared = list(range(5000, 5032))
    lines = [
        _line("y0", 0, list(range(6000, 6016)) + list(range(6100, 6116)) + shared),
        _line("x0", 1, list(range(8000, 8016)) + list(range(8100, 8116)) + shared[:16] + [1] * 16),
        _line("x1", 2, list(range(8000, 8016)) + list(range(8200, 8216)) + shared),
    ]
    got = _analyze(tmp_path, write_jsonl, lines)
    assert got.select("request_id", "split_position", "lost_tokens", "first_request_id").rows() == [
        ("x1", 1, 16, "x0")]


def test_a_lake_written_before_token_hash_existed_still_opens(tmp_path: Path,
                                                             write_jsonl: Callable[..., Path]) -> None:
    lake = tmp_path / "lake"
    import_files("gateway", [write_jsonl("gw.jsonl", _trace()[:3])], lake, scenario="gw")
    for seg in segment_files(lake, "request_blocks"):  # as an older kvlens wrote them
        pq.write_table(pq.read_table(seg).drop_columns(["token_hash"]), seg)
    con = duckdb.connect()
    open_lake(con, lake)
    assert con.sql("SELECT count(*), count(token_hash) FROM request_blocks").fetchall() == [(15, 0)]
    assert hygiene(request_blocks=con.table("request_blocks"), scenario="gw", bytes_per_token=1).is_empty()
