"""Analyzers: vLLM's continuous-batching scheduler, compiled: a fleet of replicas, step by step.

The event loop of ``kvlens simulate --engine vllm``. Each replica is one vLLM engine whose
scheduler runs as vLLM 0.32.0's (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``
and ``update_from_output``; synchronous scheduling, FCFS, no connector but the shared pool):

- A step first serves the RUNNING requests in order, each ``num_tokens − num_computed_tokens``
  tokens (a decode: 1; a prefill: the rest of its prompt) capped by the step's token budget
  ``max_num_batched_tokens``: chunked prefill (``Scheduler.schedule``, its first loop).
- A running request that cannot get its blocks preempts the last running request
  (``self.running.pop()``) until it can, or until it preempted itself; a preempted request
  frees its blocks (tail first), restarts from 0 computed tokens and goes to the **front** of
  the waiting queue (``Scheduler.schedule``; ``Scheduler._preempt_request``:
  ``waiting.prepend_request``).
- WAITING requests are admitted in arrival order only if nothing was preempted this step,
  while budget is left and fewer than ``max_num_seqs`` run; a request that does not fit stops
  admission, head-of-line (``Scheduler.schedule``, its second loop: ``if not preempted_reqs``,
  ``max_num_active_reqs``).
- Admission looks the prefix up in the cache (at most ``num_tokens − 1`` tokens), then the
  shared pool for the chain's continuation, as a KV connector's external tokens
  (``Scheduler._get_local_prefix_cache_hit``; ``kv_cache_manager.py::get_computed_blocks``).
- A new request is admitted only if its whole prompt fits (``scheduler_reserve_full_isl``,
  default True): ``cdiv(num_tokens, B) − hits + hits_in_free_queue ≤ free blocks``; then its
  chunk must fit: ``cdiv(computed + new, B) − held + hits_in_free_queue ≤ free``
  (``kv_cache_manager.py::allocate_slots``: ``full_sequence_must_fit``;
  ``single_type_kv_cache_manager.py::get_num_blocks_to_allocate``).
- The cached tokens a request reports are its first admission's local + external hit
  (``Scheduler.schedule``: ``request.prefill_stats.set`` only when ``num_preemptions <= 0``).
- After a step, every request whose computed tokens reached its tokens samples one token (its
  first ends its TTFT); it finishes at its recorded output length and frees its blocks, in the
  step's order (``Scheduler.update_from_output``, ``_free_request``;
  ``sched/utils.py::check_stop``).
- An engine with nothing to run waits for a request and schedules as it arrives; requests
  arriving during a step join the next one (``vllm/v1/engine/core.py``, ``EngineCore``'s busy
  loop). CPU engines schedule synchronously (``platforms/cpu.py`` sets
  ``async_scheduling = False``); GPU engines' asynchronous scheduling (one step ahead) is not
  modelled.

Time (the simulator's, every figure modelled): a step's duration is ``step_ns`` of the batch
it ran, from the step-time parameters (analyzers/step_time.py). Within one step's admissions
the k-th admitted request looks up at ``t + k`` ns and its events carry that time, so a look-up
sees every earlier admission's stores and never its own (the ledger's "strictly before").
Routing happens at arrival: fixed per request (precomputed), or cache-aware over every
replica's cached hashes and in-flight counts.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvlens.analyzers import vllm_cache as vc
from kvlens.analyzers.step_time import step_ns

__all__ = ["run_fleet"]

B_REF, B_H, B_HASHED, B_NXT, B_PRV, B_DNX, B_DPV = range(7)
Q_NTOK, Q_COMP, Q_NOUT, Q_NCB, Q_NBLK, Q_ST, Q_SCHED, Q_FIRST, Q_END, Q_CACHED, Q_EXT, Q_NPRE, Q_REP, \
    Q_WNX, Q_WPV, Q_MOVED = range(16)
R_NFREE, R_BUSY, R_NRUN, R_NBATCH, R_WHEAD, R_WTAIL, R_INFL, R_STEPS, R_LOAD = range(9)
WAITING, RUNNING, DONE = 0, 1, 2
NONE = -1
INF = np.iinfo(np.int64).max


@njit(cache=True)
def _cdiv(a, b):
    return -(-a // b)


@njit(cache=True)
def _wq_push(rq, rp, r, q, front):
    if rp[R_WHEAD, r] == NONE:
        rp[R_WHEAD, r] = q
        rp[R_WTAIL, r] = q
        rq[Q_WNX, q] = NONE
        rq[Q_WPV, q] = NONE
    elif front:
        h = rp[R_WHEAD, r]
        rq[Q_WNX, q], rq[Q_WPV, q], rq[Q_WPV, h] = h, NONE, q
        rp[R_WHEAD, r] = q
    else:
        t = rp[R_WTAIL, r]
        rq[Q_WPV, q], rq[Q_WNX, q], rq[Q_WNX, t] = t, NONE, q
        rp[R_WTAIL, r] = q


@njit(cache=True)
def _wq_pop(rq, rp, r):
    q = rp[R_WHEAD, r]
    n = rq[Q_WNX, q]
    rp[R_WHEAD, r] = n
    if n == NONE:
        rp[R_WTAIL, r] = NONE
    else:
        rq[Q_WPV, n] = NONE
    return q


@njit(cache=True)
def _allocate(blk, rq, rp, maps, tbl, toff, q, r, n_new, hits, n_hits, ext_tok, nb, bs, n_rep, ev, cnt, ts):
    """kv_cache_manager.allocate_slots: False (and nothing changed) if the blocks are not free."""
    ref = blk[B_REF]
    free = rp[R_NFREE, r]
    new = rq[Q_ST, q] != RUNNING
    evictable = 0
    for k in range(n_hits):
        evictable += ref[hits[k]] == 0
    if new and _cdiv(rq[Q_NTOK, q], bs) - n_hits + evictable > free:
        return False
    computed = rq[Q_COMP, q] + n_hits * bs + ext_tok
    need = _cdiv(computed + n_new, bs)
    if max(need - rq[Q_NBLK, q] - n_hits, 0) + evictable > free:
        return False
    t0 = toff[q]
    if new:
        vc.touch(ref, blk[B_NXT], blk[B_PRV], rp[R_NFREE], r, hits, n_hits)
        for k in range(n_hits):
            tbl[t0 + k] = hits[k]
        rq[Q_NBLK, q] = n_hits
        rq[Q_NCB, q] = n_hits
    head = n_rep * nb + 2 * r
    while rq[Q_NBLK, q] < need:
        g = vc.pop_block(ref, blk[B_H], blk[B_HASHED], blk[B_NXT], blk[B_PRV], rp[R_NFREE], maps,
                         blk[B_DNX], blk[B_DPV], r, head, ev, cnt, ts)
        tbl[t0 + rq[Q_NBLK, q]] = g
        rq[Q_NBLK, q] += 1
    return True


@njit(cache=True)
def _cache(blk, rq, maps, tbl, toff, blk_off, blk_h, n_pfull, pool, q, r, n_full, ev, cnt, xf, ts):
    """Cache the request's newly full blocks; computed prompt blocks are also written to the pool."""
    ph, pnx, ppv, pmap, pcnt = pool
    for pos in range(rq[Q_NCB, q], n_full):
        h = blk_h[blk_off[q] + pos]
        vc.cache_block(blk[B_H], blk[B_HASHED], maps, blk[B_DNX], blk[B_DPV], r, tbl[toff[q] + pos], h,
                       ev, cnt, ts, q, pos)
        if ph.shape[0] > 0 and pos < n_pfull[q] and h not in pmap:
            vc.pool_put(ph, pnx, ppv, pmap, pcnt, h, ev, cnt, ts, q, pos)
            _xfer(xf, cnt, q, ts, -1, r, h, pos)
    rq[Q_NCB, q] = max(rq[Q_NCB, q], n_full)


