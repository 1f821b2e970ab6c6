"""The pure-Python cache-state replay: the oracle for analyzers/replay.py and the bench baseline.

Same inputs and outputs as ``analyzers.replay.replay_core``, written plainly with dicts and
sets, one decision per line, in DESIGN.md's outcome order.
"""

from __future__ import annotations

from typing import Any

HIT_LOCAL, HIT_OFFLOAD, HIT_REMOTE, RECOMPUTED_LAST, LOAD_FAILED, AFTER_GAP, ROUTING, EVICTED, \
    INCOMPATIBLE, COLD = range(10)


def replay_py(ev_ts: Any, ev_kind: Any, ev_loc: Any, ev_tier: Any, ev_h: Any, ev_c: Any, ev_ns: Any,
              req_t: Any, req_loc: Any, req_tail: Any, req_off: Any, blk_h: Any, blk_c: Any, blk_ns: Any,
              blk_xfer: Any, n_locs: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    resident: set[tuple[int, int, int]] = set()  # (hash, loc, tier)
    stored_ever: set[int] = set()
    last_removal: dict[int, tuple[int, int]] = {}  # hash -> (ts, loc)
    content_ns: dict[int, list[int]] = {}  # content -> distinct namespaces in store order
    n = len(blk_h)
    out, holder, rem_ts, rem_loc, other = [-1] * n, [-1] * n, [-1] * n, [-1] * n, [-1] * n
    ev = list(zip(ev_ts, ev_kind, ev_loc, ev_tier, ev_h, ev_c, ev_ns, strict=True))
    k = 0
    for i in range(len(req_t)):
        while k < len(ev) and ev[k][0] < req_t[i]:
            ts, kind, loc, tier, h, c, ns = (int(x) for x in ev[k])
            k += 1
            if kind == 2:
                for entry in [e for e in resident if e[1] == loc and (tier < 0 or e[2] == tier)]:
                    resident.discard(entry)
                    last_removal[entry[0]] = (ts, loc)
            elif kind == 0:
                resident.add((h, loc, tier))
                stored_ever.add(h)
                if c != 0 and ns != -1 and ns not in content_ns.setdefault(c, []):
                    content_ns[c].append(ns)
            elif (h, loc, tier) in resident:
                resident.discard((h, loc, tier))
                last_removal[h] = (ts, loc)
        r = int(req_loc[i])
        chain = True
        for j in range(int(req_off[i]), int(req_off[i + 1])):
            h = int(blk_h[j])
            gpu, low, x = (h, r, 0) in resident, (h, r, 1) in resident, int(blk_xfer[j])
            if chain and gpu:
                out[j] = HIT_LOCAL
            elif chain and low:
                out[j] = HIT_OFFLOAD
            elif chain and x == 1:
                out[j] = HIT_REMOTE
            elif x == 2:
                out[j], chain = LOAD_FAILED, False
            elif gpu or low or x == 1:
                out[j], chain = AFTER_GAP, False
            else:
                chain = False
                holders = sorted(loc for (hh, loc, _t) in resident if hh == h and loc != r)
                others = [s for s in content_ns.get(int(blk_c[j]), []) if s != int(blk_ns[j])]
                if holders:
                    out[j], holder[j] = ROUTING, holders[0]
                elif h in stored_ever:
                    out[j] = EVICTED
                    rem_ts[j], rem_loc[j] = last_removal.get(h, (-1, -1))
                elif int(blk_c[j]) != 0 and int(blk_ns[j]) != -1 and others:
                    out[j], other[j] = INCOMPATIBLE, others[0]
                else:
                    out[j] = COLD
        last = int(req_off[i + 1]) - 1
        if chain and not req_tail[i] and last >= int(req_off[i]):
            out[last] = RECOMPUTED_LAST
    return out, holder, rem_ts, rem_loc, other
