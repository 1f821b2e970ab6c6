"""Analyzers: the cache-state replay core, compiled: KV events and block look-ups -> outcome codes.

Inputs are integer arrays (the caller encodes replicas, tiers and namespaces); the core walks
the events in time order and, at each request's look-up time, decides every needed full
block's outcome in DESIGN.md's order. Conventions, all relied on by the ledger:

- A look-up at time t sees the events with ``ts < t`` (strictly before): a request never
  sees its own stores. Events are given already sorted (stably, by time then sequence).
- Residency is per (block, location, tier); tier 0 is the GPU, tier 1 any lower tier (CPU,
  disk). The shared pool is a location of its own. A duplicate store is idempotent.
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

_key_t = types.UniTuple(types.int64, 2)


@njit(cache=True)
def _resident(res, h, loc, tier):
    return (h, np.int64(loc * 2 + tier)) in res


@njit(cache=True)
def _clear(res, loc, tier, ts, removed_ts, remover):
    gone = []
    for key in res:
        slot = key[1]
        if slot // 2 == loc and (tier < 0 or slot % 2 == tier):
            gone.append(key)
    for key in gone:
        del res[key]
        removed_ts[key[0]] = ts
        remover[key[0]] = np.int64(loc)


@njit(cache=True)
def _apply(ev_kind, ev_loc, ev_tier, ev_h, ev_c, ev_ns, ev_ts, k, res, first_store, removed_ts, remover,
           c_first_ns, c_other_ns):
    kind, loc, tier = ev_kind[k], ev_loc[k], ev_tier[k]
    if kind == _CLEARED:
        _clear(res, loc, tier, ev_ts[k], removed_ts, remover)
        return
    h = ev_h[k]
    key = (h, np.int64(loc * 2 + tier))
    if kind == _STORED:
        res[key] = np.int64(1)
        if h not in first_store:
            first_store[h] = ev_ts[k]
        ns = ev_ns[k]
        if ev_c[k] != 0 and ns != _NO_NS:
            c = ev_c[k]
            if c not in c_first_ns:
                c_first_ns[c] = ns
            elif c_first_ns[c] != ns and c not in c_other_ns:
                c_other_ns[c] = ns
    elif key in res:
        del res[key]
        removed_ts[h] = ev_ts[k]
        remover[h] = loc


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
    res = Dict.empty(key_type=_key_t, value_type=types.int64)
    first_store = Dict.empty(key_type=types.int64, value_type=types.int64)
    removed_ts = Dict.empty(key_type=types.int64, value_type=types.int64)
    remover = Dict.empty(key_type=types.int64, value_type=types.int64)
    c_first_ns = Dict.empty(key_type=types.int64, value_type=types.int64)
    c_other_ns = Dict.empty(key_type=types.int64, value_type=types.int64)
    k = 0
    n_ev = ev_ts.shape[0]
    for i in range(req_t.shape[0]):
        t = req_t[i]
        while k < n_ev and ev_ts[k] < t:
            _apply(ev_kind, ev_loc, ev_tier, ev_h, ev_c, ev_ns, ev_ts, k, res, first_store, removed_ts,
                   remover, c_first_ns, c_other_ns)
            k += 1
        r = req_loc[i]
        chain = True
        for j in range(req_off[i], req_off[i + 1]):
            h = blk_h[j]
            gpu = _resident(res, h, r, 0)
            low = _resident(res, h, r, 1)
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
                out[j] = _miss_cause(h, blk_c[j], blk_ns[j], r, n_locs, res, first_store, removed_ts,
                                     remover, c_first_ns, c_other_ns, j, holder, rem_ts, rem_loc, other_ns)
        last = req_off[i + 1] - 1
        if chain and not req_tail[i] and last >= req_off[i]:
            out[last] = _RECOMPUTED_LAST
    return out, holder, rem_ts, rem_loc, other_ns


@njit(cache=True)
def _miss_cause(h, c, ns, r, n_locs, res, first_store, removed_ts, remover, c_first_ns, c_other_ns,
                j, holder, rem_ts, rem_loc, other_ns):
    for loc in range(n_locs):
        if loc != r and (_resident(res, h, loc, 0) or _resident(res, h, loc, 1)):
            holder[j] = loc
            return _ROUTING
    if h in first_store:
        if h in removed_ts:
            rem_ts[j] = removed_ts[h]
            rem_loc[j] = remover[h]
        return _EVICTED
    if c != 0 and ns != _NO_NS and c in c_first_ns:
        if c_first_ns[c] != ns:
            other_ns[j] = c_first_ns[c]
            return _INCOMPATIBLE
        if c in c_other_ns:
            other_ns[j] = c_other_ns[c]
            return _INCOMPATIBLE
    return _COLD
