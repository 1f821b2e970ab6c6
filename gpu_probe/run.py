"""GPU probe's front door for ``kvlens probe``: this machine's device -> the measured table, probe_runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvlens.gpu_probe.probe import (
    ProbeReport,
    parse_prefix_tokens,
    plan_probe,
    render_table,
    run_probe,
    write_probe_rows,
)
from kvlens.gpu_probe.timing import cuda_available, import_torch
from kvlens.models import ModelGeometry, resolve_model

__all__ = ["ProbeResult", "probe_machine"]

CPU_NOTICE = ("CUDA is not available: running a tiny CPU version of each measurement "
              "(rows marked source=cpu)")


@dataclass(frozen=True)
class ProbeResult:
    """The run (``byte_exact`` False when a path or the delay-injection check failed), its table,
    and the probe_runs rows written (0 without a lake)."""

    report: ProbeReport
    table: str
    rows: int


def probe_machine(model: ModelGeometry | None = None, prefix_tokens: str | None = None, *,
                  quick: bool = False, lake: str | Path | None = None,
                  announce: Callable[[str], object] = lambda _line: None) -> ProbeResult:
    """Measure ``model``'s (default: the project default) transfer paths and prefill here; a tiny CPU
    run, said through ``announce``, without CUDA. ``prefix_tokens``: comma-separated lengths."""
    geometry = model or resolve_model(None)
    tokens = parse_prefix_tokens(prefix_tokens)  # the flags first: a wrong one is said with or without torch
    import_torch()
    cuda = cuda_available()
    if not cuda:
        announce(CPU_NOTICE)
    report = run_probe(plan_probe(geometry, tokens, quick=quick, cuda=cuda))
    rows = write_probe_rows(report, lake) if lake else 0
    return ProbeResult(report, render_table(report), rows)
