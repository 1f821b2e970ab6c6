"""Dashboards: what recomputed tokens are worth, in GPU-hours and money, priced by the cost model.

A recomputed token costs prefill. The price of one is the cost model's (analyzers/costs.py)
``T_recompute(T) / T`` at the window's mean prompt length ``T``: the same fit to the newest GPU
probe run (``measured``) or the same FLOP model (``modelled``) that ``kvlens analyze`` used for
the crossover and the prefix ranking. A replica prefills on all of its GPUs at once, so the
GPU-seconds of a token are its prefill milliseconds / 1000 times the GPUs per replica (those of
the configured device when modelled; one, the probed device, when measured). Money is GPU-hours
times ``--gpu-hour-price`` (``[costs] gpu_hour_usd``); without a price only GPU-hours are shown.
So the worth of ``n`` tokens is, exactly, ``n`` x the per-token price.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import duckdb
import polars as pl

from kvlens.analyzers.costs import DEFAULT_DEVICE, cost_model
from kvlens.dashboards.formatting import fmt_gpu_hours, fmt_usd
from kvlens.dashboards.read import fetch, from_lake_view
from kvlens.dashboards.report_queries import PROBE_RUNS_SQL
from kvlens.errors import KvlensError
from kvlens.models import get_model

__all__ = ["Price", "price_of"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Price:
    """The price of one recomputed prompt token; ``gpu_s_per_token`` None when nothing can price it."""

    gpu_s_per_token: float | None
    label: str | None  # measured / modelled
    assumptions: str
    usd_per_gpu_hour: float | None = None
    gpus: int = 1  # GPUs a replica prefills on

    def gpu_hours_of_ms(self, prefill_ms: float | None) -> float | None:
        """GPU-hours of ``prefill_ms`` of one replica's prefill (on all of its GPUs)."""
        return None if prefill_ms is None or self.label is None else prefill_ms / 1000 * self.gpus / 3600

    def gpu_hours(self, tokens: float) -> float | None:
        return None if self.gpu_s_per_token is None else tokens * self.gpu_s_per_token / 3600

    def usd(self, tokens: float) -> float | None:
        hours = self.gpu_hours(tokens)
        return None if hours is None or self.usd_per_gpu_hour is None else hours * self.usd_per_gpu_hour

    def words(self, tokens: float, *, per_day: float | None = None) -> str:
        """``1.2 GPU-h ($3.60), modelled``; with ``per_day`` the window scaled to a day, too."""
        if self.gpu_s_per_token is None:
            return "worth n/a (no cost model)"
        said = self.amount(tokens)
        if per_day is not None and per_day != 1:
            said += f"; {self.amount(tokens * per_day)} a day at this rate"
        return f"{said}, {self.label}"

    def amount(self, tokens: float) -> str:
        """``1.2 GPU-h ($3.60)``: GPU-hours, with money when a price was given."""
        usd = self.usd(tokens)
        return fmt_gpu_hours(self.gpu_hours(tokens)) + ("" if usd is None else f" ({fmt_usd(usd)})")


def _probe_runs(con: duckdb.DuckDBPyConnection) -> pl.DataFrame | None:
    """The lake's probe rows as the analysis DB's view shows them; None when there is none to read
    (a lake that has moved: the recompute price is then modelled)."""
    return from_lake_view(con, "probe_runs", lambda cur: fetch(cur, PROBE_RUNS_SQL))


def price_of(con: duckdb.DuckDBPyConnection, model: str | None, mean_prompt_tokens: float,
             usd_per_gpu_hour: float | None) -> Price:
    """The per-token price of ``model``'s prefill at ``mean_prompt_tokens`` (rounded to a token)."""
    if usd_per_gpu_hour is not None and usd_per_gpu_hour < 0:
        raise KvlensError(f"GPU-hour price {usd_per_gpu_hour} is negative: pass a price of 0 or more")
    if model is None or mean_prompt_tokens <= 0:
        return Price(None, None, "no model recorded for the scenario: its recompute cannot be priced",
                     usd_per_gpu_hour)
    try:
        geometry = get_model(model)
    except KvlensError:
        return Price(None, None, f"model {model} is not in kvlens's registry: its recompute cannot be priced",
                     usd_per_gpu_hour)
    costs = cost_model(probe_runs=_probe_runs(con), model=geometry)
    ref = max(round(mean_prompt_tokens), 1)
    ms, label = costs.recompute_ms(ref)
    gpus = 1 if costs.fit is not None else DEFAULT_DEVICE.gpus_per_replica
    if costs.fit is not None:
        how = f"prefill fitted to GPU probe run {costs.fit_run_id} on {costs.device_name}, one GPU"
    else:
        d = costs.device
        how = (f"prefill FLOPs at {d.efficiency:.0%} of {d.peak_tflops_per_gpu:,.0f} TFLOPS per GPU, "
               f"{gpus} GPUs per replica ({costs.device_name})")
    price = "" if usd_per_gpu_hour is None else f", at {fmt_usd(usd_per_gpu_hour)} per GPU-hour"
    words = (f"{model}: {ms:,.1f} ms to prefill the mean prompt of {ref:,} tokens ({label}: {how}), "
             f"{ms / ref * gpus:.4f} GPU-ms per recomputed token{price}")
    log.debug("price of %s: %s", model, words)
    return Price(ms / ref * gpus / 1000, str(label), words, usd_per_gpu_hour, gpus)
