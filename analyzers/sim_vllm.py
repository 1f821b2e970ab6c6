"""Analyzers: the simulator's vLLM engine: frames -> the compiled fleet (analyzers/scheduler.py) -> lake rows.

Each request needs the hashes of every full block it will hold: its prompt's full blocks from
``request_blocks`` (the engine's own keys when the source had them), then the blocks that fill
with generated tokens, whose content no trace records: each gets a hash of its own (a 64-bit
mix of the request's arrival index and position), so it takes cache space, is evicted and
published like any block, and is never a hit for another request. A request holds at most
``cdiv(prompt + output − 1, B)`` blocks (the last sampled token is never computed); one that
cannot fit in the pool is refused, as vLLM refuses a ``max_model_len`` its cache cannot hold.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from kvlens.analyzers.scheduler import run_fleet
from kvlens.analyzers.sim_config import SimConfig, SimResult
from kvlens.analyzers.step_time import StepModel
from kvlens.errors import ConfigError
from kvlens.models import ModelGeometry

__all__ = ["Prepared", "prepare", "simulate_vllm"]

_MIX = np.uint64(0x9E3779B97F4A7C15)


def _synthetic(req: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """splitmix64 of (request, position): a generated block's own hash, as int64."""
    with np.errstate(over="ignore"):
        z = req.astype(np.uint64) * np.uint64(0x100000001B3) + pos.astype(np.uint64) + _MIX
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z.view(np.int64)


