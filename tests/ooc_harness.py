"""What an analysis after the ledger is tested with out of core (issue 17).

An out-of-core analysis is called as ``kvlens analyze --out-of-core`` calls it: on the analysis DB
being built, whose lake views are open and whose ``block_outcomes`` and ``request_ledger`` hold the
scenario's rows (written by the out-of-core ledger), with DuckDB's memory bounded. Its frame must
give the rows the one-process analysis writes. ``ooc_lakes`` are lakes it accepts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import duckdb
import polars as pl
from capture_lines import capture_lake
from incremental_lake import source_lake
from test_ledger import _write_clear, _write_hand

from kvlens.analyzers.analyze import analyze_lake
from kvlens.analyzers.out_of_core import OutOfCore
from kvlens.lake import create_enum_types, open_lake, write_scenario
from kvlens.schema import TABLES

DATA = Path(__file__).parent / "data"
# The analyses after the ledger out of core writes (analyzers.analyze_after_ledger; capacity too,
# with --cache-tokens).
AFTER_LEDGER = ("fanout", "tier_payoff", "tier_reconciliation", "latency_tails", "crossover",
                "reconciliation", "prefix_ranking", "hygiene", "warmup", "isolation_findings", "flows",
                "reuse", "mrc", "ttl_coverage")
# Floats that are not bit-equal out of core, and why: warmup's saved_ms sums a float per request in
# another order (polars' chunks cannot be reproduced), so its last bits may differ.
REL = {"warmup": 1e-12}


def as_simulated(lake: Path, scenario: str) -> Path:
    """``scenario``'s rows written again with every request's source the simulator's: admission
    then keeps the time rule for them, in the one-process ledger as out of core (a real capture's
    events, ties and KV cache groups, under the rule out of core computes)."""
    con = duckdb.connect()
    try:
        open_lake(con, lake)
        tables = {}
        for name in ("requests", "request_blocks", "kv_events", "transfers", "metric_samples"):
            rows = con.sql(f"SELECT * EXCLUDE (scenario) FROM {name} WHERE scenario = ?", params=[scenario])
            if name == "requests":
                rows = con.sql(f"SELECT * EXCLUDE (scenario, source), 'sim' AS source FROM {name} "
                               "WHERE scenario = ?", params=[scenario])
            table = rows.arrow().read_all()
            if table.num_rows:
                tables[name] = table
    finally:
        con.close()
    write_scenario(lake, scenario, tables, writer_id="as-simulated")
    return lake


def ooc_lakes(tmp: Path) -> dict[str, Path]:
    """Lakes by name: ``simulated`` (a trace on a 2-replica fleet with a pool, and the trace alone),
    ``capture`` (a real vLLM capture), ``hybrid`` (two KV cache groups, one a sliding window),
    ``hand`` (clears; analyze its scenario ``clear`` only) and ``anchored`` (a real engine's
    requests, admitted at their own stores). The fixture ``ooc_lakes`` (tests/conftest.py) builds them."""
    hand = tmp / "hand"
    _write_hand(hand)
    _write_clear(hand)
    for name in ("capture", "hybrid", "anchored"):
        (tmp / name).mkdir()
    return {
        "simulated": source_lake(tmp / "sim", requests=200),
        "capture": as_simulated(capture_lake(DATA / "vllm-cpu-capture", tmp / "capture", "tiny"), "capture"),
        "hybrid": as_simulated(capture_lake(DATA / "vllm-cpu-hybrid-capture", tmp / "hybrid", "tiny-gemma2"),
                               "capture"),
        "hand": as_simulated(hand, "clear"),
        "anchored": capture_lake(DATA / "vllm-cpu-capture", tmp / "anchored", "tiny"),
    }


def ledger_db(lake: Path, db: Path, scenarios: Sequence[str] = (), *, partitions: int = 3,
              rows_per_range: int = 97) -> Path:
    """``db``: the out-of-core ledger of ``lake`` (block_outcomes, request_ledger, miss_ledger)."""
    analyze_lake(lake, db, scenarios,
                 out_of_core=OutOfCore(partitions=partitions, rows_per_range=rows_per_range))
    return db


@contextmanager
def after_ledger(db: Path, lake: Path, memory: str = "256MB") -> Iterator[duckdb.DuckDBPyConnection]:
    """A connection to ``db`` (a copy is not made: open the DB ``ledger_db`` wrote) with the lake
    views open and DuckDB's memory at ``memory``: what an out-of-core analysis is called with."""
    con = duckdb.connect(str(db))
    try:
        con.execute("SET preserve_insertion_order = true")
        con.execute(f"SET memory_limit = '{memory}'")
        open_lake(con, lake)
        yield con
    finally:
        con.close()


def same_rows(got: pl.DataFrame, memory_db: Path, table: str, scenario: str, *, rel: float = 0.0) -> int:
    """Asserts ``got``, cast as the analysis DB casts a frame, holds the rows ``memory_db`` (a
    one-process ``kvlens analyze``) holds for ``scenario`` in ``table``, in any order (floats within
    ``rel``, relative, where given); returns the count of rows."""
    columns = TABLES[table].columns
    con = duckdb.connect()
    try:
        create_enum_types(con)  # (the casts name the schema's ENUM types)
        con.execute(f"ATTACH '{memory_db}' AS mem (READ_ONLY)")
        con.register("_got", got.select([c.name for c in columns]))
        cast = ", ".join(f"CAST({c.name} AS {c.type}) AS {c.name}" for c in columns)
        names = ", ".join(c.name for c in columns)
        a = con.execute(f"SELECT {cast} FROM _got ORDER BY ALL").fetchall()
        b = con.execute(f"SELECT {names} FROM mem.{table} WHERE scenario = ? ORDER BY ALL",
                        [scenario]).fetchall()
    finally:
        con.close()
    assert len(a) == len(b), f"{table}: {len(a)} rows out of core, {len(b)} in memory"
    for x, y in zip(a, b, strict=True):
        if rel:
            assert len(x) == len(y) and all(
                math.isclose(u, v, rel_tol=rel) if isinstance(u, float) and isinstance(v, float) else u == v
                for u, v in zip(x, y, strict=True)), f"{table}: {x} != {y}"
        else:
            assert x == y, f"{table}: {x} != {y}"
    return len(a)


def memory_db(lake: Path, db: Path, scenarios: Sequence[str] = ()) -> Path:
    """``db``: the one-process ``kvlens analyze --full`` of ``lake``."""
    analyze_lake(lake, db, scenarios, full=True)
    return db


def same_tables(ooc: Path, memory: Path, tables: Sequence[str] = AFTER_LEDGER) -> dict[str, int]:
    """Per table of ``tables``, the count of rows of the DB ``ooc`` that ``same_rows`` found equal to
    those of ``memory``, over every scenario ``ooc`` analyzed."""
    counts: dict[str, int] = {}
    with duckdb.connect(str(ooc), read_only=True) as con:
        scenarios = [r[0] for r in con.execute("SELECT scenario FROM scenarios ORDER BY 1").fetchall()]
        for table in tables:
            for scenario in scenarios:
                got = con.sql(f"SELECT * FROM {table} WHERE scenario = $1", params=[scenario]).pl()
                counts[table] = counts.get(table, 0) + same_rows(got, memory, table, scenario,
                                                                 rel=REL.get(table, 0.0))
    return counts
