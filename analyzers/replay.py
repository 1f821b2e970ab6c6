"""Analyzers: the cache-state replay core, compiled: KV events and block look-ups -> outcome codes.

Inputs are integer arrays (the caller encodes replicas, tiers and namespaces); the core walks
the events in time order and, at each request's look-up time, decides every needed full
block's outcome in DESIGN.md's order. Conventions, all relied on by the ledger:

- A look-up at time t sees the events with ``ts < t`` (strictly before): a request never
  sees its own stores. Events are given already sorted (stably, by time then sequence).
- Residency is per (block, location, tier); tier 0 is the GPU, tier 1 any lower tier (CPU,
  disk). The shared pool is a location of its own. A duplicate store is idempotent.
- Each block ever stored gets a dense row (one dict look-up per block); its residency is a row
  of bit words, bit ``2·location + tier``, 62 bits per int64 word so that a location's two
  tiers share a word. One look-up answers "here, on GPU", "here, lower tier" and "elsewhere".
- ``cleared`` empties one tier of a location (or both, with tier -1): each entry there is
  removed at the clear's time. Clears are rare (a reset, a publisher restart), so the scan of
  the residency map they cost is paid seldom.
- The chain rule: a block is a hit only while every earlier block of the request was one;
  a resident block after a miss is ``miss_after_gap``. A prompt without a partial tail whose
  every full block would hit gives its last block back (``recomputed_last``): the engine
  computes at least one prompt token.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.typed import Dict

from kvlens.schema import Outcome

__all__ = ["OUTCOME_CODES", "XFER_FAILED", "XFER_NONE", "XFER_OK", "replay_core"]

OUTCOME_CODES: tuple[Outcome, ...] = tuple(Outcome)
_HIT_LOCAL, _HIT_OFFLOAD, _HIT_REMOTE, _RECOMPUTED_LAST, _LOAD_FAILED, _AFTER_GAP, _ROUTING, \
    _EVICTED, _INCOMPATIBLE, _COLD = range(10)
XFER_NONE, XFER_OK, XFER_FAILED = 0, 1, 2
_STORED, _REMOVED, _CLEARED = 0, 1, 2
_NO_NS = -1

_NO_ROW = np.int64(-1)
_BITS = 62  # per int64 word; even, so both tier bits of a location sit in one word


@njit(cache=True)
def _row(rows, h):
    """The block's dense row, or -1 if it was never stored (typed-dict get is Optional)."""
    if h in rows:
        return rows[h]
    return _NO_ROW


