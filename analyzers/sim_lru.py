"""Analyzers: the simulator's LRU engine (``--engine lru``): prompt blocks in an LRU, max_seqs slots.

The first what-if engine, kept as the baseline of the vLLM engine's benchmark and for users
who want its simpler answer. Assumptions, stated:

- Each replica caches full blocks in an LRU of ``capacity_tokens`` (unbounded when None).
  Blocks of requests in flight are pinned; a pinned block met by the eviction scan moves to
  the most-recent end. A block that cannot get a slot (everything pinned) is not cached.
- A replica runs at most ``max_seqs`` sequences at once; later requests queue FIFO. A
  request's cache look-up and its stores happen when it starts (vLLM caches blocks when it
  schedules them); starts on one replica are at least 1 ns apart, so a request sees the
  stores of every request started before it and never its own.
- Look-up: the longest prefix of full blocks resident on the replica's GPU is a local hit;
  the chain then continues in the shared pool (``pool_tokens``), each block loaded with a
  ``transfers`` row (status ok) and cached locally; the rest is computed, cached, and written
  to the pool. A prompt without a partial tail whose every block is found still computes
  its last block (the engine computes at least one prompt token).
- Time: TTFT = queue + pool load + prefill of the computed tokens; the sequence then holds
  its slot for decode (analyzers/costs.py: every figure modelled, none measured).
- The pool is shared and the simulator walks requests in arrival order, so when replicas
  queue, a request can find a block a slightly later-starting request wrote. The transfer
  row makes the ledger count it as hit_remote all the same.
"""

from __future__ import annotations

import heapq
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from kvlens.analyzers import costs
from kvlens.analyzers.sim_config import SimConfig, SimResult
from kvlens.models import ModelGeometry
from kvlens.schema import RoutingPolicy

__all__ = ["simulate_lru"]


class _Lru:
    """An LRU set of block hashes with pins; reports what it evicts."""

    def __init__(self, capacity_blocks: int | None) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.pins: dict[int, int] = {}

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def touch(self, h: int) -> None:
        self.blocks.move_to_end(h)

    def insert(self, h: int, evicted: list[int]) -> bool:
        """Cache ``h``; evicted hashes are appended to ``evicted``. False if no slot is free."""
        if self.capacity is not None:
            scanned = 0
            while len(self.blocks) >= self.capacity:
                if scanned >= len(self.blocks):
                    return False
                victim = next(iter(self.blocks))
                if self.pins.get(victim):
                    self.blocks.move_to_end(victim)
                    scanned += 1
                    continue
                del self.blocks[victim]
                evicted.append(victim)
        self.blocks[h] = None
        return True

    def pin(self, hashes: list[int], delta: int) -> None:
        for h in hashes:
            n = self.pins.get(h, 0) + delta
            if n > 0:
                self.pins[h] = n
            else:
                self.pins.pop(h, None)


@dataclass
class _Replica:
    name: str
    cache: _Lru
    slots: list[int] = field(default_factory=list)  # busy-until times of running sequences
    inflight: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (end, seq, pinned)
    last_start: int = -1
    seq: int = 0

    def load(self, now: int) -> int:
        while self.inflight and self.inflight[0][0] <= now:
            _end, _s, pinned = heapq.heappop(self.inflight)
            self.cache.pin(pinned, -1)
        return len(self.inflight)


class _Events:
    """Column buffers for kv_events, transfers and the simulated requests."""

    def __init__(self) -> None:
        self.ev: dict[str, list[Any]] = {k: [] for k in (
            "ts_ns", "recv_ns", "replica", "dp_rank", "seq", "kind", "block_hash", "parent_hash", "position",
            "block_tokens", "medium", "content_hash", "namespace", "session_id")}
        self.xfer: dict[str, list[Any]] = {k: [] for k in (
            "request_id", "ts_ns", "replica", "origin", "block_hash", "blocks", "bytes", "duration_ms",
            "status")}

    def event(self, ts: int, replica: str, seq: int, kind: str, blk: dict[str, Any], medium: str) -> None:
        e = self.ev
        for k, v in (("ts_ns", ts), ("recv_ns", ts), ("replica", replica), ("dp_rank", 0), ("seq", seq),
                     ("kind", kind), ("block_hash", blk["h"]), ("parent_hash", blk.get("parent")),
                     ("position", blk.get("pos")), ("block_tokens", blk.get("tokens")), ("medium", medium),
                     ("content_hash", blk.get("c")), ("namespace", blk.get("ns")),
                     ("session_id", blk.get("session"))):
            e[k].append(v)

    def transfer(self, rid: str, ts: int, replica: str, origin: str, h: int, nbytes: int, ms: float) -> None:
        for k, v in (("request_id", rid), ("ts_ns", ts), ("replica", replica), ("origin", origin),
                     ("block_hash", h), ("blocks", 1), ("bytes", nbytes), ("duration_ms", ms),
                     ("status", "ok")):
            self.xfer[k].append(v)


