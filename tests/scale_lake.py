"""A generated fleet lake of any size, for the out-of-core test and benchmark (issue 17).

A fleet of ``replicas`` vLLM-like replicas, each with a FIFO prefix cache of ``capacity`` blocks,
serves requests that arrive every ``interval_ns``: each request is one of ``prefixes`` shared
prefixes (chosen by a Zipf law of exponent 1.1: a few hot system prompts and many cold ones; 8 to
64 blocks, the same for every request of the prefix) and 1 to 16 blocks of its own, plus a partial
block. 85% of the requests go to their prefix's home replica, the others to any replica (routing
misses). At a request's look-up its replica stores every block it does not hold (a KV ``stored``
event stamped at the look-up, as the simulator stamps them: the time rule) and evicts its oldest
blocks to make room (``removed``). The requests are the simulator's (``source = sim``).

Generated chunk by chunk (a compiled kernel keeps each replica's cache across chunks) and written
as one segment per table per chunk, so a lake of 100M block accesses is written with bounded
memory. Deterministic for a given seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from numba import njit, types
from numba.typed import Dict

from kvlens.analyzers.hashmap import mix64
from kvlens.lake import SegmentWriter

__all__ = ["ScaleFleet", "write_scale_lake"]

_BLOCK = 16  # tokens per block
_MAX_BLOCKS = 64 + 16  # a request's most full blocks


@dataclass(frozen=True)
class ScaleFleet:
    replicas: int = 16
    capacity: int = 40_000  # blocks per replica
    prefixes: int = 50_000
    interval_ns: int = 500_000  # 2,000 requests/s
    seed: int = 17
    start_ns: int = 1_700_000_000_000_000_000
    model: str = "llama-3.1-8b"


@njit(cache=True)
def _chunk(first, n_req, replicas, capacity, cdf, seed, resident, ring, ring_hash, head, filled,
           req_replica, req_blocks, blk_req, blk_pos, blk_hash,
           ev_req, ev_kind, ev_replica, ev_hash, ev_parent):
    """Requests ``first`` .. ``first + n_req - 1``: their replicas and blocks, and the events of
    their replicas' caches; (blocks, events) written."""
    nb = 0
    ne = 0
    golden = np.uint64(0x9E3779B97F4A7C15)
    for k in range(n_req):
        i = np.uint64(first + k)
        x = mix64(np.uint64(seed) * golden + i)
        p = np.int64(np.searchsorted(cdf, (x >> np.uint64(11)) * (1.0 / 9007199254740992.0)))
        plen = np.int64(8) + np.int64(mix64(np.uint64(p) * golden + np.uint64(7)) % np.uint64(57))
        y = mix64(x)
        ulen = np.int64(1) + np.int64(y % np.uint64(16))
        z = mix64(y)
        home = z % np.uint64(100) < np.uint64(85)
        r = p % np.int64(replicas) if home else np.int64(mix64(z) % np.uint64(replicas))
        req_replica[k] = r
        req_blocks[k] = plen + ulen
        parent = np.uint64(0)
        for j in range(plen + ulen):
            if j < plen:
                h = mix64(np.uint64(p) * np.uint64(1_000_003) + np.uint64(j + 1))
            else:
                h = mix64((np.uint64(1) << np.uint64(62)) | (i * np.uint64(128) + np.uint64(j)))
            blk_req[nb] = k
            blk_pos[nb] = j
            blk_hash[nb] = h
            nb += 1
            key = h ^ (np.uint64(r + 1) * golden)
            if key in resident:
                parent = h
                continue
            at = head[r]
            if filled[r] == capacity:  # the oldest block goes first
                del resident[ring[r, at]]
                ev_req[ne] = k
                ev_kind[ne] = 1
                ev_replica[ne] = r
                ev_hash[ne] = ring_hash[r, at]
                ev_parent[ne] = 0
                ne += 1
            else:
                filled[r] += 1
            ring[r, at] = key
            ring_hash[r, at] = h
            head[r] = (at + 1) % capacity
            resident[key] = np.int8(1)
            ev_req[ne] = k
            ev_kind[ne] = 0
            ev_replica[ne] = r
            ev_hash[ne] = h
            ev_parent[ne] = parent
            ne += 1
            parent = h
    return nb, ne