@njit(cache=True)
def _xfer(xf, cnt, q, ts, replica, origin, h, pos):
    n = cnt[1]
    if n >= xf.shape[0]:
        cnt[2] = 1
        return
    xf[n, 0], xf[n, 1], xf[n, 2], xf[n, 3], xf[n, 4], xf[n, 5] = q, ts, replica, origin, h, pos
    cnt[1] = n + 1


@njit(cache=True)
def _release(blk, rq, rp, tbl, toff, q, r, nb, n_rep):
    head = n_rep * nb + 2 * r
    vc.free_blocks(blk[B_REF], blk[B_HASHED], blk[B_NXT], blk[B_PRV], rp[R_NFREE], r, head, head + 1,
                   tbl, toff[q], rq[Q_NBLK, q])
    rq[Q_NBLK, q] = 0
    rq[Q_NCB, q] = 0


@njit(cache=True)
def _pool_lookup(pool, blk_h, off, start, stop):
    """How many blocks of the chain from ``start`` the pool holds (touching each: LRU)."""
    ph, pnx, ppv, pmap, _pcnt = pool
    tail = ph.shape[0] + 1
    n = 0
    while start + n < stop and blk_h[off + start + n] in pmap:
        vc.pool_touch(pnx, ppv, pmap[blk_h[off + start + n]], tail)
        n += 1
    return n


