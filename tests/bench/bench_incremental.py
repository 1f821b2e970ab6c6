"""Benchmark: incremental ``kvlens analyze`` on a lake growing by 6 equal increments (issue 16).

The lake: the first ``REQUESTS`` requests of the sample trace served by tests/incremental_lake.py's
2-replica fleet with a pool (scenario ``rr2``: requests, blocks, KV events, transfers), cut by
time into 6 slices of about as many rows each, appended one at a time. After each increment ``kvlens analyze``
(the default, incremental) runs in a child process of its own, which reports the seconds
``analyze_lake`` took and its peak RSS (``resource.getrusage``, ru_maxrss); a warm-up child
first loads numba's kernel cache, so no child times a compile. Then a ``--full`` rebuild of the
6 increments, for comparison.

Target (issue 16): analyzing the 6th increment costs at most 1.5x analyzing the 1st (a full
rebuild of 6 increments costs about 6x). The ratio is measured in this run, both sides here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the lake builder

from incremental_lake import cut, row_bounds, source_lake

REQUESTS = 2000
INCREMENTS = 6
TARGET_RATIO = 1.5
_CHILD = """
import json, resource, sys, time
from kvlens.analyzers.analyze import analyze_lake
t0 = time.perf_counter()
result = analyze_lake(sys.argv[1], sys.argv[2], full=sys.argv[3] == "full")
seconds = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"s": seconds, "rss": rss, "modes": [m for _, m, _ in result.modes]}))
"""


class Run(NamedTuple):
    seconds: float
    rss_mib: float
    modes: tuple[str, ...]


def _analyze(lake: Path, db: Path, mode: str) -> Run:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(lake), str(db), mode],
                         capture_output=True, text=True, check=True, timeout=1800)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return Run(float(got["s"]), got["rss"] / 2**20, tuple(got["modes"]))


def main() -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = source_lake(root / "src", requests=REQUESTS)
        bounds = row_bounds(source, INCREMENTS)
        lake, db = root / "lake", root / "incr.duckdb"
        _analyze(source, root / "warm.duckdb", "full")
        runs = []
        for k in range(INCREMENTS):
            rows = cut(source, lake, None if k == 0 else bounds[k], bounds[k + 1], writer=f"inc{k}",
                       scenarios=["rr2"])
            run = _analyze(lake, db, "incremental")
            runs.append(run)
            print(f"   increment {k + 1}: {rows:>8,} rows appended; analyze {run.seconds:.2f} s "
                  f"({', '.join(run.modes)}), peak RSS {run.rss_mib:.0f} MiB (measured)")
        full = _analyze(lake, root / "full.duckdb", "full")
        first, last = runs[0].seconds, runs[-1].seconds
        print(f"   full rebuild of {INCREMENTS}: {full.seconds:.2f} s, peak RSS {full.rss_mib:.0f} MiB; "
              f"6th / 1st = {last / first:.2f}x (target <= {TARGET_RATIO}x), "
              f"full / 1st = {full.seconds / first:.2f}x (measured)")
        return last / first <= TARGET_RATIO
