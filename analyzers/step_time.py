"""Analyzers: the step-time model of a simulated engine: one batch's milliseconds, modelled or fitted.

A step's duration (``step_ns``, read by analyzers/scheduler.py) is

    overhead + [P > 0]·(prefill_fixed + b·P + c·A) + max(compute, memory) + pool load

over the step's batch: ``P`` prefill tokens with attention work ``A = Σ (c+n)² − c²`` (n new
tokens after c computed), ``D`` decodes, ``CTX`` tokens of context read. Three ways to price it,
each labelled (the simulator's times are always modelled; these say from what):

- **modelled** (no measurement): a roofline on the :class:`~analyzers.costs.DeviceModel`:
  ``compute = FLOPs / (peak · efficiency)`` with FLOPs ``2·params·(P + D) + 2·L·width·(A + A_dec)``
  (analyzers/costs.py's prefill formula, decodes included),
  ``memory = (weights + KV of CTX) / (HBM bandwidth · efficiency)``: prefill is compute-bound,
  decode bound by weight + KV reads.
- **probe-calibrated prefill**: when the lake has a GPU probe calibration of the model
  (analyzers/costs.py ``cost_model``: ``a + b·T + c·T²`` fitted to measured prefill), the
  prefill terms are that fit and the roofline prices the decodes alone.
- **calibrated from a scenario's spans** (``kvlens simulate --calibrate SCENARIO``): least
  squares of each request's measured prefill time (engine span: scheduled -> first token)
  against its computed tokens (prompt − cached), ``prefill_ms = a + b·T``, gives the cost of a
  prefill token ``b``; the time per output token after the first, ``Σ(end − first token) /
  Σ(output − 1)``, is the mean step a decoding request sits through, which includes the prefill
  tokens others computed meanwhile: over the time ``W`` anyone decoded, ``N = W / step`` steps
  shared ``C`` prefill tokens (each request's, weighted by the share of its prefill time during
  which another request decoded), so a step costs ``base = step − b·C/N`` plus ``b·P`` for its
  own prefill tokens. ``TTFT − queue − prefill``
  is the time before the engine's queue: the API server's work and hand-off plus the wait for
  the running step, which the simulator models (its mean, half a step while busy, is taken
  off); a replayed request keeps its own measured delay, any other draws one of them. A fleet
  priced by its own engine; a decode-only step's cost does not grow with the batch here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
from numba import njit

from kvlens.analyzers.costs import DEFAULT_DEVICE, CostModel, DeviceModel
from kvlens.errors import NoDataError
from kvlens.models import ModelGeometry

__all__ = ["StepModel", "calibrated", "modelled", "step_ns"]

N_PARAMS = 13


@dataclass(frozen=True)
class StepModel:
    """The parameters ``step_ns`` reads, and where they came from (shown beside every time).

    ``frontend``: when calibrated, each measured request's delay before the engine's queue
    (request id -> ms); :meth:`delays` replays a request's own, or draws one of them.
    """

    params: np.ndarray
    label: str
    calibrated_from: str | None = None
    fit: dict[str, float] | None = None
    frontend: dict[str, float] | None = None

    def delays(self, request_ids: list[str], seed: int = 0) -> np.ndarray:
        """Milliseconds from each request's arrival to the engine's queue (0 when not calibrated)."""
        if not self.frontend:
            return np.zeros(len(request_ids))
        pool = np.array(sorted(self.frontend.values()))
        drawn = np.random.default_rng(seed).choice(pool, len(request_ids))
        own = np.array([self.frontend.get(r, np.nan) for r in request_ids], dtype=float)
        return np.where(np.isnan(own), drawn, own)


@njit(cache=True)
def step_ns(st, p, a, d, a_dec, ctx, n_pre, n_adm, load_tok):
    """A step's duration in ns from its shape (the parameters: this module's docstring).

    ``p`` prefill tokens in ``n_pre`` chunks with attention work ``a`` (sum of (c+n)² − c²),
    ``d`` decodes with attention work ``a_dec``, ``ctx`` tokens of context read, ``load_tok``
    tokens loaded from the pool. At least ``n_adm + 1`` ns, so admissions stay ordered.
    """
    ms = st[0]
    if p > 0:
        ms += st[1] + st[2] * p + st[3] * a
    lin = d + p if st[10] > 0 else d
    att = a_dec + a if st[10] > 0 else a_dec
    ms += max(st[4] * (st[5] * lin + st[6] * att), st[7] * (st[8] + st[9] * ctx))
    if load_tok > 0:
        ms += st[11] + st[12] * load_tok
    return max(int(np.rint(ms * 1e6)), n_adm + 1, 1)


def _pool_terms(p: np.ndarray, model: ModelGeometry, device: DeviceModel) -> None:
    p[11] = device.pool_lookup_ms
    p[12] = model.kv_bytes_per_token() / (device.pool_gbps * 1e9) * 1e3


def modelled(model: ModelGeometry, device: DeviceModel = DEFAULT_DEVICE,
             costs: CostModel | None = None) -> StepModel:
    """The roofline of ``device``; prefill from the probe's fit when ``costs`` carries one."""
    layers = sum(g.num_layers for g in model.groups)
    p = np.zeros(N_PARAMS)
    p[0] = device.step_overhead_ms
    p[4] = 1.0 / device.flops_per_ms
    p[5] = 2.0 * model.num_params
    p[6] = 2.0 * layers * model.hidden_size
    p[7] = 1.0 / device.hbm_bytes_per_ms
    p[8] = model.num_params * device.weight_bytes_per_param
    p[9] = float(model.kv_bytes_per_token())
    p[10] = 1.0
    _pool_terms(p, model, device)
    label = (f"modelled: {device.name}, FLOPs at {device.efficiency:.0%} of peak, weights + KV reads at "
             f"{device.hbm_efficiency:.0%} of HBM bandwidth, {device.step_overhead_ms:g} ms per step")
    if costs is not None and costs.fit is not None:
        p[1], p[2], p[3] = costs.fit
        p[10] = 0.0
        label = (f"modelled; prefill from the probe's measured fit (run {costs.fit_run_id}), decode: "
                 + label.removeprefix("modelled: "))
    return StepModel(p, label)


