"""Tests for analyzers.isolation: planted cross-tenant reuse, incompatible keys, block-size mismatch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest

from kvlens.analyzers.isolation import isolation_findings
from kvlens.analyzers.outcomes import block_outcomes
from kvlens.collector.hashing import vllm_block_hashes
from kvlens.collector.importer import import_files
from kvlens.lake import SegmentWriter, open_lake
from kvlens.schema import BLOCK_OUTCOMES, KV_EVENTS, REQUEST_BLOCKS, REQUESTS, Table

BPT = 100  # bytes per token
S = "sc"


def _rel(con: duckdb.DuckDBPyConnection, table: Table, rows: list[dict[str, Any]]) -> duckdb.DuckDBPyRelation:
    """A relation with the table's columns (those not given are NULL), typed as the schema says."""
    given = set(rows[0]) if rows else set()
    cols = ", ".join(f"CAST({c.name if c.name in given else 'NULL'} AS {'VARCHAR' if c.enum else c.type}) "
                     f"AS {c.name}" for c in table.columns)
    frame = pl.DataFrame(rows) if rows else pl.DataFrame({"x": [0]})  # noqa: F841 (DuckDB reads it)
    name = f"t_{table.name}"
    where = "" if rows else " WHERE false"
    con.execute(f"CREATE OR REPLACE TABLE {name} AS SELECT {cols} FROM frame{where}")
    return con.table(name)


def _req(rid: str, tenant: str | None, t: int) -> dict[str, Any]:
    return {"request_id": rid, "scenario": S, "arrival_ns": t, "tenant": tenant, "replica": "r0"}


def _blk(rid: str, t: int, pos: int, h: int, *, c: int | None = None, size: int = 16,
         ns: str | None = "m") -> dict[str, Any]:
    return {"request_id": rid, "scenario": S, "arrival_ns": t, "position": pos, "block_hash": h,
            "content_hash": c if c is not None else h, "block_tokens": size, "block_size_tokens": size,
            "namespace": ns}


def _out(rid: str, pos: int, h: int, outcome: str, key_diff: str | None = None) -> dict[str, Any]:
    return {"scenario": S, "request_id": rid, "replica": "r0", "arrival_ns": 0, "position": pos,
            "block_hash": h, "outcome": outcome, "tokens": 16, "bytes": 16 * BPT, "key_diff": key_diff}


def _ev(replica: str, h: int, c: int | None, tokens: int = 16, extra: str | None = None,
        kind: str = "stored") -> dict[str, Any]:
    return {"scenario": S, "ts_ns": 1, "replica": replica, "kind": kind, "block_hash": h, "content_hash": c,
            "block_tokens": tokens, "extra_key": extra, "namespace": "m"}


def _audit(requests: list[dict[str, Any]], blocks: list[dict[str, Any]], outcomes: list[dict[str, Any]],
           events: list[dict[str, Any]]) -> pl.DataFrame:
    con = duckdb.connect()
    types = {c: pl.Utf8 for c in BLOCK_OUTCOMES.names} | {
        "arrival_ns": pl.Int64, "position": pl.Int32, "block_hash": pl.UInt64, "tokens": pl.Int32,
        "bytes": pl.Int64, "removed_ns": pl.Int64}
    frame = pl.DataFrame([{c: o.get(c) for c in types} for o in outcomes], schema=types)
    return isolation_findings(requests=_rel(con, REQUESTS, requests),
                              request_blocks=_rel(con, REQUEST_BLOCKS, blocks),
                              kv_events=_rel(con, KV_EVENTS, events), block_outcomes=frame, scenario=S,
                              bytes_per_token=BPT)


