"""``prefix_ranking`` out of core (analyzers/ranking.py ``prefix_ranking_out_of_core``, issue 17): on
the DB the out-of-core ledger wrote, ranges of requests and partitions of tips give the rows of the
one-process analysis, every float to the bit, on the lakes out of core accepts and on a generated
fleet cut into several of each; and the pool's value, summed a partition at a time, is ``math.fsum``'s."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pytest
from ooc_harness import after_ledger, ledger_db, memory_db, same_rows
from polars.testing import assert_frame_equal
from scale_lake import ScaleFleet, write_scale_lake

from kvlens.analyzers.analyze import scenario_model
from kvlens.analyzers.costs import CostModel, cost_model
from kvlens.analyzers.ranking import _ExactSum, prefix_ranking, prefix_ranking_out_of_core


def _costs(con: duckdb.DuckDBPyConnection, scenario: str) -> CostModel:
    """The cost model the one-process analysis ranks ``scenario`` with (its requests' model)."""
    return cost_model(probe_runs=con.table("probe_runs"), model=scenario_model(con, scenario)[0])


def _scenarios(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [r[0] for r in con.execute("SELECT scenario FROM scenarios ORDER BY 1").fetchall()]


def _ranked(con: duckdb.DuckDBPyConnection, scenario: str, work: Path, **given: int) -> pl.DataFrame:
    work.mkdir()
    return prefix_ranking_out_of_core(con, scenario, work=work, costs=_costs(con, scenario), **given)


@pytest.mark.parametrize(("name", "scenarios"), [
    ("simulated", ()), ("capture", ()), ("hybrid", ()), ("hand", ("clear",))])
def test_the_ranking_out_of_core_equals_the_one_process_one(ooc_lakes: dict[str, Path], tmp_path: Path,
                                                             name: str, scenarios: tuple[str, ...]) -> None:
    """1, 3 and 16 ranges of requests and partitions of tips: the one-process rows, to the bit."""
    lake = ooc_lakes[name]
    memory = memory_db(lake, tmp_path / "memory.duckdb", scenarios)
    rows = 0
    with after_ledger(ledger_db(lake, tmp_path / "ooc.duckdb", scenarios), lake) as con:
        for scenario in _scenarios(con):
            for partitions in (1, 3, 16):
                work = tmp_path / f"work-{scenario}-{partitions}"
                got = _ranked(con, scenario, work, partitions=partitions)
                rows += same_rows(got, memory, "prefix_ranking", scenario)
    assert rows > 0, f"no prefix groups on {name}"


def test_the_ranking_out_of_core_on_a_generated_fleet(tmp_path: Path) -> None:
    """Ranges of about 3,000 accesses (14 of them) and partitions of tips: each group's figures merged
    from several ranges. Then on a slower device with a small pool, where many groups are worth loading
    and each displaces others: every group, and the best 7 picked from each partition's best."""
    lake = tmp_path / "lake"
    write_scale_lake(lake, 40_000, fleet=ScaleFleet(replicas=4, capacity=700, prefixes=400),
                     chunk_requests=150)
    memory = memory_db(lake, tmp_path / "memory.duckdb")
    db = ledger_db(lake, tmp_path / "ooc.duckdb", partitions=5, rows_per_range=5_000)
    with after_ledger(db, lake) as con:
        (scenario,) = _scenarios(con)
        got = _ranked(con, scenario, tmp_path / "work", partitions=5, rows_in_memory=3_000)
        assert same_rows(got, memory, "prefix_ranking", scenario) > 100
        assert len(list((tmp_path / "work" / "partial").iterdir())) > 10  # one file per range
        partial = pl.read_parquet(tmp_path / "work" / "partial" / "*.parquet")
        assert (partial.group_by("tip").len()["len"] > 4).any()  # a group from several ranges
        assert len(list((tmp_path / "work" / "terms").iterdir())) == 5

        outcomes = con.sql("SELECT * FROM block_outcomes WHERE scenario = $1", params=[scenario]).pl()
        slow = _costs(con, scenario)
        slow = replace(slow, device=replace(slow.device, peak_tflops_per_gpu=20.0, pool_capacity_bytes=10**9))
        want = prefix_ranking(block_outcomes=outcomes, costs=slow, scenario=scenario, top_n=10**9)
        assert (want["eviction_ms"] > 0).all() and want["recommendation"].n_unique() == 4
        for top_n in (10**9, 7):
            work = tmp_path / f"work-{top_n}"
            work.mkdir()
            got = prefix_ranking_out_of_core(con, scenario, work=work, partitions=4, costs=slow, top_n=top_n,
                                             rows_in_memory=3_000)
            assert_frame_equal(got, want.head(top_n))


def test_the_pool_value_is_summed_as_fsum_sums_it() -> None:
    """Split anyhow, over magnitudes that cancel and subnormals: the float ``math.fsum`` gives."""
    rng = np.random.default_rng(17)
    for trial in range(200):
        size = int(rng.integers(0, 2_000))
        x = rng.standard_normal(size) * 10.0 ** rng.integers(-300, 300, size)
        if trial % 2:
            x = np.concatenate([rng.random(size) * 1e3, [1e16, 1.0, -1e16, 5e-324, 2.2e-308]])
        total = _ExactSum()
        for part in np.array_split(x, int(rng.integers(1, 9))):
            total.add(part)
        assert total.total() == math.fsum(x.tolist())
