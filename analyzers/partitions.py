"""Analyzers: the ledger's replay split into partitions that need not share memory (issue 17).

``replay_resume`` walks every event and look-up of a scenario in one process. The same
decisions, taken in two phases (analyzers/replay.py, docs/scale.md):

- **Phase 1, per block-hash partition** (``block_states``): a block's residency on every
  location depends only on the events of its own hash, and on clears, which every partition
  receives. A partition holds the events of the hashes ``h mod K = p`` and the needed block rows
  of those hashes, each with its request's place in the event stream and location; it returns
  each row's source per KV cache group and, for a block available nowhere, why. Event places
  stay global, so each row sees exactly the events the one-process replay applies before it.
- **Content**: whether a block never stored was stored under another key (``miss_incompatible``)
  depends on the stores of other hashes with the same content hash; ``content_namespaces``
  answers it for every row from the stores alone (the first two namespaces per content hash
  and where they were first stored).
- **Phase 2, per request** (``decide_requests``): the hit rule and the chain rule over the
  request's rows, joined back in look-up order.

The partitions are independent: ``run`` maps phase 1 over them (in process one at a time, each
partition's arrays built just before it runs, or as Ray tasks: analyzers/ray_runner.py). Outcomes
equal ``replay_resume``'s from an empty state row for row (tests/test_partitions.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvlens import memory
from kvlens.analyzers.replay import TIERS, block_states, decide_requests

__all__ = ["ROWS_PER_PARTITION", "Counted", "Partitions", "PhaseOne", "Runner", "State", "States",
           "content_maps", "content_namespaces", "in_process", "merged_state", "partition_of",
           "replay_partitioned", "replay_partitioned_state", "reporting", "split_by_partition"]

_STORED, _CLEARED = 0, 2  # analyzers/replay.py's event kinds

# One partition's arguments (for the ledger, ``block_states``' positional arguments).
PhaseOne = tuple[Any, ...]
States = tuple[np.ndarray, ...]  # ``block_states``' result
State = tuple[np.ndarray, ...]  # ``replay_resume``'s state
# Maps a function over partitions' arguments, yielding the results in the same order (the ledger's
# phase 1, analyzers/mrc.py's partition histograms).
Runner = Callable[[Callable[..., Any], Iterable[PhaseOne]], Iterator[Any]]


def in_process(fn: Callable[..., Any], parts: Iterable[PhaseOne]) -> Iterator[Any]:
    """The default runner: one partition at a time in this process (each a safe point of the
    analysis' memory limit, kvlens/memory.py)."""
    for args in parts:
        got = fn(*args)
        memory.check()
        yield got


class Counted(Iterator[Any]):
    """Partitions' arguments, made one at a time (bounded memory), that know how many there are:
    a runner's progress says "3/8"."""

    def __init__(self, parts: Iterator[Any], total: int) -> None:
        self._parts, self.total = parts, total

    def __iter__(self) -> Counted:
        return self

    def __next__(self) -> Any:
        return next(self._parts)


# What a runner's progress calls each map: the ledger's phase 1, or the partitioned curve's histograms.
_LABELS = {"block_states": "ledger", "partition_histogram": "curve"}


def reporting(run: Runner, say: Callable[[str], object]) -> Runner:
    """``run``, saying each partition done as it is gathered ("ledger partition 3/8")."""
    def wrapped(fn: Callable[..., Any], parts: Iterable[PhaseOne]) -> Iterator[Any]:
        total = getattr(parts, "total", None)
        label = _LABELS.get(getattr(fn, "__name__", ""), "partition")
        for done, got in enumerate(run(fn, parts), 1):
            say(f"{label} partition {done}/{total}" if total else f"{label} partition {done}")
            yield got
    return wrapped


# Rows (needed blocks, or accesses) per partition when the count is chosen from a scenario's size.
# From the sizes of its arrays (modelled, not measured), phase 1 (analyzers/replay.py's
# block_states) holds about 40 bytes per needed block row and 70 per event of its partition, plus
# 32 per distinct stored block of one bit word: a few hundred MB at this many rows.
ROWS_PER_PARTITION = 4_000_000


@dataclass(frozen=True)
class Partitions:
    """How many block-hash partitions the ledger's replay (and the partitioned curve) is split
    into, and what runs them. ``count`` None: chosen per scenario (``for_rows``)."""

    count: int | None = None
    run: Runner = in_process
    where: str = "in process"  # said on the analyze line: "in process" or the Ray cluster's address
    workers: int = 1  # what runs them in parallel (a Ray cluster's CPUs)

    def for_rows(self, rows: int) -> int:
        """The partition count for a scenario of ``rows`` rows: the given one, else two per
        worker (so that a slow partition does not leave a worker idle), more when a partition
        would hold more than ``ROWS_PER_PARTITION`` rows."""
        if self.count is not None:
            return self.count
        return max(2 * self.workers, -(-rows // ROWS_PER_PARTITION))

    def saying(self, say: Callable[[str], object]) -> Partitions:
        """The same partitions, whose runner says each one done (the CLI's progress bar)."""
        return replace(self, run=reporting(self.run, say))


def partition_of(hashes: np.ndarray, partitions: int) -> np.ndarray:
    """The partition of each block hash (int64 views of unsigned hashes): ``h mod K``, unsigned."""
    return (hashes.view(np.uint64) % np.uint64(partitions)).astype(np.int64)


def split_by_partition(part: np.ndarray, partitions: int) -> list[np.ndarray]:
    """The indices of each partition's rows, in stream order. A pass per partition costs K passes
    over the stream; past 8 partitions one stable radix sort of the codes (numpy sorts 16-bit
    integers by radix) is cheaper: on 10M rows here, 0.12 s against 0.15 s at K = 8, 0.66 s against
    0.13 s at K = 64, 2.2 s against 0.14 s at K = 256."""
    if partitions <= 8 or partitions > np.iinfo(np.uint16).max:
        return [np.flatnonzero(part == k) for k in range(partitions)]
    order = np.argsort(part.astype(np.uint16), kind="stable")
    ends = np.cumsum(np.bincount(part, minlength=partitions))
    return np.split(order, ends[:-1])


def _first_two_namespaces(ev_place: np.ndarray, ev_kind: np.ndarray, ev_c: np.ndarray, ev_ns: np.ndarray,
                          keep: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per content hash among the kept stores (sorted contents): the place and namespace it was
    first stored under, and the place and namespace of the first store under a different one
    (``int64`` max and -1 when none): what replay.py's ``_note_content`` keeps. A content hash of
    0 and a namespace of -1 are unknown and never count."""
    keep = keep & (ev_kind == _STORED) & (ev_c != 0) & (ev_ns != -1)
    place, c, ns = ev_place[keep], ev_c[keep], ev_ns[keep].astype(np.int64)
    order = np.lexsort((place, c))  # by content, then stream place
    place, c, ns = place[order], c[order], ns[order]
    contents, first = np.unique(c, return_index=True)
    first_place, first_ns = place[first], ns[first]
    group = np.searchsorted(contents, c)
    second_place = np.full(contents.shape[0], np.iinfo(np.int64).max, np.int64)
    second_ns = np.full(contents.shape[0], -1, np.int64)
    at = np.flatnonzero(ns != first_ns[group])
    # the first differing store of each content: ``at`` is in (content, place) order
    leaders = at[np.unique(group[at], return_index=True)[1]]
    second_place[group[leaders]], second_ns[group[leaders]] = place[leaders], ns[leaders]
    return contents.astype(np.int64), first_place, first_ns, second_place, second_ns


def content_namespaces(ev_place: np.ndarray, ev_kind: np.ndarray, ev_c: np.ndarray, ev_ns: np.ndarray,
                       row_t: np.ndarray, blk_c: np.ndarray, blk_ns: np.ndarray) -> np.ndarray:
    """Per block row, a namespace other than its own that its content hash was stored under
    before its look-up (``row_t``: a row sees stores with ``ev_place < row_t``), or -1: what the
    one-process replay's content maps answer (replay.py ``_note_content``/``_other_namespace``:
    the first namespace a content hash is stored under, then the first different one)."""
    other = np.full(blk_c.shape[0], -1, np.int32)
    contents, first_place, first_ns, second_place, second_ns = _first_two_namespaces(
        ev_place, ev_kind, ev_c, ev_ns, np.ones(ev_kind.shape[0], np.bool_))
    if contents.shape[0] == 0:
        return other
    g = np.minimum(np.searchsorted(contents, blk_c), contents.shape[0] - 1)
    known = (blk_c != 0) & (blk_ns != -1) & (contents[g] == blk_c) & (first_place[g] < row_t)
    own = blk_ns.astype(np.int64)
    other_first = known & (first_ns[g] != own)
    other_second = known & ~other_first & (second_place[g] < row_t)
    other[other_first] = first_ns[g][other_first]
    other[other_second] = second_ns[g][other_second]
    return other


def replay_partitioned(*args: Any, partitions: int, run: Runner = in_process) -> tuple[np.ndarray, ...]:
    """``replay_resume``'s outputs from an empty state (same arguments, no state or snapshot),
    computed as ``partitions`` block-hash partitions (phase 1, mapped by ``run``) and a pass per
    request (phase 2): ``replay_partitioned_state``'s outputs, with no snapshot."""
    outputs, _ = replay_partitioned_state(*args, partitions=partitions, run=run, snap=-1)
    return outputs


def replay_partitioned_state(ev_place: np.ndarray, ev_stamp: np.ndarray, ev_kind: np.ndarray,
                             ev_loc: np.ndarray, ev_tier: np.ndarray, ev_grp: np.ndarray, ev_h: np.ndarray,
                             ev_c: np.ndarray, ev_ns: np.ndarray, ev_left: np.ndarray, req_t: np.ndarray,
                             req_loc: np.ndarray, req_tail: np.ndarray, req_bs: np.ndarray,
                             req_off: np.ndarray, blk_h: np.ndarray, blk_c: np.ndarray, blk_ns: np.ndarray,
                             blk_xfer: np.ndarray, n_locs: int, pool_loc: int, loc_window: np.ndarray,
                             loc_grp: np.ndarray, *, partitions: int, snap: int,
                             run: Runner = in_process) -> tuple[tuple[np.ndarray, ...], State | None]:
    """``replay_resume``'s outputs from an empty state and, with ``snap`` >= 0, its state after
    exactly the events with ``ev_place < snap`` (what the ledger saves at its checkpoint, and a
    later analysis continues from in one process), gathered from the partitions' (``merged_state``);
    None when ``snap`` < 0."""
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, got {partitions}")
    n_groups = loc_window.shape[1]
    counts = np.diff(req_off)
    row_t = np.repeat(req_t, counts)
    row_loc = np.repeat(req_loc, counts)
    clears = ev_kind == _CLEARED
    cleared = np.flatnonzero(clears)
    # a clear's hash is not a block's: the clears go to every partition, not to h mod K's
    ev_part = np.where(clears, partitions, partition_of(ev_h, partitions))
    ev_parts = split_by_partition(ev_part, partitions + 1)
    chosen = split_by_partition(partition_of(blk_h, partitions), partitions)

    def parts() -> Iterator[PhaseOne]:
        for p in range(partitions):
            ev = np.sort(np.concatenate((ev_parts[p], cleared))) if cleared.size else ev_parts[p]
            rows = chosen[p]
            yield (ev_place[ev], ev_stamp[ev], ev_kind[ev], ev_loc[ev], ev_tier[ev], ev_grp[ev], ev_h[ev],
                   ev_left[ev], row_t[rows], row_loc[rows], blk_h[rows], blk_xfer[rows], n_locs, pool_loc,
                   loc_grp, snap)

    n_blk = blk_h.shape[0]
    src = np.empty((n_blk, n_groups), np.int8)
    cause = np.empty(n_blk, np.int8)
    holder = np.empty(n_blk, np.int32)
    rem_ts = np.empty(n_blk, np.int64)
    rem_loc = np.empty(n_blk, np.int32)
    snaps: list[tuple[np.ndarray, ...]] = []
    for p, got in enumerate(run(block_states, Counted(parts(), partitions))):
        rows = chosen[p]
        src[rows], cause[rows], holder[rows], rem_ts[rows], rem_loc[rows] = got[:5]
        snaps.append(got[5:])
    other = content_namespaces(ev_place, ev_kind, ev_c, ev_ns, row_t, blk_c, blk_ns)
    outputs = decide_requests(req_loc, req_tail, req_bs, req_off, loc_grp, loc_window, src,
                              blk_xfer.astype(np.int8), cause, holder, rem_ts, rem_loc, other)
    if snap < 0:
        return outputs, None
    content = content_maps(ev_place, ev_kind, ev_c, ev_ns, snap)
    return outputs, merged_state(snaps, TIERS * n_locs * n_groups, content)


def merged_state(snaps: Sequence[tuple[np.ndarray, ...]], n_slots: int,
                 content: tuple[np.ndarray, ...]) -> State:
    """The partitions' snapshots as one ``replay_resume`` state: their rows one after another (a
    row's number only indexes its arrays), extra-copy keys ``row * n_slots + slot`` moved with
    their rows, and the content maps (``content_maps``)."""
    bases = np.cumsum([0] + [part[0].shape[0] for part in snaps])
    keys = [(part[5] // n_slots + base) * n_slots + part[5] % n_slots
            for part, base in zip(snaps, bases, strict=False)]
    return (np.concatenate([part[0] for part in snaps]), np.concatenate([part[1] for part in snaps]),
            np.concatenate([part[2] for part in snaps]), np.concatenate([part[3] for part in snaps]),
            np.concatenate([part[4] for part in snaps]), np.concatenate(keys).astype(np.int64),
            np.concatenate([part[6] for part in snaps]).astype(np.int64), *content)


def content_maps(ev_place: np.ndarray, ev_kind: np.ndarray, ev_c: np.ndarray, ev_ns: np.ndarray,
                 snap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The one-process replay's content maps after the events with ``ev_place < snap``, as key and
    value arrays: per content hash its first namespace, and the first different one where there
    is one (``_first_two_namespaces``)."""
    contents, _, first_ns, _, second_ns = _first_two_namespaces(ev_place, ev_kind, ev_c, ev_ns,
                                                                ev_place < snap)
    other = second_ns != -1
    return contents, first_ns, contents[other], second_ns[other]
