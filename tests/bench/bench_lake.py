"""Benchmark: 10 million narrow rows through the segment writer, against bare pyarrow.parquet.

Target (foundation issue): >= 1,000,000 rows/s on one core, memory bounded by the flush size.
The baseline writes the same batches with pyarrow.parquet.write_table alone, in the same run.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvlens.lake import SegmentWriter

ROWS = int(os.environ.get("KVLENS_BENCH_ROWS", 10_000_000))
BATCH = 100_000
FLUSH = 1_000_000
TARGET_ROWS_PER_S = 1_000_000


def _batches() -> list[dict[str, np.ndarray]]:
    # A few distinct batches, reused: generating 10M rows must not be what we time.
    rng = np.random.default_rng(0)
    base = 1_735_689_600 * 10**9
    return [{
        "ts_ns": base + np.sort(rng.integers(0, 3_600 * 10**9, BATCH)),
        "seq": np.arange(i * BATCH, (i + 1) * BATCH, dtype=np.uint64),
        "block_hash": rng.integers(0, 2**63, BATCH).astype(np.uint64),
    } for i in range(4)]


def _writer_run(lake: Path, batches: list[dict[str, np.ndarray]]) -> tuple[float, int]:
    peak = 0
    t0 = time.perf_counter()
    with SegmentWriter(lake, "kv_events", scenario="bench", writer_id="bench", flush_rows=FLUSH) as w:
        for i in range(ROWS // BATCH):
            w.append_columns(batches[i % len(batches)])
            peak = max(peak, pa.total_allocated_bytes())
    return time.perf_counter() - t0, peak


def _baseline_run(out: Path, batches: list[dict[str, np.ndarray]]) -> float:
    schema = pa.schema([("ts_ns", pa.int64()), ("seq", pa.uint64()), ("block_hash", pa.uint64())])
    tables = [pa.table(b, schema=schema) for b in batches]
    t0 = time.perf_counter()
    per_file = FLUSH // BATCH
    for f in range(ROWS // FLUSH):
        chunk = pa.concat_tables([tables[(f * per_file + j) % len(tables)] for j in range(per_file)])
        pq.write_table(chunk, out / f"{f}.parquet", compression="snappy")
    return time.perf_counter() - t0


def main() -> bool:
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    batches = _batches()
    with tempfile.TemporaryDirectory() as tmp:
        base_s = _baseline_run(Path(tmp), batches)
    with tempfile.TemporaryDirectory() as tmp:
        writer_s, peak = _writer_run(Path(tmp), batches)
    rate = ROWS / writer_s
    flush_bytes = FLUSH * 8 * 3
    print(f"   rows                    {ROWS:>14,}")
    print(f"   segment writer          {rate:>14,.0f} rows/s  ({writer_s:.2f} s)")
    print(f"   bare pyarrow baseline   {ROWS / base_s:>14,.0f} rows/s  ({base_s:.2f} s)")
    print(f"   writer / baseline speed {base_s / writer_s:>14.2f}x")
    print(f"   peak Arrow memory       {peak / 2**20:>14.1f} MiB  "
          f"({peak / flush_bytes:.1f}x one flush of {flush_bytes / 2**20:.0f} MiB)")
    return rate >= TARGET_ROWS_PER_S and peak <= 4 * flush_bytes


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