def _route(cfg: SimConfig, reps: list[_Replica], i: int, req: dict[str, Any], full: list[int],
           rng: np.random.Generator, now: int) -> int:
    n = len(reps)
    policy = cfg.routing
    if policy == RoutingPolicy.ROUND_ROBIN:
        return i % n
    if policy == RoutingPolicy.RANDOM:
        return int(rng.integers(n))
    if policy == RoutingPolicy.SESSION_AFFINITY and req.get("session_id"):
        return zlib.crc32(str(req["session_id"]).encode()) % n
    if policy in (RoutingPolicy.SESSION_AFFINITY, RoutingPolicy.PREFIX_HASH):
        # Without a session id a conversation is known by its first blocks (one shared system
        # prompt block alone would send every request to one replica).
        head = full[: cfg.prefix_blocks] or [zlib.crc32(req["request_id"].encode())]
        return zlib.crc32(np.array(head, dtype=np.uint64).tobytes()) % n
    loads = [r.load(now) for r in reps]
    least = min(range(n), key=lambda k: (loads[k], k))
    best, best_key = least, (-1, 0)
    for idx, rep in enumerate(reps):
        matched = 0
        for h in full:
            if h not in rep.cache:
                break
            matched += 1
        key = (matched, -loads[idx])
        if key > best_key:
            best, best_key = idx, key
    if not full or best_key[0] < cfg.cache_threshold * len(full):
        best = least
    if cfg.load_factor is not None:
        mean = sum(loads) / n
        if mean > 0 and loads[best] > cfg.load_factor * mean:
            best = least
    return best


