"""The simulated engine's step time (analyzers/step_time.py): the roofline, the probe's prefill fit, spans."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from kvlens.analyzers import costs
from kvlens.analyzers.step_time import calibrated, modelled, step_ns
from kvlens.errors import NoDataError
from kvlens.models import get_model

MODEL = get_model("llama-3.1-70b")
DEVICE = costs.DEFAULT_DEVICE


def _ms(params: np.ndarray, *shape: int) -> float:
    return step_ns(params, *shape) / 1e6


def test_a_long_prefill_is_compute_bound_as_the_cost_model_prices_it() -> None:
    step = modelled(MODEL, DEVICE)
    t = 8192  # one chunk, nothing cached: the FLOPs dwarf reading 140 GB of weights
    got = _ms(step.params, t, t * t, 0, 0, t, 1, 1, 0)
    assert got == pytest.approx(DEVICE.step_overhead_ms + costs.prefill_ms(MODEL, t, 0, DEVICE), rel=1e-6)
    assert "modelled" in step.label


def test_a_decode_step_reads_the_weights_and_the_kv() -> None:
    step = modelled(MODEL, DEVICE)
    seqs, ctx = 16, 16 * 4000
    weights = MODEL.num_params * DEVICE.weight_bytes_per_param
    memory_ms = (weights + MODEL.kv_bytes_per_token() * (ctx + seqs)) / DEVICE.hbm_bytes_per_ms
    got = _ms(step.params, 0, 0, seqs, 2 * ctx + seqs, ctx + seqs, 0, 0, 0)
    assert got == pytest.approx(DEVICE.step_overhead_ms + memory_ms, rel=1e-6)
    assert 5 < got < 20  # 70B on 8 H100s: ~10 ms a decode step


def test_the_probes_prefill_fit_replaces_the_flop_model_for_prefill() -> None:
    fitted = costs.CostModel(MODEL, DEVICE, "H100 (probe)", fit=(3.0, 0.02, 1e-7), fit_tokens=(512, 8192),
                             fit_run_id="run-1")
    step = modelled(MODEL, DEVICE, fitted)
    t = 4096
    decode_only = _ms(step.params, 0, 0, 0, 0, t, 0, 0, 0)  # the memory term alone, for the same context
    got = _ms(step.params, t, t * t, 0, 0, t, 1, 1, 0)
    assert got == pytest.approx(decode_only + 3.0 + 0.02 * t + 1e-7 * t * t, rel=1e-6)
    assert "probe's measured fit (run run-1)" in step.label


def _spans(base_ms: float, b_ms: float, front_ms: float) -> pl.DataFrame:
    """Requests one after another on an engine whose steps cost base + b·(prefill tokens)."""
    rows, t = [], 0
    rng = np.random.default_rng(0)
    for i in range(40):
        prompt, cached = int(rng.integers(100, 2000)), int(rng.integers(0, 4)) * 32
        out = int(rng.integers(2, 30))
        prefill = base_ms + b_ms * (prompt - cached)
        first = t + int((front_ms + prefill) * 1e6)
        end = first + int((out - 1) * base_ms * 1e6)
        rows.append({"request_id": f"r{i}", "arrival_ns": t, "prompt_tokens": prompt,
                     "cached_tokens": cached, "output_tokens": out, "queue_ms": 0.0, "prefill_ms": prefill,
                     "ttft_ms": front_ms + prefill, "first_token_ns": first, "end_ns": end})
        t = end + 5_000_000
    return pl.DataFrame(rows)


def test_calibration_recovers_the_engines_step_costs() -> None:
    step = calibrated(_spans(8.0, 0.025, 3.0), MODEL, "spans")
    fit = step.fit or {}
    assert fit["prefill_b_ms_per_token"] == pytest.approx(0.025, rel=1e-6)
    assert fit["step_ms"] == pytest.approx(8.0, rel=1e-3)
    # A sequential engine's decoding request never shares its steps: the base is the step itself.
    assert step.params[0] == pytest.approx(8.0, rel=2e-2) and step.params[2] == pytest.approx(0.025, rel=1e-6)
    delays = step.delays(["r0", "r1", "unknown"], seed=1)
    assert step.frontend is not None
    assert delays[0] <= 3.0 and delays[1] <= 3.0 and delays[2] in set(step.frontend.values())
    assert "calibrated on scenario 'spans' (40 measured spans)" in step.label and "modelled" in step.label


def test_calibration_without_spans_says_what_to_import() -> None:
    with pytest.raises(NoDataError, match="kvlens import otlp"):
        calibrated(pl.DataFrame({"request_id": ["a"], "prompt_tokens": [10]}), MODEL, "plain")
