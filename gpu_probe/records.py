"""GPU probe, the records: one Measurement per timed path, before it becomes a probe_runs row.

The ``path`` vocabulary (``probe_runs.path``) is ProbePath; every row also says whether it was
measured on a GPU or on the CPU fallback (ProbeSource). Pure values; no torch here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Measurement", "ProbePath", "ProbeSource", "gbps"]


class ProbePath(enum.StrEnum):
    """What a probe_runs row measured (the ``path`` column)."""

    H2D_PINNED = "h2d_pinned"  # bulk host (pinned) -> device, one copy
    H2D_PAGEABLE = "h2d_pageable"  # bulk host (pageable) -> device, one copy
    D2H = "d2h"  # bulk device -> host (pinned), one copy
    D2D = "d2d"  # bulk device -> device, one copy
    KV_LOAD_BATCHED = "kv_load_batched"  # stage per layer, then one scatter per layer into the pool
    KV_LOAD_PER_BLOCK = "kv_load_per_block"  # one copy per block (per K/V tensor) into the pool
    PREFILL = "prefill"  # the model's layer stack over the prefix, causal
    MATMUL_BF16 = "matmul_bf16"  # n×n×n bf16 matrix product (prefix_tokens holds n)


class ProbeSource(enum.StrEnum):
    """Where a probe_runs row came from (the ``source`` column)."""

    GPU = "gpu"
    CPU = "cpu"
    MODEL = "model"


@dataclass(frozen=True)
class Measurement:
    """One timed path at one size: the median of ``runs`` timings after warm-up.

    ``kv_bytes`` is the bytes moved for transfer paths, the prefix's KV bytes for prefill, NULL
    for the matmul. ``tflops`` (prefill and matmul) is printed, not stored: probe_runs has no
    column for it, and it follows from the FLOP count of the row's model and tokens.
    """

    path: ProbePath
    model: str
    prefix_tokens: int | None
    kv_bytes: int | None
    ms: float
    gbps: float | None = None
    byte_exact: bool | None = None
    tflops: float | None = None
    runs_ms: tuple[float, ...] = ()
    ts_ns: int = 0


def gbps(moved_bytes: int, ms: float) -> float:
    """Decimal GB/s (1e9 bytes per second)."""
    return moved_bytes / (ms * 1e-3) / 1e9 if ms > 0 else float("inf")
