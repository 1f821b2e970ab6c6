"""Benchmark: every analysis of a lake larger than memory, out of core, under a 4 GiB limit (issue 17).

The lake is generated (tests/scale_lake.py): a 16-replica fleet with FIFO prefix caches serving
requests of Zipf-popular shared prefixes and their own blocks, ``ACCESSES`` needed full blocks (10M
here by default; ``--accesses 100000000`` for the issue's 100M), with their KV events. Each run is a
child process of its own under ``kvlens analyze``'s own ``--memory-limit`` of ``LIMIT`` (its
watchdog stops a run whose resident memory passes it, exit status 3), and reports its seconds and
peak RSS (VmHWM):

- **out of core**: ``kvlens analyze --out-of-core``: the ledger (analyzers/out_of_core.py) and
  every analysis after it (``analyzers.analyze_after_ledger``), the tables of a full analysis;
- **in memory, ledger only**: ``ledger_outcomes``, the request ledger and the miss ledger as
  ``kvlens analyze`` computes them in one process;
- **in memory, every analysis** (the baseline, the same tables): ``kvlens analyze --full``.

Two lakes: ``FITTING`` accesses, which every run analyzes under the limit (the time ratio of out of
core to the in-memory runs, at equal work), and ``ACCESSES``. Target: out of core completes with
its peak RSS under ``LIMIT`` on both; beside it, whether each in-memory run completed under the
same limit, and the time ratio where it did.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the lake generator

ACCESSES = 10_000_000
# A lake the in-memory runs analyze under the limit too: the time out of core costs at equal work.
FITTING = 3_000_000
LIMIT = 4 << 30
MEMORY_EXIT = 3

_GENERATE = """
import json, sys, time
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from scale_lake import write_scale_lake
t0 = time.perf_counter()
requests, blocks, events = write_scale_lake(Path(sys.argv[1]), int(sys.argv[2]))
print(json.dumps({"s": time.perf_counter() - t0, "requests": requests, "blocks": blocks, "events": events}))
"""

_CHILD = """
import json, sys, time
from kvlens.errors import MemoryLimitError
from kvlens.memory import MemoryGuard, peak_resident_bytes
lake, db, mode, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
t0 = time.perf_counter()
status = "done"
try:
    with MemoryGuard(limit):
        if mode == "ledger":
            from kvlens.analysis_db import build_analysis_db
            from kvlens.analyzers import scenario_rows
            from kvlens.analyzers.analyze import scenario_model
            from kvlens.analyzers.gaps import event_gaps, mark_incomplete
            from kvlens.analyzers.ledger import miss_ledger
            from kvlens.analyzers.outcomes import ledger_outcomes
            from kvlens.analyzers.request_ledger import request_ledger
            from kvlens.models import group_bytes_per_token

            def compute(con):
                geometry, _ = scenario_model(con, "scale", None)
                requests = scenario_rows(con, "requests", "scale")
                outcomes = ledger_outcomes(
                    requests=requests, request_blocks=scenario_rows(con, "request_blocks", "scale"),
                    kv_events=scenario_rows(con, "kv_events", "scale"),
                    transfers=scenario_rows(con, "transfers", "scale"), scenario="scale",
                    bytes_per_token=geometry.kv_bytes_per_token(),
                    group_bytes_per_token=group_bytes_per_token(geometry)).frame
                gaps, clears = event_gaps(metric_samples=scenario_rows(con, "metric_samples", "scale"),
                                          kv_events=scenario_rows(con, "kv_events", "scale"))
                per_request = mark_incomplete(request_ledger(block_outcomes=outcomes, requests=requests),
                                              gaps, clears)
                yield "block_outcomes", outcomes
                yield "request_ledger", per_request
                yield "miss_ledger", miss_ledger(block_outcomes=outcomes, incomplete=per_request)

            build_analysis_db(db, lake, compute, memory_limit=limit)
        else:
            import logging
            logging.basicConfig(level=logging.INFO)  # out of core's seconds per step, on stderr
            from kvlens.analyzers.analyze import analyze_lake
            from kvlens.analyzers.out_of_core import OutOfCore
            analyze_lake(lake, db, full=True, memory_limit=limit,
                         out_of_core=OutOfCore() if mode == "out-of-core" else None)