@njit(cache=True)
def _has(masks, row, slot):
    return row >= 0 and (masks[row, slot // _BITS] >> (slot % _BITS)) & 1 == 1


@njit(cache=True)
def _drop(masks, row, slot, ts, loc, removed_ts, remover):
    masks[row, slot // _BITS] &= ~(np.int64(1) << (slot % _BITS))
    removed_ts[row] = ts
    remover[row] = loc


@njit(cache=True)
def _clear(masks, n_rows, loc, tier, ts, removed_ts, remover):
    for t in range(2):
        if tier < 0 or tier == t:
            slot = loc * 2 + t
            for row in range(n_rows):
                if _has(masks, row, slot):
                    _drop(masks, row, slot, ts, loc, removed_ts, remover)


@njit(cache=True)
def _holder(masks, row, own_loc, n_words):
    """The lowest location other than ``own_loc`` holding the block in any tier, or -1."""
    for w in range(n_words):
        m = masks[row, w]
        for b in range(_BITS):
            if (m >> b) & 1 == 1:
                loc = (w * _BITS + b) // 2
                if loc != own_loc:
                    return loc
    return -1


@njit(cache=True)
def _note_content(c_first_ns, c_other_ns, c, ns):
    if c == 0 or ns == _NO_NS:
        return
    if c not in c_first_ns:
        c_first_ns[c] = ns
    elif c_first_ns[c] != ns and c not in c_other_ns:
        c_other_ns[c] = ns


@njit(cache=True)
def _other_namespace(c_first_ns, c_other_ns, c, ns):
    """A namespace other than ``ns`` that the same content was stored under, or -1."""
    if c == 0 or ns == _NO_NS or c not in c_first_ns:
        return -1
    if c_first_ns[c] != ns:
        return c_first_ns[c]
    if c in c_other_ns:
        return c_other_ns[c]
    return -1


@njit(cache=True)
def replay_core(ev_ts, ev_kind, ev_loc, ev_tier, ev_h, ev_c, ev_ns,
                req_t, req_loc, req_tail, req_off,
                blk_h, blk_c, blk_ns, blk_xfer, n_locs):
    """Outcome code per needed block, plus holder, removed_ns, remover and other namespace.

    ``req_off`` has one more entry than requests: request i needs blocks
    ``req_off[i]:req_off[i+1]`` (full blocks only, in position order). A content hash of 0
    and a namespace of -1 mean unknown. Requests are given in look-up-time order.
    """
    n_blk = blk_h.shape[0]
    out = np.full(n_blk, -1, np.int8)
    holder = np.full(n_blk, -1, np.int32)
    rem_ts = np.full(n_blk, -1, np.int64)
    rem_loc = np.full(n_blk, -1, np.int32)
    other_ns = np.full(n_blk, -1, np.int32)
    n_words = (2 * n_locs + _BITS - 1) // _BITS
    max_rows = max(int(np.sum(ev_kind == _STORED)), 1)  # a row per distinct stored block at most
    masks = np.zeros((max_rows, n_words), np.int64)
    removed_ts = np.full(max_rows, -1, np.int64)
    remover = np.full(max_rows, -1, np.int64)
    rows = Dict.empty(key_type=types.int64, value_type=types.int64)
    c_first_ns = Dict.empty(key_type=types.int64, value_type=types.int64)
    c_other_ns = Dict.empty(key_type=types.int64, value_type=types.int64)
    n_rows = 0
    k = 0
    n_ev = ev_ts.shape[0]
    for i in range(req_t.shape[0]):
        t = req_t[i]
        while k < n_ev and ev_ts[k] < t:
            kind, loc = ev_kind[k], np.int64(ev_loc[k])
            if kind == _CLEARED:
                _clear(masks, n_rows, loc, ev_tier[k], ev_ts[k], removed_ts, remover)
            else:
                slot = loc * 2 + ev_tier[k]
                row = _row(rows, ev_h[k])
                if kind == _STORED:
                    if row < 0:
                        row = n_rows
                        rows[ev_h[k]] = row
                        n_rows += 1
                    masks[row, slot // _BITS] |= np.int64(1) << (slot % _BITS)
                    _note_content(c_first_ns, c_other_ns, ev_c[k], ev_ns[k])
                elif _has(masks, row, slot):
                    _drop(masks, row, slot, ev_ts[k], loc, removed_ts, remover)
            k += 1
        r = np.int64(req_loc[i])
        chain = True
        for j in range(req_off[i], req_off[i + 1]):
            row = _row(rows, blk_h[j])
            gpu = _has(masks, row, r * 2)
            low = _has(masks, row, r * 2 + 1)
            x = blk_xfer[j]
            if chain and gpu:
                out[j] = _HIT_LOCAL
            elif chain and low:
                out[j] = _HIT_OFFLOAD
            elif chain and x == XFER_OK:
                out[j] = _HIT_REMOTE
            elif x == XFER_FAILED:
                out[j] = _LOAD_FAILED
                chain = False
            elif gpu or low or x == XFER_OK:
                out[j] = _AFTER_GAP
                chain = False
            else:
                chain = False
                where = _holder(masks, row, r, n_words) if row >= 0 else -1
                if where >= 0:
                    out[j], holder[j] = _ROUTING, where
                elif row >= 0:  # stored somewhere before, resident nowhere now
                    out[j], rem_ts[j], rem_loc[j] = _EVICTED, removed_ts[row], remover[row]
                else:
                    other_ns[j] = _other_namespace(c_first_ns, c_other_ns, blk_c[j], blk_ns[j])
                    out[j] = _INCOMPATIBLE if other_ns[j] >= 0 else _COLD
        last = req_off[i + 1] - 1
        if chain and not req_tail[i] and last >= req_off[i]:
            out[last] = _RECOMPUTED_LAST
    return out, holder, rem_ts, rem_loc, other_ns