def _fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """ms = a + b·x by least squares, both kept non-negative (a negative slope is noise)."""
    if len(np.unique(x)) < 2:
        return float(np.median(y)), 0.0
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return float(np.median(y)), 0.0
    if a < 0:
        return 0.0, float(np.sum(x * y) / np.sum(x * x))
    return float(a), float(b)


def _union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [start, end) as sorted disjoint ones."""
    order = np.argsort(starts, kind="stable")
    out_s: list[float] = []
    out_e: list[float] = []
    for s0, e0 in zip(starts[order], ends[order], strict=True):
        if out_e and s0 <= out_e[-1]:
            out_e[-1] = max(out_e[-1], e0)
        else:
            out_s.append(s0)
            out_e.append(e0)
    return np.array(out_s, float), np.array(out_e, float)


def _covered(lo: np.ndarray, hi: np.ndarray, us: np.ndarray, ue: np.ndarray) -> np.ndarray:
    """For each [lo, hi), how much of it the disjoint sorted intervals (us, ue) cover."""
    cum = np.concatenate([[0.0], np.cumsum(ue - us)])

    def upto(x: np.ndarray) -> np.ndarray:  # covered length of (-inf, x)
        k = np.searchsorted(ue, x, side="right")
        inside = np.clip(x - us[np.minimum(k, len(us) - 1)], 0, None) * (k < len(us))
        return cum[k] + np.minimum(inside, (ue - us)[np.minimum(k, len(us) - 1)])

    return upto(hi) - upto(lo) if len(us) else np.zeros_like(lo)


def calibrated(spans: pl.DataFrame, model: ModelGeometry, scenario: str,
               device: DeviceModel = DEFAULT_DEVICE) -> StepModel:
    """Fit the step model to ``spans`` (requests rows with measured prefill, queue and TTFT times).

    A ``source_request_id`` column (``join_sources(matched_ids=True)``) names each span's request
    as the replayed trace does; the front-end delays are keyed by it too.
    """
    need = ("prefill_ms", "queue_ms", "ttft_ms", "prompt_tokens", "cached_tokens", "output_tokens",
            "first_token_ns", "end_ns")
    missing = [c for c in need if c not in spans.columns]
    rows = spans if missing else spans.drop_nulls(list(need))
    if missing or rows.height < 3:
        raise NoDataError(
            f"scenario {scenario!r} has {rows.height if not missing else 0} requests with measured prefill, "
            f"queue and first-token times, cached and output tokens (need 3): import the engine's spans "
            f"(kvlens import otlp) and its API usage, or join them, then calibrate on that scenario")
    computed = (rows["prompt_tokens"] - rows["cached_tokens"]).to_numpy().astype(float)
    a, b = _fit_line(computed, rows["prefill_ms"].to_numpy().astype(float))
    dec = rows.filter(pl.col("output_tokens") >= 2)
    decode_ms = float((dec["end_ns"] - dec["first_token_ns"]).sum()) / 1e6
    step = decode_ms / max(int((dec["output_tokens"] - 1).sum()), 1)  # a decoding request's mean step
    # That mean step carries the prefill tokens computed while someone decoded: each request's
    # prefill tokens, weighted by the share of its prefill time during which another decoded,
    # spread over the steps of the time anyone decoded. Take them out.
    us, ue = _union(dec["first_token_ns"].to_numpy() / 1e6, dec["end_ns"].to_numpy() / 1e6)
    first = rows["first_token_ns"].to_numpy() / 1e6
    sched = first - rows["prefill_ms"].to_numpy()
    shared = _covered(sched, first, us, ue) / np.maximum(first - sched, 1e-9)
    steps = float((ue - us).sum()) / step if step > 0 else 0.0
    base = max(step - b * float((shared * computed).sum()) / steps, 0.0) if steps else step
    # Arrival -> the engine's queue is the API server's work and hand-off, plus the wait for the
    # running step (an engine takes new requests between steps), which the simulator models
    # itself: its mean, half a mean step while busy, comes off each measured delay.
    bs_, be_ = _union(sched, rows["end_ns"].to_numpy() / 1e6)
    busy = float((be_ - bs_).sum())  # the engine had work
    span_ms = busy
    if "arrival_ns" in rows.columns:
        ends, starts = rows["end_ns"].to_numpy(), rows["arrival_ns"].to_numpy()
        span_ms = float(ends.max() - starts.min()) / 1e6
    wait = step / 2 * min(busy / span_ms, 1.0) if span_ms > 0 else 0.0
    before = (rows["ttft_ms"] - rows["queue_ms"] - rows["prefill_ms"] - wait).clip(lower_bound=0.0)
    frontend = dict(zip(rows["request_id"].to_list(), before.to_list(), strict=True)) \
        if "request_id" in rows.columns else None
    if frontend is not None and "source_request_id" in rows.columns:
        # The replayed trace names requests by its own ids (a gateway's API id where the spans
        # carry the engine's <id>-<n>): each measured delay is found under both.
        frontend.update((s, d) for s, d in zip(rows["source_request_id"].to_list(), before.to_list(),
                                               strict=True) if s is not None)
    p = np.zeros(N_PARAMS)
    p[0], p[2] = base, b
    _pool_terms(p, model, device)
    label = (f"modelled, calibrated on scenario {scenario!r} ({rows.height:,} measured spans): {base:.3f} ms "
             f"per step + {b * 1e3:.3f} µs per prefill token, a median {np.median(before.to_numpy()):.3f} ms "
             f"before the engine's queue")
    return StepModel(p, label, scenario, {"prefill_a_ms": a, "prefill_b_ms_per_token": b, "step_ms": step,
                                          "base_ms": float(base), "step_wait_ms": wait,
                                          "spans": float(rows.height)}, frontend)
