"""``flows_out_of_core`` (analyzers/flows.py, issue 17): the byte flows computed one block-hash
partition at a time hold the rows of the one-process ``flows`` analysis, on the lakes out of core
accepts and on a generated fleet cut into many partitions."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pytest
from ooc_harness import after_ledger, ledger_db, memory_db, same_rows
from polars.testing import assert_frame_equal
from scale_lake import ScaleFleet, write_scale_lake

from kvlens.analyzers.flows import flows, flows_out_of_core
from kvlens.lake import open_lake, write_scenario

_SUMS = ("read_bytes", "write_bytes", "replica_bytes", "never_read_bytes", "read_unwritten_bytes",
         "unread_resident_bytes")


def _scenarios(db: Path) -> dict[str, int]:
    """The scenarios a one-process analysis wrote, with the bytes per token it used."""
    with duckdb.connect(str(db), read_only=True) as con:
        return dict(con.execute("SELECT scenario, kv_bytes_per_token FROM scenarios ORDER BY 1").fetchall())


def _in_memory(con: duckdb.DuckDBPyConnection, scenario: str, per_token: int, window_ns: int) -> pl.DataFrame:
    """The one-process ``flows`` on the ledger ``con``'s DB holds (the out-of-core one, equal to it)."""
    scoped = f"scenario = '{scenario}'"
    return flows(block_outcomes=con.table("block_outcomes").filter(scoped).pl(),
                 request_ledger=con.table("request_ledger").filter(scoped).pl(),
                 kv_events=con.table("kv_events").filter(scoped),
                 transfers=con.table("transfers").filter(scoped),
                 scenario=scenario, bytes_per_token=per_token, window_ns=window_ns)


def _compare(lake: Path, tmp: Path, scenarios: tuple[str, ...], *, partitions: int, window_ns: int,
             rows_per_partition: int = 2_000_000, rows_per_range: int = 97) -> dict[str, int]:
    """Each scenario's frame equal to the one-process rows, then, in windows of ``window_ns``, to the
    frame ``flows`` gives on the same ledger; per sum column the rows where it is not zero, and the
    count of those small windows (``windows``), over every scenario."""
    memory = memory_db(lake, tmp / "memory.duckdb", scenarios)
    db = ledger_db(lake, tmp / "ooc.duckdb", scenarios, partitions=partitions, rows_per_range=rows_per_range)
    counts = dict.fromkeys((*_SUMS, "windows"), 0)
    with after_ledger(db, lake) as con:
        for n, (scenario, per_token) in enumerate(_scenarios(memory).items()):
            (tmp / f"work{n}").mkdir()
            got = flows_out_of_core(con, scenario, work=tmp / f"work{n}", partitions=partitions,
                                    bytes_per_token=per_token, rows_per_partition=rows_per_partition)
            same_rows(got, memory, "flows", scenario)
            for column in _SUMS:
                counts[column] += got.filter(got[column] != 0).height
            (tmp / f"windows{n}").mkdir()
            windowed = flows_out_of_core(con, scenario, work=tmp / f"windows{n}", partitions=partitions,
                                         bytes_per_token=per_token, window_ns=window_ns,
                                         rows_per_partition=rows_per_partition)
            assert_frame_equal(windowed, _in_memory(con, scenario, per_token, window_ns))
            counts["windows"] += windowed["window_start_ns"].n_unique()
    return counts


@pytest.mark.parametrize(("name", "scenarios"), [
    ("simulated", ()), ("capture", ()), ("hybrid", ()), ("hand", ("clear",))])
def test_flows_out_of_core_equal_the_one_process_rows(ooc_lakes: dict[str, Path], tmp_path: Path, name: str,
                                                      scenarios: tuple[str, ...]) -> None:
    """Each lake in 7 partitions (the capture's clears and tiers, the pool's copies and reads), and in
    windows of a second (the requests' queue times move their reads)."""
    counts = _compare(ooc_lakes[name], tmp_path, scenarios, partitions=7, window_ns=1_000_000_000)
    assert counts["write_bytes"] > 0 and counts["read_bytes"] > 0, counts


def test_flows_out_of_core_keeps_the_order_and_sizes_of_memory(ooc_lakes: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """The simulated fleet with a third of its stores without ``block_tokens`` (sized by the median
    outcome) and a second load, from another replica, after each of its loads from the pool (the
    first in scan order is the one read)."""
    lake = tmp_path / "lake"
    shutil.copytree(ooc_lakes["simulated"], lake)
    with duckdb.connect() as con:
        open_lake(con, lake)
        events = con.sql("SELECT * EXCLUDE (scenario) REPLACE (CASE WHEN CAST(kind AS VARCHAR) = 'stored' "
                         "AND block_hash % 3 = 0 THEN NULL ELSE block_tokens END AS block_tokens) "
                         "FROM kv_events WHERE scenario = 'rr2'").arrow().read_all()
        loads = "SELECT * EXCLUDE (scenario) {} FROM transfers WHERE scenario = 'rr2' {}"
        again = con.sql(loads.format("REPLACE ('replica-0' AS origin)", "AND origin = 'pool' AND "
                                     "CAST(status AS VARCHAR) = 'ok'")).arrow().read_all()
        transfers = pa.concat_tables([con.sql(loads.format("", "")).arrow().read_all(), again])
    assert again.num_rows > 0
    write_scenario(lake, "rr2", {"kv_events": events, "transfers": transfers}, writer_id="perturbed")
    counts = _compare(lake, tmp_path, ("rr2",), partitions=4, window_ns=1_000_000_000)
    assert counts["replica_bytes"] > 0 and counts["never_read_bytes"] > 0, counts


def test_flows_out_of_core_on_a_generated_fleet(tmp_path: Path) -> None:
    """Evictions, routing misses and batches of events with one time and batch number, cut into
    some 20 partitions whose sums are merged, and in windows of 10 ms (some 50, each with rows from
    every partition)."""
    lake = tmp_path / "lake"
    write_scale_lake(lake, 40_000, fleet=ScaleFleet(replicas=4, capacity=700, prefixes=400),
                     chunk_requests=150)
    counts = _compare(lake, tmp_path, (), partitions=5, window_ns=10_000_000, rows_per_partition=3_000,
                      rows_per_range=5_000)
    assert all(counts[c] > 0 for c in ("read_bytes", "write_bytes", "never_read_bytes")), counts
    assert counts["windows"] > 40, counts


def test_flows_out_of_core_refuses_a_window_of_zero(ooc_lakes: dict[str, Path], tmp_path: Path) -> None:
    db = ledger_db(ooc_lakes["hand"], tmp_path / "ooc.duckdb", ("clear",))
    with after_ledger(db, ooc_lakes["hand"]) as con, pytest.raises(ValueError, match="window_ns"):
        flows_out_of_core(con, "clear", work=tmp_path, partitions=1, bytes_per_token=2, window_ns=0)
