"""The analyses after the ledger out of core (``analyzers.analyze_after_ledger``, issue 17): each
table ``kvlens analyze --out-of-core`` writes holds the rows of the one-process analysis, on the
lakes out of core accepts and on a generated fleet cut into several partitions."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from ooc_harness import AFTER_LEDGER, memory_db, same_tables
from scale_lake import ScaleFleet, write_scale_lake

from kvlens.analyzers.analyze import analyze_lake
from kvlens.analyzers.out_of_core import OutOfCore
from kvlens.lake import SegmentWriter, open_lake

# Whether each table must have rows on every lake (the hand-built lakes have no probe runs or scrapes).
REQUIRED = {"fanout": True, "tier_payoff": True, "tier_reconciliation": False, "latency_tails": True,
            "crossover": False, "reconciliation": False, "prefix_ranking": False,
            "hygiene": False, "warmup": True, "isolation_findings": False,
            "flows": True, "reuse": True, "mrc": True, "ttl_coverage": True}


@pytest.mark.parametrize(("name", "scenarios"), [
    ("simulated", ()), ("capture", ()), ("hybrid", ()), ("hand", ("clear",))])
def test_the_analyses_after_the_ledger_equal_the_one_process_ones(
        ooc_lakes: dict[str, Path], tmp_path: Path, name: str, scenarios: tuple[str, ...]) -> None:
    lake = ooc_lakes[name]
    memory = memory_db(lake, tmp_path / "memory.duckdb", scenarios)
    analyze_lake(lake, tmp_path / "ooc.duckdb", scenarios,
                 out_of_core=OutOfCore(partitions=3, rows_per_range=97))
    counts = same_tables(tmp_path / "ooc.duckdb", memory)
    for table in AFTER_LEDGER:
        assert counts[table] > 0 or not REQUIRED.get(table, True), f"{table}: no rows on {name}"


def _scrape(lake: Path, into: str | None = None) -> None:
    """Scrapes of every replica of the lake's scenario beside its requests: the prefix cache's hit
    and query counters and the per-source ones, every 10 minutes over its span (reconciliation);
    ``into``: as the samples of that scenario (``--metrics-from``) rather than the requests'."""
    con = duckdb.connect()
    open_lake(con, lake)
    ((scenario, first, last),) = con.execute(
        "SELECT any_value(scenario), min(arrival_ns), max(arrival_ns) FROM requests").fetchall()
    replicas = [r[0] for r in con.execute("SELECT DISTINCT replica FROM requests ORDER BY 1").fetchall()]
    con.close()
    rows: dict[str, list] = {"ts_ns": [], "replica": [], "name": [], "labels": [], "value": []}
    step = 600 * 1_000_000_000
    for k, replica in enumerate(replicas):
        for n, ts in enumerate(range(first - step, last + 2 * step, step)):
            for name, labels, value in (
                    ("vllm:prefix_cache_queries_total", [("engine", "0")], 1_000.0 * n * (k + 2)),
                    ("vllm:prefix_cache_hits_total", [("engine", "0")], 400.0 * n * (k + 1)),
                    ("vllm:prompt_tokens_cached_by_source_total", [("source", "device")], 300.0 * n)):
                for column, v in zip(rows, (ts, replica, name, labels, value), strict=True):
                    rows[column].append(v)
    with SegmentWriter(lake, "metric_samples", scenario=into or scenario, writer_id="scrape") as w:
        w.append_columns(rows)


@pytest.mark.parametrize("metrics_from", [None, "scrapes"])
def test_the_analyses_after_the_ledger_on_a_generated_fleet(tmp_path: Path, metrics_from: str | None) -> None:
    """Several windows, replicas and partitions: the fan-out's and tails' windows, the tiers' sums."""
    lake = tmp_path / "lake"
    # a request every 100 ms: the fan-out and the tails have two windows of 15 minutes
    write_scale_lake(lake, 40_000, fleet=ScaleFleet(replicas=4, capacity=700, prefixes=400,
                                                    interval_ns=100_000_000), chunk_requests=150)
    _scrape(lake, metrics_from)
    memory = tmp_path / "memory.duckdb"
    cache = 4 * 700 * 16  # the fleet's caches, in tokens: the capacity row
    analyze_lake(lake, memory, ["scale"], full=True, metrics_from=metrics_from, cache_tokens=cache)
    analyze_lake(lake, tmp_path / "ooc.duckdb", ["scale"], metrics_from=metrics_from, cache_tokens=cache,
                 out_of_core=OutOfCore(partitions=5, rows_per_range=5_000))
    counts = same_tables(tmp_path / "ooc.duckdb", memory, (*AFTER_LEDGER, "capacity"))
    assert counts["capacity"] == 1
    assert counts["fanout"] == 2 and counts["latency_tails"] > 40 and counts["tier_payoff"] >= 4
    assert counts["reconciliation"] >= 4 and counts["tier_reconciliation"] >= 4
