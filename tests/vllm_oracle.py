"""The pure-Python vLLM fleet: the oracle for analyzers/vllm_cache.py + analyzers/scheduler.py.

Written plainly, one class per vLLM object (a block, the free queue, the block pool, the
scheduler of one replica), so each rule reads like the engine's source it restates (vLLM
0.32.0, files under vllm/v1/core/; the compiled engine's module docstrings cite them). Same
inputs and outputs as ``analyzers.scheduler.run_fleet``; the tests hold the two to equality.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlens.analyzers.step_time import step_ns

STORED, REMOVED = 0, 1
WAITING, RUNNING, DONE = 0, 1, 2


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    req: int = -1  # the request and position that cached it (for the events)
    pos: int = -1


class FreeQueue:
    """FreeKVCacheBlockQueue: a doubly linked list in eviction order, head evicted first."""

    def __init__(self, blocks: list[Block]) -> None:
        self.q: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in blocks)

    def popleft(self) -> Block:
        return self.q.popitem(last=False)[1]

    def remove(self, block: Block) -> None:
        del self.q[block.block_id]

    def append_n(self, blocks: list[Block]) -> None:
        for b in blocks:
            self.q[b.block_id] = b

    def prepend_n(self, blocks: list[Block]) -> None:
        for b in reversed(blocks):
            self.q[b.block_id] = b
            self.q.move_to_end(b.block_id, last=False)

    def __len__(self) -> int:
        return len(self.q)


class BlockPool:
    """block_pool.BlockPool: blocks, the free queue, the hash map (duplicates kept in order)."""

    def __init__(self, num_gpu_blocks: int, replica: int, log: Fleet) -> None:
        self.blocks = [Block(i) for i in range(num_gpu_blocks)]
        self.free = FreeQueue(self.blocks)
        self.free.popleft()  # the null block: block 0, never freed, never cached
        self.cached: dict[int, list[Block]] = {}
        self.replica, self.log = replica, log

    def get_cached_block(self, h: int) -> Block | None:
        found = self.cached.get(h)
        return found[0] if found else None

    def touch(self, blocks: list[Block]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                self.free.remove(b)
            b.ref_cnt += 1

    def get_new_blocks(self, n: int, ts: int) -> list[Block]:
        out = []
        for _ in range(n):
            b = self.free.popleft()
            if b.block_hash is not None:  # _maybe_evict_cached_block
                self.cached[b.block_hash].remove(b)
                if not self.cached[b.block_hash]:
                    del self.cached[b.block_hash]
                self.log.event(ts, self.replica, REMOVED, b.block_hash, -1, -1)
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def cache_block(self, b: Block, h: int, req: int, pos: int, ts: int) -> None:
        b.block_hash, b.req, b.pos = h, req, pos
        self.cached.setdefault(h, []).append(b)
        self.log.event(ts, self.replica, STORED, h, req, pos)

    def free_blocks(self, ordered: list[Block]) -> None:
        first, last = [], []
        for b in ordered:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (first if b.block_hash is None else last).append(b)
        self.free.prepend_n(first)
        self.free.append_n(last)


@dataclass
class Req:
    i: int
    arrival: int
    prompt: int
    out: int
    hashes: list[int]  # every full block of prompt + output
    n_prompt_full: int
    replica: int = -1
    state: int = WAITING
    num_tokens: int = 0
    computed: int = 0
    n_out: int = 0
    blocks: list[Block] = field(default_factory=list)
    n_cached_blocks: int = 0
    sched: int = -1
    first: int = -1
    end: int = -1
    cached: int = -1
    ext: int = 0
    preempted: int = 0
    moved: int = 0


class Replica:
    """sched/scheduler.Scheduler of one engine, with its kv_cache_manager.KVCacheManager."""

    def __init__(self, r: int, fleet: Fleet) -> None:
        self.r, self.fleet, self.cfg = r, fleet, fleet.cfg
        self.pool = BlockPool(self.cfg["gpu_blocks"], r, fleet)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.busy_until = -1
        self.batch: list[tuple[Req, int]] = []
        self.steps = 0

    # -- kv_cache_manager.get_computed_blocks / allocate_slots ------------------------------
    def lookup(self, q: Req) -> list[Block]:
        hits: list[Block] = []
        for h in q.hashes[: (q.num_tokens - 1) // self.cfg["block"]]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate(self, q: Req, n_new: int, hits: list[Block], ext: int, ts: int) -> bool:
        bs, free = self.cfg["block"], len(self.pool.free)
        new = q.state != RUNNING
        evictable = sum(b.ref_cnt == 0 for b in hits)
        if new and -(-q.num_tokens // bs) - len(hits) + evictable > free:  # full sequence must fit
            return False
        computed = q.computed + len(hits) * bs + ext
        need = -(-(computed + n_new) // bs)
        if max(need - len(q.blocks) - len(hits), 0) + evictable > free:
            return False
        if new:
            self.pool.touch(hits)
            q.blocks, q.n_cached_blocks = list(hits), len(hits)
        q.blocks += self.pool.get_new_blocks(need - len(q.blocks), ts)
        return True

    def cache_blocks(self, q: Req, n_full: int, ts: int) -> None:
        for pos in range(q.n_cached_blocks, n_full):
            self.pool.cache_block(q.blocks[pos], q.hashes[pos], q.i, pos, ts)
            if pos < q.n_prompt_full and pos >= q.n_cached_blocks:
                self.fleet.pool_write(q, pos, ts, self.r)
        q.n_cached_blocks = max(q.n_cached_blocks, n_full)

    def free(self, q: Req) -> None:
        self.pool.free_blocks(list(reversed(q.blocks)))
        q.blocks, q.n_cached_blocks = [], 0

    # -- scheduler.schedule ------------------------------------------------------------------
    def schedule(self, t: int) -> None:
        budget, batch, preempted = self.cfg["max_batched_tokens"], [], False
        idx = 0
        while idx < len(self.running) and budget > 0:
            q = self.running[idx]
            n_new = min(q.num_tokens - q.computed, budget)
            while not self.allocate(q, n_new, [], 0, t):
                victim = self.running.pop()
                self.preempt(victim)
                preempted = True
                if victim is q:
                    break
            else:
                self.cache_blocks(q, min(q.computed + n_new, q.num_tokens) // self.cfg["block"], t)
                batch.append((q, n_new, q.computed))
                budget -= n_new
                idx += 1
                continue
            break
        k = 0
        while not preempted and budget > 0 and self.waiting and len(self.running) < self.cfg["max_seqs"]:
            q = self.waiting[0]
            ts = t + k + 1
            hits = self.lookup(q)
            ext = self.fleet.pool_lookup(q, len(hits), ts, self.r)
            computed = len(hits) * self.cfg["block"] + ext * self.cfg["block"]
            n_new = min(q.num_tokens - computed, budget)
            if not self.allocate(q, n_new, hits, ext * self.cfg["block"], ts):
                break
            k += 1
            self.waiting.popleft()
            if q.sched < 0:
                q.sched, q.cached, q.ext = ts, computed, ext * self.cfg["block"]
            self.fleet.pool_commit(q, ts, self.r)
            self.cache_blocks(q, min(computed + n_new, q.num_tokens) // self.cfg["block"], ts)
            q.state, q.computed = RUNNING, computed
            self.running.append(q)
            batch.append((q, n_new, computed))
            budget -= n_new
        for q, n_new, _c in batch:
            q.computed += n_new
        self.batch = [(q, n) for q, n, _c in batch]
        self.steps += 1
        if batch:
            self.busy_until = t + step_ns(self.fleet.step, *self.step_shape(batch), k,
                                          self.fleet.take_load_tokens(self.r))
        elif self.running or self.waiting:
            self.busy_until = t + 1  # everything was preempted: the engine schedules again at once
        else:
            self.busy_until = -1

    def step_shape(self, batch: list[tuple[Req, int, int]]) -> tuple[int, int, int, int, int, int]:
        p = a = d = a_dec = ctx = n_pre = 0
        for q, n, c in batch:
            if n == 1 and c == q.num_tokens - 1:
                d, a_dec = d + 1, a_dec + 2 * c + 1
            else:
                p, a, n_pre = p + n, a + (c + n) ** 2 - c**2, n_pre + 1
            ctx += c + n
        return p, a, d, a_dec, ctx, n_pre

    def preempt(self, q: Req) -> None:
        self.free(q)
        q.state, q.computed = WAITING, 0
        q.preempted += 1
        self.waiting.appendleft(q)

    # -- scheduler.update_from_output --------------------------------------------------------
    def finish_step(self, t: int) -> None:
        for q, _n in self.batch:
            if q.computed < q.num_tokens:
                continue  # a prefill chunk: nothing sampled
            q.num_tokens += 1
            q.n_out += 1
            if q.first < 0:
                q.first = t
            if q.n_out >= q.out:
                q.end, q.state = t, DONE
                self.free(q)
                self.running.remove(q)
                self.fleet.inflight[self.r] -= 1
        self.batch = []


class Fleet:
    """N replicas, the router and the shared pool; the event loop of ``run_fleet``."""

    def __init__(self, cfg: dict[str, Any], step: np.ndarray) -> None:
        self.cfg, self.step = cfg, step
        self.events: list[tuple[int, int, int, int, int, int]] = []
        self.transfers: list[tuple[int, int, int, int, int, int]] = []  # req, ts, replica, origin, h, pos
        self.reps = [Replica(r, self) for r in range(cfg["replicas"])]
        self.inflight = [0] * cfg["replicas"]
        self.pool: OrderedDict[int, None] | None = OrderedDict() if cfg["pool_blocks"] > 0 else None
        self.pending_loads: list[tuple[Req, int, int]] = []
        self.load_tokens = [0] * cfg["replicas"]

    def event(self, ts: int, loc: int, kind: int, h: int, req: int, pos: int) -> None:
        self.events.append((ts, loc, kind, h, req, pos))

    def pool_lookup(self, q: Req, n_local: int, ts: int, r: int) -> int:
        """The chain continued in the pool after the local hit; a look-up touches what it finds."""
        self.pending_loads = []
        if self.pool is None:
            return 0
        n = 0
        for pos in range(n_local, (q.num_tokens - 1) // self.cfg["block"]):
            if q.hashes[pos] not in self.pool:
                break
            self.pool.move_to_end(q.hashes[pos])
            n += 1
        self.pending_loads = [(q, pos, ts) for pos in range(n_local, n_local + n)]
        return n

    def pool_commit(self, q: Req, ts: int, r: int) -> None:
        """The admitted request loads what its look-up found: a transfer per block."""
        for _q, pos, _ts in self.pending_loads:
            self.transfers.append((q.i, ts, r, -1, q.hashes[pos], pos))
            self.load_tokens[r] += self.cfg["block"]
        self.pending_loads = []

    def take_load_tokens(self, r: int) -> int:
        n, self.load_tokens[r] = self.load_tokens[r], 0
        return n

    def pool_write(self, q: Req, pos: int, ts: int, r: int) -> None:
        if self.pool is None or q.hashes[pos] in self.pool:
            return
        if len(self.pool) >= self.cfg["pool_blocks"]:
            old, _ = self.pool.popitem(last=False)
            self.event(ts, -1, REMOVED, old, -1, -1)
        self.pool[q.hashes[pos]] = None
        self.event(ts, -1, STORED, q.hashes[pos], q.i, pos)
        self.transfers.append((q.i, ts, -1, r, q.hashes[pos], pos))

    def route(self, q: Req, fixed: int) -> int:
        """cache_aware: the longest cached prefix, else (under threshold, overloaded) the least loaded."""
        if fixed >= 0:
            return fixed
        n = self.cfg["replicas"]
        loads = self.inflight
        least = min(range(n), key=lambda k: (loads[k], k))
        best, key = least, (-1, 0)
        prompt = q.hashes[: q.n_prompt_full]
        for r in range(n):
            m = 0
            for h in prompt:
                if h not in self.reps[r].pool.cached:
                    break
                m += 1
            if (m, -loads[r]) > key:
                best, key = r, (m, -loads[r])
        if not prompt or key[0] < self.cfg["cache_threshold"] * len(prompt):
            best = least
        mean = sum(loads) / n
        if self.cfg["load_factor"] > 0 and mean > 0 and loads[best] > self.cfg["load_factor"] * mean:
            q.moved = int(best != least)
            best = least
        return best

    def run(self, reqs: list[Req], fixed: list[int]) -> None:
        i = 0
        for _guard in range(10**9):
            busy = [(rep.busy_until, rep.r) for rep in self.reps if rep.busy_until >= 0]
            nxt = min(busy) if busy else None
            if i < len(reqs) and (nxt is None or reqs[i].arrival <= nxt[0]):
                q = reqs[i]
                q.num_tokens = q.prompt
                q.replica = self.route(q, fixed[i])
                self.inflight[q.replica] += 1
                rep = self.reps[q.replica]
                rep.waiting.append(q)
                if rep.busy_until < 0:
                    rep.schedule(q.arrival)
                i += 1
            elif nxt is not None:
                rep = self.reps[nxt[1]]
                rep.finish_step(nxt[0])
                rep.schedule(nxt[0])
            else:
                return
        raise AssertionError("the fleet did not drain")


def run_fleet_py(arrival: Any, order: Any, prompt: Any, out: Any, blk_off: Any, blk_h: Any,
                 n_prompt_full: Any, fixed: Any, cfg: dict[str, Any], step: np.ndarray) -> dict[str, Any]:
    reqs = [Req(i, int(arrival[i]), int(prompt[i]), int(out[i]),
                [int(h) for h in blk_h[blk_off[i]:blk_off[i + 1]]], int(n_prompt_full[i]))
            for i in range(len(arrival))]
    fleet = Fleet(cfg, step)
    fleet.run([reqs[int(k)] for k in order], [int(fixed[int(k)]) for k in order])
    cols = ("replica", "sched", "first", "end", "cached", "ext", "preempted", "moved")
    out_cols = {c: [getattr(q, c) for q in reqs] for c in cols}
    return {**out_cols, "events": fleet.events, "transfers": fleet.transfers,
            "steps": sum(r.steps for r in fleet.reps)}