except MemoryLimitError:
    status = "stopped"
print(json.dumps({"s": time.perf_counter() - t0, "rss": peak_resident_bytes(), "status": status}))
"""

_MODES = {"out-of-core": "out of core", "ledger": "in memory, ledger only",
          "all": "in memory, every analysis (kvlens analyze --full)"}


def _run(lake: Path, db: Path, mode: str) -> dict[str, object]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, str(lake), str(db), mode, str(LIMIT)],
                         capture_output=True, text=True, timeout=3 * 3600)
    lines = out.stdout.strip().splitlines()
    if out.returncode == MEMORY_EXIT:  # the watchdog's hard end, past 1.5 limits: no report
        return {"s": time.perf_counter() - t0, "rss": None, "status": "stopped"}
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} failed ({out.returncode}): {out.stderr[-2000:]}")
    got: dict[str, object] = json.loads(lines[-1])
    said = "seconds per step: "
    steps = [line.split(said, 1)[1] for line in out.stderr.splitlines() if said in line]
    got["steps"] = steps[0] if steps else None
    db.unlink(missing_ok=True)
    return got


def _said(run: dict[str, object]) -> str:
    rss = run["rss"]
    peak = f"peak RSS {rss / 2**30:.2f} GiB" if isinstance(rss, int) else "peak RSS past 1.5 limits"
    if run["status"] == "stopped":
        return f"stopped at the {LIMIT / 2**30:.0f} GiB limit after {run['s']:.1f} s ({peak})"
    return f"{run['s']:.1f} s, {peak}"


def main(accesses: int = ACCESSES, keep: Path | None = None) -> bool:
    ok = True
    for size in (FITTING, accesses):
        print(f"   lake of {size:,} block accesses", flush=True)
        ok = _lake(size, keep) and ok
    return ok


def _lake(accesses: int, keep: Path | None) -> bool:
    with tempfile.TemporaryDirectory(prefix="kvlens-bench-ooc-", dir=keep) as tmp:
        lake = Path(tmp) / "lake"
        made = subprocess.run([sys.executable, "-c", _GENERATE, str(lake), str(accesses),
                               str(Path(__file__).resolve().parents[1])],
                              capture_output=True, text=True, check=True, timeout=3 * 3600)
        gen = json.loads(made.stdout.strip().splitlines()[-1])
        size = sum(p.stat().st_size for p in lake.rglob("*.parquet"))
        print(f"   generated lake: {gen['blocks']:,} block accesses, {gen['requests']:,} requests, "
              f"{gen['events']:,} KV events, {size / 2**30:.2f} GiB of Parquet, in {gen['s']:.0f} s")
        runs = {}
        for mode, label in _MODES.items():
            runs[mode] = _run(lake, Path(tmp) / f"{mode}.duckdb", mode)
            print(f"   {label}: {_said(runs[mode])} (measured, limit {LIMIT / 2**30:.0f} GiB)", flush=True)
        ooc = runs["out-of-core"]
        for mode in ("ledger", "all"):
            if runs[mode]["status"] == "done":
                ratio = float(ooc["s"]) / float(runs[mode]["s"])  # type: ignore[arg-type]
                print(f"   out of core / {_MODES[mode]}: {ratio:.2f}x the time (measured)")
        if ooc["status"] == "done":
            rate = gen["blocks"] / float(ooc["s"])  # type: ignore[arg-type]
            print(f"   out of core: {rate:,.0f} block accesses/s; seconds per step: {ooc['steps']} "
                  "(measured)")
        rss = ooc["rss"]
        return ooc["status"] == "done" and isinstance(rss, int) and rss < LIMIT


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accesses", type=int, default=ACCESSES)
    parser.add_argument("--keep", type=Path, default=None,
                        help="directory to generate the lake in (default: the system's temporary one)")
    args = parser.parse_args()
    sys.exit(0 if main(args.accesses, args.keep) else 1)