class Prepared:
    """The engine's input arrays for one scenario, in arrival order."""

    def __init__(self, reqs: pl.DataFrame, blocks: pl.DataFrame, block: int) -> None:
        self.reqs, self.block = reqs, block
        n = reqs.height
        self.arrival = reqs["arrival_ns"].to_numpy().astype(np.int64)
        self.prompt = reqs["prompt_tokens"].to_numpy().astype(np.int64)
        self.out = np.maximum(reqs["output_tokens"].fill_null(1).to_numpy().astype(np.int64), 1)
        n_h = (self.prompt + self.out - 1) // block
        self.n_pfull = self.prompt // block
        self.off = np.zeros(n + 1, np.int64)
        np.cumsum(n_h, out=self.off[1:])
        owner = np.repeat(np.arange(n), n_h)
        pos = np.arange(self.off[-1]) - self.off[owner]
        self.hashes = _synthetic(owner, pos)
        self.content = np.zeros(self.off[-1], np.uint64)
        full = (blocks.join(reqs.select("request_id", idx=pl.int_range(n)), on="request_id")
                .filter(pl.col("block_tokens") == block))
        idx, p = full["idx"].to_numpy(), full["position"].to_numpy()
        keep = p < self.n_pfull[idx]
        flat = self.off[idx[keep]] + p[keep]
        self.hashes[flat] = full["block_hash"].to_numpy()[keep].view(np.int64)
        self.content[flat] = full["content_hash"].fill_null(0).to_numpy()[keep]
        first_ns = blocks.group_by("request_id").agg(pl.col("namespace").first())
        self.namespace = reqs.select("request_id").join(first_ns, on="request_id", how="left",
                                                        maintain_order="left")["namespace"]
        self.needs = np.maximum(-(-(self.prompt + self.out - 1) // block), 1)

    def heads(self) -> list[list[int]]:
        return [self.hashes[self.off[i]:self.off[i] + self.n_pfull[i]].view(np.uint64).tolist()
                for i in range(self.reqs.height)]

    def unbounded_blocks(self) -> int:
        """A pool no request ever evicts from: every block any request holds, plus the null block."""
        return int(self.needs.sum()) + 1


def prepare(reqs: pl.DataFrame, blocks: pl.DataFrame) -> Prepared:
    largest = blocks["block_size_tokens"].max() if blocks.height else None
    block = int(largest) if isinstance(largest, int) and largest > 0 else 16
    return Prepared(reqs, blocks, block)


# An unbounded cache is as many blocks per replica as every request could hold at once; beyond
# this many blocks over the fleet (7 int64 rows each: ~2.8 GB) ask for a capacity instead.
MAX_FLEET_BLOCKS = 50_000_000


def _gpu_blocks(cfg: SimConfig, prep: Prepared) -> int:
    if cfg.gpu_blocks is not None:
        nb = cfg.gpu_blocks
    elif cfg.capacity_tokens is not None:
        nb = cfg.capacity_tokens // prep.block + 1
    else:
        nb = prep.unbounded_blocks()
        if nb * cfg.replicas > MAX_FLEET_BLOCKS:
            raise ConfigError(
                f"an unbounded cache for {prep.reqs.height:,} requests on {cfg.replicas} replicas would take "
                f"{nb * cfg.replicas:,} blocks of state: give --gpu-blocks or --capacity-tokens per replica")
        return nb
    worst = int(prep.needs.argmax()) if prep.needs.size else 0
    if prep.needs.size and prep.needs[worst] > nb - 1:
        rid, need = prep.reqs["request_id"][worst], int(prep.needs[worst])
        raise ConfigError(
            f"request {rid} needs {need:,} blocks of {prep.block} tokens ({prep.prompt[worst]:,} prompt + "
            f"{prep.out[worst]:,} output) but a replica of {nb:,} blocks holds {nb - 1:,} (one is "
            f"vLLM's null block): vLLM would refuse that max_model_len; give --gpu-blocks {need + 1} or more")
    return nb


def _run(prep: Prepared, cfg: SimConfig, fixed: np.ndarray, nb: int, step: StepModel) -> tuple[Any, ...]:
    pool_blocks = (cfg.pool_tokens // prep.block) if cfg.pool_tokens else 0
    cap = int(prep.off[-1]) * 2 + 1024
    delay = np.rint(step.delays(prep.reqs["request_id"].to_list(), cfg.seed) * 1e6).astype(np.int64)
    engine_arrival = prep.arrival + delay
    order = np.argsort(engine_arrival, kind="stable")
    for _attempt in range(12):  # each retry doubles the buffers; preemptions recompute blocks
        out = run_fleet(engine_arrival, order, prep.prompt, prep.out, prep.off, prep.hashes, prep.n_pfull,
                        fixed, cfg.replicas, nb, prep.block, cfg.seqs, cfg.max_batched_tokens,
                        cfg.cache_threshold, cfg.load_factor or 0.0, pool_blocks, step.params, cap, cap)
        if out[3][2] == 0:
            return out
        cap *= 2
    raise AssertionError("event buffers kept overflowing")  # pragma: no cover


def simulate_vllm(*, prep: Prepared, config: SimConfig, model: ModelGeometry, fixed: np.ndarray,
                  names: list[str], step: StepModel, request_blocks: pl.DataFrame) -> SimResult:
    """Run the fleet and turn its rows into the lake's requests, kv_events and transfers."""
    nb = _gpu_blocks(config, prep)
    rows, ev, xf, cnt, steps = _run(prep, config, fixed, nb, step)
    replica, sched, first, end, cached, ext, npre, moved = rows
    per_token = model.kv_bytes_per_token()
    reqs = prep.reqs
    arrival = prep.arrival
    requests = pl.DataFrame({
        "request_id": reqs["request_id"], "arrival_ns": arrival, "first_token_ns": first, "end_ns": end,
        "replica": pl.Series([names[r] for r in replica], dtype=pl.String),
        "model": reqs["model"].fill_null(model.name), "tenant": reqs["tenant"],
        "session_id": reqs["session_id"],
        "prompt_tokens": prep.prompt, "output_tokens": reqs["output_tokens"], "cached_tokens": cached,
        "ttft_ms": (first - arrival) / 1e6, "queue_ms": (sched - arrival) / 1e6,
        "prefill_ms": (first - sched) / 1e6, "source": "sim"})
    from kvlens.analyzers.sim_frames import events_frame, transfers_frame

    result = SimResult(tables={
        "requests": requests, "request_blocks": request_blocks.drop("scenario", strict=False),
        "kv_events": events_frame(ev, prep, names),
        "transfers": transfers_frame(xf, prep, names, per_token, step, ext)})
    result.hit_tokens = int(cached.sum())
    result.stats = {"requests": requests.height, "events": len(ev), "transfers": len(xf), "steps": int(steps),
                    "preemptions": int(npre.sum()), "gpu_blocks": nb, "block_tokens": prep.block,
                    "step_model": step.label, "pool_tokens": int(ext.sum()),
                    "fallbacks": int(cnt[3]),
                    "moved": reqs["request_id"].filter(pl.Series(moved == 1)).to_list()}
    return result
