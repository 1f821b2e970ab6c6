"""Analyzers: what a what-if is given and what it returns (shared by the simulator's engines)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from kvlens.analyzers import costs
from kvlens.analyzers.step_time import StepModel
from kvlens.errors import ConfigError
from kvlens.routing import CACHE_THRESHOLD, PREFIX_BLOCKS, prefix_replica, session_replica
from kvlens.schema import RoutingPolicy

__all__ = ["DEFAULT_MAX_BATCHED_TOKENS", "Engine", "SimConfig", "SimResult", "check", "recorded_routes",
           "static_routes"]

# vLLM 0.32.0's defaults for its OpenAI server on an H100-class GPU (vllm/engine/arg_utils.py,
# EngineArgs.get_batch_defaults): the simulator's default replica is 8x H100.
DEFAULT_MAX_BATCHED_TOKENS = 8192
DEFAULT_MAX_SEQS = {"vllm": 1024, "lru": 8}


class Engine(enum.StrEnum):
    VLLM = "vllm"  # vLLM's block pool and continuous-batching scheduler (analyzers/scheduler.py)
    LRU = "lru"  # an LRU of prompt blocks with max_seqs service slots (analyzers/sim_lru.py)


@dataclass(frozen=True)
class SimConfig:
    replicas: int
    capacity_tokens: int | None = None
    pool_tokens: int | None = None
    routing: RoutingPolicy = RoutingPolicy.ROUND_ROBIN
    load_factor: float | None = None
    seed: int = 0
    max_seqs: int | None = None  # None: the engine's default (DEFAULT_MAX_SEQS)
    prefix_blocks: int = PREFIX_BLOCKS
    # cache_aware prefers the longest resident prefix only when it covers at least this share
    # of the request's full blocks; below it the request goes to the least loaded replica
    # (the match-rate threshold of SGLang's cache-aware router; without it every request
    # follows a shared first block to the replica that saw it first).
    cache_threshold: float = CACHE_THRESHOLD  # kvlens/routing.py, shared with kvlens gateway
    device: costs.DeviceModel = costs.DEFAULT_DEVICE
    engine: Engine = Engine.VLLM
    # The engine's block pool as vLLM counts --num-gpu-blocks-override (the null block included);
    # None: capacity_tokens // block + 1, or with neither, enough that nothing is evicted.
    gpu_blocks: int | None = None
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
    step_model: StepModel | None = None  # None: modelled from the model and the device
    rate_scale: float = 1.0  # arrivals this many times denser (inter-arrival times divided by it)

    @property
    def seqs(self) -> int:
        return self.max_seqs if self.max_seqs is not None else DEFAULT_MAX_SEQS[self.engine]


@dataclass
class SimResult:
    """Lake rows of the what-if, by table, plus the simulator's own counts for cross-checks."""

    tables: dict[str, pl.DataFrame]
    hit_tokens: int = 0
    uncached_blocks: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


def check(cfg: SimConfig) -> None:
    if cfg.replicas < 1:
        raise ConfigError(f"--replicas must be at least 1, got {cfg.replicas}")
    for name, value in (("--capacity-tokens", cfg.capacity_tokens), ("--pool-tokens", cfg.pool_tokens),
                        ("--max-seqs", cfg.max_seqs)):
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if cfg.load_factor is not None and cfg.load_factor <= 0:
        raise ConfigError(f"--load-factor must be positive, got {cfg.load_factor}")
    if cfg.gpu_blocks is not None and cfg.gpu_blocks < 2:
        raise ConfigError(f"--gpu-blocks must be at least 2 (one is vLLM's null block), got {cfg.gpu_blocks}")
    if cfg.gpu_blocks is not None and cfg.capacity_tokens is not None:
        raise ConfigError("give --gpu-blocks or --capacity-tokens, not both")
    if cfg.max_batched_tokens < cfg.seqs and cfg.engine == Engine.VLLM:
        raise ConfigError(f"--max-batched-tokens ({cfg.max_batched_tokens}) must be at least --max-seqs "
                          f"({cfg.seqs}), as vLLM requires")
    if cfg.engine == Engine.LRU and (cfg.gpu_blocks is not None or cfg.step_model is not None):
        raise ConfigError("--gpu-blocks and --calibrate are the vllm engine's: the lru engine takes "
                          "--capacity-tokens and has no steps to price")
    if not cfg.rate_scale > 0:
        raise ConfigError(f"--rate-scale must be positive, got {cfg.rate_scale}")


def static_routes(cfg: SimConfig, reqs: pl.DataFrame, heads: list[list[int]]) -> np.ndarray:
    """Replica per request (arrival order) for the policies that need no cache state; -1 otherwise.

    ``heads``: each request's full-block hashes (prefix_hash and session_affinity without a
    session id know a conversation by its first ``prefix_blocks`` blocks: one shared system
    prompt block alone would send every request to one replica).
    """
    n, policy = cfg.replicas, cfg.routing
    if policy == RoutingPolicy.CACHE_AWARE:
        return np.full(reqs.height, -1, np.int64)
    if policy == RoutingPolicy.ROUND_ROBIN:
        return np.arange(reqs.height, dtype=np.int64) % n
    if policy == RoutingPolicy.RANDOM:
        rng = np.random.default_rng(cfg.seed)
        return np.array([int(rng.integers(n)) for _ in range(reqs.height)], np.int64)
    if policy == RoutingPolicy.RECORDED:
        raise ConfigError("recorded routing keeps the recorded replicas: use recorded_routes")
    out = np.empty(reqs.height, np.int64)
    sessions, ids = reqs["session_id"].to_list(), reqs["request_id"].to_list()
    for i, (session, rid, full) in enumerate(zip(sessions, ids, heads, strict=True)):
        if policy == RoutingPolicy.SESSION_AFFINITY and session:
            out[i] = session_replica(session, n)
            continue
        out[i] = prefix_replica(full, rid, n, cfg.prefix_blocks)
    return out


def recorded_routes(cfg: SimConfig, reqs: pl.DataFrame) -> tuple[np.ndarray, list[str]]:
    """Each request's recorded replica (as an index into the sorted names) and the names."""
    replicas = reqs["replica"]
    if replicas.null_count():
        raise ConfigError(f"--routing recorded: {replicas.null_count():,} requests have no recorded replica; "
                          f"import a source that names the replica, or pick another --routing")
    names = sorted(replicas.unique().to_list())
    if len(names) != cfg.replicas:
        raise ConfigError(f"--routing recorded keeps the {len(names)} recorded replicas "
                          f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): "
                          f"pass --replicas {len(names)}")
    index = {name: i for i, name in enumerate(names)}
    return np.array([index[r] for r in replicas.to_list()], np.int64), names
