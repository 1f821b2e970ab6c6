"""Lakes that grow in increments, for the incremental-analysis tests and benchmark: a source lake
(a slice of the sample trace and a simulated fleet serving it) cut by time into segments appended
one increment at a time, and a comparison of two analysis DBs table by table, row by row."""

from __future__ import annotations

import gzip
import math
from collections.abc import Sequence
from pathlib import Path

import duckdb

from kvlens.analyzers.simulate import SimConfig, simulate
from kvlens.collector import import_files
from kvlens.lake import SegmentWriter, open_lake, write_scenario
from kvlens.models import get_model
from kvlens.sample_data.demo import DEMO_MODEL, SAMPLE_TRACE
from kvlens.schema import ANALYSIS_TABLES, LAKE_TABLES, RoutingPolicy

__all__ = ["FLEET", "assert_same_db", "cut", "row_bounds", "source_lake", "time_bounds"]

# Two replicas whose caches are small beside the slice's working set (evictions, routing misses)
# and a shared pool (transfers, remote hits): most analyses have rows to compare.
FLEET = SimConfig(routing=RoutingPolicy.ROUND_ROBIN, replicas=2, capacity_tokens=200_000, pool_tokens=600_000)
SCENARIOS_SQL = "SELECT DISTINCT scenario FROM requests ORDER BY 1"
TIME_RANGE_SQL = "SELECT min(arrival_ns), max(arrival_ns) FROM requests"
ROW_QUANTILES_SQL = """
SELECT quantile_disc(t, ?::DOUBLE[]) FROM (
    SELECT arrival_ns AS t, scenario FROM requests UNION ALL SELECT arrival_ns, scenario FROM request_blocks
    UNION ALL SELECT ts_ns, scenario FROM kv_events UNION ALL SELECT ts_ns, scenario FROM transfers)
WHERE len(?::VARCHAR[]) = 0 OR list_contains(?::VARCHAR[], scenario)
"""
# Columns that differ between two analyses of the same data by design: the wall clock of the analysis.
_UNSTABLE = {("scenarios", "analyzed_ns")}


def source_lake(root: Path, *, requests: int = 300, simulated: str = "rr2", fleet: SimConfig = FLEET) -> Path:
    """A lake with the first ``requests`` lines of the sample trace (scenario ``conv``) and
    ``fleet`` serving them (scenario ``simulated``: requests, blocks, KV events, transfers)."""
    root.mkdir(parents=True, exist_ok=True)
    trace = root / "trace.jsonl"
    with gzip.open(SAMPLE_TRACE, "rt") as f, open(trace, "w") as out:
        for _, line in zip(range(requests), f, strict=False):
            out.write(line)
    lake = root / "source"
    import_files("mooncake", [trace], lake, scenario="conv", model=DEMO_MODEL)
    con = duckdb.connect()
    try:
        open_lake(con, lake)
        reqs = con.sql("SELECT * FROM requests WHERE scenario = 'conv'").pl()
        blocks = con.sql("SELECT * FROM request_blocks WHERE scenario = 'conv'").pl()
    finally:
        con.close()
    result = simulate(requests=reqs, request_blocks=blocks, config=fleet, model=get_model(DEMO_MODEL))
    write_scenario(lake, simulated, {k: v.to_arrow() for k, v in result.tables.items()}, writer_id="sim")
    return lake


def time_bounds(lake: Path, parts: int) -> list[int]:
    """``parts + 1`` cut times splitting the lake's request arrivals into equal spans of time;
    the last is past every row of the lake."""
    con = duckdb.connect()
    try:
        open_lake(con, lake)
        ((lo, hi),) = con.execute(TIME_RANGE_SQL).fetchall()
    finally:
        con.close()
    step = (hi - lo) / parts
    return [lo + round(step * i) for i in range(parts)] + [2**62]


def row_bounds(lake: Path, parts: int, scenarios: Sequence[str] = ()) -> list[int]:
    """``parts + 1`` cut times splitting the timed rows (request arrivals and KV events) of
    ``scenarios`` (default: every scenario of the lake) into ``parts`` slices of about as many rows
    each; the last is past every row of the lake. (Cut the scenarios that will be appended: another
    scenario's rows, spread otherwise in time, would make their slices unequal.)"""
    con = duckdb.connect()
    try:
        open_lake(con, lake)
        cuts = [i / parts for i in range(1, parts)]
        ((qs,),) = con.execute(ROW_QUANTILES_SQL, [cuts, list(scenarios), list(scenarios)]).fetchall()
    finally:
        con.close()
    return [-(2**62)] + [int(q) for q in qs] + [2**62]


def cut(source: Path, dest: Path, lo: int | None, hi: int, *, writer: str,
        scenarios: Sequence[str] = (), tables: Sequence[str] = ()) -> int:
    """Append to ``dest`` the rows of ``source`` whose time is in [lo, hi) (lo None: every row
    before hi, and every row without a time), one segment per table (``tables``, default all)
    and scenario (``scenarios``, default all); rows written."""
    con = duckdb.connect()
    written = 0
    try:
        open_lake(con, source)
        present = [r[0] for r in con.execute(SCENARIOS_SQL).fetchall()]
        for table in LAKE_TABLES:
            if tables and table.name not in tables:
                continue
            for scenario in scenarios or present:
                t = table.time_column
                where = "scenario = ?"
                params: list[object] = [scenario]
                if t is not None:
                    where += f" AND coalesce({t}, -1) < ?" if lo is None else f" AND {t} >= ? AND {t} < ?"
                    params += [hi] if lo is None else [lo, hi]
                elif lo is not None:
                    continue
                sql = f"SELECT * EXCLUDE (scenario) FROM {table.name} WHERE {where}"
                data = con.sql(sql, params=params).to_arrow_table()
                if data.num_rows == 0:
                    continue
                with SegmentWriter(dest, table.name, scenario=scenario, writer_id=writer) as w:
                    w.append_arrow(data)
                written += data.num_rows
    finally:
        con.close()
    return written


def _rows(con: duckdb.DuckDBPyConnection, table: str, names: list[str]) -> list[tuple[object, ...]]:
    cols = ", ".join(f"CAST({n} AS VARCHAR)" if n.endswith("_json") else n for n in names)
    rows = con.execute(f"SELECT {cols} FROM {table}").fetchall()
    return sorted(rows, key=lambda r: tuple((v is None, str(v)) for v in r))


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0) or a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def assert_same_db(got: Path, want: Path) -> dict[str, int]:
    """Every analysis table of ``got`` equals ``want``'s: the same rows (sorted), floats within
    1e-9 relative; returns the rows compared per table."""
    counts = {}
    a, b = duckdb.connect(str(got), read_only=True), duckdb.connect(str(want), read_only=True)
    try:
        for table in ANALYSIS_TABLES:
            names = [n for n in table.names if (table.name, n) not in _UNSTABLE]
            ra, rb = _rows(a, table.name, names), _rows(b, table.name, names)
            assert len(ra) == len(rb), f"{table.name}: {len(ra)} rows, a full analysis has {len(rb)}"
            for x, y in zip(ra, rb, strict=True):
                assert all(_same(u, v) for u, v in zip(x, y, strict=True)), f"{table.name}: {x} != {y}"
            counts[table.name] = len(ra)
    finally:
        a.close()
        b.close()
    return counts
