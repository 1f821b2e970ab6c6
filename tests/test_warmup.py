"""Warm-up: time to steady, tokens lost meanwhile, and what a pre-warm buys, by hand."""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.analyzers.request_ledger import request_ledger
from kvlens.analyzers.warmup import _prewarm, warmup

HOT0, HOT1, COLD = 100, 101, 200
BLOCK = 2  # tokens per block; every prompt is two full blocks
HIT = "hit_local"
# replica, arrival, [(block, outcome), ...]
REQUESTS = [
    ("r0", 0, [(HOT0, "miss_cold"), (HOT1, "miss_cold")]),
    ("r0", 10, [(HOT0, HIT), (HOT1, HIT)]),
    ("r0", 20, [(HOT0, HIT), (HOT1, HIT)]),
    ("r0", 30, [(HOT0, HIT), (HOT1, HIT)]),
    ("r1", 5, [(HOT0, "miss_routing"), (HOT1, "miss_routing")]),
    ("r1", 15, [(HOT0, HIT), (COLD, "miss_cold")]),
    ("r1", 25, [(HOT0, HIT), (HOT1, HIT)]),
    ("r1", 35, [(HOT0, HIT), (HOT1, HIT)]),
]


def _events(extra: list[dict[str, object]]) -> duckdb.DuckDBPyRelation:
    con = duckdb.connect()
    rows = [{"scenario": "s", "replica": "r0", "kind": "stored", "ts_ns": 0},
            {"scenario": "s", "replica": "r1", "kind": "stored", "ts_ns": 3}, *extra]
    con.register("kv_events", pl.DataFrame(rows))
    return con.table("kv_events")


def _inputs() -> tuple[pl.DataFrame, pl.DataFrame]:
    outcomes = pl.DataFrame([
        {"scenario": "s", "request_id": f"{rep}@{t}", "replica": rep, "arrival_ns": t, "position": pos,
         "block_hash": blk, "outcome": out, "tokens": BLOCK, "bytes": BLOCK}
        for rep, t, blocks in REQUESTS for pos, (blk, out) in enumerate(blocks)])
    con = duckdb.connect()
    con.register("requests", pl.DataFrame([
        {"scenario": "s", "request_id": f"{rep}@{t}", "replica": rep, "arrival_ns": t, "prompt_tokens": 4,
         "cached_tokens": None, "ttft_ms": 10.0, "queue_ms": 0.0} for rep, t, _ in REQUESTS]))
    ledger = request_ledger(block_outcomes=outcomes, requests=con.table("requests"))
    return ledger, outcomes


def _run(top_k: int = 2, extra: list[dict[str, object]] | None = None) -> pl.DataFrame:
    ledger, outcomes = _inputs()
    return warmup(request_ledger=ledger, block_outcomes=outcomes, kv_events=_events(extra or []),
                  scenario="s", steady_requests=2, steady_fraction=1.0, top_k=top_k, prewarm_window_ns=5)


def test_time_to_steady_and_tokens_lost() -> None:
    out = _run()
    r0, r1 = out.row(0, named=True), out.row(1, named=True)
    # Second half (arrival >= 17): four requests, all hits, so H = 1.
    assert r0["fleet_hit_ratio"] == pytest.approx(1.0)
    # r0's last two requests reach 8/8 tokens at its third request (t=20); the start is its first event.
    assert (r0["start_ns"], r0["start_kind"], r0["first_request_ns"]) == (0, "first_seen", 0)
    assert (r0["steady_after_ns"], r0["warmup_requests"], r0["warmup_recomputed_tokens"]) == (20, 2, 4)
    # r1 starts at its event (t=3); pairs reach 2/8, 6/8, 8/8: steady at t=35; warm-up 12 tokens, 6 hit.
    assert (r1["start_ns"], r1["first_request_ns"], r1["steady_after_ns"]) == (3, 5, 32)
    assert (r1["warmup_requests"], r1["warmup_recomputed_tokens"]) == (3, 6)