def test_planted_cross_tenant_reuse_is_a_high_finding() -> None:
    reqs = [_req("a1", "acme", 1), _req("b1", "bolt", 2), _req("c1", "cola", 3), _req("n1", None, 4)]
    blocks = [_blk("a1", 1, 0, 11), _blk("a1", 1, 1, 12),
              _blk("b1", 2, 0, 11), _blk("b1", 2, 1, 12), _blk("b1", 2, 2, 13),
              _blk("c1", 3, 0, 13), _blk("n1", 4, 0, 11)]
    outcomes = [_out("a1", 0, 11, "miss_cold"), _out("a1", 1, 12, "miss_cold"),
                _out("b1", 0, 11, "hit_local"), _out("b1", 1, 12, "hit_remote"),
                _out("b1", 2, 13, "miss_cold"),
                _out("c1", 0, 13, "miss_routing"), _out("n1", 0, 11, "hit_local")]
    got = _audit(reqs, blocks, outcomes, [])
    assert got.select("finding", "severity", "subject", "blocks", "tokens", "bytes", "requests").rows() == [
        # b1 (bolt) hit blocks 11 and 12 that acme's a1 needed first: 2 blocks, 32 tokens
        ("cross_tenant_reuse", "high", "acme -> bolt", 2, 32, 3200, 1),
        # block 13: needed by bolt (b1) then cola (c1), no hit across them; n1 has no tenant
        ("cross_tenant_keys", "medium", "bolt, cola", 1, 16, 1600, 2),
    ]
    assert "2 cache hits (32 tokens) in 1 requests of tenant bolt" in got["detail"][0]
    assert set(got["scenario"]) == {S}


def test_token_sums_do_not_wrap_at_int32() -> None:
    # block_outcomes.tokens is INTEGER (Int32): a fleet's hits summed per tenant pair pass 2**31
    # tokens long before any one block does; stand in for millions of blocks with three big ones.
    big = 2**30
    reqs = [_req("a1", "acme", 1), _req("b1", "bolt", 2)]
    blocks = [_blk("a1", 1, p, 11 + p, size=big) for p in range(3)] + [_blk("b1", 2, p, 11 + p, size=big)
                                                                        for p in range(3)]
    outcomes = [{**_out("a1", p, 11 + p, "miss_cold"), "tokens": big} for p in range(3)]
    outcomes += [{**_out("b1", p, 11 + p, "hit_local"), "tokens": big} for p in range(3)]
    got = _audit(reqs, blocks, outcomes, []).filter(pl.col("finding") == "cross_tenant_reuse")
    assert got.select("tokens", "bytes").rows() == [(3 * big, 3 * big * BPT)]


def test_incompatible_namespaces_name_what_differs() -> None:
    a, b = "llama|rev1|sha256|seed0", "llama|rev1|sha256_cbor|seed0"
    reqs = [_req("x", None, 1), _req("y", None, 2)]
    blocks = [_blk("x", 1, 0, 11, c=901, ns=a), _blk("x", 1, 1, 12, c=902, ns=a),
              _blk("y", 2, 0, 21, c=901, ns=b), _blk("y", 2, 1, 22, c=902, ns=b)]
    outcomes = [_out("x", 0, 11, "miss_cold"), _out("x", 1, 12, "miss_cold"),
                _out("y", 0, 21, "miss_incompatible", a), _out("y", 1, 22, "miss_incompatible", a)]
    events = [_ev("r0", 11, 901), _ev("r0", 12, 902), _ev("r1", 21, 901), _ev("r1", 22, 902),
              _ev("r1", 23, 903), _ev("r0", 11, 901, kind="removed")]
    got = _audit(reqs, blocks, outcomes, events)
    assert got.select("finding", "severity", "subject", "blocks", "tokens").rows() == [
        ("incompatible_keys", "medium", f"{b} vs {a}", 2, 32),
        ("same_content_different_keys", "medium", f"{b} vs {a}", 2, None),  # router namespaces (sorted)
        ("same_content_different_keys", "medium", "r0 vs r1", 2, None),  # engine replicas
    ]
    assert "'sha256_cbor' vs 'sha256'" in got["detail"][0]
    assert "2 blocks (32 tokens, 1 requests)" in got["detail"][0]


