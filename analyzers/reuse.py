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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import duckdb
import numba
import numpy as np
import polars as pl

from kvlens.analyzers.hashmap import mix64 as _mix64
from kvlens.analyzers.state_blob import pack, still_counted, unpack
from kvlens.errors import NoDataError
from kvlens.schema import REUSE

__all__ = ["REUSE_STATE_TABLE", "AccessStream", "Distances", "ReuseState", "Reused", "access_stream", "reuse",
           "reuse_continued", "reuse_distances"]

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
    live = head
    nxt = head
    for i in range(head, ids.shape[0]):
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
        last_i[k] = i
        slot_key[nxt] = k
        live += 1
        nxt += 1


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
    m = 0 if prior is None else prior.height
    if m:
        assert prior is not None
        keys = np.concatenate([prior["block_hash"].to_numpy(), keys])
        sizes = np.concatenate([prior["size"].to_numpy(), sizes])
        ts = pl.concat([prior["ts_ns"].cast(pl.Int64), ts.cast(pl.Int64)])
    d = reuse_distances(keys, sizes, distinct_head=m)
    rows = _rows_at(name, keys, ts, d, _reaccesses(d, m))
    if cut_ns is None:
        return rows, None
    # in stream order, so the accesses before the cut come first (unstamped ones sort last)
    settled = m + int((ts.slice(m) < cut_ns).sum())
    return rows, _last_accesses(keys, sizes, ts, d.prev, settled)


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