@njit(cache=True)
def _schedule(blk, rq, rp, run, bat, maps, tbl, toff, blk_off, blk_h, n_pfull, pool, r, t,
              nb, bs, n_rep, max_seqs, budget0, st, ev, cnt, xf, hits):
    """Scheduler.schedule on replica ``r`` at time ``t``; sets its busy-until time."""
    budget, preempted, nbat = budget0, False, 0
    p = a = d = a_dec = ctx = n_pre = 0
    idx = 0
    while idx < rp[R_NRUN, r] and budget > 0:
        q = run[r, idx]
        n_new = min(rq[Q_NTOK, q] - rq[Q_COMP, q], budget)
        ok = _allocate(blk, rq, rp, maps, tbl, toff, q, r, n_new, hits, 0, 0, nb, bs, n_rep, ev, cnt, t)
        while not ok:
            victim = run[r, rp[R_NRUN, r] - 1]
            rp[R_NRUN, r] -= 1
            _release(blk, rq, rp, tbl, toff, victim, r, nb, n_rep)
            rq[Q_ST, victim], rq[Q_COMP, victim] = WAITING, 0
            rq[Q_NPRE, victim] += 1
            _wq_push(rq, rp, r, victim, True)
            preempted = True
            if victim == q:
                break
            ok = _allocate(blk, rq, rp, maps, tbl, toff, q, r, n_new, hits, 0, 0, nb, bs, n_rep, ev, cnt, t)
        if not ok:
            break
        c = rq[Q_COMP, q]
        _cache(blk, rq, maps, tbl, toff, blk_off, blk_h, n_pfull, pool, q, r,
               min(c + n_new, rq[Q_NTOK, q]) // bs, ev, cnt, xf, t)
        rq[Q_COMP, q] = c + n_new
        bat[r, nbat] = q
        nbat += 1
        budget -= n_new
        idx += 1
        if n_new == 1 and c == rq[Q_NTOK, q] - 1:
            d, a_dec = d + 1, a_dec + 2 * c + 1
        else:
            p, a, n_pre = p + n_new, a + (c + n_new) ** 2 - c * c, n_pre + 1
        ctx += c + n_new
    k = 0
    while (not preempted and budget > 0 and rp[R_WHEAD, r] != NONE and rp[R_NRUN, r] < max_seqs):
        q = rp[R_WHEAD, r]
        ts = t + k + 1
        off, ntok = blk_off[q], rq[Q_NTOK, q]
        n_hits = vc.lookup(maps, r, blk_h, off, (ntok - 1) // bs, hits)
        n_ext = 0
        if pool[0].shape[0] > 0:
            n_ext = _pool_lookup(pool, blk_h, off, n_hits, (ntok - 1) // bs)
        c = (n_hits + n_ext) * bs
        n_new = min(ntok - c, budget)
        if not _allocate(blk, rq, rp, maps, tbl, toff, q, r, n_new, hits, n_hits, n_ext * bs, nb, bs, n_rep,
                         ev, cnt, ts):
            break
        k += 1
        _wq_pop(rq, rp, r)
        if rq[Q_SCHED, q] < 0:
            rq[Q_SCHED, q], rq[Q_CACHED, q], rq[Q_EXT, q] = ts, c, n_ext * bs
        for pos in range(n_hits, n_hits + n_ext):
            _xfer(xf, cnt, q, ts, r, -1, blk_h[off + pos], pos)
        rp[R_LOAD, r] += n_ext * bs
        rq[Q_ST, q], rq[Q_COMP, q] = RUNNING, c + n_new
        _cache(blk, rq, maps, tbl, toff, blk_off, blk_h, n_pfull, pool, q, r, min(c + n_new, ntok) // bs,
               ev, cnt, xf, ts)
        run[r, rp[R_NRUN, r]] = q
        rp[R_NRUN, r] += 1
        bat[r, nbat] = q
        nbat += 1
        budget -= n_new
        if n_new == 1 and c == ntok - 1:
            d, a_dec = d + 1, a_dec + 2 * c + 1
        else:
            p, a, n_pre = p + n_new, a + (c + n_new) ** 2 - c * c, n_pre + 1
        ctx += c + n_new
    rp[R_NBATCH, r] = nbat
    rp[R_STEPS, r] += 1
    if nbat > 0:
        rp[R_BUSY, r] = t + step_ns(st, p, a, d, a_dec, ctx, n_pre, k, rp[R_LOAD, r])
        rp[R_LOAD, r] = 0
    elif rp[R_NRUN, r] > 0 or rp[R_WHEAD, r] != NONE:
        rp[R_BUSY, r] = t + 1  # everything was preempted: the engine schedules again at once
    else:
        rp[R_BUSY, r] = NONE


@njit(cache=True)
def _finish_step(blk, rq, rp, run, bat, tbl, toff, out, r, t, nb, n_rep):
    """Scheduler.update_from_output: sample, stop at the recorded output length, free in step order."""
    for j in range(rp[R_NBATCH, r]):
        q = bat[r, j]
        if rq[Q_COMP, q] < rq[Q_NTOK, q]:
            continue  # a prefill chunk: nothing sampled yet
        rq[Q_NTOK, q] += 1
        rq[Q_NOUT, q] += 1
        if rq[Q_FIRST, q] < 0:
            rq[Q_FIRST, q] = t
        if rq[Q_NOUT, q] >= out[q]:
            rq[Q_END, q], rq[Q_ST, q] = t, DONE
            _release(blk, rq, rp, tbl, toff, q, r, nb, n_rep)
            n = rp[R_NRUN, r]
            k = 0
            while run[r, k] != q:
                k += 1
            for m in range(k, n - 1):
                run[r, m] = run[r, m + 1]
            rp[R_NRUN, r] = n - 1
            rp[R_INFL, r] -= 1
    rp[R_NBATCH, r] = 0


@njit(cache=True)
def _fast_decode(rq, rp, bat, r, next_arrival, st, out, bs):
    """Run replica ``r``'s pure-decode steps back to back while nothing but time changes.

    Between two arrivals, a batch of decodes that finishes nobody, needs no new block and fills
    none (so no allocation, eviction, cache event or admission) repeats step after step; each
    step is taken here as ``_finish_step`` + ``_schedule`` would take it, without the fleet's
    event loop around it. Other replicas never read this one's state between arrivals.
    """
    nbat = rp[R_NBATCH, r]
    if nbat == 0 or nbat != rp[R_NRUN, r] or rp[R_WHEAD, r] != NONE:
        return  # someone waits, or the budget left a running request out: the next step differs
    while rp[R_BUSY, r] < next_arrival:
        for j in range(nbat):
            q = bat[r, j]
            c = rq[Q_NTOK, q]  # after sampling, the next step computes token c
            if (rq[Q_COMP, q] < c or rq[Q_NOUT, q] + 1 >= out[q] or _cdiv(c + 1, bs) > rq[Q_NBLK, q]
                    or (c + 1) // bs > rq[Q_NCB, q]):
                return
        t = rp[R_BUSY, r]
        a_dec = ctx = 0
        for j in range(nbat):
            q = bat[r, j]
            if rq[Q_FIRST, q] < 0:
                rq[Q_FIRST, q] = t
            c = rq[Q_NTOK, q]
            rq[Q_NTOK, q] = c + 1
            rq[Q_NOUT, q] += 1
            rq[Q_COMP, q] = c + 1
            a_dec += 2 * c + 1
            ctx += c + 1
        rp[R_STEPS, r] += 1
        rp[R_BUSY, r] = t + step_ns(st, 0, 0, nbat, a_dec, ctx, 0, 0, 0)


@njit(cache=True)
def _route(maps, rp, blk_h, off, n_full, n_rep, threshold, load_factor):
    """cache_aware: the longest cached prefix (ties: the less loaded, then the lower index), unless
    it covers under ``threshold`` of the prompt's full blocks; then, above ``load_factor`` x the
    mean in-flight count, the least loaded."""
    loads = rp[R_INFL]
    least = 0
    for r in range(1, n_rep):
        if loads[r] < loads[least]:
            least = r
    best, bm, bl = least, -1, 0
    for r in range(n_rep):
        m = vc.matched(maps, r, blk_h, off, n_full)
        if m > bm or (m == bm and -loads[r] > bl):
            best, bm, bl = r, m, -loads[r]
    if n_full == 0 or bm < threshold * n_full:
        best = least
    mean = loads.sum() / n_rep
    if load_factor > 0 and mean > 0 and loads[best] > load_factor * mean:
        return least, best != least
    return best, False


@njit(cache=True)
def run_fleet(arrival, order, prompt, out, blk_off, blk_h, n_pfull, fixed, n_rep, nb, bs, max_seqs, budget,
              threshold, load_factor, pool_blocks, st, ev_cap, xf_cap):
    """Serve every request on ``n_rep`` vLLM engines of ``nb`` blocks each.

    Requests reach the engines at ``arrival`` ns, in the order ``order`` (ties as given).
    ``blk_h[blk_off[i]:blk_off[i+1]]`` are request i's full-block hashes (prompt, then blocks
    holding generated tokens); ``fixed[i]`` its replica, or -1 to route cache-aware. Returns
    the per-request rows (replica, scheduled, first token, end ns; cached and pool tokens;
    preemptions; 1 if the load fallback moved it), the events and transfers buffers, counts
    (events, transfers, overflow, fallbacks) and the number of steps.
    """
    n = arrival.shape[0]
    toff = np.zeros(n + 1, np.int64)
    for i in range(n):
        toff[i + 1] = toff[i] + max(_cdiv(prompt[i] + out[i] - 1, bs), 1)
    tbl = np.zeros(toff[n], np.int64)
    blk = np.full((7, n_rep * nb + 2 * n_rep), NONE, np.int64)
    blk[B_REF, :], blk[B_H, :], blk[B_HASHED, :] = 0, 0, 0
    rp = np.zeros((9, n_rep), np.int64)
    rp[R_BUSY, :], rp[R_WHEAD, :], rp[R_WTAIL, :] = NONE, NONE, NONE
    vc.fq_init(blk[B_NXT], blk[B_PRV], rp[R_NFREE], n_rep, nb)
    rq = np.full((16, n), NONE, np.int64)
    for row in (Q_NTOK, Q_COMP, Q_NOUT, Q_NCB, Q_NBLK, Q_ST, Q_EXT, Q_NPRE, Q_MOVED):
        rq[row, :] = 0
    run = np.zeros((n_rep, max_seqs), np.int64)
    bat = np.zeros((n_rep, max_seqs), np.int64)
    maps = vc.new_maps(n_rep)
    ph, pnx, ppv, pmap = vc.new_pool(pool_blocks)
    pool = (ph, pnx, ppv, pmap, np.zeros(1, np.int64))
    hits = np.zeros(max(int(prompt.max() + out.max()) // bs + 1, 1), np.int64)
    ev = np.zeros((ev_cap, 6), np.int64)
    xf = np.zeros((xf_cap, 6), np.int64)
    cnt = np.zeros(4, np.int64)  # events, transfers, overflow, requests the load fallback moved
    i = 0
    while True:
        rb, tb = NONE, 0
        for r in range(n_rep):
            if rp[R_BUSY, r] != NONE and (rb == NONE or rp[R_BUSY, r] < tb):
                rb, tb = r, rp[R_BUSY, r]
        if i < n and (rb == NONE or arrival[order[i]] <= tb):
            q = order[i]
            i += 1
            rq[Q_NTOK, q] = prompt[q]
            r = fixed[q]
            if r < 0:
                r, moved = _route(maps, rp, blk_h, blk_off[q], n_pfull[q], n_rep, threshold, load_factor)
                cnt[3] += moved
                rq[Q_MOVED, q] = moved
            rq[Q_REP, q] = r
            rp[R_INFL, r] += 1
            _wq_push(rq, rp, r, q, False)
            if rp[R_BUSY, r] == NONE:
                _schedule(blk, rq, rp, run, bat, maps, tbl, toff, blk_off, blk_h, n_pfull, pool, r,
                          arrival[q], nb, bs, n_rep, max_seqs, budget, st, ev, cnt, xf, hits)
        elif rb != NONE:
            _finish_step(blk, rq, rp, run, bat, tbl, toff, out, rb, tb, nb, n_rep)
            _schedule(blk, rq, rp, run, bat, maps, tbl, toff, blk_off, blk_h, n_pfull, pool, rb,
                      tb, nb, bs, n_rep, max_seqs, budget, st, ev, cnt, xf, hits)
            _fast_decode(rq, rp, bat, rb, arrival[order[i]] if i < n else INF, st, out, bs)
        else:
            break
    rows = np.stack((rq[Q_REP], rq[Q_SCHED], rq[Q_FIRST], rq[Q_END], rq[Q_CACHED], rq[Q_EXT], rq[Q_NPRE],
                     rq[Q_MOVED]))
    return rows, ev[:cnt[0]].copy(), xf[:cnt[1]].copy(), cnt, rp[R_STEPS].sum()
