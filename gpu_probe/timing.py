"""GPU probe, the clock: CUDA events on a GPU, perf_counter on the CPU fallback; median of runs.

torch is imported inside functions, so the package imports without the ``gpu`` extra.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from kvlens.errors import ConfigError

__all__ = ["cuda_available", "device_name", "import_torch", "median_ms", "time_ms"]


def import_torch() -> Any:
    """The torch module, or a ConfigError that says how to install it."""
    try:
        import torch
    except ImportError:
        raise ConfigError("kvlens probe needs PyTorch, which is not installed: "
                          "pip install 'kvlens[gpu]' (or a CPU build of torch)") from None
    return torch


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def device_name(device: str) -> str:
    """The name probe_runs records: the GPU's name, or ``cpu``."""
    if device == "cuda":
        torch = import_torch()
        return str(torch.cuda.get_device_name(torch.cuda.current_device()))
    return "cpu"


def time_ms(run: Callable[[], None], *, device: str, warmup: int, runs: int,
            before: Callable[[], None] | None = None) -> list[float]:
    """Milliseconds of each of ``runs`` calls of ``run`` after ``warmup`` untimed ones.

    ``before`` runs untimed ahead of every call (the probe poisons destinations there). On CUDA
    the span is between two events on the current stream; ``run`` must join any side stream it
    uses back to the current one before it returns.
    """
    if runs < 1 or warmup < 0:
        raise ConfigError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    out = []
    for i in range(warmup + runs):
        if before is not None:
            before()
        ms = _cuda_once(run) if device == "cuda" else _cpu_once(run)
        if i >= warmup:
            out.append(ms)
    return out


def _cuda_once(run: Callable[[], None]) -> float:
    torch = import_torch()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def _cpu_once(run: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1e3


def median_ms(samples: list[float]) -> float:
    return float(statistics.median(samples))