def test_prewarm_cost_and_savings() -> None:
    out = _run()
    r0, r1 = out.row(0, named=True), out.row(1, named=True)
    # Hot set: 100 (needed 8 times) and 101 (7); 200 is needed once. One chain, 4 bytes.
    assert (r0["prewarm_blocks"], r0["prewarm_prefixes"], r0["prewarm_bytes"]) == (2, 1, 4)
    # Both starts fall within 5 ns of each other: N = 2, N·W/Δt = 2 x 4 B / 5 ns.
    assert r0["concurrent_starts"] == r1["concurrent_starts"] == 2
    assert r0["prewarm_bandwidth_bytes_per_s"] == pytest.approx(2 * 4 / 5e-9)
    # r0's cold first request and r1's routed first request both become hits; 200 is not hot.
    assert (r0["saved_tokens"], r1["saved_tokens"]) == (4, 4)
    # Measured prefill: 8 x 10 ms over 10 recomputed tokens (4 + 4 + 2) = 8 ms a token.
    assert r0["saved_ms"] == pytest.approx(32.0)


def test_top_one_saves_only_the_root_block() -> None:
    out = _run(top_k=1)
    assert out["prewarm_blocks"].to_list() == [1, 1]
    assert out["prewarm_prefixes"].to_list() == [1, 1]
    assert out["saved_tokens"].to_list() == [2, 2]


def test_a_clear_is_a_new_start() -> None:
    out = _run(extra=[{"scenario": "s", "replica": "r0", "kind": "cleared", "ts_ns": 25}])
    starts = out.filter(pl.col("replica") == "r0")
    assert starts["start_kind"].to_list() == ["first_seen", "cleared"]
    first, again = starts.row(0, named=True), starts.row(1, named=True)
    assert first["steady_after_ns"] == 20
    # After the clear, one request (t=30): too few for the 2-request window, so never steady.
    assert (again["start_ns"], again["first_request_ns"], again["steady_after_ns"]) == (25, 30, None)
    assert again["warmup_requests"] == 1
    assert (again["warmup_recomputed_tokens"], again["concurrent_starts"]) == (0, 1)


def test_demo_replicas_warm_up(demo_workdir: Path) -> None:
    con = duckdb.connect(str(demo_workdir / "kvlens.duckdb"), read_only=True)
    rows = con.execute("SELECT w.replica, w.first_request_ns, w.steady_after_ns, w.warmup_recomputed_tokens, "
                       "w.prewarm_bytes, (SELECT min(arrival_ns) FROM request_ledger l "
                       "WHERE l.scenario = w.scenario AND l.replica = w.replica) "
                       "FROM warmup w WHERE w.scenario = 'rr8'").fetchall()
    ((replicas,),) = con.execute("SELECT count(DISTINCT replica) FROM request_ledger "
                                 "WHERE scenario = 'rr8'").fetchall()
    assert len(rows) == replicas
    for _rep, first, steady, lost, prewarm, ledger_first in rows:
        assert first == ledger_first
        # Every replica starts cold at the trace start: warm-up takes time; it costs tokens beyond
        # the fleet's steady hit ratio wherever the early requests hit less than that ratio.
        assert steady is not None and steady > 0
        assert lost >= 0 and prewarm > 0
    assert sum(row[3] > 0 for row in rows) > len(rows) // 2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 4), st.integers(1, 3)),
                min_size=20, max_size=160),
       st.integers(0, 8))
def test_the_hot_set_is_the_top_k_of_every_block_in_rank_order(
        rows: list[tuple[int, int, int]], top_k: int) -> None:
    # Many ties in needs and position: the k chosen (and their order) are those of a sort of all.
    outcomes = pl.DataFrame({"request_id": [f"q{i % 7}" for i in range(len(rows))],
                             "block_hash": pl.Series([h for h, _, _ in rows], dtype=pl.UInt64),
                             "position": [p for _, p, _ in rows], "bytes": [b for _, _, b in rows]},
                            schema_overrides={"position": pl.Int32, "bytes": pl.Int64})
    expected = (outcomes.group_by("block_hash")
                .agg(needs=pl.len(), position=pl.col("position").min(), bytes=pl.col("bytes").max())
                .filter(pl.col("needs") >= 2)
                .sort(["needs", "position", "block_hash"], descending=[True, False, False]).head(top_k))
    hot, _ = _prewarm(outcomes, top_k)
    assert hot.to_dicts() == expected.select("block_hash", "bytes").to_dicts()
