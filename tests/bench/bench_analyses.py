"""Benchmark: ``kvlens analyze`` with every analysis on the demo's three what-ifs (issue 7).

The demo's lake is built as ``make demo`` builds it (the Mooncake conversation trace simulated
on 8 replicas under round_robin, cache_aware and cache_aware with a 2x load fallback), then
the analysis DB is built twice in process, after one warm-up run (so numba's compile or cache
load is not timed): once with the ledger alone (block_outcomes, miss_ledger, request_ledger:
the baseline, measured in the same run) and once with every analysis ``kvlens analyze`` writes.
Each table's compute time is the time its frame took to come out of ``analyze_scenario``
(``scenarios`` carries the ledger itself: block outcomes and the request ledger are computed
before it).

Target (issue 7): every analysis of the three scenarios under 60 s in total on this machine.
"""

from __future__ import annotations

import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import duckdb
import polars as pl

from kvlens.analysis_db import build_analysis_db
from kvlens.analyzers import analyze_scenario, scenario_rows
from kvlens.analyzers.gaps import event_gaps, mark_incomplete
from kvlens.analyzers.ledger import miss_ledger
from kvlens.analyzers.outcomes import block_outcomes
from kvlens.analyzers.request_ledger import request_ledger
from kvlens.analyzers.simulate import simulate
from kvlens.collector.importer import import_files
from kvlens.lake import open_lake, write_scenario
from kvlens.models import get_model
from kvlens.sample_data.demo import DEMO_MODEL, DEMO_SCENARIO, SAMPLE_TRACE, WHAT_IFS

TARGET_S = 60.0
CACHE_TOKENS = 4_000_000  # the demo fleet's: 8 replicas x 500k tokens


def _lake(root: Path) -> Path:
    lake = root / "lake"
    import_files("mooncake", [SAMPLE_TRACE], lake, scenario=DEMO_SCENARIO, model=DEMO_MODEL)
    con = duckdb.connect()
    open_lake(con, lake)
    reqs = con.sql("SELECT * FROM requests WHERE scenario = ?", params=[DEMO_SCENARIO]).pl()
    blocks = con.sql("SELECT * FROM request_blocks WHERE scenario = ?", params=[DEMO_SCENARIO]).pl()
    con.close()
    for name, config in WHAT_IFS.items():
        result = simulate(requests=reqs, request_blocks=blocks, config=config, model=get_model(DEMO_MODEL))
        write_scenario(lake, name, {k: v.to_arrow() for k, v in result.tables.items()}, writer_id="bench")
    return lake


def _ledger_only(con: duckdb.DuckDBPyConnection) -> Iterator[tuple[str, pl.DataFrame]]:
    per_token = get_model(DEMO_MODEL).kv_bytes_per_token()
    for name in WHAT_IFS:
        requests = scenario_rows(con, "requests", name)
        outcomes = block_outcomes(
            requests=requests, request_blocks=scenario_rows(con, "request_blocks", name),
            kv_events=scenario_rows(con, "kv_events", name), transfers=scenario_rows(con, "transfers", name),
            scenario=name, bytes_per_token=per_token)
        # the ledger as analyze_scenario writes it: requests after an unfillable gap marked incomplete
        gaps, clears = event_gaps(metric_samples=scenario_rows(con, "metric_samples", name),
                                  kv_events=scenario_rows(con, "kv_events", name))
        ledger = request_ledger(block_outcomes=outcomes, requests=requests)
        per_request = mark_incomplete(ledger, gaps, clears)
        yield "block_outcomes", outcomes
        yield "miss_ledger", miss_ledger(block_outcomes=outcomes, incomplete=per_request)
        yield "request_ledger", per_request


def _everything(times: dict[str, float]) -> object:
    def compute(con: duckdb.DuckDBPyConnection) -> Iterator[tuple[str, pl.DataFrame]]:
        for name in WHAT_IFS:
            t0 = time.perf_counter()
            for table, frame in analyze_scenario(con, name, get_model(DEMO_MODEL), cache_tokens=CACHE_TOKENS):
                times[table] += time.perf_counter() - t0
                yield table, frame
                t0 = time.perf_counter()
    return compute


def _timed(db: Path, lake: Path, compute: object) -> float:
    t0 = time.perf_counter()
    build_analysis_db(db, lake, compute)  # type: ignore[arg-type]
    return time.perf_counter() - t0


def main() -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lake = _lake(root)
        _timed(root / "warm.duckdb", lake, _everything(defaultdict(float)))
        ledger_s = _timed(root / "ledger.duckdb", lake, _ledger_only)
        times: dict[str, float] = defaultdict(float)
        full_s = _timed(root / "full.duckdb", lake, _everything(times))
    print(f"   ledger only (baseline), 3 scenarios  {ledger_s:8.2f} s")
    print(f"   every analysis, 3 scenarios          {full_s:8.2f} s   ({full_s / ledger_s:.1f}x the ledger; "
          f"target < {TARGET_S:.0f} s)")
    slowest = sorted(times.items(), key=lambda kv: -kv[1])[:8]
    print("   slowest tables: " + ", ".join(f"{t} {s:.2f} s" for t, s in slowest))
    return full_s < TARGET_S