def write_scale_lake(lake: Path, accesses: int, *, fleet: ScaleFleet = ScaleFleet(), scenario: str = "scale",
                     chunk_requests: int = 50_000) -> tuple[int, int, int]:
    """Write ``scenario`` into ``lake`` with at least ``accesses`` needed full blocks (the requests
    that reach it); (requests, blocks, events) written."""
    ranks = np.arange(1, fleet.prefixes + 1, dtype=np.float64)
    weights = ranks ** -1.1
    cdf = np.cumsum(weights) / weights.sum()
    cdf[-1] = 1.0
    resident = Dict.empty(key_type=types.uint64, value_type=types.int8)
    ring = np.zeros((fleet.replicas, fleet.capacity), np.uint64)
    ring_hash = np.zeros((fleet.replicas, fleet.capacity), np.uint64)
    head = np.zeros(fleet.replicas, np.int64)
    filled = np.zeros(fleet.replicas, np.int64)
    names = pa.array([f"replica-{r}" for r in range(fleet.replicas)])
    kinds = pa.array(["stored", "removed"])
    writers = {t: SegmentWriter(lake, t, scenario=scenario, writer_id="scale", flush_rows=2**62)
               for t in ("requests", "request_blocks", "kv_events")}
    n_req = n_blk = n_ev = 0
    try:
        while n_blk < accesses:
            n = chunk_requests
            req_replica = np.zeros(n, np.int64)
            req_blocks = np.zeros(n, np.int64)
            blk_req, blk_pos = np.zeros(n * _MAX_BLOCKS, np.int64), np.zeros(n * _MAX_BLOCKS, np.int32)
            blk_hash = np.zeros(n * _MAX_BLOCKS, np.uint64)
            ev = (np.zeros(2 * n * _MAX_BLOCKS, np.int64), np.zeros(2 * n * _MAX_BLOCKS, np.int64),
                  np.zeros(2 * n * _MAX_BLOCKS, np.int64), np.zeros(2 * n * _MAX_BLOCKS, np.uint64),
                  np.zeros(2 * n * _MAX_BLOCKS, np.uint64))
            nb, ne = _chunk(n_req, n, fleet.replicas, fleet.capacity, cdf, fleet.seed, resident, ring,
                            ring_hash, head, filled, req_replica, req_blocks, blk_req, blk_pos, blk_hash, *ev)
            idx = np.arange(n_req, n_req + n)
            ids = pa.array([f"req-{i:010d}" for i in idx])
            arrival = fleet.start_ns + idx * fleet.interval_ns
            writers["requests"].append_arrow(pa.table({
                "request_id": ids, "arrival_ns": arrival, "replica": names.take(req_replica),
                "model": pa.array([fleet.model] * n),
                "prompt_tokens": (req_blocks * _BLOCK + 5).astype(np.int32),
                "queue_ms": np.zeros(n), "source": pa.array(["sim"] * n)}))
            writers["request_blocks"].append_arrow(pa.table({
                "request_id": ids.take(blk_req[:nb]), "arrival_ns": arrival[blk_req[:nb]],
                "position": blk_pos[:nb], "block_hash": blk_hash[:nb],
                "block_tokens": np.full(nb, _BLOCK, np.int32),
                "block_size_tokens": np.full(nb, _BLOCK, np.int32)}))
            ev_req, ev_kind, ev_replica, ev_hash, ev_parent = (a[:ne] for a in ev)
            writers["kv_events"].append_arrow(pa.table({
                "ts_ns": arrival[ev_req], "replica": names.take(ev_replica),
                "seq": (n_req + ev_req).astype(np.uint64),
                "kind": kinds.take(ev_kind), "block_hash": ev_hash,
                "parent_hash": pa.array(ev_parent, mask=ev_parent == 0),
                "block_tokens": np.full(ne, _BLOCK, np.int32),
                "medium": pa.array(["gpu"] * ne)}))
            for w in writers.values():
                w.flush()
            n_req, n_blk, n_ev = n_req + n, n_blk + nb, n_ev + ne
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    for w in writers.values():
        w.commit()
    return n_req, n_blk, n_ev