def test_router_engine_block_size_mismatch() -> None:
    reqs = [_req("x", None, 1)]
    blocks = [_blk("x", 1, 0, 11, size=16)]
    events = [_ev("r0", 11, 11, tokens=16), _ev("r1", 31, 31, tokens=32), _ev("r1", 32, 32, tokens=32)]
    got = _audit(reqs, blocks, [], events)
    assert got.select("finding", "severity", "subject", "blocks").rows() == [
        ("block_size_mismatch", "high", "r1", 2),
        ("engine_block_size_mismatch", "medium", "r0, r1", 3),
    ]
    assert "blocks of 32 tokens, but the router keys prompts in blocks of 16 tokens" in got["detail"][0]


def test_one_key_under_two_salts_is_a_high_finding() -> None:
    events = [_ev("r0", 5, None, extra='["salt-a"]'), _ev("r1", 5, None, extra='["salt-b"]'),
              _ev("r1", 6, None, extra='["salt-b"]')]
    got = _audit([_req("x", None, 1)], [_blk("x", 1, 0, 5)], [], events)
    assert got.select("finding", "severity", "blocks").rows() == [("cross_salt_keys", "high", 1)]


@pytest.mark.parametrize("tenant", ["acme", None])
def test_an_isolated_fleet_has_no_findings(tenant: str | None) -> None:
    reqs = [_req("a1", tenant, 1), _req("a2", tenant, 2)]
    blocks = [_blk("a1", 1, 0, 11), _blk("a2", 2, 0, 11)]
    outcomes = [_out("a1", 0, 11, "miss_cold"), _out("a2", 0, 11, "hit_local")]
    got = _audit(reqs, blocks, outcomes, [_ev("r0", 11, 11)])
    assert got.is_empty() and got.columns[:5] == ["scenario", "finding", "subject", "blocks", "detail"]


def test_cross_tenant_hit_found_from_imported_requests_and_engine_events(
        tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    """End to end: gateway lines with token ids, the engine's stores, the ledger's outcomes."""
    tokens = list(range(100, 148))  # 3 full blocks of 16: no tail, so the last block is given back
    lake = tmp_path / "lake"
    line = {"prompt_tokens": 48, "token_ids": tokens, "replica": "r0", "model": "m"}
    import_files("gateway", [write_jsonl("gw.jsonl", [
        {**line, "request_id": "a1", "arrival_ns": 1_000, "tenant": "acme"},
        {**line, "request_id": "b1", "arrival_ns": 5_000, "tenant": "bolt"}])], lake, scenario=S)
    hashes = [b.value for b in vllm_block_hashes(tokens, 16)]
    with SegmentWriter(lake, "kv_events", scenario=S) as w:  # a1's blocks stored on r0 at t=2000
        w.append_columns({"ts_ns": [2_000] * 3, "replica": ["r0"] * 3, "kind": ["stored"] * 3,
                          "block_hash": hashes, "block_tokens": [16] * 3, "medium": ["gpu"] * 3})
    con = duckdb.connect()
    open_lake(con, lake)
    outcomes = block_outcomes(requests=con.table("requests"), request_blocks=con.table("request_blocks"),
                              kv_events=con.table("kv_events"), transfers=con.table("transfers"),
                              scenario=S, bytes_per_token=BPT)
    got = isolation_findings(requests=con.table("requests"), request_blocks=con.table("request_blocks"),
                             kv_events=con.table("kv_events"), block_outcomes=outcomes, scenario=S,
                             bytes_per_token=BPT)
    # b1: blocks 0-1 hit_local (2 blocks, 32 tokens); block 2 is recomputed_last, not a hit,
    # but both tenants needed its key (2 requests)
    assert outcomes.filter(pl.col("request_id") == "b1")["outcome"].to_list() == [
        "hit_local", "hit_local", "recomputed_last"]
    assert got.select("finding", "severity", "subject", "blocks", "tokens", "requests").rows() == [
        ("cross_tenant_reuse", "high", "acme -> bolt", 2, 32, 1),
        ("cross_tenant_keys", "medium", "acme, bolt", 1, 16, 2)]
