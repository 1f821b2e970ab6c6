"""Analyzer: request_blocks (and kv_events) -> exact LRU reuse distances in blocks and bytes (table `reuse`).

Convention (the one every curve here relies on):

- An access stream is a sequence of (key, size_bytes, ts_ns). The reuse distance of an access
  to key ``k`` whose previous access was at index ``p`` is the LRU **stack depth** of ``k``:
  the distinct keys touched in the window ``(p, i]``, **counting ``k`` itself**. An immediate
  re-access has ``distance_blocks = 1``. So an LRU cache of ``C`` blocks hits exactly the
  accesses with ``distance_blocks <= C``, and an LRU cache of ``C`` bytes (variable sizes,
  evicting from the tail until the newcomer fits) hits exactly those with ``distance_bytes <= C``.
- ``distance_bytes`` sums each distinct key once, at the size of its most recent access before
  ``i``: what the cache holds of it, ``k`` included (at its previous size). When a block's size
  changes, the cache is taken to hold the last size it saw; the new size counts from access
  ``i`` on (for the blocks after it, and as the bytes that access reads). When every block
  keeps one size, a byte-capacity LRU hits exactly ``distance_bytes <= C`` for every ``C`` at
  least the largest block (a block larger than the cache bypasses a real LRU, while the stack
  model counts its bytes). When sizes change it is the stack model's reading: an LRU that
  evicted for a block's larger size does not refill when the block shrinks.
- A first access has no distance (``-1`` in the arrays; no row in the table).

The kernel is numba-compiled: keys are made dense by an open-addressing hash map, then a
Fenwick tree over access-time slots holds a 1 (and the size) at each key's latest access. The
tree has ``2·M`` slots for ``M`` distinct keys and is compacted (live slots renumbered in order)
when time runs past its end, so the work is O(N log M) and the memory O(M). When every access
has the same size (unit-size blocks, or all full blocks), a count-only int32 tree does the same
with a quarter of the memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numba
import numpy as np
import polars as pl

from kvlens import memory
from kvlens.analysis_db import settings
from kvlens.analyzers.hashmap import mix64 as _mix64
from kvlens.analyzers.state_blob import pack, still_counted, unpack
from kvlens.errors import ConfigError, NoDataError
from kvlens.schema import REUSE

__all__ = ["REUSE_STATE_TABLE", "AccessStream", "Distances", "ReuseState", "Reused", "StreamChunk",
           "StreamStack", "access_stream", "requests_read", "reuse", "reuse_continued", "reuse_distances",
           "reuse_out_of_core"]

log = logging.getLogger(__name__)

# Past this many rows the table keeps only the `requests` stream (the others are derived views).
MAX_REUSE_ROWS = 5_000_000
_REQUEST_ORDER = "arrival_ns, request_id, position"


@dataclass(frozen=True)
class Distances:
    """Per-access results, aligned with the input stream; -1 where an access is a first access."""

    blocks: np.ndarray  # int64, distinct keys in (prev, i], the key itself included
    bytes: np.ndarray  # int64, their bytes (see the module docstring for which size counts)
    prev: np.ndarray  # int64, index of the previous access to the same key, or -1

    @property
    def reaccess(self) -> np.ndarray:
        return self.prev >= 0


@numba.njit(cache=True)
def key_hashes(keys: np.ndarray, seed: np.uint64) -> np.ndarray:
    """Each key's SHARDS hash (``mix64(key ^ seed)``): a key is sampled at rate R below R·2^64."""
    out = np.empty(keys.shape[0], np.uint64)
    for i in range(keys.shape[0]):
        out[i] = _mix64(keys[i] ^ seed)
    return out


@numba.njit(cache=True)
def _keys_table(keys: np.ndarray) -> tuple[np.ndarray, int, np.ndarray, np.uint64]:
    """Dense ids 0..M-1 in order of first appearance, via a growing open-addressing table: (ids,
    M, the table, its mask). Each table entry is (key, id + 1) side by side, so a probe costs one
    cache line."""
    n = keys.shape[0]
    bits = 16
    table = np.zeros((1 << bits, 2), np.uint64)
    mask = np.uint64((1 << bits) - 1)
    ids = np.empty(n, np.int64)
    m = 0
    for i in range(n):
        if 2 * (m + 1) > (1 << bits):
            bits += 1
            grown = np.zeros((1 << bits, 2), np.uint64)
            mask = np.uint64((1 << bits) - 1)
            for j in range(table.shape[0]):
                if table[j, 1] != 0:
                    h = _mix64(table[j, 0]) & mask
                    while grown[h, 1] != 0:
                        h = (h + np.uint64(1)) & mask
                    grown[h, 0] = table[j, 0]
                    grown[h, 1] = table[j, 1]
            table = grown
        k = keys[i]
        h = _mix64(k) & mask
        while table[h, 1] != 0 and table[h, 0] != k:
            h = (h + np.uint64(1)) & mask
        if table[h, 1] == 0:
            m += 1
            table[h, 0] = k
            table[h, 1] = np.uint64(m)
        ids[i] = np.int64(table[h, 1]) - 1
    return ids, m, table, mask


