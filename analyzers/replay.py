"""Analyzers: the cache-state replay core, compiled: KV events and block look-ups -> outcome codes.

Inputs are integer arrays (the caller encodes replicas, tiers, KV cache groups and namespaces);
the core walks the events in time order and, at each request's look-up time, decides every
needed full block's outcome in DESIGN.md's order. Conventions, all relied on by the ledger:

- A look-up at time t sees the events with ``ts < t`` (strictly before): a request never
  sees its own stores. Events are given already sorted (stably, by time then sequence).
- Residency is per (block, KV cache group, location, tier); tier 0 is the GPU, 1 the CPU, 2
  disk. The shared pool is a location of its own (``pool_loc``): a block resident there can be
  loaded by any replica. A GPU removal of a block the same location keeps on a lower tier is a
  demotion, not an eviction: the block is still there, and a later look-up finds it offloaded.
- Copies are counted: vLLM keeps one hash in several physical blocks when it computes a
  block again (vllm/v1/core/block_pool.py: ``cached_block_hash_to_block`` maps a hash to
  blocks; ``_maybe_evict_cached_block`` emits one ``BlockRemoved`` per physical copy), so a
  store of a resident block is one more copy and a removal takes one away; the block stays
  resident until the last goes. A removal that says how many copies remain (newer vLLM's
  ``remaining_copy_counts``, ``ev_left`` >= 0) sets the count.
- Each block ever stored gets a dense row (one dict look-up per block); its residency is a row
  of bit words, bit ``3·(group·n_locs + location) + tier``, 63 bits per int64 word so that a
  location's three tiers share a word.
- ``cleared`` empties one tier of a location (or all, with tier -1) in every group.
- The hit rule is vLLM 0.32's for each group's spec, combined as its hybrid coordinator does
  (vllm/v1/core/kv_cache_coordinator.py::HybridKVCacheCoordinator.find_longest_cache_hit):
  full-attention groups give the longest prefix every one of them holds
  (single_type_kv_cache_manager.py::FullAttentionManager.find_longest_cache_hit); each
  sliding-window group then needs only ``ceil((window - 1) / B)`` contiguous blocks ending at
  the match point, searched right to left within that prefix, or else the run from block 0
  (SlidingWindowManager.find_longest_cache_hit); the groups are iterated to a fixed point, since
  a shorter length can move a window. The look-up is capped at ``prompt_tokens - 1`` tokens
  (kv_cache_manager.py::KVCacheManager.get_computed_blocks), so a prompt without a partial tail
  whose every block the full groups hold gives its last block back (``recomputed_last``).
- A block is available in a group when it is on this replica's GPU or a lower tier, loaded by
  an ok transfer, or in the pool; a failed transfer makes a block unavailable unless a local
  tier holds it. Within the hit, a block's outcome is the slowest source among the groups that need
  it (a sliding group needs only the blocks of its window before the match point).
- Past the hit: a block the full groups hold with its whole prefix was cut short by another
  group (``miss_group``); otherwise the dense chain rule: a failed load, a block available after
  a gap, one held elsewhere, one evicted, one stored under another key, or a cold one.
- A replica that publishes no block event in the whole stream is ``unobserved``: its residency
  is unknown. (One that has not published yet is observed: a fresh cache is simply empty.)
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.typed import Dict

from kvlens.analyzers.hashmap import get, items, put, table, table_of
from kvlens.schema import Outcome

__all__ = ["OUTCOME_CODES", "SRC_CPU", "SRC_DISK", "SRC_GPU", "SRC_POOL", "SRC_TRANSFER", "TIERS",
           "XFER_FAILED", "XFER_NONE", "XFER_OK", "loc_groups", "replay_core", "replay_resume"]

OUTCOME_CODES: tuple[Outcome, ...] = tuple(Outcome)
_HIT_LOCAL = OUTCOME_CODES.index(Outcome.HIT_LOCAL)
_HIT_OFFLOAD = OUTCOME_CODES.index(Outcome.HIT_OFFLOAD)
_HIT_REMOTE = OUTCOME_CODES.index(Outcome.HIT_REMOTE)
_RECOMPUTED_LAST = OUTCOME_CODES.index(Outcome.RECOMPUTED_LAST)
_GROUP = OUTCOME_CODES.index(Outcome.MISS_GROUP)
_LOAD_FAILED = OUTCOME_CODES.index(Outcome.MISS_LOAD_FAILED)
_AFTER_GAP = OUTCOME_CODES.index(Outcome.MISS_AFTER_GAP)
_ROUTING = OUTCOME_CODES.index(Outcome.MISS_ROUTING)
_EVICTED = OUTCOME_CODES.index(Outcome.MISS_EVICTED)
_INCOMPATIBLE = OUTCOME_CODES.index(Outcome.MISS_INCOMPATIBLE)
_COLD = OUTCOME_CODES.index(Outcome.MISS_COLD)
_UNOBSERVED = OUTCOME_CODES.index(Outcome.UNOBSERVED)
XFER_NONE, XFER_OK, XFER_FAILED = 0, 1, 2
_STORED, _REMOVED, _CLEARED = 0, 1, 2
_NO_NS = -1
_PENDING = -2  # a miss whose cause is not found yet (``_decide``)
# A block's best source in one group, slowest last; below _SRC_FAILED it is available. The
# serving source of a hit is returned per block (``src`` below): SRC_GPU ... SRC_POOL.
SRC_GPU, SRC_CPU, SRC_DISK, SRC_TRANSFER, SRC_POOL = 0, 1, 2, 3, 4
_SRC_FAILED, _SRC_NONE = 5, 6
_SRC_OUTCOME = np.array([_HIT_LOCAL, _HIT_OFFLOAD, _HIT_OFFLOAD, _HIT_REMOTE, _HIT_REMOTE], np.int8)
_TIERS = 3
TIERS = _TIERS  # residency slots per (group, location): gpu, cpu, disk

_NO_ROW = np.int64(-1)
_BITS = 63  # per int64 word; a multiple of 3, so a location's tier bits sit in one word


@njit(cache=True, inline="always")
def _row(rows, h):
    """The block's dense row, or -1 if it was never stored (one hash probe: analyzers/hashmap.py)."""
    return get(rows, h)


