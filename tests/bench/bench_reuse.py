"""Benchmark: exact reuse distances for 10 million accesses over ~1 million keys, and the full curve.

Targets (issue 6): distances at >= 3,000,000 accesses/s on one core (under 3 s for 10M), and the
full exact LRU curve (distances, then the hit ratio at every capacity) at least 5x faster than
libCacheSim's LRU simulating 11 capacities of the same stream, measured in the same run.
NUMBA_NUM_THREADS=1; numba compile time is excluded (a warm-up call compiles first). The stream is
Zipf(0.8) over 1M keys with 64-bit keys; a uniform stream (the cache-hostile worst case) is timed
too, for the record. libCacheSim reads a binary oracleGeneral file written before the clock starts.
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import tempfile
import time
from pathlib import Path

import numpy as np

from kvlens.analyzers.mrc import curve, exact_histogram
from kvlens.analyzers.reuse import reuse_distances

ACCESSES = int(os.environ.get("KVLENS_BENCH_ACCESSES", 10_000_000))
KEYS = 1_000_000
TARGET_PER_S = 3_000_000
TARGET_SPEEDUP = 5.0


def _stream(kind: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "zipf":
        p = 1.0 / np.arange(1, KEYS + 1) ** 0.8
        ranks = rng.choice(KEYS, size=ACCESSES, p=p / p.sum())
    else:
        ranks = rng.integers(0, KEYS, ACCESSES)
    return rng.integers(1, 2**63, KEYS, dtype=np.int64).astype(np.uint64)[ranks]


def _timed(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def _full_curve(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hist = exact_histogram(keys, 1)
    caps = np.unique(hist.distance_blocks)
    return caps, curve(hist, caps, by="blocks")[0]


def _libcachesim(keys: np.ndarray, capacities: list[int]) -> tuple[float, list[float]] | None:
    try:
        import libcachesim as lcs  # test-only dependency (GPL): never imported by product code
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.oracleGeneral"
        rec = np.zeros(len(keys), np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")]))
        rec["t"], rec["id"], rec["size"], rec["next"] = np.arange(len(keys)) // 1000, keys, 1, -1
        rec.tofile(path)
        t0 = time.perf_counter()
        misses = [lcs.LRU(c).process_trace(lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE))[0]
                  for c in capacities]
        return time.perf_counter() - t0, misses


def main() -> bool:
    reuse_distances(np.arange(1000, dtype=np.uint64) % 37, 1)  # compile (or load the numba cache)
    _full_curve(np.arange(1000, dtype=np.uint64) % 37)
    keys = _stream("zipf")
    dist_s, d = _timed(reuse_distances, keys, 1)
    curve_s, (caps, hit) = _timed(_full_curve, keys)
    uni = _stream("uniform")
    uni_s, _ = _timed(reuse_distances, uni, 1)
    del uni
    distinct = int(d.blocks.max())
    grid = [int(c) for c in np.unique(np.geomspace(10, distinct, 11).astype(np.int64))]
    lcs = _libcachesim(keys, grid)
    rate = ACCESSES / dist_s
    print(f"   accesses / distinct keys    {ACCESSES:>12,} / {len(np.unique(keys)):,}")
    print(f"   exact distances (zipf 0.8)  {rate:>12,.0f} accesses/s  ({dist_s:.2f} s)")
    print(f"   exact distances (uniform)   {ACCESSES / uni_s:>12,.0f} accesses/s  "
          f"({uni_s:.2f} s, worst case)")
    print(f"   full exact curve            {curve_s:>12.2f} s  ({len(caps):,} capacities)")
    if lcs is None:
        print("   libCacheSim                 not installed (pip install -e '.[dev]'): no baseline")
        return False
    lcs_s, misses = lcs
    ours = np.interp(grid, caps, hit)  # grid capacities are distances, so these are exact points
    same = all(round((1 - m) * ACCESSES) == round(o * ACCESSES) for m, o in zip(misses, ours, strict=True))
    print(f"   libCacheSim LRU, 11 sizes   {lcs_s:>12.2f} s  (hit counts equal to ours: {same})")
    print(f"   curve speed-up vs baseline  {lcs_s / curve_s:>12.1f}x")
    return rate >= TARGET_PER_S and lcs_s / curve_s >= TARGET_SPEEDUP and same


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
