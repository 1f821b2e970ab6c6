"""Analyzers: the what-if simulator: a scenario's requests replayed on N replicas -> lake rows.

It writes what engines would have published (``kv_events``), what a tracer would have seen
(``requests`` with replica, scheduling, first-token and end times) and what moved
(``transfers``), so the ledger and every other analysis run on a what-if exactly as on
production data. Every time it writes is **modelled** (rows carry ``source = 'sim'``); the
step-time model says from what (:class:`analyzers.step_time.StepModel`, in ``stats``).

Two engines:

- ``vllm`` (the default): vLLM's block pool (analyzers/vllm_cache.py) and continuous-batching
  scheduler (analyzers/scheduler.py), rule for rule as vLLM 0.32.0, with a step-time model
  (analyzers/step_time.py). Checked against a real engine's per-request ``cached_tokens``
  (tests/test_simulate_vllm.py on the captures under tests/data/).
- ``lru``: the first engine (analyzers/sim_lru.py): an LRU of prompt blocks and ``max_seqs``
  slots each holding a sequence for its prefill plus a fixed time per output token.

Routing: ``recorded`` keeps each request on its recorded replica (validate a what-if against
what the fleet did, then change one knob); ``round_robin``, ``random``, ``session_affinity``,
``prefix_hash`` decide from the request alone; ``cache_aware`` routes to the longest cached
prefix at arrival (with ``load_factor``: to the least loaded replica when that one has more
than K x the mean in-flight requests). ``rate_scale`` K replays the arrivals K times denser.
"""

from __future__ import annotations

import time

import polars as pl

from kvlens.analyzers import step_time
from kvlens.analyzers.sim_config import Engine, SimConfig, SimResult, check, recorded_routes, static_routes
from kvlens.analyzers.sim_lru import simulate_lru
from kvlens.analyzers.sim_vllm import prepare, simulate_vllm
from kvlens.models import ModelGeometry
from kvlens.schema import RoutingPolicy

__all__ = ["Engine", "SimConfig", "SimResult", "simulate"]


def _ordered(requests: pl.DataFrame, rate_scale: float) -> pl.DataFrame:
    reqs = requests.unique("request_id", keep="first").sort("arrival_ns", "request_id")
    if reqs.is_empty() and "prompt_tokens" in reqs.columns:
        return reqs
    if rate_scale != 1.0:
        t0 = reqs["arrival_ns"].min()
        reqs = reqs.with_columns(
            arrival_ns=(pl.lit(t0) + ((pl.col("arrival_ns") - t0) / rate_scale).round().cast(pl.Int64)))
    return reqs


def _prompts(reqs: pl.DataFrame, blocks: pl.DataFrame) -> pl.DataFrame:
    """Fill a missing prompt length from the request's blocks."""
    sums = blocks.group_by("request_id").agg(pl.col("block_tokens").sum().alias("_sum"))
    return (reqs.join(sums, on="request_id", how="left", maintain_order="left")
            .with_columns(prompt_tokens=pl.coalesce("prompt_tokens", "_sum", pl.lit(0))).drop("_sum"))


def _assumptions(config: SimConfig, stats: dict[str, object], model: ModelGeometry) -> str:
    """What a what-if's modelled figures assume, in words (table simulations, the report, the dashboard)."""
    fallback = f" with the load fallback at {config.load_factor:g}x the mean" if config.load_factor else ""
    pool = f", a shared pool of {config.pool_tokens:,} tokens" if config.pool_tokens else ""
    dense = f", arrivals {config.rate_scale:g}x denser" if config.rate_scale != 1.0 else ""
    fleet = f"{config.replicas} replica(s) routed {config.routing.value}{fallback}{pool}{dense}; {model.name}"
    if config.engine == Engine.LRU:
        cache = (f"an LRU of {config.capacity_tokens:,} prompt tokens" if config.capacity_tokens
                 else "an unbounded LRU")
        d = config.device
        return (f"kvlens simulate --engine lru: {fleet}; {cache} per replica, {config.seqs} slots each; "
                f"TTFT = queue + pool load ({d.pool_gbps:g} GB/s, {d.pool_lookup_ms:g} ms lookup) + "
                f"prefill at {d.efficiency:.0%} of {d.name.removesuffix(' (modelled)')} bf16 peak; "
                f"{d.decode_ms_per_token:g} ms per output token")
    return (f"kvlens simulate --engine vllm: {fleet}; vLLM's block pool of {stats['gpu_blocks']:,} blocks of "
            f"{stats['block_tokens']} tokens per replica, continuous batching of at most {config.seqs} "
            f"sequences and {config.max_batched_tokens:,} tokens per step; step times {stats['step_model']}")


def _simulation_row(config: SimConfig, result: SimResult, model: ModelGeometry) -> pl.DataFrame:
    vllm = config.engine == Engine.VLLM
    return pl.DataFrame({
        "created_ns": [time.time_ns()], "engine": [config.engine.value], "replicas": [config.replicas],
        "routing": [config.routing.value], "load_factor": [config.load_factor],
        "gpu_blocks": [result.stats.get("gpu_blocks") if vllm else None],
        "capacity_tokens": [config.capacity_tokens], "pool_tokens": [config.pool_tokens],
        "max_seqs": [config.seqs], "max_batched_tokens": [config.max_batched_tokens if vllm else None],
        "rate_scale": [config.rate_scale], "model": [model.name],
        "step_model": [str(result.stats.get("step_model")) if vllm else "lru service model"],
        "assumptions": [_assumptions(config, result.stats, model)],
    }, schema_overrides={"load_factor": pl.Float64, "gpu_blocks": pl.Int32, "capacity_tokens": pl.Int64,
                         "pool_tokens": pl.Int64, "max_batched_tokens": pl.Int32, "replicas": pl.Int32,
                         "max_seqs": pl.Int32})


def simulate(*, requests: pl.DataFrame, request_blocks: pl.DataFrame, config: SimConfig,
             model: ModelGeometry) -> SimResult:
    """Replay ``requests`` (with their ``request_blocks``) under ``config``; rows for the lake.

    Returns frames for ``requests``, ``request_blocks``, ``kv_events``, ``transfers`` and one
    ``simulations`` row saying what the figures assume (without ``scenario``: the writer sets
    it). ``stats`` has the step model's label.
    """
    result = _replay(requests=requests, request_blocks=request_blocks, config=config, model=model)
    result.tables["simulations"] = _simulation_row(config, result, model)
    return result


def _replay(*, requests: pl.DataFrame, request_blocks: pl.DataFrame, config: SimConfig,
            model: ModelGeometry) -> SimResult:
    check(config)
    reqs = _prompts(_ordered(requests, config.rate_scale), request_blocks)
    names = [f"replica-{i}" for i in range(config.replicas)]
    fixed = None
    if config.routing == RoutingPolicy.RECORDED:
        fixed, names = recorded_routes(config, reqs)
    if config.engine == Engine.LRU:
        return simulate_lru(requests=reqs, request_blocks=request_blocks, config=config, model=model,
                            fixed=fixed, names=names)
    prep = prepare(reqs, request_blocks)
    if fixed is None:
        fixed = static_routes(config, reqs, prep.heads())
    step = config.step_model or step_time.modelled(model, config.device)
    return simulate_vllm(prep=prep, config=config, model=model, fixed=fixed, names=names, step=step,
                         request_blocks=request_blocks)
