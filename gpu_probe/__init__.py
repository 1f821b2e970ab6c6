"""GPU probe: measurements -> probe_runs rows; torch is imported inside functions.

Transfer paths (bulk copies and paged KV loads, byte-gated), the prefill of the model's layer
stack, the bf16 matmul rate and a delay-injection check of the gate; ``run_probe`` ties them
together and ``write_probe_rows`` appends them to the lake. See probe.py for the flow.
"""

from __future__ import annotations

from kvlens.gpu_probe.prefill import INTERMEDIATE_SIZES, LayerShape, layer_shape, prefill_flops
from kvlens.gpu_probe.probe import (
    ProbePlan,
    ProbeReport,
    parse_prefix_tokens,
    plan_probe,
    probe_rows,
    render_table,
    run_probe,
    write_probe_rows,
)
from kvlens.gpu_probe.records import Measurement, ProbePath, ProbeSource
from kvlens.gpu_probe.transfer import DelayCheck, delay_injection_check, measure_transfers

__all__ = [
    "INTERMEDIATE_SIZES",
    "DelayCheck",
    "LayerShape",
    "Measurement",
    "ProbePath",
    "ProbePlan",
    "ProbeReport",
    "ProbeSource",
    "delay_injection_check",
    "layer_shape",
    "measure_transfers",
    "parse_prefix_tokens",
    "plan_probe",
    "prefill_flops",
    "probe_rows",
    "render_table",
    "run_probe",
    "write_probe_rows",
]