@njit(cache=True, inline="always")
def _has(masks, row, slot):
    return row >= 0 and (masks[row, slot // _BITS] >> (slot % _BITS)) & 1 == 1


@njit(cache=True, inline="always")
def _drop(masks, row, slot, ts, loc, removed_ts, remover):
    masks[row, slot // _BITS] &= ~(np.int64(1) << (slot % _BITS))
    removed_ts[row] = ts
    remover[row] = loc


@njit(cache=True, inline="always")
def _set(bits, row, slot, on):
    if on:
        bits[row, slot // _BITS] |= np.int64(1) << (slot % _BITS)
    else:
        bits[row, slot // _BITS] &= ~(np.int64(1) << (slot % _BITS))


@njit(cache=True)
def _clear(masks, extra, n_rows, loc, tier, ts, removed_ts, remover, n_locs, n_groups, copies):
    n_slots = _TIERS * n_locs * n_groups
    for g in range(n_groups):
        for t in range(_TIERS):
            if tier < 0 or tier == t:
                slot = (g * n_locs + loc) * _TIERS + t
                for row in range(n_rows):
                    if _has(masks, row, slot):
                        _drop(masks, row, slot, ts, loc, removed_ts, remover)
                        if _has(extra, row, slot):
                            _set(extra, row, slot, False)
                            del copies[row * n_slots + slot]


@njit(cache=True, inline="always")
def _store(masks, extra, row, slot, key, copies):
    """One more physical copy; the extra copies of a (row, slot) beyond the first live in ``copies``,
    flagged in ``extra`` so that a removal of a single copy needs no dict look-up."""
    if _has(masks, row, slot):
        copies[key] = copies.get(key, 0) + 1
        _set(extra, row, slot, True)
    else:
        _set(masks, row, slot, True)


@njit(cache=True, inline="always")
def _remove(masks, extra, row, slot, key, left, ts, loc, removed_ts, remover, copies):
    """One copy gone (or, with ``left`` >= 0, exactly ``left`` copies remain)."""
    if not _has(masks, row, slot):
        return
    more = _has(extra, row, slot)
    after = left if left >= 0 else (copies[key] if more else 0)  # copies left after this removal
    if after > 1:
        copies[key] = after - 1
        _set(extra, row, slot, True)
        return
    if more:
        del copies[key]
        _set(extra, row, slot, False)
    if after == 1:
        return
    _drop(masks, row, slot, ts, loc, removed_ts, remover)


@njit(cache=True)
def _holder(masks, row, own_loc, pool_loc, n_words, n_locs, n_groups):
    """The lowest replica other than ``own_loc`` (and the pool) holding the block in any group, or -1."""
    best = -1
    for w in range(n_words):
        m = masks[row, w]
        b = 0
        while m != 0:
            if m & 1 == 1:
                loc = ((w * _BITS + b) // _TIERS) % n_locs
                if loc != own_loc and loc != pool_loc and (best < 0 or loc < best):
                    best = loc
                    if n_groups == 1:  # one group: slots ascend with the location, the first is lowest
                        return best
            m >>= 1
            b += 1
    return best


@njit(cache=True)
def _note_content(c_first_ns, c_other_ns, c, ns):
    """The first namespace content ``c`` is stored under, and the first different one (tables)."""
    if c == 0 or ns == _NO_NS:
        return
    first = get(c_first_ns, c)
    if first < 0:
        put(c_first_ns, c, ns)
    elif first != ns and get(c_other_ns, c) < 0:
        put(c_other_ns, c, ns)


@njit(cache=True)
def _other_namespace(c_first_ns, c_other_ns, c, ns):
    """A namespace other than ``ns`` that the same content was stored under, or -1."""
    if c == 0 or ns == _NO_NS:
        return -1
    first = get(c_first_ns, c)
    if first < 0 or first != ns:
        return first
    return get(c_other_ns, c)


@njit(cache=True, inline="always")
def _source(masks, row, g, r, pool_loc, n_locs, x):
    """One group's best source of a block for a request on location ``r`` (a SRC_ code)."""
    here = _tier_bits(masks, row, (g * n_locs + r) * _TIERS)
    if here != 0:
        return 0 if here & 1 else 1 if here & 2 else 2  # SRC_GPU, SRC_CPU, SRC_DISK
    if x == XFER_OK:
        return SRC_TRANSFER
    if x == XFER_FAILED:
        return _SRC_FAILED
    if pool_loc >= 0 and _tier_bits(masks, row, (g * n_locs + pool_loc) * _TIERS) != 0:
        return SRC_POOL
    return _SRC_NONE


@njit(cache=True, inline="always")
def _tier_bits(masks, row, base):
    """A location's three tier bits (gpu 1, cpu 2, disk 4) in one load: they share a word."""
    if row < 0:
        return 0
    return (masks[row, base // _BITS] >> (base % _BITS)) & 7


@njit(cache=True)
def _window_hit(src, g, m, need):
    """Blocks a sliding-window group can serve of the first ``m``: the rightmost run of ``need``
    available blocks, its end being the hit; else the run from block 0 (vLLM's right-to-left scan)."""
    run = 0
    for k in range(m - 1, -1, -1):
        if src[k, g] < _SRC_FAILED:
            run += 1
            if run >= need:
                return k + run
        else:
            run = 0
    return run


@njit(cache=True)
def _full_chain(src, grp_on, grp_need, n, limit):
    """Longest prefix (at most ``limit``) every full-attention group of the request holds."""
    chain = limit
    for g in range(grp_need.shape[0]):
        if grp_on[g] and grp_need[g] == 0:
            k = 0
            while k < chain and src[k, g] < _SRC_FAILED:
                k += 1
            chain = k
    return chain


@njit(cache=True)
def _hybrid_hit(src, grp_on, grp_need, n_full, cap):
    """(hit blocks, full groups' prefix, cutting group or -1), as the hybrid coordinator finds them."""
    full = _full_chain(src, grp_on, grp_need, cap, cap) if n_full > 0 else cap
    hit, cut = full, -1
    moved = True
    while moved:
        moved = False
        for g in range(grp_need.shape[0]):
            if grp_on[g] and grp_need[g] > 0:
                h = _window_hit(src, g, hit, grp_need[g])
                if h < hit:
                    hit, cut, moved = h, g, True
    return hit, full, cut


@njit(cache=True)
def replay_core(ev_ts, ev_kind, ev_loc, ev_tier, ev_grp, ev_h, ev_c, ev_ns, ev_left,
                req_t, req_loc, req_tail, req_bs, req_off,
                blk_h, blk_c, blk_ns, blk_xfer, n_locs, pool_loc, loc_window):
    """Outcome code per needed block, plus holder, removed_ns, remover, other namespace, the
    cutting group of a miss_group block, the bit mask of groups that serve or compute it, and
    for a hit its serving source (SRC_GPU, SRC_CPU, SRC_DISK, SRC_TRANSFER, SRC_POOL; else -1).

    ``req_off`` has one more entry than requests: request i needs blocks
    ``req_off[i]:req_off[i+1]`` (full blocks only, in position order) of ``req_bs[i]`` tokens.
    ``loc_window[loc, g]`` is group g's sliding window on location ``loc`` in tokens, 0 for full
    attention (a fleet may mix models, so a group's spec is per location). A content
    hash of 0 and a namespace of -1 mean unknown. Requests are given in look-up-time order.
    The replay starts from an empty cache; ``replay_resume`` continues one from a saved state.
    """
    n_groups = loc_window.shape[1]
    n_words = (_TIERS * n_locs * n_groups + _BITS - 1) // _BITS
    loc_grp = loc_groups(ev_kind, ev_loc, ev_grp, n_locs, n_groups)
    no = np.zeros(0, np.int64)
    out, _ = replay_resume(ev_ts, ev_ts, ev_kind, ev_loc, ev_tier, ev_grp, ev_h, ev_c, ev_ns, ev_left,
                           req_t, req_loc, req_tail, req_bs, req_off, blk_h, blk_c, blk_ns, blk_xfer,
                           n_locs, pool_loc, loc_window, loc_grp,
                           (no, np.zeros((0, n_words), np.int64), np.zeros((0, n_words), np.int64), no, no,
                            no, no, no, no, no, no), -1)
    return out


@njit(cache=True)
def loc_groups(ev_kind, ev_loc, ev_grp, n_locs, n_groups):
    """The KV cache groups each location publishes in the given events (a clear names none)."""
    loc_grp = np.zeros((n_locs, n_groups), np.bool_)
    for e in range(ev_kind.shape[0]):
        if ev_kind[e] != _CLEARED:
            loc_grp[ev_loc[e], ev_grp[e]] = True
    return loc_grp


@njit(cache=True)
def _apply(k, upto, t, ev_ts, ev_kind, ev_loc, ev_tier, ev_grp, ev_h, ev_c, ev_ns, ev_left, ev_stamp, masks,
           extra, removed_ts, remover, rows, copies, c_first_ns, c_other_ns, n_rows, n_locs, n_groups):
    """Events from ``k`` on, before index ``upto`` and ordered before ``t``, applied to the cache
    state; (the next event's index, the new row count)."""
    n_slots = _TIERS * n_locs * n_groups
    while k < upto and ev_ts[k] < t:
        kind, loc = ev_kind[k], np.int64(ev_loc[k])
        if kind == _CLEARED:
            _clear(masks, extra, n_rows, loc, ev_tier[k], ev_stamp[k], removed_ts, remover, n_locs,
                   n_groups, copies)
        else:
            slot = (ev_grp[k] * n_locs + loc) * _TIERS + ev_tier[k]
            row = _row(rows, ev_h[k])
            if kind == _STORED:
                if row < 0:  # a block never stored before: its first copy
                    row = n_rows
                    put(rows, ev_h[k], row)
                    n_rows += 1
                    _set(masks, row, slot, True)
                else:
                    _store(masks, extra, row, slot, row * n_slots + slot, copies)
                _note_content(c_first_ns, c_other_ns, ev_c[k], ev_ns[k])
            elif row >= 0:
                _remove(masks, extra, row, slot, row * n_slots + slot, ev_left[k], ev_stamp[k], loc,
                        removed_ts, remover, copies)
        k += 1
    return k, n_rows


@njit(cache=True)
def _dict_of(keys, values):
    d = Dict.empty(key_type=types.int64, value_type=types.int64)
    for i in range(keys.shape[0]):
        d[keys[i]] = values[i]
    return d


@njit(cache=True)
def _arrays_of(d):
    keys = np.empty(len(d), np.int64)
    values = np.empty(len(d), np.int64)
    for i, (key, value) in enumerate(d.items()):
        keys[i], values[i] = key, value
    return keys, values


@njit(cache=True)
def _snapshot(rows, masks, extra, removed_ts, remover, copies, c_first_ns, c_other_ns, n_rows):
    """The cache state as arrays (``replay_resume``'s ``state``): a copy, the replay goes on."""
    row_hash = np.empty(n_rows, np.int64)
    for h in range(rows.shape[0] - 1):  # (a table: analyzers/hashmap.py)
        row = rows[h, 1] - 1
        if 0 <= row < n_rows:  # rows added later are not part of the snapshot
            row_hash[row] = rows[h, 0]
    ck, cv = _arrays_of(copies)
    fk, fv = items(c_first_ns)
    ok, ov = items(c_other_ns)
    return (row_hash, masks[:n_rows].copy(), extra[:n_rows].copy(), removed_ts[:n_rows].copy(),
            remover[:n_rows].copy(), ck, cv, fk, fv, ok, ov)


@njit(cache=True)
def _outputs(n_blk):
    """The replay's outputs, unset: outcome, holder, removed_ns, remover, other namespace, cutting
    group, groups mask, serving source (see ``replay_core``)."""
    return (np.full(n_blk, -1, np.int8), np.full(n_blk, -1, np.int32), np.full(n_blk, -1, np.int64),
            np.full(n_blk, -1, np.int32), np.full(n_blk, -1, np.int32), np.full(n_blk, -1, np.int32),
            np.zeros(n_blk, np.int64), np.full(n_blk, -1, np.int8))


@njit(cache=True)
def _cache(max_rows, n_words):
    """An empty cache state of ``max_rows`` block rows: residency bits, extra-copy bits (slots
    holding more than one copy), last removal time and remover."""
    return (np.zeros((max_rows, n_words), np.int64), np.zeros((max_rows, n_words), np.int64),
            np.full(max_rows, -1, np.int64), np.full(max_rows, -1, np.int64))


@njit(cache=True, nogil=True)  # (a continuation reads the previous rows meanwhile: outcomes.Prefetch)
def replay_resume(ev_ts, ev_stamp, ev_kind, ev_loc, ev_tier, ev_grp, ev_h, ev_c, ev_ns, ev_left,
                  req_t, req_loc, req_tail, req_bs, req_off,
                  blk_h, blk_c, blk_ns, blk_xfer, n_locs, pool_loc, loc_window, loc_grp, state, snap):
    """``replay_core`` continued from ``state``, the cache after some earlier events (a tuple of
    arrays: each dense row's block hash, residency and extra-copy bit words, last removal time
    and remover; the extra copies, and the content-to-namespace maps, as key and value arrays),
    with ``loc_grp`` (the groups each location publishes, over the whole stream) given.

    ``ev_ts`` orders (a look-up at ``t`` sees the events with ``ev_ts < t``); ``ev_stamp`` is the
    time a removal records. Returns ``replay_core``'s outputs and, when ``snap`` >= 0, the state
    after exactly the events with ``ev_ts < snap`` (else an empty one)."""
    n_blk = blk_h.shape[0]
    n_groups = loc_window.shape[1]
    out, holder, rem_ts, rem_loc, other_ns, cut_grp, grp_mask, served = _outputs(n_blk)
    n_words = (_TIERS * n_locs * n_groups + _BITS - 1) // _BITS
    row_hash, st_masks, st_extra, st_removed, st_remover, ck, cv, fk, fv, ok, ov = state
    n_rows = row_hash.shape[0]
    stores = int(np.sum(ev_kind == _STORED))
    max_rows = max(n_rows + stores, 1)  # a row per distinct stored block at most
    masks, extra, removed_ts, remover = _cache(max_rows, n_words)
    masks[:n_rows] = st_masks
    extra[:n_rows] = st_extra
    removed_ts[:n_rows] = st_removed
    remover[:n_rows] = st_remover
    rows = table(max_rows)  # block hash -> row, and content -> namespaces: each store adds one key at most
    for row in range(n_rows):
        put(rows, row_hash[row], row)
    c_first_ns = table_of(fk, fv, stores)
    c_other_ns = table_of(ok, ov, stores)
    copies = _dict_of(ck, cv)  # extra copies per (row, slot)
    most = 1
    for i in range(req_t.shape[0]):
        most = max(most, req_off[i + 1] - req_off[i])
    src = np.empty((most, n_groups), np.int8)
    brow = np.empty(most, np.int64)
    grp_on = np.zeros(n_groups, np.bool_)
    grp_need = np.zeros(n_groups, np.int64)
    n_ev = ev_ts.shape[0]
    snap_k = np.searchsorted(ev_ts, snap) if snap >= 0 else -1
    saved = state  # replaced by the snapshot when one is asked for
    no_bound = np.iinfo(np.int64).max
    k = 0
    for i in range(req_t.shape[0]):
        t = req_t[i]
        # The snapshot comes first when every event before its place is ordered before t.
        if snap_k >= k and (snap_k == 0 or ev_ts[snap_k - 1] < t):
            k, n_rows = _apply(k, snap_k, no_bound, ev_ts, ev_kind, ev_loc, ev_tier, ev_grp, ev_h, ev_c,
                               ev_ns, ev_left, ev_stamp, masks, extra, removed_ts, remover, rows, copies,
                               c_first_ns, c_other_ns, n_rows, n_locs, n_groups)
            saved = _snapshot(rows, masks, extra, removed_ts, remover, copies, c_first_ns, c_other_ns, n_rows)
            snap_k = -1
        k, n_rows = _apply(k, n_ev, t, ev_ts, ev_kind, ev_loc, ev_tier, ev_grp, ev_h, ev_c, ev_ns, ev_left,
                           ev_stamp, masks, extra, removed_ts, remover, rows, copies, c_first_ns, c_other_ns,
                           n_rows, n_locs, n_groups)
        b0, b1 = req_off[i], req_off[i + 1]
        n = b1 - b0
        if n == 0:
            continue
        r = np.int64(req_loc[i])
        n_on, n_full, every, g0 = _groups(r, req_bs[i], loc_grp, loc_window, grp_on, grp_need)
        if n_on == 0:
            out[b0:b1] = _UNOBSERVED
            continue
        if n_on == 1 and n_full == 1:
            _dense(b0, n, g0, r, req_tail[i], every, rows, masks, pool_loc, n_locs, n_words, n_groups, blk_h,
                   blk_xfer, blk_c, blk_ns, c_first_ns, c_other_ns, removed_ts, remover, out, holder, rem_ts,
                   rem_loc, other_ns, grp_mask, served)
            continue
        for kk in range(n):
            row = _row(rows, blk_h[b0 + kk])
            brow[kk] = row
            for g in range(n_groups):
                src[kk, g] = _source(masks, row, g, r, pool_loc, n_locs, blk_xfer[b0 + kk]) \
                    if grp_on[g] else _SRC_NONE
        _decide(b0, n, req_tail[i], src, grp_on, grp_need, n_on, n_full, every, out, cut_grp, grp_mask,
                served)
        for kk in range(n):
            if out[b0 + kk] == _PENDING:
                _miss(b0 + kk, kk, src, brow, masks, grp_on, r, pool_loc, n_words, n_locs, blk_xfer, blk_c,
                      blk_ns, c_first_ns, c_other_ns, removed_ts, remover, out, holder, rem_ts, rem_loc,
                      other_ns)
    if snap_k >= k:  # the snapshot place lies past every look-up
        k, n_rows = _apply(k, snap_k, no_bound, ev_ts, ev_kind, ev_loc, ev_tier, ev_grp, ev_h, ev_c, ev_ns,
                           ev_left, ev_stamp, masks, extra, removed_ts, remover, rows, copies, c_first_ns,
                           c_other_ns, n_rows, n_locs, n_groups)
        saved = _snapshot(rows, masks, extra, removed_ts, remover, copies, c_first_ns, c_other_ns, n_rows)
    return (out, holder, rem_ts, rem_loc, other_ns, cut_grp, grp_mask, served), saved


@njit(cache=True, inline="always")
def _groups(r, bs, loc_grp, loc_window, grp_on, grp_need):
    """Fills which KV cache groups a request on location ``r`` looks up (``grp_on``) and how many
    contiguous blocks each sliding one needs (``grp_need``, 0 for full attention); returns (groups
    on, full-attention groups on, their bit mask, the last group on)."""
    n_on, n_full = 0, 0
    every = np.int64(0)
    g0 = -1
    for g in range(loc_grp.shape[1]):
        grp_on[g] = loc_grp[r, g]
        if grp_on[g]:
            n_on += 1
            every |= np.int64(1) << min(g, 62)
            g0 = g
            window = loc_window[r, g]
            if window <= 0:
                grp_need[g] = 0
                n_full += 1
            else:  # ceil((window - 1) / B), vLLM's _contiguous_blocks_for_hit without EAGLE
                grp_need[g] = max((window - 1 + bs - 1) // bs, 1)
    return n_on, n_full, every, g0


@njit(cache=True)
def _decide(b0, n, tail, src, grp_on, grp_need, n_on, n_full, every, out, cut_grp, grp_mask, served):
    """One request's hit from its blocks' sources (``src[0:n]``, a row per block): the hits, a
    ``recomputed_last`` and the blocks another group cut short are decided here; every other block
    is left ``_PENDING``, a miss whose cause the caller finds (``_miss``)."""
    n_groups = grp_on.shape[0]
    hit, full, cut = _hybrid_hit(src, grp_on, grp_need, n_full, n if tail else n - 1)
    # Every block held: by the full groups, or (no full group) the hit reaching the cap.
    if n_full > 0:
        whole = _full_chain(src, grp_on, grp_need, n, n) == n
    else:
        whole = hit == n - 1 and _all_on(src, grp_on, n - 1)
    for kk in range(n):
        j = b0 + kk
        if kk < hit:
            best = SRC_GPU
            mask = np.int64(0)
            for g in range(n_groups):
                if grp_on[g] and (grp_need[g] == 0 or kk >= hit - grp_need[g]):
                    best = max(best, src[kk, g])
                    mask |= np.int64(1) << min(g, 62)
            out[j], grp_mask[j], served[j] = _SRC_OUTCOME[best], mask, best
            continue
        grp_mask[j] = every
        if kk == n - 1 and not tail and whole:
            out[j] = _RECOMPUTED_LAST
        elif n_full > 0 and n_on > n_full and kk < full:
            out[j], cut_grp[j] = _GROUP, cut
        else:
            out[j] = _PENDING


@njit(cache=True, inline="always")
def _dense(b0, n, g, r, tail, every, rows, masks, pool_loc, n_locs, n_words, n_groups, blk_h, blk_xfer, blk_c,
           blk_ns, c_first_ns, c_other_ns, removed_ts, remover, out, holder, rem_ts, rem_loc, other_ns,
           grp_mask, served):
    """One request on a location with one full-attention group (a dense model): the hybrid rule
    reduces to the chain rule, decided in one pass (the same decisions as the general path, written
    out: this loop is most of the ledger's time)."""
    here = (g * n_locs + r) * _TIERS
    pool_at = (g * n_locs + pool_loc) * _TIERS if pool_loc >= 0 else -1
    chain = True
    for j in range(b0, b0 + n):
        row = _row(rows, blk_h[j])
        grp_mask[j] = every
        gpu = _has(masks, row, here)
        if chain and gpu:  # the common hit first: nothing else to look up
            out[j] = _HIT_LOCAL
            served[j] = SRC_GPU
            continue
        cpu = _has(masks, row, here + 1)
        disk = _has(masks, row, here + 2)
        x = blk_xfer[j]
        pooled = pool_at >= 0 and (_has(masks, row, pool_at) or _has(masks, row, pool_at + 1)
                                   or _has(masks, row, pool_at + 2))
        if chain and gpu:
            out[j] = _HIT_LOCAL
            served[j] = SRC_GPU
        elif chain and (cpu or disk):
            out[j] = _HIT_OFFLOAD
            served[j] = SRC_CPU if cpu else SRC_DISK
        elif chain and x == XFER_OK:
            out[j] = _HIT_REMOTE
            served[j] = SRC_TRANSFER
        elif chain and pooled and x != XFER_FAILED:
            out[j] = _HIT_REMOTE
            served[j] = SRC_POOL
        elif x == XFER_FAILED:
            out[j] = _LOAD_FAILED
            chain = False
        elif gpu or cpu or disk or x == XFER_OK or pooled:
            out[j] = _AFTER_GAP
            chain = False
        else:  # _cause's decisions, written out: a call per block would pay reference counting
            chain = False
            where = _holder(masks, row, r, pool_loc, n_words, n_locs, n_groups) if row >= 0 else -1
            if where >= 0:
                out[j], holder[j] = _ROUTING, where
            elif row >= 0:
                out[j], rem_ts[j], rem_loc[j] = _EVICTED, removed_ts[row], remover[row]
            else:
                other_ns[j] = _other_namespace(c_first_ns, c_other_ns, blk_c[j], blk_ns[j])
                out[j] = _INCOMPATIBLE if other_ns[j] >= 0 else _COLD
    if chain and not tail:
        out[b0 + n - 1], served[b0 + n - 1] = _RECOMPUTED_LAST, -1


@njit(cache=True, inline="always")
def _cause(j, row, masks, r, pool_loc, n_words, n_locs, n_groups, blk_c, blk_ns, c_first_ns, c_other_ns,
           removed_ts, remover, out, holder, rem_ts, rem_loc, other_ns):
    """A block available nowhere to the request: held elsewhere, evicted, stored under another key, cold."""
    where = _holder(masks, row, r, pool_loc, n_words, n_locs, n_groups) if row >= 0 else -1
    if where >= 0:
        out[j], holder[j] = _ROUTING, where
    elif row >= 0:  # stored somewhere before, resident nowhere now
        out[j], rem_ts[j], rem_loc[j] = _EVICTED, removed_ts[row], remover[row]
    else:
        other_ns[j] = _other_namespace(c_first_ns, c_other_ns, blk_c[j], blk_ns[j])
        out[j] = _INCOMPATIBLE if other_ns[j] >= 0 else _COLD


@njit(cache=True)
def _all_on(src, grp_on, kk):
    """Block ``kk`` is available in every group of the request."""
    for g in range(grp_on.shape[0]):  # noqa: SIM110 (a loop numba compiles; a generator it does not)
        if grp_on[g] and src[kk, g] >= _SRC_FAILED:
            return False
    return True


@njit(cache=True, inline="always")
def _miss(j, kk, src, brow, masks, grp_on, r, pool_loc, n_words, n_locs, blk_xfer, blk_c, blk_ns,
          c_first_ns, c_other_ns, removed_ts, remover, out, holder, rem_ts, rem_loc, other_ns):
    """A block past the hit that no group cut short: DESIGN.md's miss causes, in order."""
    if blk_xfer[j] == XFER_FAILED:
        out[j] = _LOAD_FAILED
        return
    for g in range(grp_on.shape[0]):
        if grp_on[g] and src[kk, g] < _SRC_FAILED:
            out[j] = _AFTER_GAP
            return
    _cause(j, brow[kk], masks, r, pool_loc, n_words, n_locs, grp_on.shape[0], blk_c, blk_ns, c_first_ns,
           c_other_ns, removed_ts, remover, out, holder, rem_ts, rem_loc, other_ns)


# -- the replay in two phases (analyzers/partitions.py; docs/scale.md) ------------------------------
# Phase 1 needs one block's events only, so it runs per block-hash partition; phase 2 needs one
# request's blocks only, so it runs per request. Together they decide what ``replay_resume`` does.

CAUSE_NONE, CAUSE_HELD, CAUSE_REMOVED, CAUSE_NEVER = 0, 1, 2, 3  # why a block is available nowhere


@njit(cache=True)
def block_states(ev_place, ev_stamp, ev_kind, ev_loc, ev_tier, ev_grp, ev_h, ev_left,
                 row_t, row_loc, blk_h, blk_xfer, n_locs, pool_loc, loc_grp, snap):
    """Phase 1: each needed block's state at its request's look-up, from the events of its own
    hash (and every clear): per block row, its source in each group the request's location looks
    up (a SRC_ code, ``_SRC_NONE`` for a group not looked up) and, when no group has it and no
    load failed, why (``CAUSE_HELD`` with the holder, ``CAUSE_REMOVED`` with the last removal,
    or ``CAUSE_NEVER``). Rows are given in look-up order (``row_t``, their request's place in
    the stream: a row sees the events with ``ev_place < row_t``).

    With ``snap`` >= 0, also this partition's cache after exactly the events with ``ev_place <
    snap`` (look-ups change no state, so it is the one-process replay's at that place, restricted
    to this partition's blocks): its rows' hashes, residency and extra-copy words, last removals
    and extra copies (keys ``row * slots + slot``), as ``_snapshot`` gives them, without the
    content maps (content is phase 2's); empty arrays when ``snap`` < 0."""
    n_groups = loc_grp.shape[1]
    n_words = (_TIERS * n_locs * n_groups + _BITS - 1) // _BITS
    n_blk = blk_h.shape[0]
    src = np.full((n_blk, n_groups), _SRC_NONE, np.int8)
    cause = np.zeros(n_blk, np.int8)
    holder = np.full(n_blk, -1, np.int32)
    rem_ts = np.full(n_blk, -1, np.int64)
    rem_loc = np.full(n_blk, -1, np.int32)
    max_rows = max(int(np.sum(ev_kind == _STORED)), 1)
    masks, extra, removed_ts, remover = _cache(max_rows, n_words)
    none = np.zeros(0, np.int64)
    rows = table(max_rows)
    copies = _dict_of(none, none)
    c_first_ns = table(0)  # content is phase 2's (content_namespaces): left empty here
    c_other_ns = table(0)
    no_content = np.zeros(ev_kind.shape[0], np.int64)
    saved = _snapshot(rows, masks, extra, removed_ts, remover, copies, c_first_ns, c_other_ns, 0)
    snapped = snap < 0
    n_rows = 0
    k = 0
    n_ev = ev_kind.shape[0]
    for j in range(n_blk + 1):
        if not snapped and (j == n_blk or row_t[j] >= snap):
            # every event applied so far lies before row_t[j - 1] <= snap: apply up to snap, copy
            k, n_rows = _apply(k, n_ev, snap, ev_place, ev_kind, ev_loc, ev_tier, ev_grp, ev_h, no_content,
                               no_content, ev_left, ev_stamp, masks, extra, removed_ts, remover, rows, copies,
                               c_first_ns, c_other_ns, n_rows, n_locs, n_groups)
            saved = _snapshot(rows, masks, extra, removed_ts, remover, copies, c_first_ns, c_other_ns, n_rows)
            snapped = True
        if j == n_blk:
            break
        k, n_rows = _apply(k, n_ev, row_t[j], ev_place, ev_kind, ev_loc, ev_tier, ev_grp, ev_h, no_content,
                           no_content, ev_left, ev_stamp, masks, extra, removed_ts, remover, rows, copies,
                           c_first_ns, c_other_ns, n_rows, n_locs, n_groups)
        r = np.int64(row_loc[j])
        row = _row(rows, blk_h[j])
        seen = False
        for g in range(n_groups):
            if loc_grp[r, g]:
                src[j, g] = _source(masks, row, g, r, pool_loc, n_locs, blk_xfer[j])
                seen = seen or src[j, g] < _SRC_FAILED
        if seen or blk_xfer[j] == XFER_FAILED:
            continue
        where = _holder(masks, row, r, pool_loc, n_words, n_locs, n_groups) if row >= 0 else -1
        if where >= 0:
            cause[j], holder[j] = CAUSE_HELD, where
        elif row >= 0:
            cause[j], rem_ts[j], rem_loc[j] = CAUSE_REMOVED, removed_ts[row], remover[row]
        else:
            cause[j] = CAUSE_NEVER
    return (src, cause, holder, rem_ts, rem_loc, saved[0], saved[1], saved[2], saved[3], saved[4], saved[5],
            saved[6])


@njit(cache=True)
def decide_requests(req_loc, req_tail, req_bs, req_off, loc_grp, loc_window, src, blk_xfer, cause,
                    blk_holder, blk_rem_ts, blk_rem_loc, blk_other_ns):
    """Phase 2: every request's outcomes from its blocks' phase-1 states (``block_states``) and
    ``blk_other_ns`` (the other namespace its content was stored under by the look-up, or -1):
    ``replay_core``'s outputs."""
    n_blk = src.shape[0]
    n_groups = loc_grp.shape[1]
    out, holder, rem_ts, rem_loc, other_ns, cut_grp, grp_mask, served = _outputs(n_blk)
    grp_on = np.zeros(n_groups, np.bool_)
    grp_need = np.zeros(n_groups, np.int64)
    for i in range(req_loc.shape[0]):
        b0, b1 = req_off[i], req_off[i + 1]
        if b1 == b0:
            continue
        r = np.int64(req_loc[i])
        n_on, n_full, every, _ = _groups(r, req_bs[i], loc_grp, loc_window, grp_on, grp_need)
        if n_on == 0:
            out[b0:b1] = _UNOBSERVED
            continue
        _decide(b0, b1 - b0, req_tail[i], src[b0:b1], grp_on, grp_need, n_on, n_full, every, out, cut_grp,
                grp_mask, served)
        for j in range(b0, b1):
            if out[j] != _PENDING:
                continue
            if blk_xfer[j] == XFER_FAILED:
                out[j] = _LOAD_FAILED
            elif cause[j] == CAUSE_NONE:  # available in some group, past the hit
                out[j] = _AFTER_GAP
            elif cause[j] == CAUSE_HELD:
                out[j], holder[j] = _ROUTING, blk_holder[j]
            elif cause[j] == CAUSE_REMOVED:
                out[j], rem_ts[j], rem_loc[j] = _EVICTED, blk_rem_ts[j], blk_rem_loc[j]
            else:
                other_ns[j] = blk_other_ns[j]
                out[j] = _INCOMPATIBLE if other_ns[j] >= 0 else _COLD
    return out, holder, rem_ts, rem_loc, other_ns, cut_grp, grp_mask, served
