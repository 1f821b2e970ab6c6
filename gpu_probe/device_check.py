"""GPU probe, the one-shot acceptance check for a session lent a GPU (run gpu_probe/device_check.sh).

Probes Llama-3.1-8B geometry in bf16 on CUDA and prints the table, then one line per acceptance
criterion of the probe's issue, each with its measured number:

- the batched KV load reaches >= 85% of the bulk pinned host->device bandwidth of the same run,
  at every prefix length;
- prefill at 16,384 tokens runs at >= 50% of the bf16 matmul rate of the same run;
- every transfer path is byte-exact, and the delay-injection check holds (ordered path exact,
  unordered control caught).

Exit status 0 when all hold, 1 when one fails, 2 without CUDA. Needs torch with CUDA; no network.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlens.gpu_probe.probe import (
    GPU_PREFIX_TOKENS,
    ProbeReport,
    parse_prefix_tokens,
    plan_probe,
    probe_rows,
    render_table,
    run_probe,
)
from kvlens.gpu_probe.records import ProbePath
from kvlens.gpu_probe.timing import cuda_available
from kvlens.models import resolve_model

__all__ = ["BANDWIDTH_RATIO_MIN", "PREFILL_TOKENS", "PREFILL_TO_MATMUL_MIN", "acceptance", "main"]

BANDWIDTH_RATIO_MIN = 0.85
PREFILL_TO_MATMUL_MIN = 0.50
PREFILL_TOKENS = 16384


def _bandwidth(report: ProbeReport) -> tuple[str, bool]:
    ratios = {}
    for t in report.plan.prefix_tokens:
        pinned = report.find(ProbePath.H2D_PINNED, t)
        batched = report.find(ProbePath.KV_LOAD_BATCHED, t)
        if pinned and batched and pinned.gbps and batched.gbps:
            ratios[t] = batched.gbps / pinned.gbps
    ok = bool(ratios) and min(ratios.values()) >= BANDWIDTH_RATIO_MIN
    shown = ", ".join(f"{t:,}: {r:.3f}" for t, r in ratios.items()) or "not measured"
    return (f"batched KV load / bulk pinned H2D bandwidth >= {BANDWIDTH_RATIO_MIN}: {shown}", ok)


def _prefill(report: ProbeReport) -> tuple[str, bool]:
    prefill = report.find(ProbePath.PREFILL, PREFILL_TOKENS)
    matmul = report.find(ProbePath.MATMUL_BF16)
    if not (prefill and matmul and prefill.tflops and matmul.tflops):
        return f"prefill at {PREFILL_TOKENS:,} tokens / bf16 matmul rate: not measured", False
    ratio = prefill.tflops / matmul.tflops
    return (f"prefill at {PREFILL_TOKENS:,} tokens / bf16 matmul rate >= {PREFILL_TO_MATMUL_MIN}: "
            f"{prefill.tflops:.1f} / {matmul.tflops:.1f} TFLOP/s = {ratio:.3f}",
            ratio >= PREFILL_TO_MATMUL_MIN)


def _exact(report: ProbeReport) -> tuple[str, bool]:
    gated = [m for m in report.measurements if m.byte_exact is not None]
    bad = [f"{m.path}@{m.prefix_tokens}" for m in gated if not m.byte_exact]
    d = report.delay
    ok = bool(gated) and not bad and d.passed
    return (f"byte-exact: {len(gated) - len(bad)} of {len(gated)} gated runs"
            f"{' (failed: ' + ', '.join(bad) + ')' if bad else ''}; delay injection: ordered exact "
            f"{d.ordered_exact}, unordered control caught {d.control_caught}", ok)


def acceptance(report: ProbeReport) -> tuple[list[str], bool]:
    """One ``PASS``/``FAIL`` line per criterion, and whether all hold."""
    checks = [_bandwidth(report), _prefill(report), _exact(report)]
    return [f"{'PASS' if ok else 'FAIL'}  {text}" for text, ok in checks], all(ok for _, ok in checks)


def _save(report: ProbeReport, table: str, lines: list[str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_table.txt").write_text(table + "\n\n" + "\n".join(lines) + "\n")
    (out / "probe_runs.json").write_text(json.dumps(probe_rows(report), indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--model-config", default=None, metavar="config.json",
                        help="a Hugging Face config.json: its geometry instead of --model's")
    parser.add_argument("--prefix-tokens", default=",".join(str(t) for t in GPU_PREFIX_TOKENS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the table and rows here")
    args = parser.parse_args(argv)
    if not cuda_available():
        print("device_check: no CUDA device visible to torch; nothing measured")
        return 2
    geometry = resolve_model(args.model, args.model_config)
    plan = plan_probe(geometry, parse_prefix_tokens(args.prefix_tokens), cuda=True, runs=args.runs)
    report = run_probe(plan)
    table = render_table(report)
    lines, ok = acceptance(report)
    print(table, "", *lines, sep="\n", flush=True)
    if args.out is not None:
        _save(report, table, lines, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
