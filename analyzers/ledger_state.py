"""Analyzers: the ledger's replay state at a checkpoint, so that the next analysis continues from it.

A checkpoint is a time ``T_c`` chosen when a ledger is computed (``checkpoint``): every request
that arrived before it is *settled* (its outcomes are final: no row the lake can still receive
changes them), and the state is the cache after exactly the events stamped before it. The next
``kvlens analyze`` of the scenario keeps the settled requests' rows, restores the state, and
replays only the events from ``T_c`` on for the requests that arrived from ``T_c`` on
(analyzers/outcomes.py, ``ledger_outcomes``). The result equals a full replay because:

- new lake data holds no row older than the previous watermark less the lag
  (analyzers/incremental.py ``horizon`` and ``late_lag``; it rebuilds in full otherwise), the
  *horizon*; ``T_c`` is at most that,
  so the events before ``T_c`` and their order are the same in every later analysis;
- the requests that look up before ``T_c`` are settled: ``T_c`` is lowered until each of them
  sees at most the events before it (its look-up place is at most the checkpoint's) and its
  admission (analyzers/admission.py) cannot move. A request on the time rule sees the events
  stamped before its look-up time, so it qualifies by its time; one anchored at its own run
  qualifies once that run lies before the checkpoint (an earlier run stays the earliest: new runs
  come later); one that found no run of its own qualifies once the checkpoint is
  ``ADMISSION_WINDOW_NS`` past its look-up time (admission.py looks no further for its run, nor for
  the place where it found its blocks held);
- the ledger is ordered by look-up place, then look-up time: the settled rows precede every
  replayed one, and keep their order.

What a continuation checks before it trusts the state (any failure rebuilds the scenario's ledger
in full, and says why): the KV cache groups each location publishes, and their sliding windows,
are those the settled rows were decided with; no location starts publishing; locations first
seen after the checkpoint appear in the same order; no request after the checkpoint looks up
before it; no request id arrives again; the transfers of settled requests are those counted at the
checkpoint; when requests after it are anchored at their own runs, the events before it are those
it counted.

Requests anchored at their own stores (a real vLLM's) continue too: the state keeps the runs the
settled requests claimed (``claimed``), and the requests after the checkpoint are admitted over the
whole event stream with those runs taken (outcomes.py ``_admitted_after``): in look-up order the
settled requests come first, so these are the claims a full admission holds when it reaches them.

The state is stored as one ``state_blob.pack_arrays`` blob (zstd-compressed arrays, no pickles) in
the analysis DB's ``kvlens_ledger`` table, written in the same file as the results. (A state is
only read by the code that wrote it: ``incremental.code_digest`` is part of its configuration.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from kvlens.analyzers import admission
from kvlens.analyzers.state_blob import pack_arrays, unpack_arrays

__all__ = ["LEDGER_TABLE", "LedgerState", "checkpoint"]

LEDGER_TABLE = "kvlens_ledger"
# replay_resume's state tuple, in order
_ARRAYS = ("row_hash", "masks", "extra", "removed_ts", "remover", "copy_keys", "copy_values",
           "first_ns_keys", "first_ns_values", "other_ns_keys", "other_ns_values")


@dataclass(frozen=True)
class LedgerState:
    """The replay state at ``checkpoint_ns`` and what continuing from it must agree with."""

    checkpoint_ns: int  # T_c: every event stamped before it is applied, every look-up before it settled
    events: int  # how many events that is (the stream place the next replay starts at)
    locations: tuple[str, ...]  # location codes: event locations by first appearance, then request-only
    event_locations: int  # how many of them published events
    prefix_locations: int  # how many of them published before the checkpoint
    namespaces: tuple[str, ...]
    group_idx: tuple[int, ...]  # KV cache group codes
    loc_grp: np.ndarray  # bool (locations, groups): groups each location published, whole stream
    windows: np.ndarray  # int64 (locations, groups): sliding window in tokens, 0 full attention
    prefix_specs: str  # JSON: per (location, group_idx), the first spec kind / window seen before T_c
    arrays: tuple[np.ndarray, ...]  # replay_resume's state
    needed: np.ndarray  # int64: block hashes the settled requests needed (for ``reusable``)
    settled_transfers: int  # loads stamped from T_c on for requests that may be settled
    # The earliest transfer of a request that may look up from T_c on, or of one no request row
    # names yet (None: there is none): the next run finds those requests' transfers from there (or
    # T_c if earlier) on, not in the whole lake (outcomes.py, ``_transfer_marks``).
    loads_from: int | None
    # stream places of the runs settled requests were admitted at (analyzers/admission.py's claims)
    claimed: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    def to_bytes(self) -> bytes:
        meta = {"checkpoint_ns": self.checkpoint_ns, "events": self.events, "locations": list(self.locations),
                "event_locations": self.event_locations, "prefix_locations": self.prefix_locations,
                "namespaces": list(self.namespaces), "group_idx": list(self.group_idx),
                "prefix_specs": self.prefix_specs, "settled_transfers": self.settled_transfers,
                "loads_from": self.loads_from}
        arrays = {"loc_grp": self.loc_grp, "windows": self.windows, "needed": self.needed,
                  "claimed": self.claimed, **dict(zip(_ARRAYS, self.arrays, strict=True))}
        return pack_arrays(meta, arrays)

    @classmethod
    def from_bytes(cls, data: bytes) -> LedgerState:
        meta, f = unpack_arrays(data)
        return cls(checkpoint_ns=int(meta["checkpoint_ns"]), events=int(meta["events"]),
                   locations=tuple(meta["locations"]), event_locations=int(meta["event_locations"]),
                   prefix_locations=int(meta["prefix_locations"]), namespaces=tuple(meta["namespaces"]),
                   group_idx=tuple(int(g) for g in meta["group_idx"]), loc_grp=f["loc_grp"],
                   windows=f["windows"], prefix_specs=meta["prefix_specs"],
                   arrays=tuple(f[name] for name in _ARRAYS), needed=f["needed"],
                   settled_transfers=int(meta["settled_transfers"]),
                   loads_from=None if meta["loads_from"] is None else int(meta["loads_from"]),
                   claimed=f["claimed"])


def checkpoint(ev_ts: np.ndarray, offset: int, start_ns: int | None, horizon_ns: int, lookup: np.ndarray,
               cut: np.ndarray, own: np.ndarray) -> tuple[int, int]:
    """(T_c, its stream place): the latest time at most ``horizon_ns`` such that every request
    that looks up before it is settled (module docstring). ``ev_ts``: the sorted event times from
    stream place ``offset`` on (those before were stamped before ``start_ns``, the previous
    checkpoint); per request its look-up time, look-up place ``cut`` and ``own`` (admission's run
    place, -1 none found, -2 the time rule's)."""
    t = int(horizon_ns)
    while True:
        place = offset + int(np.searchsorted(ev_ts, t, side="left"))
        # No run found: final once the stream is known to ADMISSION_WINDOW_NS past the look-up.
        unfound = (own == -1) & (lookup + admission.ADMISSION_WINDOW_NS >= t)
        open_ = (lookup < t) & ((cut > place) | unfound | (own >= place))
        if not open_.any():
            break
        t = int(lookup[open_].min())
    if start_ns is not None and t < start_ns:
        raise AssertionError(f"checkpoint {t} before the previous one {start_ns}: a replayed request settled")
    return t, offset + int(np.searchsorted(ev_ts, t, side="left"))
