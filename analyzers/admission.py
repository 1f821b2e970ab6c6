"""Analyzers: each request's look-up moment as a place in the KV-event stream (the engine's admission).

vLLM consults its prefix cache when its scheduler admits a request, not when the request
arrives, and it stores a request's blocks at that same admission, before the step computes
them (vllm/v1/core/sched/scheduler.py::Scheduler.schedule: for each waiting request in turn,
``kv_cache_manager.get_computed_blocks`` is the look-up and ``kv_cache_manager.allocate_slots``
then caches the new full blocks, kv_cache_manager.py::KVCacheManager.allocate_slots ->
``coordinator.cache_blocks`` -> block_pool.py::BlockPool.cache_full_blocks, which emits one
``BlockStored`` with the blocks past the hit and ``parent_block_hash`` the last hit block). The
step's events are published as one batch only after the step ran
(Scheduler.update_from_output: ``KVEventBatch(ts=time.time(), ...)``). So a request admitted in
a step sees the blocks that requests admitted before it in the same step stored (their batch
is stamped after its look-up), and misses the ones they evicted: a look-up time compared with
batch stamps is wrong under concurrency in both directions.

The engine's own moment is recoverable from the stream: it is just before the request's own
``BlockStored`` rows: a run of stored rows on the request's replica, published after it
arrived, that begins an event at one of its blocks ``j`` with its block ``j - 1`` as parent
(none for block 0) and continues with its blocks ``j + 1, ...`` without turning into another
prompt (a stored row continuing the chain with a block that is not the request's next). Each
event is one request's allocation, so a run is claimed once: by the first request, in look-up
time order, whose run it can be. The run must be stamped after the request's look-up time (a
batch published after the step that admitted it) and not lie across the shared pool's events;
the simulators' requests keep the time rule, which their streams are stamped to agree with. A
request that stores none of its prompt blocks at admission has no such run: every full block it
needed was then cached (a block it had to compute, allocate_slots would have stored), so its
look-up is the first place, from its time (arrival plus queue time) on, where its replica holds
every one of its full blocks: a request admitted in the same step after one that stored them
sees them, although their batch is stamped after both arrived (measured live: two engines behind
kvlens gateway, a request of 5 full blocks admitted just after another of the same system prompt
read 0 hit tokens where the engine had 160). The runs that held them are claimed first, by every
request: the one that stored them may have reached the gateway after this one, since the API
server hands requests to the engine core in the order it finishes with them (seen once in CI: the
same 0 for 160 with the storing request second in arrival order). Where no such place is found,
it stays at its time.
Every request of a hybrid model's replica (several KV cache groups, each publishing its own runs,
a sliding window's with gaps) keeps its time; this rule does not cover them yet.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import numpy as np
import polars as pl

__all__ = ["ADMISSION_WINDOW_NS", "admission_cuts"]

_STORED, _CLEARED = 0, 2  # analyzers/replay.py's event kinds
# Stores of one block after a request's arrival looked at per block: a block is stored again only
# after an eviction, so the request's own run is among the first few; the bound keeps a hot block
# (a system prompt re-stored all day) from making the search quadratic.
_CANDIDATES = 8
# A request's own run is stamped at most this long after its look-up time (arrival plus queue time):
# vLLM stores a request's new full blocks in the step that admits it (Scheduler.schedule ->
# KVCacheManager.allocate_slots) and publishes that step's KVEventBatch when the step ends
# (Scheduler.update_from_output), seconds later at most; the margin covers a queue time the lake
# does not know (a trace without it looks up at arrival) up to ten minutes. A run stamped later is
# a later request's, and a place where every block is held that late is not this admission's; and
# the rule's decision for a request is final once the stream is known that far (ledger_state.py).
ADMISSION_WINDOW_NS = 600 * 1_000_000_000
# The simulators' requests (analyzers/sim_vllm.py, sim_lru.py) carry their look-up as their time
# and their events are stamped to agree: the time rule is theirs by construction.
SIMULATED = "sim"


def _stored_index(ev_kind: np.ndarray, ev_loc: np.ndarray,
                  ev_h: np.ndarray) -> dict[tuple[int, int], list[int]]:
    """Stored rows by (location, block hash), in stream order (one sort, not a dict call per row)."""
    stored = np.flatnonzero(ev_kind == _STORED)
    if stored.shape[0] == 0:
        return {}
    loc, h = ev_loc[stored].astype(np.int64), ev_h[stored]
    order = np.lexsort((stored, h, loc))
    loc, h, rows = loc[order], h[order], stored[order].tolist()
    first = np.ones(loc.shape[0], np.bool_)
    first[1:] = (loc[1:] != loc[:-1]) | (h[1:] != h[:-1])
    starts = np.flatnonzero(first).tolist()
    ends = [*starts[1:], len(rows)]
    keys = zip(loc[first].tolist(), h[first].tolist(), strict=True)
    return {key: rows[a:b] for key, a, b in zip(keys, starts, ends, strict=True)}


def _single_group_locations(ev_loc: np.ndarray, ev_grp: np.ndarray) -> set[int]:
    """Locations whose events name one KV cache group. A hybrid model's groups each publish their
    own runs (a sliding window's with gaps): only such a location is anchored; the others keep the
    time rule. (One key per (location, group) pair: numpy's unique over an axis sorts rows as
    records, ten times slower on a day's events.)"""
    if ev_loc.shape[0] == 0:
        return set()
    width = int(ev_grp.max()) + 1
    pairs = np.unique(ev_loc.astype(np.int64) * width + ev_grp.astype(np.int64))
    locs, per_loc = np.unique(pairs // width, return_counts=True)
    return {int(loc) for loc, n in zip(locs.tolist(), per_loc.tolist(), strict=True) if n == 1}


def _continues(ev: dict[str, np.ndarray], e: int, prev: int) -> bool:
    """Row ``e`` is a stored row of the same event as row ``prev``: same replica and chain, and the
    same batch (a simulator that numbers each event on its own stamps one request's at one time)."""
    return (e < ev["ev_kind"].shape[0] and ev["ev_kind"][e] == _STORED
            and ev["ev_loc"][e] == ev["ev_loc"][prev] and ev["ev_parent"][e] == ev["ev_h"][prev]
            and (ev["ev_seq"][e] == ev["ev_seq"][prev] or ev["ev_ts"][e] == ev["ev_ts"][prev]))


def _own_run(ev: dict[str, np.ndarray], e: int, chain: list[int], j: int) -> bool:
    """Rows from ``e`` store ``chain[j:]`` (or its prefix, where the event ends) as one event."""
    parent = chain[j - 1] if j > 0 else 0
    if ev["ev_parent"][e] != parent or (e > 0 and _continues(ev, e, e - 1)):
        return False
    k, row = j, e
    while True:
        nxt = row + 1
        if not _continues(ev, nxt, row):
            return True  # the event ends: the request's chunk (or its prompt) ended here
        if k + 1 >= len(chain) or ev["ev_h"][nxt] != chain[k + 1]:
            return False  # the chain goes on with a block of another prompt
        k, row = k + 1, nxt


def _cut(ev: dict[str, np.ndarray], index: dict[tuple[int, int], list[int]], loc: int, chain: list[int],
         after: int, upto: int, claimed: set[int]) -> int:
    """The first unclaimed own run's row at or after stream index ``after`` and before ``upto``; -1
    when there is none."""
    best = -1
    for j, h in enumerate(chain):
        rows = index.get((loc, h), ())
        first = bisect.bisect_left(rows, after)
        for e in rows[first:first + _CANDIDATES]:
            if e >= upto or (best >= 0 and e >= best):
                break
            if e not in claimed and _own_run(ev, e, chain, j):
                best = e
                break
    return best


def _held_at(ev: dict[str, np.ndarray], loc: int, h: int, place: int, last_store: int) -> bool:
    """Block ``h``, last stored on ``loc`` at row ``last_store``, is still there at stream ``place``:
    no removal of it, nor a clear of ``loc``, between."""
    kinds, locs = ev["ev_kind"][last_store + 1:place], ev["ev_loc"][last_store + 1:place]
    removed = (kinds != _STORED) & (ev["ev_h"][last_store + 1:place] == h)
    gone = (locs == loc) & (removed | (kinds == _CLEARED))
    return not bool(gone.any())


def _all_held(ev: dict[str, np.ndarray], index: dict[tuple[int, int], list[int]], loc: int, chain: list[int],
              start: int, upto: int, claimed: set[int]) -> int:
    """The first stream place from ``start`` on (at most ``upto``) where ``loc`` holds every block
    of ``chain``, each from a run some request claimed (``start`` when none is found): a
    request that stored nothing found them all cached. A block held only through a run nobody
    claimed is not taken as a hit (measured live: a request the engine served with 0 hits matched
    no run of its own, and the first place holding its blocks gave it 704 hit tokens)."""
    place = start
    for _ in range(2):  # a later place found for one block is checked again for the others
        for h in chain:
            rows = index.get((loc, h), ())
            before = bisect.bisect_left(rows, place) - 1
            if before >= 0 and _held_at(ev, loc, h, place, rows[before]):
                continue
            later = rows[before + 1] if before + 1 < len(rows) else -1
            if later < 0 or later >= upto:
                return start
            place = later + 1
    held = [index[(loc, h)][bisect.bisect_left(index[(loc, h)], place) - 1] for h in chain]
    if all(_held_at(ev, loc, h, place, row) for h, row in zip(chain, held, strict=True)) \
            and all(_event_start(ev, row) in claimed for row in held):
        return place
    return start


def _event_start(ev: dict[str, np.ndarray], row: int) -> int:
    """The first stored row of the event row ``row`` belongs to."""
    while row > 0 and _continues(ev, row, row - 1):
        row -= 1
    return row


def _crosses(ev_loc: np.ndarray, a: int, b: int, shared: int) -> bool:
    """Events between stream places ``a`` and ``b`` include the shared pool's."""
    lo, hi = min(a, b), max(a, b)
    return shared >= 0 and bool((ev_loc[lo:hi] == shared).any())


def admission_cuts(ev: dict[str, np.ndarray], req: pl.DataFrame, full: pl.DataFrame, req_loc: np.ndarray,
                   shared: int = -1, claimed: Iterable[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Per request (``req``'s order): how many events of the sorted stream its look-up sees, and
    the stream place of the run it was anchored at (-1: it found none, -2: it keeps the time rule).

    ``ev`` holds the replay's sorted event arrays plus ``ev_seq`` (the batch) and ``ev_parent``
    (the row's parent hash, 0 for none), hashes as signed 64-bit. ``req`` has ``request_id``,
    ``arrival_ns`` and ``lookup_ns``; ``full`` the needed full blocks (``request_id``,
    ``position``, ``block_hash_i64``). A request without its own run gets the events stamped
    strictly before its look-up time, the replay's rule for one request at a time; so does one
    whose own run lies across events of the shared pool (location ``shared``), whose stores
    another replica's scheduler made: the rule orders one engine's admissions only. ``claimed``:
    runs (their first stored row's place) that requests before these, in look-up order, took.
    """
    ts = ev["ev_ts"]
    look = req["lookup_ns"].to_numpy()
    by_time = np.searchsorted(ts, look, side="left")
    single = _single_group_locations(ev["ev_loc"], ev["ev_grp"])
    # The batch of the admitting step is stamped after the request arrived, and within
    # ADMISSION_WINDOW_NS of its look-up time.
    after = np.searchsorted(ts, req["arrival_ns"].to_numpy(), side="right")
    upto = np.searchsorted(ts, look + ADMISSION_WINDOW_NS, side="right")
    cuts = by_time.astype(np.int64)
    owns = np.full(req.height, -2, np.int64)
    simulated = (req["source"] == SIMULATED).fill_null(False).to_numpy() if "source" in req.columns \
        else np.zeros(req.height, np.bool_)
    candidates = np.isin(req_loc, np.fromiter(single, np.int64, len(single))) & ~simulated
    if not candidates.any():  # every request keeps the time rule (a simulator's, a hybrid model's)
        return cuts, owns
    chains = dict(full.sort("request_id", "position").group_by("request_id", maintain_order=True)
                  .agg(pl.col("block_hash_i64")).iter_rows())
    ids = req["request_id"].to_list()
    # One BlockStored event comes from one request's allocation: in look-up-time order, each
    # request takes the first run no request before it took.
    taken: set[int] = set(claimed)
    anchored = [i for i in np.argsort(look, kind="stable").tolist() if candidates[i] and chains.get(ids[i])]
    index = _stored_index(ev["ev_kind"], ev["ev_loc"], ev["ev_h"])
    unfound = []
    for i in anchored:
        own = _cut(ev, index, int(req_loc[i]), chains[ids[i]], int(after[i]), int(upto[i]), taken)
        owns[i] = own
        if own < 0:
            unfound.append(i)
            continue
        taken.add(own)
        # Only a run published after the look-up time is a step's batch the engine stamped
        # after admitting (a simulator stamps a request's stores at its look-up: the time
        # rule is already exact there).
        if ts[own] > look[i] and not _crosses(ev["ev_loc"], int(by_time[i]), own, shared):
            cuts[i] = own
    # A request that stored nothing found its blocks cached by runs the engine admitted before it,
    # whoever claimed them: the gateway's arrival order is not the engine core's (the API server
    # hands requests on in the order it finishes with them), so a run claimed by a request that
    # arrived after it can still be the one it found (CI, live: 0 hit tokens where the engine had 160).
    for i in unfound:
        cuts[i] = _all_held(ev, index, int(req_loc[i]), chains[ids[i]], int(by_time[i]), int(upto[i]), taken)
    return cuts, owns