@numba.njit(cache=True)
def _factorize(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense ids 0..M-1 in order of first appearance."""
    ids, m, _, _ = _keys_table(keys)
    return ids, m


_FILTER_SEED = np.uint64(0x9E3779B97F4A7C15)  # _factorize_after's filter: another hash than the table's


@numba.njit(cache=True)
def _factorize_after(keys: np.ndarray, head: int) -> tuple[np.ndarray, int]:
    """Dense ids 0..M-1 of a stream whose first ``head`` keys are distinct (an LRU stack replayed
    before the accesses that follow it: ``_resumed``). Only the keys after the head enter the
    table; a head key is looked up in it, and one that no later access names gets an id of its own
    without entering it. A stream's stack holds every key it ever saw, so it grows with the lake's
    age while the accesses after it do not: the table stays their size (on the whole sample
    trace's 6th increment, the fleet stream's 148k-key stack before 100k accesses). The ids are
    not in order of first appearance; the distance kernels need none."""
    ids_after, m, table, mask = _keys_table(keys[head:])
    ids = np.empty(keys.shape[0], np.int64)
    ids[head:] = ids_after
    # Most head keys are named by no later access: a filter of 32 bits per later key, a few hundred
    # kB, answers most of them from the cache, where a probe of the table misses it (824k stack
    # keys before 100k accesses, the events stream of the whole sample trace's 6th increment: 20.6 ms
    # without it, 6.4 ms with it, measured here).
    n_tail = keys.shape[0] - head
    fbits = 64
    while fbits < 32 * n_tail:
        fbits *= 2
    fmask = np.uint64(fbits - 1)
    seen = np.zeros(fbits // 64, np.uint64)
    for i in range(head, keys.shape[0]):
        b = _mix64(keys[i] ^ _FILTER_SEED) & fmask
        seen[b >> np.uint64(6)] |= np.uint64(1) << (b & np.uint64(63))
    for i in range(head):
        k = keys[i]
        b = _mix64(k ^ _FILTER_SEED) & fmask
        if (seen[b >> np.uint64(6)] >> (b & np.uint64(63))) & np.uint64(1) == 0:
            ids[i] = m  # named by no later access
            m += 1
            continue
        h = _mix64(k) & mask
        while table[h, 1] != 0 and table[h, 0] != k:
            h = (h + np.uint64(1)) & mask
        if table[h, 1] != 0:
            ids[i] = np.int64(table[h, 1]) - 1
        else:
            ids[i] = m
            m += 1
    return ids, m


# The Fenwick tree is one (T, 2) int64 array: column 0 counts live keys, column 1 their bytes,
# side by side so one node is one cache access. Per-key state is one (M, 4) array:
# [slot of the latest access or -1, index of the latest access, size at it, unused].
_SLOT, _LAST, _SIZE = 0, 1, 2


@numba.njit(cache=True, inline="always")
def _fw_add(tree: np.ndarray, slot: int, dc: int, db: int) -> None:
    j = slot + 1
    t = tree.shape[0]
    while j <= t:
        tree[j - 1, 0] += dc
        tree[j - 1, 1] += db
        j += j & -j


@numba.njit(cache=True, inline="always")
def _fw_prefix(tree: np.ndarray, slot: int) -> tuple[int, int]:
    """Sums over slots 0..slot inclusive."""
    c = 0
    b = 0
    j = slot + 1
    while j > 0:
        c += tree[j - 1, 0]
        b += tree[j - 1, 1]
        j -= j & -j
    return c, b


@numba.njit(cache=True)
def _fw_compact(tree: np.ndarray, slot_key: np.ndarray, state: np.ndarray) -> int:
    """Renumber live slots 0..L-1 in time order, rebuild the tree in O(T); returns L."""
    t = tree.shape[0]
    live = 0
    for j in range(t):
        k = slot_key[j]
        if k >= 0 and state[k, _SLOT] == j:
            slot_key[live] = k
            state[k, _SLOT] = live
            live += 1
    tree[:] = 0
    slot_key[live:] = -1
    for j in range(t):
        if j < live:
            tree[j, 0] += 1
            tree[j, 1] += state[slot_key[j], _SIZE]
        parent = j + ((j + 1) & -(j + 1))  # linear-time build: push each node into its parent
        if parent < t:
            tree[parent, 0] += tree[j, 0]
            tree[parent, 1] += tree[j, 1]
    return live


@numba.njit(cache=True, inline="always")
def _stack_take(tree: np.ndarray, slot_key: np.ndarray, slot: int, size: int) -> None:
    """Take the block at ``slot`` (of ``size`` bytes) out of the LRU stack."""
    _fw_add(tree, slot, -1, -size)
    slot_key[slot] = -1


@numba.njit(cache=True, inline="always")
def _stack_push(tree: np.ndarray, slot_key: np.ndarray, state: np.ndarray, k: int, size: int,
                nxt: int) -> int:
    """Put block ``k`` on top of the LRU stack at slot ``nxt`` (compacting when full); next free slot."""
    if nxt == tree.shape[0]:
        nxt = _fw_compact(tree, slot_key, state)
    _fw_add(tree, nxt, 1, size)
    state[k, _SLOT] = nxt
    state[k, _SIZE] = size
    slot_key[nxt] = k
    return nxt + 1


@numba.njit(cache=True)
def _stack_kernel(ids: np.ndarray, sizes: np.ndarray, tree: np.ndarray, slot_key: np.ndarray,
                  state: np.ndarray, d_blocks: np.ndarray, d_bytes: np.ndarray, prev: np.ndarray,
                  head: int) -> None:
    """Distances of ``ids`` (each access's bytes in ``sizes``), whose first ``head`` keys are
    distinct: a replayed stack (``reuse_distances``' ``distinct_head``), its tree built at once."""
    n = ids.shape[0]
    t = tree.shape[0]
    live_b = 0
    for i in range(head):
        k = ids[i]
        state[k, _SLOT] = i
        state[k, _LAST] = i
        state[k, _SIZE] = sizes[i]
        slot_key[i] = k
        live_b += sizes[i]
    for j in range(t):  # the tree of those slots in O(T), as _fw_compact builds it
        if j < head:
            tree[j, 0] += 1
            tree[j, 1] += sizes[j]
        parent = j + ((j + 1) & -(j + 1))
        if parent < t:
            tree[parent, 0] += tree[j, 0]
            tree[parent, 1] += tree[j, 1]
    live_c = head
    nxt = head
    for i in range(head, n):
        k = ids[i]
        s = sizes[i]
        p = state[k, _SLOT]
        if p >= 0:
            old = state[k, _SIZE]
            c, b = _fw_prefix(tree, p)
            d_blocks[i] = live_c - c + 1
            d_bytes[i] = live_b - b + old
            prev[i] = state[k, _LAST]
            _stack_take(tree, slot_key, p, old)
            live_c -= 1
            live_b -= old
        nxt = _stack_push(tree, slot_key, state, k, s, nxt)
        state[k, _LAST] = i
        live_c += 1
        live_b += s


@numba.njit(cache=True)
def _uniform_kernel(ids: np.ndarray, tree: np.ndarray, slot_key: np.ndarray, slot_of: np.ndarray,
                    last_i: np.ndarray, d_blocks: np.ndarray, prev: np.ndarray, head: int) -> None:
    """Every access the same size: a count-only int32 tree, a quarter of the memory traffic. The
    first ``head`` keys are distinct, as in ``_stack_kernel``."""
    t = tree.shape[0]
    for i in range(head):
        k = ids[i]
        slot_of[k] = i
        last_i[k] = i
        slot_key[i] = k
    for j in range(t):
        if j < head:
            tree[j] += 1
        parent = j + ((j + 1) & -(j + 1))
        if parent < t:
            tree[parent] += tree[j]
    _uniform_steps(ids, tree, slot_key, slot_of, last_i, d_blocks, prev, head, 0, head, head)


@numba.njit(cache=True)
def _uniform_steps(ids: np.ndarray, tree: np.ndarray, slot_key: np.ndarray, slot_of: np.ndarray,
                   last_i: np.ndarray, d_blocks: np.ndarray, prev: np.ndarray, start: int, offset: int,
                   live: int, nxt: int) -> tuple[int, int]:
    """``_uniform_kernel``'s accesses ``ids[start:]`` on its stack (``live`` keys on it, ``nxt``
    its next free slot), access ``i`` counted as the stream's ``offset + i`` (in ``last_i`` and
    ``prev``); the stack's (live, nxt) after them, so that a stream read in chunks goes on."""
    t = tree.shape[0]
    for i in range(start, ids.shape[0]):
        k = ids[i]
        p = slot_of[k]
        if p >= 0:
            c = 0
            j = p + 1
            while j > 0:
                c += tree[j - 1]
                j -= j & -j
            d_blocks[i] = live - c + 1
            prev[i] = last_i[k]
            j = p + 1
            while j <= t:
                tree[j - 1] -= 1
                j += j & -j
            live -= 1
            slot_key[p] = -1
        if nxt == t:
            nxt = 0
            for j in range(t):
                kk = slot_key[j]
                if kk >= 0 and slot_of[kk] == j:
                    slot_key[nxt] = kk
                    slot_of[kk] = nxt
                    nxt += 1
            slot_key[nxt:] = -1
            tree[:] = 0
            for j in range(t):
                if j < nxt:
                    tree[j] += 1
                parent = j + ((j + 1) & -(j + 1))
                if parent < t:
                    tree[parent] += tree[j]
        j = nxt + 1
        while j <= t:
            tree[j - 1] += 1
            j += j & -j
        slot_of[k] = nxt
        last_i[k] = offset + i
        slot_key[nxt] = k
        live += 1
        nxt += 1
    return live, nxt


def _uniform_distances(ids: np.ndarray, size: int, n_keys: int,
                       head: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = max(2 * n_keys, 64)
    d_blocks = np.full(ids.shape[0], -1, np.int64)
    prev = np.full(ids.shape[0], -1, np.int64)
    _uniform_kernel(ids, np.zeros(t, np.int32), np.full(t, -1, np.int32), np.full(n_keys, -1, np.int32),
                    np.zeros(n_keys, np.int64), d_blocks, prev, head)
    d_bytes = np.where(d_blocks >= 0, d_blocks * size, -1)
    return d_blocks, d_bytes, prev


def _stack_distances(ids: np.ndarray, sizes: np.ndarray, n_keys: int, head: int = 0
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Allocated by NumPy, not inside the kernel: NumPy asks the kernel for transparent huge pages
    # on large arrays, and the random walks over the tree and key state are TLB-bound without them.
    n = ids.shape[0]
    t = max(2 * n_keys, 64)
    tree = np.zeros((t, 2), np.int64)
    slot_key = np.full(t, -1, np.int64)
    state = np.zeros((n_keys, 4), np.int64)
    state[:, _SLOT] = -1
    d_blocks = np.full(n, -1, np.int64)
    d_bytes = np.full(n, -1, np.int64)
    prev = np.full(n, -1, np.int64)
    _stack_kernel(ids, sizes, tree, slot_key, state, d_blocks, d_bytes, prev, head)
    return d_blocks, d_bytes, prev


def reuse_distances(keys: np.ndarray, sizes: np.ndarray | int = 1, *, distinct_head: int = 0) -> Distances:
    """Exact stack distances of an access stream (see the module docstring for the convention).

    ``keys``: uint64-convertible array; ``sizes``: per-access bytes (an int means every access).
    ``distinct_head``: how many of the first keys are known distinct (a replayed stack: see
    ``_factorize_after``); the distances are the same, found with a smaller key table.
    """
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    sizes_arr = (np.full(keys.shape[0], sizes, np.int64) if np.isscalar(sizes)
                 else np.ascontiguousarray(sizes, dtype=np.int64))
    if sizes_arr.shape != keys.shape:
        raise ValueError(f"sizes has shape {sizes_arr.shape}, keys {keys.shape}")
    if keys.shape[0] == 0:
        empty = np.empty(0, np.int64)
        return Distances(empty, empty, empty)
    ids, m = _factorize_after(keys, distinct_head) if distinct_head > 0 else _factorize(keys)
    if m < 2**30 and sizes_arr.min() == sizes_arr.max():
        blocks, byts, prev = _uniform_distances(ids, int(sizes_arr[0]), m, distinct_head)
    else:
        blocks, byts, prev = _stack_distances(ids, sizes_arr, m, distinct_head)
    return Distances(blocks, byts, prev)


# -- streams -----------------------------------------------------------------------------------


# A full block: as many tokens as the cache's block size (a row without a block size counts as full).
_FULL_BLOCK = "block_tokens IS NOT NULL AND block_tokens = coalesce(block_size_tokens, block_tokens)"


def request_stream(request_blocks: duckdb.DuckDBPyRelation,
                   requests: duckdb.DuckDBPyRelation | None = None,
                   since_ns: int | None = None) -> pl.DataFrame:
    """The `requests` stream: ts_ns, position, block_hash, block_tokens, replica, in access order.

    The prefix-cache stream: the **full** blocks of the scenario's request_blocks only. A partial
    tail is never cached by an engine (vLLM's ``KVCacheManager`` hashes and caches full blocks
    only: ``vllm/v1/core/kv_cache_utils.py`` ``get_request_block_hasher`` stops at the last full
    block, "We only hash full blocks"), so it never enters a cache, a reuse distance or a curve.
    Order: arrival_ns, then request_id (ties in arrival keep a stable order), then position.
    ``since_ns``: only the accesses that arrived from then on (and those without an arrival time),
    and only their requests' replicas are read.
    """
    full = request_blocks.filter(_FULL_BLOCK)
    if since_ns is None:
        return _stream_rows(full, requests)
    recent = f"arrival_ns >= {int(since_ns)} OR arrival_ns IS NULL"
    return _stream_rows(full.filter(recent), requests.filter(recent) if requests is not None else None)


def _stream_rows(full: duckdb.DuckDBPyRelation, requests: duckdb.DuckDBPyRelation | None) -> pl.DataFrame:
    rb = full.project("request_id, arrival_ns, position, block_hash, block_tokens").order(_REQUEST_ORDER)
    frame = rb.pl()
    if requests is not None and frame.height:
        reps = requests.project("request_id, replica").pl()
        frame = frame.join(reps.unique("request_id"), on="request_id", how="left", maintain_order="left")
    else:
        frame = frame.with_columns(replica=pl.lit(None, pl.String))
    # The request id ordered the stream and found each access's replica; no reader needs it after
    # (a saved state keeps the stream before its checkpoint: without the ids, the steady lake's 5th
    # reuse state is 0.59 MB instead of 0.68, and is written and read in 18 ms instead of 26).
    return frame.drop("request_id").rename({"arrival_ns": "ts_ns"})


def _rows_at(stream: str, keys: np.ndarray, ts: pl.Series, d: Distances, at: np.ndarray) -> pl.DataFrame:
    """Rows of table `reuse` for the re-accesses ``at`` (indices into the stream). ``ts``: Int64,
    NULL for an event stamped without a time (it sorts last; its time and interval are NULL)."""
    when = ts.cast(pl.Int64).gather(at)
    return pl.DataFrame({
        "block_hash": pl.Series(keys[at], dtype=pl.UInt64),
        "ts_ns": when,
        "distance_blocks": d.blocks[at],
        "distance_bytes": d.bytes[at],
        "interval_ns": when - ts.cast(pl.Int64).gather(d.prev[at]),
    }).select(pl.lit(stream, pl.String).alias("stream"), pl.all())  # typed even with no re-access


def _reaccesses(d: Distances, start: int = 0) -> np.ndarray:
    return np.flatnonzero(d.prev[start:] >= 0) + start


# One stored event carries a chain of blocks (one row each, the same ts_ns, replica and seq): they
# are stored in chain order, so position breaks the tie, and the rest makes the order total (a
# sort is not stable: without them two analyses of one lake could order a chain differently).
_EVENT_ORDER = "ts_ns, replica, seq, position NULLS FIRST, block_hash, medium, block_tokens NULLS FIRST"
_STORED = "kind = 'stored' AND block_hash IS NOT NULL"


def _stored_events(kv_events: duckdb.DuckDBPyRelation, since_ns: int | None = None) -> pl.DataFrame:
    """The stored events with a block hash (from ``since_ns`` on, and the unstamped ones, when given),
    in stream order; block_tokens as the lake has it (NULL where unknown: ``_filled``)."""
    where = _STORED if since_ns is None else f"{_STORED} AND (ts_ns >= {int(since_ns)} OR ts_ns IS NULL)"
    ev = kv_events.filter(where).project(
        "ts_ns, seq, replica, CAST(medium AS VARCHAR) AS medium, block_hash, block_tokens, position"
    ).order(_EVENT_ORDER)
    return ev.pl()  # typed and empty when the scenario has no events (a raw trace import)


def _token_counts(ev: pl.DataFrame) -> pl.DataFrame:
    """block_tokens, count: how many of ``ev`` have each known size."""
    known = ev.select(pl.col("block_tokens").cast(pl.Int64)).drop_nulls()
    return known.group_by("block_tokens").len("count").cast({"count": pl.Int64})


def _fill_tokens(counts: pl.DataFrame) -> int:
    """The size an event without block_tokens is given: the most frequent known one (the smallest
    of equally frequent ones), 0 when none is known."""
    if counts.height == 0:
        return 0
    top = counts.group_by("block_tokens").agg(pl.col("count").sum())
    modes = top.filter(pl.col("count") == pl.col("count").max())
    return int(modes.select(pl.col("block_tokens").min()).item())


def _resumed(name: str, prior: pl.DataFrame | None, keys: np.ndarray, sizes: np.ndarray, ts: pl.Series,
             cut_ns: int | None) -> tuple[pl.DataFrame, pl.DataFrame | None]:
    """One stream's rows for accesses (``keys``, ``sizes``, ``ts``, in stream order) that follow
    ``prior`` (the stream's LRU stack before them: its keys in last-access order, with the size and
    time of that access), and the stack before ``cut_ns`` (None without one).

    An LRU stack is the order of its keys' last accesses and their sizes there, nothing more: the
    prior replayed as one access per key, in that order, leaves the stack the whole history left,
    so every later access gets the distance (blocks and bytes) and interval it gets in a replay of
    the whole stream. The prior's own accesses are first accesses here and give no row."""
    keys, sizes, ts, d, m = _replayed(prior, keys, sizes, ts)
    rows = _rows_at(name, keys, ts, d, _reaccesses(d, m))
    if cut_ns is None:
        return rows, None
    # in stream order, so the accesses before the cut come first (unstamped ones sort last)
    settled = m + int((ts.slice(m) < cut_ns).sum())
    return rows, _last_accesses(keys, sizes, ts, d.prev, settled)


def _replayed(prior: pl.DataFrame | None, keys: np.ndarray, sizes: np.ndarray, ts: pl.Series
              ) -> tuple[np.ndarray, np.ndarray, pl.Series, Distances, int]:
    """The stack ``prior`` (block_hash, size, ts_ns; None: none) replayed before the accesses
    (``keys``, ``sizes``, ``ts``): their keys, sizes and times after it, the distances of them all,
    and how many the stack put first."""
    m = 0 if prior is None else prior.height
    if m:
        assert prior is not None
        keys = np.concatenate([prior["block_hash"].to_numpy(), keys])
        sizes = np.concatenate([prior["size"].to_numpy(), sizes])
        ts = pl.concat([prior["ts_ns"].cast(pl.Int64), ts.cast(pl.Int64)])
    return keys, sizes, ts, reuse_distances(keys, sizes, distinct_head=m), m


def _last_accesses(keys: np.ndarray, sizes: np.ndarray, ts: pl.Series, prev: np.ndarray,
                   n: int) -> pl.DataFrame:
    """block_hash, size, ts_ns: each key of the first ``n`` accesses once, at its last access among
    them, in the order of those. ``prev``: each access's previous access to its key
    (``Distances.prev``): an access is a key's last unless a later one of the ``n`` names it (no
    sort of the keys: a stream's keys grow with the lake's age)."""
    later = prev[:n]
    last = np.ones(n, bool)
    last[later[later >= 0]] = False
    last = np.flatnonzero(last)
    return pl.DataFrame({"block_hash": pl.Series(keys[last], dtype=pl.UInt64),
                         "size": pl.Series(sizes[last], dtype=pl.Int64),
                         "ts_ns": ts.cast(pl.Int64).gather(last)})


@dataclass(frozen=True)
class Summary:
    """What the `requests` stream's curves and TTL table keep of its accesses before a checkpoint
    when every access has one size (analyzers/stream_summary.py says why it is exact): beside the
    stream's stack in the reuse state."""

    tokens: int  # every access's block_tokens
    size: int  # and bytes
    accesses: int  # the accesses before the checkpoint
    first_ns: int | None  # the first one's time (None: none yet)
    exact: np.ndarray  # int64: their re-accesses per distance in blocks (the index)
    sampled: np.ndarray  # int64: the same in the SHARDS sample at ``rate`` (empty without one)
    sampled_accesses: int
    rate: float | None
    ttls_ns: tuple[int, ...]
    # per TTL: re-accesses covered; byte-nanoseconds (exact), latest end, peak of the settled residencies
    covered: tuple[int, ...]
    held: tuple[int, ...]
    last_stop: tuple[int, ...]
    peak: tuple[int, ...]

    def head(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "size": self.size, "accesses": self.accesses,
                "first_ns": self.first_ns,
                "sampled_accesses": self.sampled_accesses, "rate": self.rate, "ttls_ns": list(self.ttls_ns),
                "covered": list(self.covered), "held": [str(h) for h in self.held],
                "last_stop": list(self.last_stop), "peak": list(self.peak)}

    @classmethod
    def of(cls, head: dict[str, Any], exact: pl.DataFrame, sampled: pl.DataFrame) -> Summary:
        def ints(key: str) -> tuple[int, ...]:
            return tuple(int(x) for x in head[key])  # (``held`` is written as text: past 64 bits)
        return cls(int(head["tokens"]), int(head["size"]), int(head["accesses"]),
                   None if head["first_ns"] is None else int(head["first_ns"]),
                   exact["n"].to_numpy().astype(np.int64), sampled["n"].to_numpy().astype(np.int64),
                   int(head["sampled_accesses"]), None if head["rate"] is None else float(head["rate"]),
                   ints("ttls_ns"), ints("covered"), ints("held"), ints("last_stop"), ints("peak"))


@dataclass(frozen=True)
class AccessStream:
    """A scenario's `requests` stream with its exact reuse distances: built once, read by reuse,
    mrc and ttl_coverage. Either the whole stream, or (``stack`` given: continued from a reuse
    state) its accesses from ``since`` on, whose distances follow the stream's LRU stack there
    (each key once, at its last access before it), replayed first."""

    frame: pl.DataFrame  # request_stream's columns, in access order
    sizes: np.ndarray  # int64 bytes per access of ``frame``
    distances: Distances  # of the stack's keys, then ``frame``'s accesses
    stack: pl.DataFrame | None = None  # block_hash, size, ts_ns: the stack at ``since``
    summary: Summary | None = None  # what the curves keep of the accesses before ``since``
    since: int | None = None

    @property
    def head(self) -> int:
        """Accesses of the stack replayed before ``frame``'s (0: the stream is whole)."""
        return 0 if self.stack is None else self.stack.height

    @property
    def before(self) -> int:
        """The stream's accesses before ``frame``'s first."""
        return 0 if self.summary is None else self.summary.accesses

    def keys(self) -> np.ndarray:
        """Block hashes (uint64) of the stack's accesses, then ``frame``'s."""
        keys = self.frame["block_hash"].to_numpy()
        return keys if self.stack is None else np.concatenate([self.stack["block_hash"].to_numpy(), keys])

    def times(self) -> np.ndarray:
        """Their times (int64; a whole stream's access without one: use ``frame``)."""
        ts = self.frame["ts_ns"].cast(pl.Int64).to_numpy()
        return ts if self.stack is None else np.concatenate([self.stack["ts_ns"].to_numpy(), ts])

    def ts_series(self) -> pl.Series:
        ts = self.frame["ts_ns"].cast(pl.Int64)
        return ts if self.stack is None else pl.concat([self.stack["ts_ns"].cast(pl.Int64), ts])


def access_stream(request_blocks: duckdb.DuckDBPyRelation, scenario: str, bytes_per_token: int,
                  requests: duckdb.DuckDBPyRelation | None = None,
                  prior: ReuseState | None = None, unchanged_before: int | None = None) -> AccessStream:
    """The `requests` stream of ``scenario``'s rows and its distances; NoDataError when it is empty.

    ``prior``: a saved reuse state. When it kept the stream's stack and summary (every access of
    one size), the lake still holds as many accesses before its checkpoint (no row before a
    checkpoint can arrive later: ``kvlens analyze`` rebuilds on a late segment; with
    ``unchanged_before`` at or after the checkpoint, a time before which the lake holds the rows it
    held when the state was saved (analyzers/incremental.py ``new_rows_from``), that count is not
    read again), and the newer accesses are stamped and of that size too, only those are read and
    the stack is replayed before them. Otherwise the stream is read whole."""
    since = prior.checkpoint_ns if prior is not None else None
    if (prior is not None and prior.summary is not None and requests is not None
            and prior.bytes_per_token == bytes_per_token
            and (still_counted(unchanged_before, prior.checkpoint_ns)
                 or request_blocks.filter(f"({_FULL_BLOCK}) AND arrival_ns < {int(prior.checkpoint_ns)}")
                 .aggregate("count(*)").fetchall() == [(prior.summary.accesses,)])):
        rs = request_stream(request_blocks, requests, since)
        tokens = rs["block_tokens"]
        one_size = rs.height == 0 or tokens.min() == tokens.max() == prior.summary.tokens
        if one_size and not rs["ts_ns"].null_count():
            stack = prior.by_stream().get("requests", prior.stacks.clear())
            if stack.height + rs.height == 0:
                raise _no_stream(scenario)
            sizes = tokens.to_numpy().astype(np.int64) * bytes_per_token
            keys = np.concatenate([stack["block_hash"].to_numpy(), rs["block_hash"].to_numpy()])
            d = reuse_distances(keys, prior.summary.size, distinct_head=stack.height)
            return AccessStream(rs, sizes, d, stack, prior.summary, since)
    rs = request_stream(request_blocks, requests)
    if rs.height == 0:
        raise _no_stream(scenario)
    sizes = rs["block_tokens"].to_numpy().astype(np.int64) * bytes_per_token
    return AccessStream(rs, sizes, reuse_distances(rs["block_hash"].to_numpy(), sizes))


def _no_stream(scenario: str) -> NoDataError:
    return NoDataError(f"scenario {scenario!r} has no request_blocks rows: import a trace into it first")


def reuse(*, request_blocks: duckdb.DuckDBPyRelation, kv_events: duckdb.DuckDBPyRelation | None = None,
          bytes_per_token: int, scenario: str, requests: duckdb.DuckDBPyRelation | None = None,
          stream: AccessStream | None = None) -> pl.DataFrame:
    """Rows of table `reuse`: one per re-access, per stream, sorted by stream, ts_ns, block_hash.

    Columns: scenario, stream, block_hash, ts_ns, distance_blocks, distance_bytes (block bytes =
    block_tokens × bytes_per_token), interval_ns. Streams:

    - ``requests``: every full block of the scenario's request_blocks in arrival order, then
      position (partial tails are never cached: see ``request_stream``). A shared pool
      (``fleet``) sees exactly this stream, so it is not written twice.
    - ``replica:<name>``: the requests served by one replica (needs ``requests`` for the replica).
    - ``group:<root hash>``: each re-access of a prefix group (the chain root, position 0): its
      distance in the ``requests`` stream, i.e. the bytes an LRU would have to hold to keep it.
    - from ``kv_events`` (stored rows only): ``fleet`` (every replica's stores, what a pool fed by
      all publishes sees) and ``replica:<name>/<medium>`` (what each replica's tier stored again:
      a re-store is a block recomputed after eviction, its distance what would have kept it). An
      event without block_tokens counts the most frequent size of the others.

    Past MAX_REUSE_ROWS rows only the ``requests`` stream is kept (logged). ``stream``: the
    scenario's access stream when the caller already built it (with ``requests`` for replicas).
    """
    acc = stream or access_stream(request_blocks, scenario, bytes_per_token, requests)
    return reuse_continued(kv_events=kv_events, bytes_per_token=bytes_per_token, scenario=scenario,
                           stream=acc).frame


REUSE_STATE_TABLE = "kvlens_reuse"  # a scenario's ReuseState, in the analysis DB beside its rows


@dataclass(frozen=True)
class ReuseState:
    """reuse at checkpoint ``checkpoint_ns``: what the streams before it leave to the rows after it.

    No access stamped before the checkpoint can still arrive (``kvlens analyze`` rebuilds on a late
    segment), so every row before it is final and stays in the analysis DB; the next run replaces
    the rows from the checkpoint on. Every replica and event stream keeps its LRU stack
    (``_resumed``), the ``requests`` stream too when every access has one size, with what mrc and
    ttl_coverage keep of its accesses before the checkpoint (``summary``,
    analyzers/stream_summary.py): the next run reads only the newer ones from the lake. (A stream
    of several sizes keeps neither and is read whole again.)"""

    checkpoint_ns: int
    bytes_per_token: int
    accesses: int  # `requests`-stream accesses stamped before the checkpoint
    events: int  # stored events with a block hash stamped before it
    unfilled: int  # of those, the ones without block_tokens (their size is ``fill_tokens``)
    fill_tokens: int
    tokens: pl.DataFrame  # block_tokens, count: the known sizes of those events
    # block_hash, size, ts_ns: each stream's stack in last-access order, one stream after another
    # (``streams``: their names and lengths; a column naming each row's stream was a third of the
    # time to write and half the time to read the whole sample trace's 5th state, 683k rows)
    stacks: pl.DataFrame
    roots: pl.DataFrame  # block_hash: the chain roots (position 0) of the whole stream when saved
    streams: tuple[tuple[str, int], ...] = ()  # (stream, its stack's rows), in the order of ``stacks``
    kept_rows: int = 0  # read back with the rows of table reuse before the checkpoint (not saved)
    summary: Summary | None = None  # the `requests` stream's, beside its stack (stream ``requests``)

    def __post_init__(self) -> None:
        names = [name for name, _ in self.streams]
        if len(set(names)) != len(names) or sum(n for _, n in self.streams) != self.stacks.height \
                or any(n < 0 for _, n in self.streams):
            raise ValueError(f"the stacks' {self.stacks.height} rows are not those of streams {self.streams}")

    def to_bytes(self) -> bytes:
        frames = {"tokens": self.tokens, "stacks": self.stacks, "roots": self.roots}
        head: dict[str, object] = {
            "checkpoint_ns": self.checkpoint_ns, "bytes_per_token": self.bytes_per_token,
            "accesses": self.accesses, "events": self.events, "unfilled": self.unfilled,
            "fill_tokens": self.fill_tokens, "streams": [list(s) for s in self.streams], "summary": None}
        if self.summary is not None:
            head["summary"] = self.summary.head()
            frames["exact"] = pl.DataFrame({"n": self.summary.exact}, schema={"n": pl.Int64})
            frames["sampled"] = pl.DataFrame({"n": self.summary.sampled}, schema={"n": pl.Int64})
        return pack(head, frames)

    @classmethod
    def from_bytes(cls, data: bytes) -> ReuseState:
        head, frames = unpack(data)
        summary = None if head["summary"] is None else Summary.of(head["summary"], frames["exact"],
                                                                    frames["sampled"])
        return cls(int(head["checkpoint_ns"]), int(head["bytes_per_token"]), int(head["accesses"]),
                   int(head["events"]), int(head["unfilled"]), int(head["fill_tokens"]), frames["tokens"],
                   frames["stacks"], frames["roots"],
                   tuple((str(name), int(n)) for name, n in head["streams"]), summary=summary)

    def with_requests(self, stack: pl.DataFrame | None, summary: Summary | None) -> ReuseState:
        """This state with the `requests` stream's stack and summary at its checkpoint (None: the
        stream has several sizes, and keeps neither)."""
        streams = [(name, n) for name, n in self.streams if name != "requests"]
        kept = self.by_stream()
        frames = [kept[name] for name, _ in streams]
        if stack is not None and summary is not None and stack.height:
            streams.append(("requests", stack.height))
            frames.append(stack.cast(self.stacks.schema))
        stacks = pl.concat(frames) if frames else self.stacks.clear()
        return dataclasses.replace(self, stacks=stacks, streams=tuple(streams),
                                   summary=summary if stack is not None else None)

    def by_stream(self) -> dict[str, pl.DataFrame]:
        """Each stream's stack (block_hash, size, ts_ns), by name."""
        starts = itertools.accumulate((n for _, n in self.streams), initial=0)
        return {name: self.stacks.slice(at, n) for (name, n), at in zip(self.streams, starts, strict=False)}


@dataclass(frozen=True)
class Reused:
    """Table `reuse`'s rows for one scenario: all of them, or (``since`` set: continued) those
    stamped from ``since`` on (and unstamped ones) with the group rows that new chain roots add
    before it; ``state``: the state at the new checkpoint; ``refused``: why a given state was not
    continued from."""

    frame: pl.DataFrame
    state: ReuseState | None = None
    since: int | None = None
    refused: str | None = None
    stream: AccessStream | None = None  # the `requests` stream the rows came from (mrc and TTL read it)


class _CannotContinue(Exception):
    pass


def reuse_continued(*, kv_events: duckdb.DuckDBPyRelation | None, bytes_per_token: int, scenario: str,
                    stream: AccessStream, resume: ReuseState | None = None,
                    checkpoint_ns: int | None = None, events_unchanged_before: int | None = None,
                    earlier: duckdb.DuckDBPyRelation | pl.DataFrame | None = None,
                    whole: Callable[[], AccessStream] | None = None) -> Reused:
    """``reuse``'s rows, continued from ``resume`` when it can be (else all of them, with why not),
    and with the state at ``checkpoint_ns`` when given. Continuing gives the rows a replay of the
    whole lake gives (``_resumed``); the caller keeps the rows before ``resume``'s checkpoint.
    ``events_unchanged_before``: a time before which ``kv_events`` holds the rows it held when
    ``resume`` was saved (``request_stream``'s ``unchanged_before``).

    A ``stream`` read from ``resume``'s stack (``access_stream``) holds only the accesses after
    the checkpoint: ``earlier`` gives the table's rows of the scenario before it (a chain root new
    since then gets group rows for its earlier `requests` rows), and ``whole`` reads the whole
    stream for a run that cannot continue."""
    refused = None
    if resume is not None:
        try:
            return _continue(resume, kv_events, bytes_per_token, scenario, stream, checkpoint_ns,
                             events_unchanged_before, earlier)
        except _CannotContinue as e:
            refused = str(e)
            log.info("scenario %s: reuse computed in full: %s", scenario, refused)
    if stream.stack is not None:
        if whole is None:
            raise ValueError("a stream continued from a state needs the whole one to compute reuse in full")
        stream = whole()
    ev = _stored_events(kv_events) if kv_events is not None else None
    fill = _fill_tokens(_token_counts(ev)) if ev is not None else 0
    parts, stacks, roots = _streams(stream, 0, ev, fill, None, bytes_per_token, checkpoint_ns)
    rows = sum(p.height for p in parts)
    if rows > MAX_REUSE_ROWS:
        log.warning("reuse: %d rows over %d; keeping only the requests stream", rows, MAX_REUSE_ROWS)
        return Reused(_sorted(parts[:1], scenario), None, None, refused, stream)
    state = _state(None, stream, ev, fill, stacks, roots, bytes_per_token, checkpoint_ns)
    return Reused(_sorted(parts, scenario), state, None, refused, stream)


def _sorted(parts: list[pl.DataFrame], scenario: str) -> pl.DataFrame:
    out = pl.concat(parts).with_columns(scenario=pl.lit(scenario))
    return out.select(REUSE.names).sort("stream", "ts_ns", "block_hash")


def _streams(acc: AccessStream, start: int, ev: pl.DataFrame | None, fill: int, prior: ReuseState | None,
             bytes_per_token: int, cut_ns: int | None,
             earlier: duckdb.DuckDBPyRelation | pl.DataFrame | None = None
             ) -> tuple[list[pl.DataFrame], list[tuple[str, pl.DataFrame]], np.ndarray]:
    """Every stream's rows for the `requests` accesses of ``acc.frame`` from ``start`` on and the
    stored events ``ev`` (those after ``prior``'s stacks; ``fill`` for their missing sizes); each
    replica and event stream's stack before ``cut_ns``; and the chain roots the whole stream has
    (the `requests` stream first in the rows, then its group rows: those before the new accesses
    are the ones whose root is new since ``prior``: from the whole stream's distances, or, for a
    stream continued from ``prior``'s stack, from ``earlier``, the table's rows before it)."""
    rs = acc.frame
    keys, ts, d = acc.keys(), acc.ts_series(), acc.distances
    first = acc.head + start  # the first new access, in the distances' order
    base = _rows_at("requests", keys, ts, d, _reaccesses(d, first))
    here = rs.slice(start).filter(pl.col("position") == 0)["block_hash"].to_numpy()
    if acc.stack is not None and prior is not None:
        roots = np.union1d(prior.roots["block_hash"].to_numpy(), here)
    else:
        roots = np.unique(rs.filter(pl.col("position") == 0)["block_hash"].to_numpy())
    group = [base.filter(pl.col("block_hash").is_in(pl.Series(roots).implode()))]
    if prior is not None and first:  # a root new since the state makes groups of earlier re-accesses
        new = np.setdiff1d(roots, prior.roots["block_hash"].to_numpy())
        if acc.stack is not None:
            # only a key accessed before the checkpoint has rows there: every such key is in its stack
            seen = acc.stack.filter(pl.col("block_hash").is_in(pl.Series(new, dtype=pl.UInt64).implode()))
            group.insert(0, _earlier_rows(earlier, seen["block_hash"].to_numpy(), prior.checkpoint_ns))
        else:
            before = np.flatnonzero((d.prev[:start] >= 0) & np.isin(keys[:start], new))
            group.insert(0, _rows_at("requests", keys, ts, d, before))
    parts = [base, *(g.with_columns(stream=pl.format("group:{}", pl.col("block_hash"))) for g in group)]
    stacks: list[tuple[str, pl.DataFrame]] = []
    saved = prior.by_stream() if prior is not None else {}
    saved.pop("requests", None)  # (the `requests` stream's: analyzers/stream_summary.py keeps it)
    named = []
    tail = rs.slice(start).filter(pl.col("replica").is_not_null())
    for (name,), f in tail.group_by("replica", maintain_order=True):
        named.append((f"replica:{name}", f))
    if ev is not None and ev.height:
        ev = ev.with_columns(pl.col("block_tokens").fill_null(fill))
        named.append(("fleet", ev))
        for (rep, med), f in ev.group_by("replica", "medium", maintain_order=True):
            named.append((f"replica:{rep}/{med}", f))
    for name, f in named:
        sizes = f["block_tokens"].to_numpy().astype(np.int64) * bytes_per_token
        rows, stack = _resumed(name, saved.pop(name, None), f["block_hash"].to_numpy(), sizes, f["ts_ns"],
                               cut_ns)
        parts.append(rows)
        if stack is not None:
            stacks.append((name, stack))
    stacks.extend(saved.items())  # streams with no access since the state: their stacks stand
    return parts, stacks, roots


def _earlier_rows(earlier: duckdb.DuckDBPyRelation | pl.DataFrame | None, keys: np.ndarray,
                  before_ns: int) -> pl.DataFrame:
    """The `requests` stream's rows of table `reuse` stamped before ``before_ns`` whose block is one
    of ``keys``, as ``_rows_at`` gives them."""
    columns = ["stream", "block_hash", "ts_ns", "distance_blocks", "distance_bytes", "interval_ns"]
    schema = {"stream": pl.String, "block_hash": pl.UInt64, "ts_ns": pl.Int64, "distance_blocks": pl.Int64,
              "distance_bytes": pl.Int64, "interval_ns": pl.Int64}
    if keys.shape[0] == 0:
        return pl.DataFrame(schema=schema)
    if earlier is None:
        raise _CannotContinue("the rows before its checkpoint are not given")
    if isinstance(earlier, pl.DataFrame):
        rows = earlier.filter((pl.col("stream") == "requests") & (pl.col("ts_ns") < before_ns)
                              & pl.col("block_hash").is_in(pl.Series(keys, dtype=pl.UInt64).implode()))
    else:
        listed = ", ".join(str(int(k)) for k in keys.astype(np.uint64))
        rows = earlier.filter(f"stream = 'requests' AND ts_ns < {int(before_ns)} AND block_hash IN ({listed})"
                              ).project(", ".join(columns)).pl()
    return rows.select(columns).cast(schema)  # type: ignore[arg-type]


def _state(prior: ReuseState | None, acc: AccessStream, ev: pl.DataFrame | None, fill: int,
           stacks: list[tuple[str, pl.DataFrame]], roots: np.ndarray, bytes_per_token: int,
           cut_ns: int | None) -> ReuseState | None:
    """The state at ``cut_ns`` after ``prior`` (None: from the start) and the stored events ``ev``
    after it (``fill``: the size those without block_tokens were given); None when no checkpoint is
    given or the stream has an access without a time (it sorts after every later one)."""
    ts = acc.frame["ts_ns"]
    if cut_ns is None or ts.null_count():
        return None
    settled_ev = (ev.filter(pl.col("ts_ns") < cut_ns) if ev is not None
                  else pl.DataFrame(schema={"block_tokens": pl.Int64}))
    tokens = _token_counts(settled_ev)
    if prior is not None:
        tokens = (pl.concat([prior.tokens, tokens]).group_by("block_tokens").agg(pl.col("count").sum())
                  .sort("block_tokens"))
    schema = pl.Schema({"block_hash": pl.UInt64, "size": pl.Int64, "ts_ns": pl.Int64})
    kept = [(name, s) for name, s in stacks if s.height]  # (a stream with none before the cut has none)
    return ReuseState(
        checkpoint_ns=cut_ns, bytes_per_token=bytes_per_token,
        accesses=acc.before + int((ts < cut_ns).sum()),
        events=(prior.events if prior else 0) + settled_ev.height,
        unfilled=(prior.unfilled if prior else 0) + settled_ev["block_tokens"].null_count(),
        fill_tokens=fill, tokens=tokens,
        stacks=pl.concat([s.cast(schema) for _, s in kept]) if kept else pl.DataFrame(schema=schema),
        roots=pl.DataFrame({"block_hash": roots}, schema={"block_hash": pl.UInt64}),
        streams=tuple((name, s.height) for name, s in kept))


def _continue(resume: ReuseState, kv_events: duckdb.DuckDBPyRelation | None, bytes_per_token: int,
              scenario: str, acc: AccessStream, cut_ns: int | None, unchanged_before: int | None,
              earlier: duckdb.DuckDBPyRelation | pl.DataFrame | None = None) -> Reused:
    """The rows from ``resume``'s checkpoint on (see ``Reused``); _CannotContinue when the lake
    before the checkpoint is not the one it saw, or a missing event size would now count another."""
    t = resume.checkpoint_ns
    if resume.bytes_per_token != bytes_per_token:
        raise _CannotContinue(f"bytes per token changed ({resume.bytes_per_token} -> {bytes_per_token})")
    ts = acc.frame["ts_ns"]
    if ts.null_count():
        raise _CannotContinue("a request has no arrival time")
    if acc.stack is not None:  # read from the state's stack: access_stream counted the accesses before it
        if acc.since != t:
            raise _CannotContinue("the stream was read from another checkpoint")
        start = 0
    else:
        start = int((ts < t).sum())
        if start != resume.accesses:
            raise _CannotContinue(f"{start:,} accesses before the checkpoint, the state counted "
                                  f"{resume.accesses:,}")
    if cut_ns is not None and cut_ns < t:
        raise _CannotContinue("the new checkpoint is before the state's")
    ev = None
    if kv_events is not None:
        if not still_counted(unchanged_before, t):
            stored_before = kv_events.filter(f"{_STORED} AND ts_ns < {int(t)}")
            ((before,),) = stored_before.aggregate("count(*)").fetchall()
            if before != resume.events:
                raise _CannotContinue(f"{before:,} stored events before the checkpoint, the state "
                                      f"counted {resume.events:,}")
        ev = _stored_events(kv_events, t)
    elif resume.events:
        raise _CannotContinue("the state counted stored events, none are given")
    fill = _fill_tokens(pl.concat([resume.tokens, _token_counts(ev)]) if ev is not None else resume.tokens)
    if fill != resume.fill_tokens and resume.unfilled:
        raise _CannotContinue(f"events without block_tokens now count {fill} tokens, not "
                              f"{resume.fill_tokens}")
    parts, stacks, roots = _streams(acc, start, ev, fill, resume, bytes_per_token, cut_ns, earlier)
    rows = sum(p.height for p in parts)
    if resume.kept_rows + rows > MAX_REUSE_ROWS:
        raise _CannotContinue(f"{resume.kept_rows + rows:,} rows would pass {MAX_REUSE_ROWS:,}")
    state = _state(resume, acc, ev, fill, stacks, roots, bytes_per_token, cut_ns)
    return Reused(_sorted(parts, scenario), state, t, None, acc)


# -- out of core (issue 17) -------------------------------------------------------------------------

# Accesses of one stream read into memory at once out of core: this many, or a quarter of the
# replica and event streams' stacks replayed before each chunk when that is more (a replay costs
# its length: so it costs at most 4 times the chunk's own accesses).
CHUNK_ROWS = 2_000_000
_REPLAYS = 4  # a chunk is at least 1/_REPLAYS of the stacks replayed before it
_BATCH_ROWS = 262_144  # rows per Arrow batch fetched from DuckDB
_NO_TIME = 2**63 - 1  # the cut before the accesses without a time (they sort last)
_NEVER = -(2**63)  # StreamStack: a key's last time before its first access

# request_stream's rows and order, with each request's replica (out of core refuses repeated ids)
# and each block's number (table {ids})
_REQUESTS_SQL = f"""
SELECT b.arrival_ns AS ts_ns, b.position, b.block_hash, b.block_tokens, r.replica, k.id
FROM request_blocks b JOIN {{ids}} k ON b.block_hash = k.block_hash
LEFT JOIN (SELECT request_id, any_value(replica) AS replica FROM requests WHERE scenario = $1
           GROUP BY request_id) r ON b.request_id = r.request_id
WHERE b.scenario = $1 AND ({_FULL_BLOCK})
ORDER BY b.arrival_ns, b.request_id, b.position
"""
# _stored_events' rows and order
_EVENTS_SQL = f"""
SELECT * FROM (
    SELECT ts_ns, seq, replica, CAST(medium AS VARCHAR) AS medium, block_hash, block_tokens, position
    FROM kv_events WHERE scenario = $1 AND {_STORED})
ORDER BY {_EVENT_ORDER}
"""


def _cut_at(ts: pl.Series, target: int) -> int | None:
    """Where to cut ``ts`` (in order): the last place at most ``target`` where the time changes,
    else the first one after it; None when it never changes."""
    n = ts.len()
    change = np.flatnonzero(ts.slice(1).ne_missing(ts.slice(0, n - 1)).to_numpy()) + 1
    if change.size == 0:
        return None
    below = change[change <= target]
    return int(below[-1]) if below.size else int(change[0])


def _in_chunks(reader: Any, rows: Callable[[], int]) -> Iterator[tuple[pl.DataFrame, int | None]]:
    """The rows of ``reader`` (Arrow batches in ts_ns order) in frames of about ``rows()`` each,
    cut only where the time changes (so no time is in two frames), each with the first time after
    it: the cut (``_NO_TIME`` before the unstamped ones; None after the last frame)."""
    held: list[pl.DataFrame] = []
    count = 0
    for batch in reader:
        got = pl.from_arrow(batch)
        assert isinstance(got, pl.DataFrame)
        held.append(got)
        count += got.height
        while count > rows():
            frame = pl.concat(held)
            at = _cut_at(frame["ts_ns"], rows())
            held, count = [frame], frame.height
            if at is None:
                break
            cut = frame["ts_ns"][at]
            yield frame.slice(0, at), _NO_TIME if cut is None else int(cut)
            held, count = [frame.slice(at)], frame.height - at
    if count:
        yield pl.concat(held), None


@numba.njit(cache=True)
def _intervals(ids: np.ndarray, ts: np.ndarray, last_ts: np.ndarray, out: np.ndarray) -> None:
    """Each re-access's interval (``out``; a first access: its key's ``last_ts`` is ``_NEVER``), the
    keys' last times moved on: accesses in stream order."""
    for i in range(ids.shape[0]):
        k = ids[i]
        if last_ts[k] != _NEVER:
            out[i] = ts[i] - last_ts[k]
        last_ts[k] = ts[i]


class StreamStack:
    """The LRU stack of a stream of one-size accesses whose keys are dense ids 0..``keys``-1, kept
    from one chunk of the stream to the next: ``_uniform_kernel``'s arrays and each key's last
    time, O(keys) (36 bytes a key), whatever the stream's length."""

    def __init__(self, keys: int) -> None:
        t = max(2 * keys, 64)
        self.tree, self.slot_key = np.zeros(t, np.int32), np.full(t, -1, np.int32)
        self.slot_of, self.last_i = np.full(keys, -1, np.int32), np.zeros(keys, np.int64)
        self.last_ts = np.full(keys, _NEVER, np.int64)
        self.live = self.nxt = self.seen = 0

    def push(self, ids: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The next accesses (key ids, int64 times, in stream order): their distances in blocks and
        their intervals (-1 for a first access), those a replay of the whole stream gives."""
        n = ids.shape[0]
        blocks, prev, interval = np.full(n, -1, np.int64), np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        self.live, self.nxt = _uniform_steps(ids, self.tree, self.slot_key, self.slot_of, self.last_i, blocks,
                                             prev, 0, self.seen, self.live, self.nxt)
        _intervals(ids, ts, self.last_ts, interval)
        self.seen += n
        return blocks, interval


@dataclass(frozen=True)
class StreamChunk:
    """A chunk of the `requests` stream read in order (``requests_read``)."""

    frame: pl.DataFrame  # request_stream's columns
    blocks: np.ndarray  # int64: each access's distance in blocks (-1: a first access)
    interval: np.ndarray  # int64: its interval (-1: a first access)
    size: int  # every access's bytes
    cut: int | None  # the next chunk's first time (None: the last chunk)


def requests_read(con: duckdb.DuckDBPyConnection, scenario: str, bytes_per_token: int, *,
                  rows: int = CHUNK_ROWS, replayed: Callable[[], int] = lambda: 0) -> Iterator[StreamChunk]:
    """``scenario``'s `requests` stream (``request_stream``'s rows and order) read from the lake
    views on ``con`` in order, in chunks of about ``rows`` accesses cut where the time changes,
    with their distances and intervals from one ``StreamStack`` (the keys are numbered by DuckDB,
    in a temporary table dropped at the end). In memory: a chunk and the stack, O(rows + distinct
    blocks). ``replayed``: rows of other stacks the caller replays per chunk (a chunk is at least
    1/_REPLAYS of them). NoDataError when the stream is empty; ConfigError when its accesses have
    several sizes or one has no time (not built out of core)."""
    full = f"scenario = $1 AND ({_FULL_BLOCK})"
    ids = f"kvlens_reuse_ids_{uuid.uuid4().hex}"
    # While the stream is read: one DuckDB thread, no insertion order to keep (the query sorts), and
    # half DuckDB's memory, as the stack grows beside it. Measured on 100.3M accesses of 22.6M
    # distinct blocks: at 2 GB its sort with the join to the ids ran out of DuckDB's memory on 2
    # threads; on one it completed in 138 s at a peak of 3.40 GiB (the stack's included), at 1 GB
    # in 186 s at 2.49 GiB.
    ((limit,),) = con.execute("SELECT current_setting('memory_limit')").fetchall()
    try:  # as DuckDB shows it ("1.8 GiB"); another form (no limit): left as it is
        half = {"memory_limit": f"{max(memory.parse_size(limit, 'memory_limit') // 2, 64 << 20)}B"}
    except ConfigError:
        half = {}
    with settings(con, threads=1, preserve_insertion_order=False, **half):
        con.execute(f"CREATE OR REPLACE TEMP TABLE {ids} AS SELECT block_hash, "
                    "CAST(row_number() OVER () - 1 AS BIGINT) AS id FROM "
                    f"(SELECT block_hash FROM request_blocks WHERE {full} GROUP BY block_hash)", [scenario])
        try:
            ((keys,),) = con.execute(f"SELECT count(*) FROM {ids}").fetchall()
            ((low, high, unstamped),) = con.execute(
                f"SELECT min(block_tokens), max(block_tokens), count(*) FILTER (WHERE arrival_ns IS NULL) "
                f"FROM request_blocks WHERE {full}", [scenario]).fetchall()
            if not keys:
                raise _no_stream(scenario)
            if low != high or unstamped:
                raise ConfigError(f"scenario {scenario}: out of core, the `requests` stream needs every full "
                                  "block of one size and an arrival time (not built for others yet)")
            size = int(low) * bytes_per_token
            stack = StreamStack(int(keys))
            target = [rows]
            reader = con.sql(_REQUESTS_SQL.format(ids=ids), params=[scenario]).to_arrow_reader(_BATCH_ROWS)
            for frame, cut in _in_chunks(reader, lambda: target[0]):
                blocks, interval = stack.push(frame["id"].to_numpy(), frame["ts_ns"].to_numpy())
                yield StreamChunk(frame.drop("id"), blocks, interval, size, cut)
                target[0] = max(rows, replayed() // _REPLAYS)
        finally:
            con.execute(f"DROP TABLE IF EXISTS {ids}")


class _Written:
    """Rows of table `reuse` written to Parquet files in ``folder``, counted."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True)
        self.folder, self.rows, self.files = folder, 0, 0

    def add(self, rows: pl.DataFrame) -> None:
        if rows.height:
            rows.write_parquet(self.folder / f"{self.files:06d}.parquet")
            self.files += 1
            self.rows += rows.height


def _chained(named: Iterable[tuple[str, pl.DataFrame]], stacks: dict[str, pl.DataFrame], cut: int | None,
             bytes_per_token: int, out: _Written) -> None:
    """One chunk of streams (name, accesses in stream order): each continued from its stack in
    ``stacks`` (``_resumed``), its rows written to ``out``, its stack before ``cut`` kept."""
    for name, f in named:
        sizes = f["block_tokens"].to_numpy().astype(np.int64) * bytes_per_token
        rows, stack = _resumed(name, stacks.get(name), f["block_hash"].to_numpy(), sizes, f["ts_ns"], cut)
        out.add(rows)
        if stack is not None:
            stacks[name] = stack


def reuse_out_of_core(con: duckdb.DuckDBPyConnection, scenario: str, *, work: Path, partitions: int,
                      bytes_per_token: int,
                      on_chunk: Callable[[StreamChunk], None] | None = None,
                      rows: int = CHUNK_ROWS) -> Iterator[pl.DataFrame]:
    """Table `reuse`'s rows of ``scenario`` (``reuse``'s, row for row), read from the lake views on
    ``con`` (``kvlens analyze --out-of-core``), as frames of at most about ``rows`` rows: the table
    holds a row per re-access, O(accesses), so it is given in pieces. They come in ``reuse``'s
    order (stream, ts_ns, block_hash).

    Every stream is read in order in chunks: the `requests` stream on one ``StreamStack``
    (``requests_read``), each replica's and the stored events' streams continued from their LRU
    stacks before each chunk (``_resumed``), so every distance, byte count and interval is a replay
    of the whole stream's; each chunk's rows go to Parquet files in ``work``, read back when the
    frames are asked for (``work`` must stay until then). In memory: one chunk, the `requests`
    stream's stack (``StreamStack``: 36 bytes per distinct block), and, when the table may hold the
    other streams, their stacks (each key once per stream). When the `requests` stream alone
    has more than MAX_REUSE_ROWS re-accesses (counted first, in DuckDB) only it is read, as
    ``reuse`` keeps only it then; the other streams are read only when the table may hold them,
    and dropped, as there, when all together pass it. Group rows are the `requests` rows of the
    chain roots, selected in DuckDB. ``on_chunk``: called with each chunk of the `requests` stream
    (stream_summary.py's ``CurvesChain.add`` sums mrc's and ttl_coverage's figures in the same read).
    ``partitions`` is not used: a stream is read in time order, not by block hash."""
    del partitions
    out = work / "reuse"
    requests_out, other_out = _Written(out / "requests"), _Written(out / "other")
    full = f"scenario = ? AND ({_FULL_BLOCK})"
    ((accesses, distinct),) = con.execute(
        f"SELECT count(*), (SELECT count(*) FROM (SELECT block_hash FROM request_blocks WHERE {full} "
        f"GROUP BY block_hash)) FROM request_blocks WHERE {full}", [scenario, scenario]).fetchall()
    every = accesses - distinct <= MAX_REUSE_ROWS  # else only the `requests` stream is kept
    replicas: dict[str, pl.DataFrame] = {}
    for chunk in requests_read(con, scenario, bytes_per_token, rows=rows,
                               replayed=lambda: sum(s.height for s in replicas.values())):
        if on_chunk is not None:
            on_chunk(chunk)
        re = chunk.blocks >= 0
        requests_out.add(pl.DataFrame({
            "stream": pl.Series([], dtype=pl.String).extend_constant("requests", int(re.sum())),
            "block_hash": chunk.frame["block_hash"].filter(re).cast(pl.UInt64),
            "ts_ns": chunk.frame["ts_ns"].filter(re).cast(pl.Int64),
            "distance_blocks": chunk.blocks[re], "distance_bytes": chunk.blocks[re] * chunk.size,
            "interval_ns": chunk.interval[re]}).sort("ts_ns", "block_hash"))
        if every:
            tail = chunk.frame.filter(pl.col("replica").is_not_null())
            _chained(((f"replica:{name}", f) for (name,), f in tail.group_by("replica", maintain_order=True)),
                     replicas, chunk.cut, bytes_per_token, other_out)
    replicas.clear()  # (their stacks)
    if every:
        roots = con.sql(f"SELECT DISTINCT block_hash FROM request_blocks WHERE {full} AND position = 0",
                        params=[scenario])
        roots.write_parquet(str(out / "roots.parquet"))
        ((grouped,),) = con.execute(
            f"SELECT count(*) FROM read_parquet('{out / 'requests'}/*.parquet') q SEMI JOIN "
            f"read_parquet('{out / 'roots.parquet'}') r ON q.block_hash = r.block_hash").fetchall() \
            if requests_out.files else [(0,)]
        counts = con.sql("SELECT CAST(block_tokens AS BIGINT) AS block_tokens, count(*) AS count "
                         f"FROM kv_events WHERE scenario = ? AND {_STORED} AND block_tokens IS NOT NULL "
                         "GROUP BY ALL",
                         params=[scenario]).pl()
        fill = _fill_tokens(counts.cast({"count": pl.Int64}))
        stacks: dict[str, pl.DataFrame] = {}
        target = [rows]  # at least 1/_REPLAYS of the stacks replayed before it
        reader = con.sql(_EVENTS_SQL, params=[scenario]).to_arrow_reader(_BATCH_ROWS)
        for ev, cut in _in_chunks(reader, lambda: target[0]):
            ev = ev.with_columns(pl.col("block_tokens").fill_null(fill))
            per_tier = ev.group_by("replica", "medium", maintain_order=True)
            named = [("fleet", ev), *((f"replica:{rep}/{med}", f) for (rep, med), f in per_tier)]
            _chained(named, stacks, cut, bytes_per_token, other_out)
            target[0] = max(rows, sum(s.height for s in stacks.values()) // _REPLAYS)
            if requests_out.rows + grouped + other_out.rows > MAX_REUSE_ROWS:
                break  # the table keeps only the `requests` stream: no need to read on
        every = requests_out.rows + grouped + other_out.rows <= MAX_REUSE_ROWS
    if not every:
        log.warning("reuse: more than %d rows; keeping only the requests stream", MAX_REUSE_ROWS)
    ((memory,),) = con.execute("SELECT current_setting('memory_limit')").fetchall()
    return _read_back(out, scenario, str(memory), rows, every=every, others=other_out.files > 0)


def _read_back(out: Path, scenario: str, memory: str, rows: int, *, every: bool,
               others: bool) -> Iterator[pl.DataFrame]:
    """The rows ``reuse_out_of_core`` wrote under ``out``, in frames of about ``rows``, in table
    order: the streams before `requests` (with ``every``: replicas, events, groups), sorted by
    DuckDB (at most MAX_REUSE_ROWS rows), then the `requests` files, each sorted and in time order
    (chunks are cut where the time changes, so they are sorted as a whole)."""
    files = sorted((out / "requests").glob("*.parquet"))
    if every and files:
        con = duckdb.connect()
        try:
            con.execute(f"SET memory_limit = '{memory}'")
            con.execute(f"SET temp_directory = '{out / 'spill'}'")
            requests = f"read_parquet('{out / 'requests'}/*.parquet')"
            union = (f"SELECT * FROM read_parquet('{out / 'other'}/*.parquet') UNION ALL BY NAME "
                     if others else "")
            reader = con.sql(
                f"SELECT * FROM ({union}SELECT 'group:' || CAST(q.block_hash AS VARCHAR) AS stream, "
                f"q.* EXCLUDE (stream) FROM {requests} q SEMI JOIN read_parquet('{out / 'roots.parquet'}') r "
                "ON q.block_hash = r.block_hash) ORDER BY stream, ts_ns NULLS FIRST, block_hash"
            ).to_arrow_reader(rows)
            for batch in reader:
                got = pl.from_arrow(batch)
                assert isinstance(got, pl.DataFrame)
                yield got.with_columns(scenario=pl.lit(scenario)).select(REUSE.names)
        finally:
            con.close()
    for file in files:
        yield pl.read_parquet(file).with_columns(scenario=pl.lit(scenario)).select(REUSE.names)
