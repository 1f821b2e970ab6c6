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
A run that ends inside the request's blocks is its own only where a later run continues it (the
next chunk of a chunked prefill, within ``_CHUNK_GAP`` batches: the earliest, and it is claimed
with the run), or where the request was preempted and its admission after that computes again
from within the run (``_cut``); otherwise it is a shorter prompt's. A block stays held while a
copy of it does (vLLM caches a block it computes again as a second physical copy). vLLM admits
waiting requests in arrival order, so a request whose run would come after the admission of one
that arrived ``_REORDER_NS`` after it, and which could have found its blocks cached before that,
stored nothing, and the run is another's (``_out_of_order``). Measured on two captures of 960
requests each prefilling in chunks of 256 tokens under memory pressure
(tests/data/vllm-chunked-capture, -hybrid-capture), these rules take the requests that differ from
the engine's count from 4 and 2 to none.

A hybrid model's replica (several KV cache groups, each publishing its own runs, a sliding
window's with gaps) is anchored at the runs of its first full-attention group (``anchor_groups``);
the request's look-up is before its other groups' rows of the same admission, which precede that
run in the batch. Measured on a real vLLM 0.32 serving a two-group model to six clients
(tests/data/vllm-concurrent-hybrid-capture): look-ups at their arrival times gave 10 of 360
requests other hit tokens than the engine's, anchored every request gets the engine's count.
A hybrid request that stored nothing found, in every group, the blocks its hit of all its blocks
needed: the full-attention group's, and the tail a sliding window group's hit needs
(``_window_tail``), so it looks up where both are held (where none holds them, the full-attention
group's blocks alone place it). Measured on the same model with a KV cache too small for its sixteen
clients (tests/data/vllm-preempting-hybrid-capture: requests queue for blocks, 20 preemptions): placed
by the full-attention group alone, a request queued 117 ms read 32 hit tokens at its arrival, where
the window group had just evicted two of its blocks and the engine had 96; with the tail, every
request of 960 gets the engine's count. A preempted request is counted at its first admission, as
vLLM reports it (scheduler.py: ``prefill_stats.set`` only while ``num_preemptions <= 0``).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import polars as pl

from kvlens.analyzers.replay import loc_groups

__all__ = ["ADMISSION_WINDOW_NS", "Admission", "admission_cuts", "anchor_groups"]

_STORED, _REMOVED, _CLEARED = 0, 1, 2  # analyzers/replay.py's event kinds
# Stores of one block after a request's arrival looked at per block: a block is stored again only
# after an eviction, so the request's own run is among the first few; the bound keeps a hot block
# (a system prompt re-stored all day) from making the search quadratic.
_CANDIDATES = 8
# A prefill in chunks goes on at the engine's next steps: vLLM schedules its running requests first
# at every step (Scheduler.schedule), so a request's next chunk waits only while the running requests
# before it take the step's token budget (measured on two captures in chunks of 256 tokens: 2,474 of
# 2,477 next chunks one batch later, the rest 2 to 4). A run further on is another request's.
_CHUNK_GAP = 16
# vLLM admits waiting requests in arrival order (Scheduler.schedule, the default "fcfs" policy; a
# preempted request goes back to the front, and its first admission is the one it counts): the
# engine core receives them in the gateway's order but for the API server's work on each, which this
# bound covers. A request admitted after one that reached the gateway this much later was not.
_REORDER_NS = 250_000_000
_ORDER_ROUNDS = 3  # claims made again after requests found to have stored nothing
_NO_RUN = np.iinfo(np.int64).max
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


def _rows_index(ev_loc: np.ndarray, ev_h: np.ndarray, mask: np.ndarray) -> dict[tuple[int, int], list[int]]:
    """The rows of ``mask`` by (location, block hash), in stream order (one sort, not a dict call
    per row)."""
    stored = np.flatnonzero(mask)
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


def anchor_groups(loc_grp: np.ndarray, windows: np.ndarray | None = None) -> np.ndarray:
    """Per location code, the KV cache group code whose runs anchor its requests' admissions (-1:
    none, its requests keep the time rule): its one group, or for a hybrid model's replica
    (several groups) the first full-attention one (``windows`` 0; ``loc_grp`` the groups each
    location publishes; without ``windows``, a location of several groups has none). vLLM's
    coordinator caches a request's new blocks group by group at one admission
    (kv_cache_coordinator.py::KVCacheCoordinator.cache_blocks calls each manager's
    ``cache_blocks``, block_pool.py::BlockPool.cache_full_blocks emits one BlockStored each), so
    the request's events are consecutive in the batch; a full-attention group stores every new
    full block as one chain, where a sliding window's skips the blocks it can never serve
    (``block_mask``) and names no parent for its first. (A Mamba group is not told apart from full
    attention: its hashes are per its own block size, so its runs match no request's blocks and
    such a request keeps its time.)"""
    anchors = np.full(loc_grp.shape[0], -1, np.int64)
    for loc in range(loc_grp.shape[0]):
        groups = np.flatnonzero(loc_grp[loc])
        if groups.shape[0] > 1:
            groups = groups[windows[loc, groups] == 0] if windows is not None else groups[:0]
        if groups.shape[0]:
            anchors[loc] = groups[0]
    return anchors


def _continues(ev: dict[str, np.ndarray], e: int, prev: int) -> bool:
    """Row ``e`` is a stored row of the same event as row ``prev``, a stored row too: same replica,
    group and chain, and the same batch (a simulator that numbers each event on its own stamps one
    request's at one time). (A removal of the parent just before, the allocation's eviction of
    another copy of it, is not: measured, a chunk whose first block's parent was evicted at the
    chunk's own step.)"""
    return (e < ev["ev_kind"].shape[0] and ev["ev_kind"][e] == _STORED and ev["ev_kind"][prev] == _STORED
            and ev["ev_loc"][e] == ev["ev_loc"][prev] and ev["ev_grp"][e] == ev["ev_grp"][prev]
            and ev["ev_parent"][e] == ev["ev_h"][prev]
            and (ev["ev_seq"][e] == ev["ev_seq"][prev] or ev["ev_ts"][e] == ev["ev_ts"][prev]))


class _Run(NamedTuple):
    """The first row of each event of a run storing a request's blocks (its first event's, then its
    later chunks'), and the chain position of the last block it stores."""
    path: list[int]
    reached: int


def _own_run(ev: dict[str, np.ndarray], index: dict[tuple[int, int], list[int]], e: int, chain: list[int],
             j: int, upto: int, claimed: set[int]) -> _Run | None:
    """The run from ``e`` on that stores ``chain[j:]``: one event, or its prefix where the event
    ends when a later event (before ``upto``, claimed by no request) continues it the same way: the
    request's next chunk; where none reaches the chain's end, the one that goes furthest (None when
    row ``e`` starts none). A request computes every block after its first computed one (a prefix
    cache hit is a prefix), and a chunked prefill caches each chunk's full blocks at its step
    (KVCacheManager.allocate_slots), so a run that ends inside the request's blocks is its own only
    when its chain goes on, or when the request was preempted (``_cut``); one that does not go on is
    a shorter prompt's (measured on the hybrid capture: a request whose 12 blocks were all cached
    took the run of a later 7-block prompt of the same system prompt, stored after an eviction). The
    chunks are followed in a loop, the earliest first, each candidate once, and at most
    ``_CANDIDATES`` stores of a block after a chunk's end (a hot block is stored all day)."""
    pending: list[tuple[int, int, list[int]]] = [(e, j, [e])]
    seen: set[int] = set()
    furthest: _Run | None = None
    while pending:
        e, j, path = pending.pop()
        end = _event_end(ev, e, chain, j)
        if end < 0:
            continue
        k = j + end - e  # the chain position the event ends at
        if furthest is None or k > furthest.reached:
            furthest = _Run(path, k)
        if k + 1 >= len(chain):
            return furthest
        rows = index.get((int(ev["ev_loc"][end]), chain[k + 1]), ())
        first = bisect.bisect_right(rows, end)
        later = []
        for r in rows[first:first + _CANDIDATES]:
            if r >= upto:
                break
            if ev["ev_seq"][r] - ev["ev_seq"][end] > _CHUNK_GAP:  # (not a break: ranks number apart)
                continue
            if ev["ev_grp"][r] == ev["ev_grp"][end] and r not in seen and r not in claimed:
                seen.add(r)
                later.append((r, k + 1, [*path, r]))
        pending.extend(reversed(later))  # the earliest next chunk first: a running prefill goes on at once
    return furthest


def _event_end(ev: dict[str, np.ndarray], e: int, chain: list[int], j: int) -> int:
    """The last row of the event that starts at row ``e`` storing ``chain[j], chain[j + 1], ...`` (its
    parent ``chain[j - 1]``), ending within the chain; -1 when row ``e`` starts no such event (it
    continues another, names another parent, or the event goes on with a block of another prompt)."""
    parent = chain[j - 1] if j > 0 else 0
    if ev["ev_parent"][e] != parent or (e > 0 and _continues(ev, e, e - 1)):
        return -1
    k, row = j, e
    while _continues(ev, row + 1, row):
        if k + 1 >= len(chain) or ev["ev_h"][row + 1] != chain[k + 1]:
            return -1
        k, row = k + 1, row + 1
    return row


def _cut(ev: dict[str, np.ndarray], index: dict[tuple[int, int], list[int]], loc: int, chain: list[int],
         after: int, upto: int, claimed: set[int], ends: _Ends) -> list[int]:
    """The first row of each event of the first unclaimed own run at or after stream index ``after``
    and before ``upto`` (its first event first, then its later chunks'); empty when there is none.

    A preempted request's first admission stores a run that stops inside its blocks, and its
    admission after the preemption computes again from its hit then, which is at most where the
    first stopped (vLLM frees a preempted request's blocks, Scheduler._preempt_request, and counts
    the cached tokens of its first admission only). So an earlier run that stops at a block where
    no request still to come, arrived before the run, ends (``ends``: a shorter prompt's run),
    followed by the request's own run starting within it, is its first admission, and both runs are
    its own
    (measured on a capture prefilling in chunks of 256 tokens: a 1,024-token request preempted after
    its third chunk read 96 hit tokens at its second admission, where the engine counted 0)."""
    best: list[int] = []
    best_j = -1
    short: _Run | None = None
    for j, h in enumerate(chain):
        rows = index.get((loc, h), ())
        first = bisect.bisect_left(rows, after)
        for e in rows[first:first + _CANDIDATES]:
            if e >= upto or (best and e >= best[0]):
                break
            if e in claimed:
                continue
            run = _own_run(ev, index, e, chain, j, upto, claimed)
            if run is None:
                continue
            if run.reached + 1 >= len(chain):
                best, best_j = run.path, j
                break
            if (short is None or e < short.path[0]) and not ends.may_own(loc, chain[run.reached], e):
                short = run
    if best and short is not None and short.path[0] < best[0] and best_j <= short.reached + 1 \
            and not set(short.path) & set(best):
        return [*short.path, *best]
    return best


class _Ends:
    """The requests still to come in look-up order, by (location, last full block): whether one of
    them may own a run that ends at that block (a shorter prompt's), stamped at a stream place."""

    def __init__(self, anchored: list[int], req_loc: np.ndarray, last: list[int], after: np.ndarray) -> None:
        self._heaps: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (arrival place, request)
        for i, h in zip(anchored, last, strict=True):
            self._heaps.setdefault((int(req_loc[i]), h), []).append((int(after[i]), i))
        for heap in self._heaps.values():
            heapq.heapify(heap)
        self._done: set[int] = set()

    def done(self, i: int) -> None:
        self._done.add(i)

    def may_own(self, loc: int, h: int, place: int) -> bool:
        heap = self._heaps.get((loc, h), [])
        while heap and heap[0][1] in self._done:
            heapq.heappop(heap)
        return bool(heap) and heap[0][0] <= place


class _Copies:
    """How many copies of a block a location's anchoring group holds at a stream place. vLLM keeps
    one hash in several physical blocks when it computes a cached block again (a hybrid model's
    full-attention group does whenever the sliding window cut a hit short: block_pool.py
    ``cached_block_hash_to_block`` maps a hash to blocks, and each eviction removes one), so a
    removal leaves the block held while another copy is (the replay counts them the same way); a
    removal that says how many copies remain (``ev_left`` >= 0) sets the count; a clear empties
    the location."""

    def __init__(self, ev: dict[str, np.ndarray], stored: dict[tuple[int, int], list[int]],
                 anchored: np.ndarray) -> None:
        self._ev, self._stored = ev, stored
        self._removed = _rows_index(ev["ev_loc"], ev["ev_h"], (ev["ev_kind"] == _REMOVED) & anchored)
        clears = np.flatnonzero(ev["ev_kind"] == _CLEARED)
        self._clears: dict[int, list[int]] = {}
        for row, loc in zip(clears.tolist(), ev["ev_loc"][clears].tolist(), strict=True):
            self._clears.setdefault(int(loc), []).append(row)

    def held(self, loc: int, h: int, place: int) -> bool:
        clears = self._clears.get(loc, ())
        at = bisect.bisect_left(clears, place)
        since = clears[at - 1] if at else -1
        stores, removals = self._stored.get((loc, h), ()), self._removed.get((loc, h), ())
        s0, s1 = bisect.bisect_right(stores, since), bisect.bisect_left(stores, place)
        r0, r1 = bisect.bisect_right(removals, since), bisect.bisect_left(removals, place)
        if r1 > r0:
            last = removals[r1 - 1]
            left = int(self._ev["ev_left"][last]) if "ev_left" in self._ev else -1
            if left >= 0:
                return left + s1 - max(s0, bisect.bisect_right(stores, last)) > 0
        return (s1 - s0) - (r1 - r0) > 0


def _all_held(ev: dict[str, np.ndarray], needs: list[_Need], loc: int, start: int, upto: int,
              claimed: set[int]) -> int | None:
    """The first stream place from ``start`` on (at most ``upto``) where ``loc`` holds, in each KV
    cache group of ``needs`` (the anchoring group first), the blocks the look-up needs there, those
    of the anchoring group each last stored by a run some request claimed (None when none is
    found): a request that stored nothing found them all cached. A block held only through a run
    nobody claimed is not taken as a hit (measured live: a request the engine served with 0 hits
    matched no run of its own, and the first place holding its blocks gave it 704 hit tokens)."""
    place = start
    for _ in range(2 * len(needs)):  # a later place found for one block is checked again for the others
        moved = False
        for need in needs:
            for h in need.blocks:
                if need.copies.held(loc, h, place):
                    continue
                rows = need.stores.get((loc, h), ())
                later = bisect.bisect_left(rows, place)
                if later >= len(rows) or rows[later] >= upto:
                    return None
                place, moved = rows[later] + 1, True
        if not moved:
            break
    stores = [needs[0].stores[(loc, h)] for h in needs[0].blocks]  # the anchoring group's
    held = [rows[bisect.bisect_left(rows, place) - 1] for rows in stores]
    if all(need.copies.held(loc, h, place) for need in needs for h in need.blocks) \
            and all(_event_start(ev, row) in claimed for row in held):
        return place
    return None


class _Need(NamedTuple):
    """Blocks a look-up needs held in one KV cache group, and that group's stores and copies."""
    blocks: list[int]
    stores: dict[tuple[int, int], list[int]]
    copies: _Copies


def _window_tail(chain: list[int], window: int, block_size: int) -> list[int]:
    """The blocks of ``chain`` a sliding window group must hold for a hit of the whole chain: the
    last ``cdiv(window - 1, block_size)`` (all of a shorter chain). vLLM's
    single_type_kv_cache_manager.py::SlidingWindowManager.find_longest_cache_hit scans from the
    right for that many contiguous cached blocks (``_contiguous_blocks_for_hit``; one more with an
    EAGLE drafter, which the lake does not record), and without them keeps the contiguous cached
    run from block 0, which is the whole chain only when every block of it is cached."""
    need = -(-(window - 1) // block_size)
    return chain[max(0, len(chain) - need):]


def _event_start(ev: dict[str, np.ndarray], row: int) -> int:
    """The first stored row of the event row ``row`` belongs to."""
    while row > 0 and _continues(ev, row, row - 1):
        row -= 1
    return row


def _admission_start(ev: dict[str, np.ndarray], own: int, blocks: set[int]) -> int:
    """The first row of the admission whose anchoring run starts at ``own``: the stored rows just
    before it, in its batch and on its replica, of other KV cache groups, that store the request's
    blocks (a hybrid model's other groups cache them first, in group order); ``own`` itself for a
    single group's.

    The removals just before those are not walked back over, although the request's own
    allocation makes its evictions before it caches (KVCacheManager.allocate_slots: get_new_blocks,
    then cache_blocks), after its look-up: a request admitted just before it in the same step that
    found every block cached evicts without storing, and its removals are indistinguishable from
    these (walking back over them broke 5 of the concurrent capture's exact hits). The look-up then
    sees the request's own evictions, which only touch blocks past its hit (its hit blocks were
    taken first): on the sequential hybrid capture, 105 blocks a full-attention group held past a
    window's cut read as ``miss_evicted`` where the engine still held them (``miss_group``)."""
    row = own
    while row > 0:
        p = row - 1
        if not (ev["ev_kind"][p] == _STORED and ev["ev_loc"][p] == ev["ev_loc"][own]
                and ev["ev_grp"][p] != ev["ev_grp"][own] and int(ev["ev_h"][p]) in blocks
                and (ev["ev_seq"][p] == ev["ev_seq"][own] or ev["ev_ts"][p] == ev["ev_ts"][own])):
            break
        row = p
    return row


def _out_of_order(anchored: list[int], look: np.ndarray, req_loc: np.ndarray,
                  owns: np.ndarray) -> list[tuple[int, int]]:
    """(request, bound) for each request whose own run lies after the own run of a request on its
    replica that looked up more than ``_REORDER_NS`` after it; the bound is the earliest such run."""
    out = []
    by_loc: dict[int, list[int]] = {}
    for i in anchored:  # (in look-up order)
        by_loc.setdefault(int(req_loc[i]), []).append(i)
    for members in by_loc.values():
        times = [int(look[i]) for i in members]
        runs = [int(owns[i]) if owns[i] >= 0 else _NO_RUN for i in members]
        after = list(itertools.accumulate(reversed(runs), min))[::-1]  # the earliest run from each on
        for k, i in enumerate(members):
            later = bisect.bisect_right(times, times[k] + _REORDER_NS)
            if owns[i] >= 0 and later < len(members) and after[later] < owns[i]:
                out.append((i, after[later]))
    return out


class Admission(NamedTuple):
    """``admission_cuts``' answer, per request."""
    cuts: np.ndarray
    owns: np.ndarray
    chunks: list[list[int]]


def _crosses(ev_loc: np.ndarray, a: int, b: int, shared: int) -> bool:
    """Events between stream places ``a`` and ``b`` include the shared pool's."""
    lo, hi = min(a, b), max(a, b)
    return shared >= 0 and bool((ev_loc[lo:hi] == shared).any())


def admission_cuts(ev: dict[str, np.ndarray], req: pl.DataFrame, full: pl.DataFrame, req_loc: np.ndarray,
                   shared: int = -1, claimed: Iterable[int] = (),
                   anchors: np.ndarray | None = None,
                   windows: np.ndarray | None = None) -> Admission:
    """Per request (``req``'s order): how many events of the sorted stream its look-up sees, the
    stream place of the run it was anchored at (-1: it found none, -2: it keeps the time rule),
    and the first rows of that run's later chunks (a chunked prefill's).

    ``ev`` holds the replay's sorted event arrays plus ``ev_seq`` (the batch) and ``ev_parent``
    (the row's parent hash, 0 for none), hashes as signed 64-bit. ``req`` has ``request_id``,
    ``arrival_ns`` and ``lookup_ns``; ``full`` the needed full blocks (``request_id``,
    ``position``, ``block_hash_i64``). A request without its own run gets the events stamped
    strictly before its look-up time, the replay's rule for one request at a time; so does one
    whose own run lies across events of the shared pool (location ``shared``), whose stores
    another replica's scheduler made: the rule orders one engine's admissions only. ``claimed``:
    runs and later chunks (their first stored row's place) that requests before these, in look-up
    order, took.
    ``anchors``: per location code, the group whose runs anchor it (``anchor_groups``; default:
    from the events, without windows: a location publishing one group is anchored at it). A hybrid
    model's request anchored at its run in that group looks up before the run's batch-mates of its
    other groups that store its blocks just before it (its own admission's). ``windows``: per
    location and group code, the sliding window in tokens of each group the location publishes
    (0: full attention, or a group it does not publish); a request that stored nothing then also
    needs each window group's tail of its blocks held (``_window_tail``), which the engine's hit of
    every block took; where no place holds them, the anchoring group's blocks alone place it.
    """
    ts = ev["ev_ts"]
    look = req["lookup_ns"].to_numpy()
    by_time = np.searchsorted(ts, look, side="left")
    if anchors is None:
        n_locs = int(ev["ev_loc"].max()) + 1 if ev["ev_loc"].shape[0] else 0
        n_groups = int(ev["ev_grp"].max()) + 1 if ev["ev_grp"].shape[0] else 0
        anchors = anchor_groups(loc_groups(ev["ev_kind"], ev["ev_loc"], ev["ev_grp"], n_locs, n_groups))
    # The batch of the admitting step is stamped after the request arrived, and within
    # ADMISSION_WINDOW_NS of its look-up time.
    after = np.searchsorted(ts, req["arrival_ns"].to_numpy(), side="right")
    upto = np.searchsorted(ts, look + ADMISSION_WINDOW_NS, side="right")
    cuts = by_time.astype(np.int64)
    owns = np.full(req.height, -2, np.int64)
    chunks: list[list[int]] = [[] for _ in range(req.height)]
    simulated = (req["source"] == SIMULATED).fill_null(False).to_numpy() if "source" in req.columns \
        else np.zeros(req.height, np.bool_)
    known = (req_loc >= 0) & (req_loc < anchors.shape[0])
    candidates = known & (anchors[np.where(known, req_loc, 0)] >= 0) & ~simulated
    if not candidates.any():  # every request keeps the time rule (a simulator's, an unanchored replica's)
        return Admission(cuts, owns, chunks)
    chains = dict(full.sort("request_id", "position").group_by("request_id", maintain_order=True)
                  .agg(pl.col("block_hash_i64")).iter_rows())
    ids = req["request_id"].to_list()
    # One BlockStored event comes from one request's allocation: in look-up-time order, each
    # request takes the first run no request before it took.
    anchored = [i for i in np.argsort(look, kind="stable").tolist() if candidates[i] and chains.get(ids[i])]
    loc_rows = ev["ev_loc"].astype(np.int64)
    in_range = (loc_rows >= 0) & (loc_rows < anchors.shape[0])
    row_anchor = np.where(in_range, anchors[np.where(in_range, loc_rows, 0)], -1)
    on_anchor = ev["ev_grp"] == row_anchor
    index = _rows_index(ev["ev_loc"], ev["ev_h"], (ev["ev_kind"] == _STORED) & on_anchor)
    anchor_copies = _Copies(ev, index, on_anchor)
    sliding: dict[int, tuple[dict[tuple[int, int], list[int]], _Copies]] = {}
    sizes = req["block_size"].fill_null(0).to_numpy() if "block_size" in req.columns \
        else np.zeros(req.height, np.int64)
    tails = np.zeros((0, 0), np.int64) if windows is None else windows

    def needs_of(i: int) -> list[_Need]:
        """What request ``i`` needed held to store nothing: the anchoring group's blocks first."""
        loc, chain = int(req_loc[i]), chains[ids[i]]
        needs = [_Need(chain, index, anchor_copies)]
        groups = np.flatnonzero(tails[loc] > 0).tolist() if sizes[i] > 0 and loc < tails.shape[0] else []
        for g in groups:
            if g not in sliding:
                in_group = ev["ev_grp"] == g
                g_index = _rows_index(ev["ev_loc"], ev["ev_h"], (ev["ev_kind"] == _STORED) & in_group)
                sliding[g] = (g_index, _Copies(ev, g_index, in_group))
            needs.append(_Need(_window_tail(chain, int(tails[loc, g]), int(sizes[i])), *sliding[g]))
        return needs

    # One BlockStored event comes from one request's allocation: in look-up-time order, each
    # request takes the first run no request before it took. A request whose run would come after
    # the admission of one that arrived well after it, and which could have found its blocks cached
    # before that, found them so (the engine admits in arrival order), and the run goes to another.
    stored_nothing: set[int] = set()
    for _ in range(_ORDER_ROUNDS):
        taken: set[int] = set(claimed)
        cuts, owns = by_time.astype(np.int64), np.full(req.height, -2, np.int64)
        chunks = [[] for _ in range(req.height)]
        ends = _Ends(anchored, req_loc, [chains[ids[i]][-1] for i in anchored], after)
        unfound = []
        for i in anchored:
            ends.done(i)
            path = [] if i in stored_nothing else \
                _cut(ev, index, int(req_loc[i]), chains[ids[i]], int(after[i]), int(upto[i]), taken, ends)
            if not path:
                owns[i] = -1
                unfound.append(i)
                continue
            own, chunks[i] = path[0], path[1:]
            owns[i] = own
            taken.update(path)  # its later chunks are its own too
            # Only a run published after the look-up time is a step's batch the engine stamped
            # after admitting (a simulator stamps a request's stores at its look-up: the time
            # rule is already exact there).
            if ts[own] > look[i] and not _crosses(ev["ev_loc"], int(by_time[i]), own, shared):
                cuts[i] = _admission_start(ev, own, set(chains[ids[i]]))
        more = set()
        for i, bound in _out_of_order(anchored, look, req_loc, owns):
            others = taken.difference([owns[i], *chunks[i]])
            if _all_held(ev, needs_of(i), int(req_loc[i]), int(by_time[i]), bound, others) is not None:
                more.add(i)
        if not more:
            break
        stored_nothing |= more
    # A request that stored nothing found its blocks cached by runs the engine admitted before it,
    # whoever claimed them: the gateway's arrival order is not the engine core's (the API server
    # hands requests on in the order it finishes with them), so a run claimed by a request that
    # arrived after it can still be the one it found (CI, live: 0 hit tokens where the engine had 160).
    for i in unfound:
        needs, start = needs_of(i), int(by_time[i])
        held = _all_held(ev, needs, int(req_loc[i]), start, int(upto[i]), taken)
        if held is None and len(needs) > 1:  # no place holds every group's: the anchoring group's
            held = _all_held(ev, needs[:1], int(req_loc[i]), start, int(upto[i]), taken)
        cuts[i] = start if held is None else held
    return Admission(cuts, owns, chunks)