def _block_lists(blocks: pl.DataFrame, sessions: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """request id -> its blocks in position order, as small dicts (h, c, ns, tokens, full, ...)."""
    out: dict[str, list[dict[str, Any]]] = {}
    rows = blocks.sort("request_id", "position").iter_rows(named=True)
    for row in rows:
        lst = out.setdefault(row["request_id"], [])
        lst.append({"h": row["block_hash"], "c": row["content_hash"], "ns": row["namespace"],
                    "tokens": row["block_tokens"], "pos": row["position"],
                    "full": row["block_tokens"] >= row["block_size_tokens"],
                    "parent": lst[-1]["h"] if lst else None, "session": sessions.get(row["request_id"])})
    return out


def simulate_lru(*, requests: pl.DataFrame, request_blocks: pl.DataFrame, config: SimConfig,
                 model: ModelGeometry, fixed: np.ndarray | None = None,
                 names: list[str] | None = None) -> SimResult:
    """Replay ``requests`` (with their ``request_blocks``) under ``config``; rows for the lake.

    Returns frames for ``requests``, ``request_blocks``, ``kv_events`` and ``transfers``
    (without ``scenario``: the writer sets it), sorted by time.
    """
    largest = request_blocks["block_size_tokens"].max() if request_blocks.height else None
    block_tokens = int(largest) if isinstance(largest, int) and largest > 0 else 1
    cap = None if config.capacity_tokens is None else max(config.capacity_tokens // block_tokens, 1)
    names = names or [f"replica-{i}" for i in range(config.replicas)]
    reps = [_Replica(name, _Lru(cap)) for name in names]
    pool = _Lru(config.pool_tokens // block_tokens) if config.pool_tokens else None
    per_token = model.kv_bytes_per_token()
    reqs = requests.unique("request_id", keep="first").sort("arrival_ns", "request_id")
    sessions = dict(zip(reqs["request_id"].to_list(), reqs["session_id"].to_list(), strict=True))
    by_req = _block_lists(request_blocks, sessions)
    rng = np.random.default_rng(config.seed)
    out = _Events()
    rows: list[dict[str, Any]] = []
    result = SimResult(tables={})
    pool_seq = 0
    for i, req in enumerate(reqs.iter_rows(named=True)):
        blocks = by_req.get(req["request_id"], [])
        full = [b for b in blocks if b["full"]]
        prompt = req["prompt_tokens"]
        if prompt is None:
            prompt = sum(b["tokens"] for b in blocks)
        rep = reps[int(fixed[i]) if fixed is not None
                   else _route(config, reps, i, req, [b["h"] for b in full], rng, req["arrival_ns"])]
        start = max(req["arrival_ns"], rep.last_start + 1)
        while rep.slots and rep.slots[0] <= start:
            heapq.heappop(rep.slots)
        if len(rep.slots) >= config.seqs:
            start = max(start, heapq.heappop(rep.slots))
        rep.last_start = start
        rep.load(start)
        local = 0
        for b in full:
            if b["h"] not in rep.cache:
                break
            rep.cache.touch(b["h"])
            local += 1
        pooled = 0
        if pool is not None:
            for b in full[local:]:
                if b["h"] not in pool:
                    break
                pool.touch(b["h"])
                pooled += 1
        usable = local + pooled
        if usable == len(full) and usable and prompt == sum(b["tokens"] for b in full):
            usable -= 1  # the engine computes at least one prompt token
        loads = full[local:usable]
        cached = sum(b["tokens"] for b in full[:usable])
        rep.seq += 1
        hits = [b["h"] for b in full[:local]]
        rep.cache.pin(hits, +1)
        pinned = list(hits)
        load_bytes = sum(b["tokens"] for b in loads) * per_token
        load_ms = costs.load_ms(load_bytes, config.device)
        for b in loads:
            out.transfer(req["request_id"], start, rep.name, "pool", b["h"], b["tokens"] * per_token,
                         load_ms * b["tokens"] * per_token / max(load_bytes, 1))
        for b in full[local:]:
            evicted: list[int] = []
            if rep.cache.insert(b["h"], evicted):
                for h in evicted:
                    out.event(start, rep.name, rep.seq, "removed", {"h": h}, "gpu")
                out.event(start, rep.name, rep.seq, "stored", b, "gpu")
                rep.cache.pin([b["h"]], +1)
                pinned.append(b["h"])
            else:
                result.uncached_blocks += 1
        if pool is not None:
            pool_seq += 1
            for b in full[usable:]:
                if b["h"] in pool:
                    continue
                evicted = []
                pool.insert(b["h"], evicted)
                for h in evicted:
                    out.event(start, "pool", pool_seq, "removed", {"h": h}, "pool")
                out.event(start, "pool", pool_seq, "stored", b, "pool")
                out.transfer(req["request_id"], start, "pool", rep.name, b["h"], b["tokens"] * per_token,
                             0.0)
        prefill = costs.prefill_ms(model, prompt - cached, cached, config.device)
        queue_ms = (start - req["arrival_ns"]) / 1e6
        ttft_ms = queue_ms + load_ms + prefill
        busy_ms = load_ms + prefill + costs.decode_ms(req["output_tokens"] or 0, config.device)
        end = start + max(int(busy_ms * 1e6), 1)
        heapq.heappush(rep.slots, end)
        heapq.heappush(rep.inflight, (end, i, pinned))
        result.hit_tokens += cached
        rows.append({
            "request_id": req["request_id"], "arrival_ns": req["arrival_ns"],
            "first_token_ns": req["arrival_ns"] + int(ttft_ms * 1e6), "end_ns": end,
            "replica": rep.name, "model": req["model"] or model.name,
            "tenant": req["tenant"], "session_id": req["session_id"], "prompt_tokens": prompt,
            "output_tokens": req["output_tokens"], "cached_tokens": cached, "ttft_ms": ttft_ms,
            "queue_ms": queue_ms, "prefill_ms": prefill, "source": "sim"})
    result.tables = {
        "requests": pl.DataFrame(rows, infer_schema_length=None),
        "request_blocks": request_blocks.drop("scenario", strict=False),
        "kv_events": pl.DataFrame(out.ev, schema_overrides={
            "block_hash": pl.UInt64, "parent_hash": pl.UInt64, "content_hash": pl.UInt64,
            "seq": pl.UInt64}),
        "transfers": pl.DataFrame(out.xfer, schema_overrides={"block_hash": pl.UInt64}),
    }
    result.stats = {"requests": len(rows), "events": len(out.ev["ts_ns"]),
                    "transfers": len(out.xfer["ts_ns"])}
    return result
