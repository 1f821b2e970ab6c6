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

import itertools
import logging
from dataclasses import dataclass

import duckdb
import numba
import numpy as np
import polars as pl

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


@numba.njit(cache=True, inline="always")
def _mix64(x: np.uint64) -> np.uint64:
    # splitmix64 finalizer: spreads sequential ids (Mooncake's are small integers) over 64 bits.
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


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
    for i in range(head):
        k = keys[i]
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
                  state: np.ndarray, d_blocks: np.ndarray, d_bytes: np.ndarray, prev: np.ndarray) -> None:
    n = ids.shape[0]
    live_c = 0
    live_b = 0
    nxt = 0
    for i in range(n):
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
                    last_i: np.ndarray, d_blocks: np.ndarray, prev: np.ndarray) -> None:
    """Every access the same size: a count-only int32 tree, a quarter of the memory traffic."""
    t = tree.shape[0]
    live = 0
    nxt = 0
    for i in range(ids.shape[0]):
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


def _uniform_distances(ids: np.ndarray, size: int, n_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = max(2 * n_keys, 64)
    d_blocks = np.full(ids.shape[0], -1, np.int64)
    prev = np.full(ids.shape[0], -1, np.int64)
    _uniform_kernel(ids, np.zeros(t, np.int32), np.full(t, -1, np.int32), np.full(n_keys, -1, np.int32),
                    np.zeros(n_keys, np.int64), d_blocks, prev)
    d_bytes = np.where(d_blocks >= 0, d_blocks * size, -1)
    return d_blocks, d_bytes, prev


def _stack_distances(ids: np.ndarray, sizes: np.ndarray, n_keys: int
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
    _stack_kernel(ids, sizes, tree, slot_key, state, d_blocks, d_bytes, prev)
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
        blocks, byts, prev = _uniform_distances(ids, int(sizes_arr[0]), m)
    else:
        blocks, byts, prev = _stack_distances(ids, sizes_arr, m)
    return Distances(blocks, byts, prev)


# -- streams -----------------------------------------------------------------------------------


# A full block: as many tokens as the cache's block size (a row without a block size counts as full).
_FULL_BLOCK = "block_tokens IS NOT NULL AND block_tokens = coalesce(block_size_tokens, block_tokens)"


def request_stream(request_blocks: duckdb.DuckDBPyRelation,
                   requests: duckdb.DuckDBPyRelation | None = None, prior: pl.DataFrame | None = None,
                   since_ns: int | None = None, unchanged_before: int | None = None) -> pl.DataFrame:
    """The `requests` stream: ts_ns, position, block_hash, block_tokens, replica, in access order.

    The prefix-cache stream: the **full** blocks of the scenario's request_blocks only. A partial
    tail is never cached by an engine (vLLM's ``KVCacheManager`` hashes and caches full blocks
    only: ``vllm/v1/core/kv_cache_utils.py`` ``get_request_block_hasher`` stops at the last full
    block, "We only hash full blocks"), so it never enters a cache, a reuse distance or a curve.
    Order: arrival_ns, then request_id (ties in arrival keep a stable order), then position.

    ``prior``: the stream's accesses that arrived before ``since_ns``, as an earlier read of the
    same lake gave them (a ReuseState's ``stream``): when the lake holds as many of them still (no
    row before a checkpoint can arrive later: ``kvlens analyze`` rebuilds on a late segment), only
    the rows from ``since_ns`` on are read, and they follow ``prior`` in the order above.
    ``unchanged_before``: a time before which the lake holds the rows it held when ``prior`` was
    read (analyzers/incremental.py, ``new_rows_from``): with ``since_ns`` at or before it, the count
    is not read again.
    """
    full = request_blocks.filter(_FULL_BLOCK)
    if prior is not None and since_ns is not None and requests is not None and (
            still_counted(unchanged_before, since_ns)
            or full.filter(f"arrival_ns < {int(since_ns)}").aggregate("count(*)").fetchall()
            == [(prior.height,)]):
        tail = _stream_rows(full.filter(f"arrival_ns >= {int(since_ns)} OR arrival_ns IS NULL"), requests)
        return pl.concat([prior.select(tail.columns).cast(tail.schema), tail])
    return _stream_rows(full, requests)


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
class AccessStream:
    """A scenario's `requests` stream with its exact reuse distances: built once, read by
    reuse, mrc and ttl_coverage."""

    frame: pl.DataFrame  # request_stream's columns, in access order
    sizes: np.ndarray  # int64 bytes per access
    distances: Distances


def access_stream(request_blocks: duckdb.DuckDBPyRelation, scenario: str, bytes_per_token: int,
                  requests: duckdb.DuckDBPyRelation | None = None,
                  prior: ReuseState | None = None, unchanged_before: int | None = None) -> AccessStream:
    """The `requests` stream of ``scenario``'s rows and its distances; NoDataError when it is empty.
    ``prior``: a saved reuse state, whose accesses before its checkpoint are not read again
    (``unchanged_before``: see ``request_stream``)."""
    rs = request_stream(request_blocks, requests, prior.stream if prior is not None else None,
                        prior.checkpoint_ns if prior is not None else None, unchanged_before)
    if rs.height == 0:
        raise NoDataError(f"scenario {scenario!r} has no request_blocks rows: import a trace into it first")
    sizes = rs["block_tokens"].to_numpy().astype(np.int64) * bytes_per_token
    return AccessStream(rs, sizes, reuse_distances(rs["block_hash"].to_numpy(), sizes))


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
    (``_resumed``). The ``requests`` stream's distances are computed whole every run (mrc and
    ttl_coverage read them all), so it keeps its accesses before the checkpoint instead (``stream``:
    the next run reads only the newer ones from the lake)."""

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
    stream: pl.DataFrame | None = None  # the `requests` stream's accesses before the checkpoint

    def __post_init__(self) -> None:
        names = [name for name, _ in self.streams]
        if len(set(names)) != len(names) or sum(n for _, n in self.streams) != self.stacks.height \
                or any(n < 0 for _, n in self.streams):
            raise ValueError(f"the stacks' {self.stacks.height} rows are not those of streams {self.streams}")

    def to_bytes(self) -> bytes:
        frames = {"tokens": self.tokens, "stacks": self.stacks, "roots": self.roots}
        if self.stream is not None:
            frames["stream"] = self.stream
        return pack({"checkpoint_ns": self.checkpoint_ns, "bytes_per_token": self.bytes_per_token,
                     "accesses": self.accesses, "events": self.events, "unfilled": self.unfilled,
                     "fill_tokens": self.fill_tokens, "streams": [list(s) for s in self.streams]}, frames)

    @classmethod
    def from_bytes(cls, data: bytes) -> ReuseState:
        head, frames = unpack(data)
        return cls(int(head["checkpoint_ns"]), int(head["bytes_per_token"]), int(head["accesses"]),
                   int(head["events"]), int(head["unfilled"]), int(head["fill_tokens"]), frames["tokens"],
                   frames["stacks"], frames["roots"],
                   tuple((str(name), int(n)) for name, n in head["streams"]), stream=frames.get("stream"))

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


class _CannotContinue(Exception):
    pass


def reuse_continued(*, kv_events: duckdb.DuckDBPyRelation | None, bytes_per_token: int, scenario: str,
                    stream: AccessStream, resume: ReuseState | None = None,
                    checkpoint_ns: int | None = None, events_unchanged_before: int | None = None) -> Reused:
    """``reuse``'s rows, continued from ``resume`` when it can be (else all of them, with why not),
    and with the state at ``checkpoint_ns`` when given. Continuing gives the rows a replay of the
    whole lake gives (``_resumed``); the caller keeps the rows before ``resume``'s checkpoint.
    ``events_unchanged_before``: a time before which ``kv_events`` holds the rows it held when
    ``resume`` was saved (``request_stream``'s ``unchanged_before``)."""
    refused = None
    if resume is not None:
        try:
            return _continue(resume, kv_events, bytes_per_token, scenario, stream, checkpoint_ns,
                             events_unchanged_before)
        except _CannotContinue as e:
            refused = str(e)
            log.info("scenario %s: reuse computed in full: %s", scenario, refused)
    ev = _stored_events(kv_events) if kv_events is not None else None
    fill = _fill_tokens(_token_counts(ev)) if ev is not None else 0
    parts, stacks, roots = _streams(stream, 0, ev, fill, None, bytes_per_token, checkpoint_ns)
    rows = sum(p.height for p in parts)
    if rows > MAX_REUSE_ROWS:
        log.warning("reuse: %d rows over %d; keeping only the requests stream", rows, MAX_REUSE_ROWS)
        return Reused(_sorted(parts[:1], scenario), None, None, refused)
    state = _state(None, stream, ev, fill, stacks, roots, bytes_per_token, checkpoint_ns)
    return Reused(_sorted(parts, scenario), state, None, refused)


def _sorted(parts: list[pl.DataFrame], scenario: str) -> pl.DataFrame:
    out = pl.concat(parts).with_columns(scenario=pl.lit(scenario))
    return out.select(REUSE.names).sort("stream", "ts_ns", "block_hash")


def _streams(acc: AccessStream, start: int, ev: pl.DataFrame | None, fill: int, prior: ReuseState | None,
             bytes_per_token: int, cut_ns: int | None
             ) -> tuple[list[pl.DataFrame], list[tuple[str, pl.DataFrame]], np.ndarray]:
    """Every stream's rows for the `requests` accesses from ``start`` on and the stored events
    ``ev`` (those after ``prior``'s stacks; ``fill`` for their missing sizes); each replica and event
    stream's stack before ``cut_ns``; and the chain roots the whole stream has (the `requests`
    stream first in the rows, then its group rows: those before ``start`` are the ones whose root
    is new since ``prior``)."""
    rs = acc.frame
    keys, ts, d = rs["block_hash"].to_numpy(), rs["ts_ns"], acc.distances
    base = _rows_at("requests", keys, ts, d, _reaccesses(d, start))
    roots = np.unique(rs.filter(pl.col("position") == 0)["block_hash"].to_numpy())
    group = [base.filter(pl.col("block_hash").is_in(pl.Series(roots).implode()))]
    if prior is not None and start:  # a root new since the state makes groups of earlier re-accesses
        new = np.setdiff1d(roots, prior.roots["block_hash"].to_numpy())
        before = np.flatnonzero((d.prev[:start] >= 0) & np.isin(keys[:start], new))
        group.insert(0, _rows_at("requests", keys, ts, d, before))
    parts = [base, *(g.with_columns(stream=pl.format("group:{}", pl.col("block_hash"))) for g in group)]
    stacks: list[tuple[str, pl.DataFrame]] = []
    saved = prior.by_stream() if prior is not None else {}
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
    accesses = int((ts < cut_ns).sum())
    return ReuseState(
        checkpoint_ns=cut_ns, bytes_per_token=bytes_per_token,
        accesses=accesses, stream=acc.frame.head(accesses),  # in time order: those before the cut
        events=(prior.events if prior else 0) + settled_ev.height,
        unfilled=(prior.unfilled if prior else 0) + settled_ev["block_tokens"].null_count(),
        fill_tokens=fill, tokens=tokens,
        stacks=pl.concat([s.cast(schema) for _, s in kept]) if kept else pl.DataFrame(schema=schema),
        roots=pl.DataFrame({"block_hash": roots}, schema={"block_hash": pl.UInt64}),
        streams=tuple((name, s.height) for name, s in kept))


def _continue(resume: ReuseState, kv_events: duckdb.DuckDBPyRelation | None, bytes_per_token: int,
              scenario: str, acc: AccessStream, cut_ns: int | None, unchanged_before: int | None) -> Reused:
    """The rows from ``resume``'s checkpoint on (see ``Reused``); _CannotContinue when the lake
    before the checkpoint is not the one it saw, or a missing event size would now count another."""
    t = resume.checkpoint_ns
    if resume.bytes_per_token != bytes_per_token:
        raise _CannotContinue(f"bytes per token changed ({resume.bytes_per_token} -> {bytes_per_token})")
    ts = acc.frame["ts_ns"]
    if ts.null_count():
        raise _CannotContinue("a request has no arrival time")
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
    parts, stacks, roots = _streams(acc, start, ev, fill, resume, bytes_per_token, cut_ns)
    rows = sum(p.height for p in parts)
    if resume.kept_rows + rows > MAX_REUSE_ROWS:
        raise _CannotContinue(f"{resume.kept_rows + rows:,} rows would pass {MAX_REUSE_ROWS:,}")
    state = _state(resume, acc, ev, fill, stacks, roots, bytes_per_token, cut_ns)
    return Reused(_sorted(parts, scenario), state, t)
