"""GPU probe, the orchestration: plan a run, measure every path, render the table, write probe_runs.

A run measures, per prefix length, the six transfer paths (transfer.py) and the prefill of the
model's layer stack (prefill.py), once the bf16 matmul rate and once the delay-injection check.
Without CUDA the same code runs a tiny CPU version (short prefixes, one or two layers of a 1/8-width
stack) and every row says ``source=cpu``. Rows go to ``probe_runs`` (scenario ``probe``), one per
measurement; the cost model fits ``a + b·T + c·T²`` to the ``prefill`` rows of a device and model.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlens.errors import ConfigError
from kvlens.gpu_probe.prefill import PrefillSetup, measure_matmul, measure_prefill
from kvlens.gpu_probe.records import Measurement, ProbePath, ProbeSource
from kvlens.gpu_probe.timing import cuda_available, device_name, import_torch
from kvlens.gpu_probe.transfer import DelayCheck, delay_injection_check, measure_transfers
from kvlens.models import ModelGeometry

__all__ = [
    "CPU_MAX_PREFIX_TOKENS",
    "GPU_PREFIX_TOKENS",
    "ProbePlan",
    "ProbeReport",
    "parse_prefix_tokens",
    "plan_probe",
    "probe_rows",
    "render_table",
    "run_probe",
    "write_probe_rows",
]

log = logging.getLogger(__name__)

GPU_PREFIX_TOKENS = (4096, 16384, 32768, 65536)
GPU_QUICK_PREFIX_TOKENS = (4096, 16384)
CPU_PREFIX_TOKENS = (128, 256, 512)
CPU_QUICK_PREFIX_TOKENS = (64, 128)
CPU_MAX_PREFIX_TOKENS = 1024
TRANSFER_PATHS = (ProbePath.H2D_PINNED, ProbePath.H2D_PAGEABLE, ProbePath.D2H, ProbePath.D2D,
                  ProbePath.KV_LOAD_BATCHED, ProbePath.KV_LOAD_PER_BLOCK)


@dataclass(frozen=True)
class ProbePlan:
    """What one run measures, and how hard."""

    model: ModelGeometry
    device: str
    prefix_tokens: tuple[int, ...]
    warmup: int
    runs: int
    prefill_layers: int | None  # None: as many as fit in device memory
    width_divisor: int
    matmul_n: int
    dropped_tokens: tuple[int, ...] = ()
    matmul_inner: int = 1  # products per timed matmul run

    @property
    def source(self) -> ProbeSource:
        return ProbeSource.GPU if self.device == "cuda" else ProbeSource.CPU


@dataclass(frozen=True)
class ProbeReport:
    plan: ProbePlan
    run_id: str
    device_name: str
    measurements: tuple[Measurement, ...]
    delay: DelayCheck
    prefill: PrefillSetup | None
    notes: tuple[str, ...] = ()

    def find(self, path: ProbePath, prefix_tokens: int | None = None) -> Measurement | None:
        for m in self.measurements:
            if m.path == path and (prefix_tokens is None or m.prefix_tokens == prefix_tokens):
                return m
        return None

    @property
    def byte_exact(self) -> bool:
        """Every gated path and the delay-injection check held."""
        gated = [m.byte_exact for m in self.measurements if m.byte_exact is not None]
        return all(gated) and self.delay.passed


def parse_prefix_tokens(text: str | None) -> tuple[int, ...] | None:
    """``"4096,16384"`` -> (4096, 16384); None stays None."""
    if text is None:
        return None
    try:
        values = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise ConfigError(f"--prefix-tokens {text!r} must be comma-separated integers, "
                          "e.g. 4096,16384") from None
    if not values or min(values) < 1:
        raise ConfigError(f"--prefix-tokens {text!r} must list token counts >= 1")
    return values


def plan_probe(model: ModelGeometry, prefix_tokens: Sequence[int] | None = None, *, quick: bool = False,
               cuda: bool | None = None, runs: int | None = None) -> ProbePlan:
    """The GPU plan, or without CUDA the tiny CPU one (lengths above CPU_MAX_PREFIX_TOKENS dropped)."""
    cuda = cuda_available() if cuda is None else cuda
    block = model.block_size_tokens
    wanted = tuple(sorted(set(prefix_tokens))) if prefix_tokens else ()
    short = [t for t in wanted if t < block]
    if short:
        raise ConfigError(f"prefix lengths {short} hold no full {block}-token block of {model.name}")
    if cuda:
        tokens = wanted or (GPU_QUICK_PREFIX_TOKENS if quick else GPU_PREFIX_TOKENS)
        return ProbePlan(model, "cuda", tokens, 1, runs or (3 if quick else 5), None, 1, 8192,
                         matmul_inner=20)
    kept = tuple(t for t in wanted if t <= CPU_MAX_PREFIX_TOKENS)
    dropped = tuple(t for t in wanted if t > CPU_MAX_PREFIX_TOKENS)
    tokens = kept or (CPU_QUICK_PREFIX_TOKENS if quick else CPU_PREFIX_TOKENS)
    return ProbePlan(model, "cpu", tokens, 1, runs or (3 if quick else 5), 1 if quick else 2, 8,
                     256 if quick else 512, dropped, matmul_inner=4)


def run_probe(plan: ProbePlan) -> ProbeReport:
    """Measure everything the plan asks for; the table and the rows come from the report."""
    import_torch()
    notes = []
    if plan.dropped_tokens:
        notes.append(f"prefix lengths {list(plan.dropped_tokens)} skipped on the CPU "
                     f"(more than {CPU_MAX_PREFIX_TOKENS} tokens)")
    timing: dict[str, Any] = {"device": plan.device, "warmup": plan.warmup, "runs": plan.runs}
    measured = []
    for tokens in plan.prefix_tokens:
        log.info("transfer paths at %d tokens", tokens)
        measured += measure_transfers(plan.model, tokens, **timing)
    delay = delay_injection_check(plan.model, device=plan.device)
    setup = None
    try:
        setup, rows = measure_prefill(plan.model, list(plan.prefix_tokens), layers=plan.prefill_layers,
                                      width_divisor=plan.width_divisor, **timing)
        measured += rows
    except ConfigError as err:  # an MLA model: transfers measured, prefill not
        notes.append(f"prefill not measured: {err}")
    # Last, on a device the prefill has warmed up; many products per sample on a GPU.
    measured.append(measure_matmul(plan.matmul_n, model=plan.model.name, inner=plan.matmul_inner,
                                   **timing))
    return ProbeReport(plan, uuid.uuid4().hex[:12], device_name(plan.device), tuple(measured), delay,
                       setup, tuple(notes))


def probe_rows(report: ProbeReport) -> list[dict[str, Any]]:
    """One probe_runs row per measurement (``scenario`` comes from the writer)."""
    return [{"run_id": report.run_id, "ts_ns": m.ts_ns, "device": report.device_name,
             "path": str(m.path), "model": m.model or report.plan.model.name,
             "prefix_tokens": m.prefix_tokens, "kv_bytes": m.kv_bytes, "ms": m.ms, "gbps": m.gbps,
             "byte_exact": m.byte_exact, "source": str(report.plan.source)}
            for m in report.measurements]


def write_probe_rows(report: ProbeReport, lake: str | Path, *, scenario: str = "probe",
                     writer_id: str = "probe") -> int:
    """Append the report's rows to ``probe_runs`` in ``lake``; returns the row count."""
    from kvlens.lake import SegmentWriter

    rows = probe_rows(report)
    with SegmentWriter(lake, "probe_runs", scenario=scenario, writer_id=writer_id) as writer:
        writer.append_rows(rows)
    return len(rows)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _grid(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    body = [list(r) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(headers)]
    return ["  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True))
            for line in [list(headers), *body]]


def _ms(report: ProbeReport, path: ProbePath, tokens: int) -> float | None:
    m = report.find(path, tokens)
    return None if m is None else m.ms


def _load_rows(report: ProbeReport) -> list[list[str]]:
    rows = []
    for t in report.plan.prefix_tokens:
        prefill, load = _ms(report, ProbePath.PREFILL, t), _ms(report, ProbePath.KV_LOAD_BATCHED, t)
        kv = report.find(ProbePath.KV_LOAD_BATCHED, t)
        beats = "-" if prefill is None or load is None else ("yes" if load < prefill else "no")
        rows.append([f"{t:,}", _fmt(kv.kv_bytes if kv else None, ","), _fmt(prefill, ".2f"),
                     *(_fmt(_ms(report, p, t), ".3f") for p in TRANSFER_PATHS), beats])
    return rows


def _rate_rows(report: ProbeReport) -> list[list[str]]:
    matmul = report.find(ProbePath.MATMUL_BF16)
    rows = []
    for t in report.plan.prefix_tokens:
        rates = [report.find(p, t) for p in TRANSFER_PATHS]
        pinned, batched = rates[0], rates[4]
        ratio = (batched.gbps / pinned.gbps if batched and pinned and batched.gbps and pinned.gbps
                 else None)
        prefill = report.find(ProbePath.PREFILL, t)
        tflops = prefill.tflops if prefill else None
        of_matmul = tflops / matmul.tflops if tflops and matmul and matmul.tflops else None
        exact = all(m.byte_exact for m in rates if m is not None)
        rows.append([f"{t:,}", *(_fmt(m.gbps if m else None, ".2f") for m in rates), _fmt(ratio, ".3f"),
                     _fmt(tflops, ".2f"), _fmt(of_matmul, ".3f"), "yes" if exact else "NO"])
    return rows


def render_table(report: ProbeReport) -> str:
    """The probe's table: load ms against cold prefill ms, then rates and the gate, per prefix."""
    plan, matmul = report.plan, report.find(ProbePath.MATMUL_BF16)
    short = ["pinned", "pageable", "d2h", "d2d", "batched", "per_block"]
    lines = [f"probe {plan.model.name} on {report.device_name} (source={plan.source}), run {report.run_id}"]
    if report.prefill is not None:
        s = report.prefill.shape
        lines.append(f"prefill stack: {s.name}, {report.prefill.layers_run} of {s.num_layers} layers run "
                     f"(ms scaled to all), hidden {s.hidden}, heads {s.heads}/{s.kv_heads} kv, "
                     f"head_dim {s.head_dim}, intermediate {s.intermediate}, {report.prefill.attention}")
    if matmul is not None:
        lines.append(f"matmul_bf16 n={matmul.prefix_tokens}: {matmul.ms:.3f} ms, "
                     f"{_fmt(matmul.tflops, '.2f')} TFLOP/s")
    lines += ["", *_grid(["prefix_tokens", "kv_bytes", "cold_prefill_ms",
                          *(f"load_ms:{s}" for s in short), "load_beats_recompute"], _load_rows(report))]
    lines += ["", *_grid(["prefix_tokens", *(f"GB/s:{s}" for s in short), "batched/pinned",
                          "prefill_TFLOP/s", "prefill/matmul", "byte_exact"], _rate_rows(report))]
    d = report.delay
    lines += ["", f"delay injection ({d.delay} on the producer): ordered path byte-exact "
                  f"{'yes' if d.ordered_exact else 'NO'}; unordered control caught "
                  f"{'yes' if d.control_caught else 'NO'}"]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)
