"""The pure-Python cache-state replay: the oracle for analyzers/replay.py and the bench baseline.

Same inputs and outputs as ``analyzers.replay.replay_core``, written plainly with dicts and
sets, one decision per line, in DESIGN.md's outcome order. The hybrid hit rule is written the
way vLLM 0.32 writes it (kv_cache_coordinator.py, single_type_kv_cache_manager.py): full groups
scan left to right, sliding groups right to left for ``ceil((window - 1) / B)`` contiguous blocks.
"""

from __future__ import annotations

from typing import Any

from kvlens.schema import Outcome

CODE = {o: i for i, o in enumerate(Outcome)}
GPU, CPU, DISK, TRANSFER, POOL, FAILED, NONE = range(7)  # a block's sources, slowest last
HIT = {GPU: CODE[Outcome.HIT_LOCAL], CPU: CODE[Outcome.HIT_OFFLOAD], DISK: CODE[Outcome.HIT_OFFLOAD],
       TRANSFER: CODE[Outcome.HIT_REMOTE], POOL: CODE[Outcome.HIT_REMOTE]}


def _sliding_hit(avail: list[bool], m: int, need: int) -> int:
    run = 0
    for k in range(m - 1, -1, -1):
        if avail[k]:
            run += 1
            if run >= need:
                return k + run
        else:
            run = 0
    return run


def _prefix(avail: list[bool], limit: int) -> int:
    k = 0
    while k < limit and avail[k]:
        k += 1
    return k


def replay_py(ev_ts: Any, ev_kind: Any, ev_loc: Any, ev_tier: Any, ev_grp: Any, ev_h: Any, ev_c: Any,
              ev_ns: Any, ev_left: Any, req_t: Any, req_loc: Any, req_tail: Any, req_bs: Any, req_off: Any,
              blk_h: Any, blk_c: Any, blk_ns: Any, blk_xfer: Any, n_locs: int, pool_loc: int,
              loc_window: Any) -> tuple[list[int], ...]:
    n_groups = len(loc_window[0])
    copies: dict[tuple[int, int, int, int], int] = {}  # (hash, group, loc, tier) -> physical copies
    stored_ever: set[int] = set()
    last_removal: dict[int, tuple[int, int]] = {}  # hash -> (ts, loc)
    content_ns: dict[int, list[int]] = {}  # content -> distinct namespaces in store order
    n_blk = len(blk_h)
    out, holder, rem_ts, rem_loc, other = ([-1] * n_blk for _ in range(5))
    cut_grp, mask, served = [-1] * n_blk, [0] * n_blk, [-1] * n_blk
    ev = list(zip(ev_ts, ev_kind, ev_loc, ev_tier, ev_grp, ev_h, ev_c, ev_ns, ev_left, strict=True))
    published = {(int(e[2]), int(e[4])) for e in ev if int(e[1]) != 2}  # (loc, group), whole stream
    k = 0
    for i in range(len(req_t)):
        while k < len(ev) and ev[k][0] < req_t[i]:
            ts, kind, loc, tier, g, h, c, ns, left = (int(x) for x in ev[k])
            k += 1
            if kind == 2:
                for entry in [e for e in copies if e[2] == loc and (tier < 0 or e[3] == tier)]:
                    del copies[entry]
                    last_removal[entry[0]] = (ts, loc)
                continue
            key = (h, g, loc, tier)
            if kind == 0:
                copies[key] = copies.get(key, 0) + 1
                stored_ever.add(h)
                if c != 0 and ns != -1 and ns not in content_ns.setdefault(c, []):
                    content_ns[c].append(ns)
            elif key in copies:
                copies[key] = copies[key] - 1 if left < 0 else left
                if copies[key] <= 0:
                    del copies[key]
                    last_removal[h] = (ts, loc)
        r = int(req_loc[i])
        b0, b1 = int(req_off[i]), int(req_off[i + 1])
        n = b1 - b0
        groups = [g for g in range(n_groups) if (r, g) in published]
        windows = [int(w) for w in loc_window[r]]
        if n and not groups:
            out[b0:b1] = [CODE[Outcome.UNOBSERVED]] * n
            continue
        if not n:
            continue
        bs = int(req_bs[i])
        need = {g: (0 if windows[g] <= 0 else max(-(-(windows[g] - 1) // bs), 1)) for g in groups}
        full = [g for g in groups if need[g] == 0]
        sliding = [g for g in groups if need[g] > 0]

        def source(j: int, g: int, r: int = r) -> int:
            h, x = int(blk_h[j]), int(blk_xfer[j])
            for tier, name in ((0, GPU), (1, CPU), (2, DISK)):
                if (h, g, r, tier) in copies:
                    return name
            if x == 1:
                return TRANSFER
            if x == 2:
                return FAILED
            if pool_loc >= 0 and any((h, g, pool_loc, tier) in copies for tier in range(3)):
                return POOL
            return NONE

        src = {g: [source(b0 + kk, g) for kk in range(n)] for g in groups}
        avail = {g: [s < FAILED for s in src[g]] for g in groups}
        tail = bool(req_tail[i])
        cap = n if tail else n - 1
        chain = min([_prefix(avail[g], cap) for g in full], default=cap)
        hit, cut = chain, -1
        moved = True
        while moved:  # the coordinator's fixed point
            moved = False
            for g in sliding:
                h = _sliding_hit(avail[g], hit, need[g])
                if h < hit:
                    hit, cut, moved = h, g, True
        if full:
            whole = all(_prefix(avail[g], n) == n for g in full)
        else:
            whole = hit == n - 1 and all(avail[g][n - 1] for g in groups)
        every = sum(1 << g for g in groups)
        for kk in range(n):
            j = b0 + kk
            if kk < hit:
                serving = [g for g in groups if need[g] == 0 or kk >= hit - need[g]]
                served[j] = max([src[g][kk] for g in serving], default=GPU)
                out[j] = HIT[served[j]]
                mask[j] = sum(1 << g for g in serving)
                continue
            mask[j] = every
            if kk == n - 1 and not tail and whole:
                out[j] = CODE[Outcome.RECOMPUTED_LAST]
            elif full and sliding and kk < chain:
                out[j], cut_grp[j] = CODE[Outcome.MISS_GROUP], cut
            elif int(blk_xfer[j]) == 2:
                out[j] = CODE[Outcome.MISS_LOAD_FAILED]
            elif any(avail[g][kk] for g in groups):
                out[j] = CODE[Outcome.MISS_AFTER_GAP]
            else:
                h = int(blk_h[j])
                holders = sorted({loc for (hh, _g, loc, _t) in copies
                                  if hh == h and loc not in (r, pool_loc)})
                others = [s for s in content_ns.get(int(blk_c[j]), []) if s != int(blk_ns[j])]
                if holders:
                    out[j], holder[j] = CODE[Outcome.MISS_ROUTING], holders[0]
                elif h in stored_ever:
                    out[j] = CODE[Outcome.MISS_EVICTED]
                    rem_ts[j], rem_loc[j] = last_removal.get(h, (-1, -1))
                elif int(blk_c[j]) != 0 and int(blk_ns[j]) != -1 and others:
                    out[j], other[j] = CODE[Outcome.MISS_INCOMPATIBLE], others[0]
                else:
                    out[j] = CODE[Outcome.MISS_COLD]
    return out, holder, rem_ts, rem_loc, other, cut_grp, mask, served
