"""Benchmark: the ledger's replay in block-hash partitions (issue 17), in process and on Ray.

The lake is bench_ledger's: the Mooncake conversation trace (12,031 requests) simulated on 8
replicas under round_robin. The replay core's arrays are captured as ``block_outcomes`` builds
them; the baseline is the one-process ``replay_core`` on them, measured in this run. Then:

- phase 1 (``block_states``) per partition, in process: each partition's look-ups per second
  is one worker's throughput;
- phase 2 (``decide_requests``, every request in one pass in the driver), timed on its own;
- the serial part besides it (the content maps, cutting the inputs and scattering the results
  back);
- ``replay_partitioned`` on a local Ray cluster of 1 and of 2 workers (``num_cpus``), after a
  warm-up run so that no worker times numba's cache load; outputs checked equal to the core's;
- 64 workers, **modelled**: the serial part (phase 2 included) plus the in-process phase-1 time
  over 64, plus the Ray overhead measured with 2 workers. Not measured: this machine has 2 CPUs.

Target: the partitioned replay's outputs equal the core's, every run.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ledger import _capture, _lake

from kvlens.analyzers import partitions
from kvlens.analyzers.partitions import replay_partitioned
from kvlens.analyzers.replay import loc_groups, replay_core

PARTITIONS = 8
MODELLED_WORKERS = 64


def _partitioned_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    ev_ts, ev_kind, ev_loc, _, ev_grp = args[:5]
    n_locs, _, windows = args[-3:]
    return (ev_ts, *args, loc_groups(ev_kind, ev_loc, ev_grp, n_locs, windows.shape[1]))


def _timed_phase_one(per_part: list[tuple[int, float]]) -> Any:
    def run(fn: Any, parts: Any) -> Any:
        for p in parts:
            t0 = time.perf_counter()
            got = fn(*p)
            per_part.append((len(p[10]), time.perf_counter() - t0))
            yield got
    return run


@contextmanager
def _timed_phase_two(took: list[float]) -> Iterator[None]:
    """Times phase 2 (partitions.py calls ``decide_requests`` once, in the driver)."""
    decide = partitions.decide_requests

    def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return decide(*args)
        finally:
            took.append(time.perf_counter() - t0)

    partitions.decide_requests = timed
    try:
        yield
    finally:
        partitions.decide_requests = decide


def _ray_run(workers: int, pargs: tuple[Any, ...], want: list[list[int]]) -> float:
    import ray

    from kvlens.analyzers.ray_runner import ray_partitions

    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        with ray_partitions("local") as parts:
            run = parts.run
            replay_partitioned(*pargs, partitions=PARTITIONS, run=run)  # warm-up: workers load numba's cache
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                got = replay_partitioned(*pargs, partitions=PARTITIONS, run=run)
                best = min(best, time.perf_counter() - t0)
                assert [np.asarray(x).tolist() for x in got] == want, "Ray's outputs differ from the core's"
    finally:
        ray.shutdown()
    return best


def main() -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        args = _capture(_lake(Path(tmp)))
    n_blk = len(args[14])
    pargs = _partitioned_args(args)
    replay_core(*args)
    core_s = min(_timed(replay_core, *args) for _ in range(3))
    want = [np.asarray(x).tolist() for x in replay_core(*args)]
    replay_partitioned(*pargs, partitions=PARTITIONS)  # compiles or loads the phase kernels
    per_part: list[tuple[int, float]] = []
    phase2: list[float] = []
    with _timed_phase_two(phase2):
        t0 = time.perf_counter()
        got = replay_partitioned(*pargs, partitions=PARTITIONS, run=_timed_phase_one(per_part))
        whole_s = time.perf_counter() - t0
    equal = [np.asarray(x).tolist() for x in got] == want
    phase1_s = sum(s for _, s in per_part)
    phase2_s = sum(phase2)
    serial_s = whole_s - phase1_s
    rates = [n / s for n, s in per_part if s > 0]
    print(f"   scenario rr8: {n_blk:,} block look-ups, {len(args[0]):,} events, {PARTITIONS} partitions")
    print(f"   one-process replay core (baseline)   {n_blk / core_s:>12,.0f} look-ups/s  ({core_s:.3f} s)")
    print(f"   partitioned, in process              {n_blk / whole_s:>12,.0f} look-ups/s  ({whole_s:.3f} s, "
          f"{whole_s / core_s:.2f}x the core; outputs {'equal' if equal else 'DIFFER'})")
    print(f"     phase 1, per partition (a worker)  {min(rates):>12,.0f} to {max(rates):,.0f} look-ups/s "
          f"({phase1_s:.3f} s over {PARTITIONS} partitions, measured)")
    print(f"     serial, in the driver              {serial_s:>12.3f} s  (measured), of which")
    print(f"       phase 2, every request           {n_blk / phase2_s:>12,.0f} look-ups/s  "
          f"({phase2_s:.3f} s, measured)")
    print(f"       content, cutting, gathering      {serial_s - phase2_s:>12.3f} s  (measured)")
    try:
        import ray  # noqa: F401
    except ImportError:
        print("   Ray: not installed (pip install 'kvlens[ray]'); the Ray rows are not measured")
        return equal
    ray1 = _ray_run(1, pargs, want)
    ray2 = _ray_run(2, pargs, want)
    overhead = max(ray2 - serial_s - phase1_s / 2, 0.0)
    model = serial_s + phase1_s / MODELLED_WORKERS + overhead
    print(f"   Ray, 1 worker                        {n_blk / ray1:>12,.0f} look-ups/s  "
          f"({ray1:.3f} s, measured)")
    print(f"   Ray, 2 workers                       {n_blk / ray2:>12,.0f} look-ups/s  ({ray2:.3f} s, "
          f"{ray1 / ray2:.2f}x 1 worker, measured)")
    print(f"   Ray, {MODELLED_WORKERS} workers (MODELLED)             {n_blk / model:>12,.0f} look-ups/s  "
          f"(serial {serial_s:.3f} s + phase 1 / {MODELLED_WORKERS} + Ray overhead {overhead:.3f} s "
          "at 2 workers; modelled, not measured)")
    return equal


def _timed(fn: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
