"""Tests for analyzers/ranking.py: prefix groups and E[benefit] by hand, the recommendation rule,
and, on a small simulated round-robin fleet, that the top of the ranking is where the avoidable
misses are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from kvlens.analyzers import block_outcomes
from kvlens.analyzers.costs import CostModel, DeviceModel, Label, Rate, cost_model
from kvlens.analyzers.ranking import DO_NOT, KEEP_LOCAL, PIN, PUBLISH, prefix_ranking
from kvlens.analyzers.simulate import SimConfig, simulate
from kvlens.collector.importer import import_files
from kvlens.lake import open_lake, write_scenario
from kvlens.models import get_model
from kvlens.schema import TABLES, RoutingPolicy

MODEL = get_model("llama-3.1-70b")
# 1 MB per 100-token block. Pool: 1 ms lookup, 1 GB/s; H2D and D2H 2 GB/s; install 4 GB/s.
DEVICE = DeviceModel(name="hand", pool_gbps=1.0, pool_lookup_ms=1.0, pool_queue_ms=0.0, local_lookup_ms=0.05,
                     h2d_gbps=2.0, d2h_gbps=2.0, install_gbps=4.0, pool_capacity_bytes=10**15)
FIT = (10.0, 0.5, 0.001)  # T_recompute = 10 + 0.5·T + 0.001·T² ms


def _costs(device: DeviceModel = DEVICE) -> CostModel:
    modelled = Label.MODELLED
    return CostModel(MODEL, device, device.name, fit=FIT, fit_tokens=(100, 1000),
                     h2d=Rate(device.h2d_gbps, modelled), d2h=Rate(device.d2h_gbps, modelled),
                     install=Rate(device.install_gbps, modelled))


def _outcomes(requests: list[tuple[str, str, list[int], list[str]]], tokens: int = 100,
              block_bytes: int = 10**6) -> pl.DataFrame:
    rows = [{"scenario": "s", "request_id": rid, "replica": rep, "arrival_ns": i, "position": p,
             "block_hash": h, "outcome": o, "tokens": tokens, "bytes": block_bytes}
            for i, (rid, rep, hashes, outcomes) in enumerate(requests)
            for p, (h, o) in enumerate(zip(hashes, outcomes, strict=True))]
    return pl.DataFrame(rows, schema_overrides={"block_hash": pl.UInt64})


HAND = [
    ("r1", "rep-0", [1, 2, 3], ["miss_cold"] * 3),
    ("r2", "rep-1", [1, 2, 4], ["miss_routing", "miss_routing", "miss_cold"]),
    ("r3", "rep-0", [1, 2, 3], ["hit_local"] * 3),
    ("r4", "rep-0", [1, 2, 3], ["hit_local", "hit_local", "miss_evicted"]),
    ("r5", "rep-2", [9], ["miss_cold"]),
    ("r6", "rep-1", [5], ["miss_cold"]),
    ("r7", "rep-2", [5], ["miss_evicted"]),
    ("r8", "rep-1", [5], ["hit_local"]),
    ("r10", "rep-0", [7], ["miss_cold"]),
    ("r11", "rep-0", [7], ["hit_local"]),
]


def _by_hash(frame: pl.DataFrame) -> dict[int, dict[str, Any]]:
    return {r["prefix_hash"]: r for r in frame.iter_rows(named=True)}


def test_hand_computed_groups_and_benefits() -> None:
    ranking = prefix_ranking(block_outcomes=_outcomes(HAND), costs=_costs(), scenario="s")
    assert set(ranking.columns) == set(TABLES["prefix_ranking"].names)
    assert ranking["prefix_hash"].to_list() == [2, 3, 5, 7]  # 4 and 9 are needed once: no group
    assert ranking["rank"].to_list() == [1, 2, 3, 4]
    g = _by_hash(ranking)
    # Group 2: blocks 1-2, four requests on two replicas; r2 missed both to routing: one load.
    # saved 0.5·200 + 0.001·200² = 140; pool load 1 + 2 MB/1 GB/s 2 + stage 1 + install 0.5 = 4.5;
    # write 1 + D2H 1 + network 2 = 4.
    a = g[2]
    assert (a["parent_hash"], a["prefix_tokens"], a["bytes"]) == (None, 200, 2 * 10**6)
    assert (a["segment_tokens"], a["requests"], a["reuses"], a["replicas"]) == (200, 4, 3, 2)
    assert a["avoidable_miss_tokens"] == 200
    assert a["path"] == "pool" and a["h_remote_ratio"] == pytest.approx(0.25)
    assert (a["recompute_ms"], a["remote_ms"], a["write_ms"]) == pytest.approx((140.0, 4.5, 4.0))
    assert a["benefit_ms"] == pytest.approx(1 * (140 - 4.5) - 4.0) and a["recommendation"] == PUBLISH
    # Group 3: block 3 after 200 cached tokens, three requests all on rep-0, one eviction.
    # saved 0.5·100 + 0.001·(300² − 200²) = 100; local load 0.05 + 0.5 + 0.25; write 0.05 + 0.5.
    b = g[3]
    assert (b["parent_hash"], b["prefix_tokens"], b["segment_tokens"], b["replicas"]) == (2, 300, 100, 1)
    assert b["path"] == "local_tier" and b["h_remote_ratio"] == pytest.approx(1 / 3)
    assert b["benefit_ms"] == pytest.approx((100 - 0.8) - 0.55) and b["recommendation"] == KEEP_LOCAL
    # Group 5: one block on two replicas, its only avoidable miss an eviction: pin.
    # saved 0.5·100 + 0.001·100² = 60; pool load 1 + 1 + 0.5 + 0.25; write 1 + 0.5 + 1.
    c = g[5]
    assert c["benefit_ms"] == pytest.approx((60 - 2.75) - 2.5) and c["recommendation"] == PIN
    # Group 7: every reuse was a local hit; publishing only costs the write.
    d = g[7]
    assert d["benefit_ms"] == pytest.approx(-0.55) and d["recommendation"] == DO_NOT
    assert "no access missed it" in d["reason"]
    assert "140.0 ms of prefill (measured)" in a["reason"] and "expected benefit 131.5 ms" in a["reason"]


def test_eviction_penalty_by_hand() -> None:
    small = DeviceModel(**{**DEVICE.__dict__, "pool_capacity_bytes": 2 * 10**6})
    g = _by_hash(prefix_ranking(block_outcomes=_outcomes(HAND), costs=_costs(small), scenario="s"))
    # Demand 4 MB of groups worth loading (2, 3, 5) against 2 MB: half of it cannot fit; their
    # gross benefit 135.5 + 99.2 + 57.25 spread over 4 MB.
    per_byte = (135.5 + 99.2 + 57.25) / 4e6 * 0.5
    assert g[2]["eviction_ms"] == pytest.approx(2e6 * per_byte)
    assert g[5]["eviction_ms"] == pytest.approx(1e6 * per_byte)
    assert g[5]["benefit_ms"] == pytest.approx(57.25 - 2.5 - 1e6 * per_byte)


def test_failed_loads_stall() -> None:
    reqs = [("a", "rep-0", [11, 12], ["miss_cold"] * 2), ("b", "rep-1", [11, 12], ["miss_routing"] * 2),
            ("c", "rep-2", [11, 12], ["miss_load_failed"] * 2)]
    ranking = prefix_ranking(block_outcomes=_outcomes(reqs), costs=_costs(), scenario="s")
    (row,) = ranking.iter_rows(named=True)
    assert row["stall_ms"] == pytest.approx(4.5)  # one failed load waited a T_remote
    assert row["benefit_ms"] == pytest.approx(135.5 - 4.5 - 4.0)


def test_a_load_slower_than_recompute_is_never_recommended() -> None:
    slow = DeviceModel(**{**DEVICE.__dict__, "pool_gbps": 0.001})  # 2 MB take 2 s
    g = _by_hash(prefix_ranking(block_outcomes=_outcomes(HAND), costs=_costs(slow), scenario="s"))
    assert g[2]["benefit_ms"] < 0 and g[2]["recommendation"] == DO_NOT
    assert "loading is no faster than recomputing" in g[2]["reason"]


def test_top_n_bounds_the_output() -> None:
    ranking = prefix_ranking(block_outcomes=_outcomes(HAND), costs=_costs(), scenario="s", top_n=2)
    assert ranking["prefix_hash"].to_list() == [2, 3]
    empty = prefix_ranking(block_outcomes=_outcomes(HAND[4:5]), costs=_costs(), scenario="s")
    assert empty.is_empty() and set(empty.columns) == set(TABLES["prefix_ranking"].names)


_OUTCOMES = ["hit_local", "hit_remote", "miss_routing", "miss_evicted", "miss_cold", "miss_load_failed"]
_REQUEST = st.tuples(st.integers(0, 2), st.lists(st.integers(0, 1), min_size=1, max_size=4),
                     st.lists(st.sampled_from(_OUTCOMES), min_size=4, max_size=4))


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(_REQUEST, min_size=1, max_size=12), gbps=st.floats(0.01, 100.0),
       capacity=st.integers(10**5, 10**9), fitted=st.booleans())
def test_only_positive_benefit_is_recommended(reqs: list[tuple[int, list[int], list[str]]], gbps: float,
                                              capacity: int, fitted: bool) -> None:
    ids: dict[tuple[int, ...], int] = {}
    built = []
    for i, (rep, path, outs) in enumerate(reqs):
        hashes = [ids.setdefault(tuple(path[: p + 1]), len(ids) + 1) for p in range(len(path))]
        built.append((f"r{i}", f"rep-{rep}", hashes, outs[: len(path)]))
    device = DeviceModel(pool_gbps=gbps, h2d_gbps=gbps, pool_capacity_bytes=capacity)
    costs = _costs(device) if fitted else cost_model(probe_runs=None, model=MODEL, device=device)
    frame = _outcomes(built)
    ranking = prefix_ranking(block_outcomes=frame, costs=costs, scenario="s", top_n=10**6)
    for row in ranking.iter_rows(named=True):
        assert (row["recommendation"] != DO_NOT) == (row["benefit_ms"] > 0), row
    # Segments tile the shared blocks: no avoidable token is counted twice, none is lost.
    shared = frame.filter(pl.len().over("block_hash") >= 2)
    avoidable = shared.filter(pl.col("outcome").is_in(["miss_routing", "miss_evicted"]))["tokens"].sum()
    assert int(ranking["avoidable_miss_tokens"].sum()) == avoidable
    # The rows in any order rank the same: a request's rows apart or out of position order are
    # sorted first; together and by position (as the ledger writes them) they are read as given.
    shuffled = frame.sample(fraction=1.0, shuffle=True, seed=len(built))
    again = prefix_ranking(block_outcomes=shuffled, costs=costs, scenario="s", top_n=10**6)
    assert_frame_equal(again, ranking)


def test_requests_split_by_others_with_their_positions_rising_are_sorted_first() -> None:
    """a and c share blocks 1, 2, 3 and b blocks 1 and 2. Each position rises within its run, so
    only the ids at the runs' starts (a, b, c, b, a, c) show that the requests' rows are apart:
    read as given, a's and c's third blocks would each start a request of their own, and the
    group of block 3 would lose the two blocks before it."""
    frame = _outcomes([("a", "rep-0", [1, 2, 3], ["miss_cold"] * 3),
                       ("b", "rep-1", [1, 2, 5], ["miss_routing"] * 3),
                       ("c", "rep-0", [1, 2, 3], ["hit_local", "hit_local", "miss_evicted"])])
    row = {(r["request_id"], r["position"]): i for i, r in enumerate(frame.iter_rows(named=True))}
    order = [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("b", 2), ("a", 2), ("c", 2)]
    split = frame[[row[k] for k in order]]
    assert split["position"].to_list() == [0, 1, 0, 0, 1, 1, 2, 2, 2]
    costs = _costs()
    ranking = prefix_ranking(block_outcomes=frame, costs=costs, scenario="s", top_n=10**6)
    assert _by_hash(ranking)[3]["prefix_tokens"] == 300
    assert_frame_equal(prefix_ranking(block_outcomes=split, costs=costs, scenario="s", top_n=10**6), ranking)


@pytest.fixture(scope="module")
def round_robin(tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    """Block outcomes of a 400-request trace on 4 round-robin replicas with small caches.

    Seven prompt families (shared prefixes of 12, 8, 6, 4, 3, 2 and 1 blocks of 512 tokens, with
    different popularity), each request adding 1-3 blocks of its own.
    """
    tmp = tmp_path_factory.mktemp("rr")
    families, weights = [12, 8, 6, 4, 3, 2, 1], [1, 3, 2, 4, 3, 2, 5]
    lines, unique = [], 10_000
    for i in range(400):
        f = (i * 7919 + i // 3) % sum(weights)  # a fixed, well-mixed family sequence
        family = next(k for k in range(len(families)) if f < sum(weights[: k + 1]))
        ids = [family * 100 + b for b in range(families[family])] + list(range(unique, unique + 1 + i % 3))
        unique += 1 + i % 3
        lines.append({"timestamp": i * 200, "input_length": len(ids) * 512 + 100, "output_length": 20,
                      "hash_ids": ids})
    trace = tmp / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    lake = tmp / "lake"
    import_files("mooncake", [trace], lake, scenario="src", model=MODEL.name)
    return _simulate(lake)


def _simulate(lake: Path) -> pl.DataFrame:
    con = duckdb.connect()
    open_lake(con, lake)
    reqs = con.sql("SELECT * FROM requests WHERE scenario = 'src'").pl()
    blocks = con.sql("SELECT * FROM request_blocks WHERE scenario = 'src'").pl()
    config = SimConfig(replicas=4, routing=RoutingPolicy.ROUND_ROBIN, capacity_tokens=16 * 512)
    sim = simulate(requests=reqs, request_blocks=blocks, config=config, model=MODEL)
    write_scenario(lake, "rr", {k: v.to_arrow() for k, v in sim.tables.items()}, writer_id="simulate")
    con = duckdb.connect()
    open_lake(con, lake)
    return block_outcomes(requests=con.table("requests"), request_blocks=con.table("request_blocks"),
                          kv_events=con.table("kv_events"), transfers=con.table("transfers"), scenario="rr",
                          bytes_per_token=MODEL.kv_bytes_per_token())


def test_round_robin_top_prefixes_carry_the_most_avoidable_misses(round_robin: pl.DataFrame) -> None:
    by_cause = round_robin.group_by("outcome").agg(pl.col("tokens").sum())
    assert set(by_cause["outcome"].cast(pl.String)) >= {"miss_routing", "miss_evicted"}
    ranking = prefix_ranking(block_outcomes=round_robin, costs=cost_model(probe_runs=None, model=MODEL),
                             scenario="rr")
    assert ranking.height >= 5 and (ranking["recommendation"] != DO_NOT).sum() >= 5
    by_avoidable = ranking.sort("avoidable_miss_tokens", descending=True)["prefix_hash"].head(3).to_list()
    assert ranking["prefix_hash"].head(3).to_list() == by_avoidable
    ranks = ranking.select(pl.col("benefit_ms").rank(), pl.col("avoidable_miss_tokens").rank())
    assert ranks.select(pl.corr("benefit_ms", "avoidable_miss_tokens"))[0, 0] >= 0.8


@pytest.mark.slow
def test_demo_rr8_ranking_leads_with_the_most_avoidable_misses(demo_workdir: Path) -> None:
    con = duckdb.connect(str(demo_workdir / "kvlens.duckdb"), read_only=True)
    ranking = con.sql("SELECT * FROM prefix_ranking WHERE scenario = 'rr8' ORDER BY rank").pl()
    crossover = con.sql("SELECT * FROM crossover WHERE scenario = 'rr8'").pl()
    con.close()
    assert 0 < ranking.height <= 200 and crossover.height == 27
    assert (ranking.filter(pl.col("recommendation") != DO_NOT)["benefit_ms"] > 0).all()
    top = ranking["avoidable_miss_tokens"].head(10).sum()
    best = ranking["avoidable_miss_tokens"].sort(descending=True).head(10).sum()
    assert top >= 0.9 * best
    assert ranking["prefix_hash"].head(3).to_list() == ranking.sort(
        "avoidable_miss_tokens", descending=True)["prefix_hash"].head(3).to_list()
