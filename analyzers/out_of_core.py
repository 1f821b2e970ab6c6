"""Analyzers: the ledger of a lake larger than memory, in one process (issue 17, ``kvlens analyze
--out-of-core``).

The one-process ledger (analyzers/outcomes.py) holds every event, every needed block and every
outcome of a scenario in memory at once: measured, about 600 bytes per block access, so this
24 GiB machine stops near 35M accesses. Here the same outcomes are computed with one block-hash
partition's rows, or one range of requests' rows, in memory at a time. Everything else is in
Parquet files that DuckDB writes, joins and sorts (spilling past its memory limit), in a
directory beside the analysis DB that is removed at the end (a killed run's is removed by the
next build, as its temporary DB is).

1. **Codes and checks**: one aggregate over the scenario's events gives the location codes in
   order of first appearance in the sorted stream, the KV cache groups, the groups each location
   publishes and their sliding windows: what ``ledger_outcomes`` derives from its arrays.
2. **Requests** in look-up time order (``k``: look-up, arrival, id), each with its replica's code
   (the replicas without events follow the event locations, in that order), whether its prompt
   ends in a partial block, its block size and its count of full blocks.
3. **Events by block hash, with their stream places**: one pass writes the rows of partition
   ``h mod K`` to a directory of their own (clears to one that every partition reads), each with
   its ``place``, its index in the one-process replay's sorted stream (its row number in one file
   that DuckDB writes sorted by the stream's key, sorting out of core).
4. **Look-up places** (``cut``: the look-up sees the events with ``place < cut``). The time rule's
   (``searchsorted(ev_ts, lookup)``): as-of joined to the first place of the first event time at or
   after the look-up. A real engine's requests are admitted at their own stores
   (analyzers/admission.py ``admission_cuts``), replica by replica: each anchored replica's events
   (and the full blocks of its candidate requests) are written to a directory of their own, and
   admission runs on them alone; its answers, rows of that replica's subsequence, map to stream
   places (``_admit_replica``). Then the requests are numbered in the one-process replay's order
   (``i``: cut, look-up, arrival, id) and written sorted by ``i``. The simulator's requests, and
   those of replicas whose runs anchor nothing (``anchor_groups``), keep the time rule.
5. **Needed blocks by block hash**, with their request's ``i`` and cut.
6. **Phase 1 per partition** (analyzers/replay.py ``block_states``): the partition's events in
   stream order and its blocks in ``i`` order, each seeing the events before its cut; each block's
   source per group and, when it is available nowhere, why. Written by ranges of requests.
7. **Phase 2 per range of requests** (``decide_requests``): the hit rule and the chain rule, then
   the range's ``block_outcomes`` and ``request_ledger`` rows, and its ``miss_ledger`` sums,
   summed over the ranges at the end.

**Exact.** The outcomes are ``ledger_outcomes``' row for row (tests/test_out_of_core.py: simulated
lakes, and real vLLM captures with chunked prefill, preemption, hybrid groups and concurrency, on
one replica and on two), by the same partitions as analyzers/partitions.py (property-tested
against the one-process replay). Events with the same time and batch number keep the order a scan
of the lake view reads them in, as the one-process replay's stable sort does
(kvlens.lake.positioned_sql).

Admission per replica gives the whole stream's answers because every rule of it looks at one
replica: a run, its later chunks and the blocks it holds are that replica's stored rows
(``_rows_index`` by location), a request claims runs of its own replica only, ``_Ends`` and
``_out_of_order`` are per location, and a place it finds (``_all_held``) is counted in that
replica's stores, removals and clears. Places compare the same in the subsequence as in the stream
(it keeps their order; a look-up time's boundary falls between the same two of its rows). Two
things are not the replica's own: row adjacency (``_continues``, ``_event_end``,
``_event_start``, ``_admission_start`` ask whether the stream's next or previous row is a stored
row of the same replica and batch), which would read two of its rows as adjacent where another
location's events lie between them in the stream (two replicas' batches of one time and batch
number interleaved in one segment, or a pool-medium event inside a replica's batch): one barrier
row (no event kind, no location) stands for each such gap in the subsequence, so adjacency reads
as in the stream; and ``_crosses`` (the shared pool's events between a request's time cut and its
run), which the pool's places decide after admission, by an as-of join (``_numbered``): a run's cut
is given back for the time cut there, as the one-process admission does. A local answer maps to
a place thus: the run's first row ``r`` (``_admission_start``) -> ``place[r]``; the place just
after a store at row ``r`` (``_all_held``) -> ``place[r] + 1``; a time cut -> the request's time
cut over the whole stream.

**Memory**: one partition's rows (phase 1), one range's (phase 2), and in admission one
replica's events with the full blocks of its candidate requests, and admission's indexes of them:
O(one replica's events), so a fleet of N replicas holds about 1/N of the stream (measured with
tracemalloc, its arrays and Python objects: 7.6 MiB for a replica of 37,500 events and 960
requests, 47 MiB for one of 300,000 events and 7,680 requests, some 160 bytes per event). A single
replica holding most of the stream holds most of it here too.

**Refused**, with the reason, before any row is written:

- two namespaces or more: ``miss_incompatible`` needs the content maps of every store;
- repeated request ids, or requests without an id or an arrival time.

**This module writes the ledger**: ``block_outcomes``, ``request_ledger`` and ``miss_ledger``.
Every analysis after it is computed out of core too, from those tables in the analysis DB
(``kvlens.analyzers.analyze_after_ledger``: each in the module of its one-process analysis, with
its own partitions). No incremental state is saved, so the next ``kvlens analyze`` of the
scenario is a full one.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import polars as pl

from kvlens import memory
from kvlens.analysis_db import settings
from kvlens.analyzers.admission import SIMULATED, admission_cuts, anchor_groups
from kvlens.analyzers.gaps import event_gaps, mark_incomplete
from kvlens.analyzers.ledger import miss_ledger
from kvlens.analyzers.outcomes import _SLIDING_KINDS, POOL_LOCATION, _Codes, _frame
from kvlens.analyzers.partitions import Partitions, in_process
from kvlens.analyzers.replay import XFER_FAILED, XFER_NONE, XFER_OK, block_states, decide_requests
from kvlens.analyzers.request_ledger import request_ledger
from kvlens.errors import ConfigError
from kvlens.lake import positioned_sql

__all__ = ["DUCKDB_MEMORY", "ROWS_PER_PARTITION", "ROWS_PER_RANGE", "OutOfCore", "OutOfCoreResult",
           "ledger_out_of_core"]

# Rows of one block-hash partition in memory at once (phase 1): its arrays, block_states' hash
# table and outputs, about 150 bytes per row (modelled from their sizes), so some 300 MB.
ROWS_PER_PARTITION = 2_000_000
# Rows of one range of requests in memory at once (phase 2): phase 1's columns read back, the
# outcome frame and the request ledger's rows of the range.
ROWS_PER_RANGE = 1_000_000
# DuckDB's memory when no --memory-limit is given (it spills past it into the build's directory).
DUCKDB_MEMORY = "1GB"
_STORED, _REMOVED, _CLEARED = 0, 1, 2  # analyzers/replay.py's event kinds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutOfCore:
    """How ``kvlens analyze --out-of-core`` cuts each scenario: ``partitions`` block-hash
    partitions (None: one per ``rows_per_partition`` needed blocks) and ranges of requests of
    about ``rows_per_range`` blocks each."""

    partitions: int | None = None
    rows_per_partition: int = ROWS_PER_PARTITION
    rows_per_range: int = ROWS_PER_RANGE

    def __post_init__(self) -> None:
        if self.partitions is not None and self.partitions < 1:
            raise ValueError(f"partitions must be at least 1, got {self.partitions}")
        if self.rows_per_partition < 1 or self.rows_per_range < 1:
            raise ValueError("rows per partition and per range must be positive")


@dataclass
class OutOfCoreResult:
    """What a scenario's run did: filled in as it goes (its ``scenarios`` row and its line)."""

    requests: int = 0
    needed_blocks: int = 0
    partitions: int = 0
    ranges: int = 0
    spill_bytes: int = 0  # the largest the spill directory grew (measured after each step)
    seconds: dict[str, float] = field(default_factory=dict)  # per step (phase 2 with its DB writes)
    where: str = "in process"  # what ran phase 1's partitions: "in process", or "on Ray (...)"

    def timed(self, step: str, since: float) -> float:
        """Adds the time from ``since`` to ``step``'s; the time now."""
        now = time.perf_counter()
        self.seconds[step] = self.seconds.get(step, 0.0) + now - since
        return now

    def steps(self) -> str:
        """The seconds per step, in words ("codes and checks 8.9, requests 3.1, ...")."""
        return ", ".join(f"{step} {s:.1f}" for step, s in self.seconds.items())

    def said(self) -> str:
        return (f"ledger out of core in {self.partitions} block-hash partitions {self.where} and "
                f"{self.ranges} ranges of requests, spilling {self.spill_bytes / 2**20:,.0f} MiB to disk")


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# A request's look-up time, rounded as Polars rounds (half to even) in analyzers/outcomes.py.
_LOOKUP = "arrival_ns + CAST(round_even(coalesce(queue_ms, 0) * 1e6, 0) AS BIGINT)"
_KEY = "struct_pack(t := ts0, s := seq0, f := _segment, r := _row)"  # a scan's place in the stream


def _events_sql(con: duckdb.DuckDBPyConnection, lake: Path, scenario: str) -> str:
    """The scenario's events that change residency, with analyzers/outcomes.py ``_events``' codes
    (kind, tier, the location's name: ``pool`` for a pool-medium event) and scan positions."""
    medium = "CAST(medium AS VARCHAR)"
    return f"""
        SELECT coalesce(ts_ns, 0) AS ts0, coalesce(seq, 0) AS seq0, _segment, _row,
               CASE CAST(kind AS VARCHAR) WHEN 'stored' THEN {_STORED} WHEN 'removed' THEN {_REMOVED}
                    ELSE {_CLEARED} END AS kind,
               CASE WHEN {medium} = '{POOL_LOCATION}' THEN '{POOL_LOCATION}' ELSE coalesce(replica, '') END
                   AS loc_name,
               CASE WHEN {medium} = 'cpu' THEN 1 WHEN {medium} = 'disk' THEN 2
                    WHEN CAST(kind AS VARCHAR) = 'cleared' AND medium IS NULL THEN -1 ELSE 0 END AS tier,
               coalesce(group_idx, 0) AS grp, coalesce(block_hash, 0) AS h,
               coalesce(remaining_copies, -1) AS copies_left, coalesce(parent_hash, 0) AS parent, spec_kind,
               sliding_window_tokens, namespace
        FROM ({positioned_sql(con, lake, "kv_events")})
        WHERE scenario = {_literal(scenario)} AND CAST(kind AS VARCHAR) IN ('stored', 'removed', 'cleared')"""


@dataclass
class _Stream:
    """The codes and per-location facts ``ledger_outcomes`` derives from the whole event stream:
    location codes (the event locations in order of first appearance, then the replicas of the
    requests without events, in look-up order), the KV cache groups (``group_idx`` values, sorted),
    per location and group whether it publishes (a clear names none), its first spec kind and
    sliding window, and the namespaces the events name."""

    locs: _Codes
    group_idx: list[int]
    facts: list[tuple[str, int, bool, str | None, int | None]]
    namespaces: set[str]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(loc_grp, windows): analyzers/replay.py ``loc_groups`` and outcomes.py ``_windows``."""
        n_locs = max(len(self.locs.names), 1)
        codes = {g: c for c, g in enumerate(self.group_idx)}
        loc_grp = np.zeros((n_locs, len(self.group_idx)), np.bool_)
        windows = np.zeros((n_locs, len(self.group_idx)), np.int64)
        for loc, g, published, kind, window in self.facts:
            at, code = self.locs.index[loc], codes[g]
            loc_grp[at, code] |= published
            if kind in _SLIDING_KINDS and window is not None and window > 0:
                windows[at, code] = window
        return loc_grp, windows


def _stream(con: duckdb.DuckDBPyConnection, events: str) -> _Stream:
    rows = con.execute(f"""
        SELECT loc_name, grp, min({_KEY}), bool_or(kind <> {_CLEARED}),
               arg_min(spec_kind, {_KEY}) FILTER (WHERE spec_kind IS NOT NULL),
               arg_min(sliding_window_tokens, {_KEY}) FILTER (WHERE sliding_window_tokens IS NOT NULL),
               min(namespace), max(namespace)
        FROM ({events}) GROUP BY loc_name, grp""").fetchall()
    firsts: dict[str, tuple[int, int, str, int]] = {}
    namespaces: set[str] = set()
    facts = []
    for loc, grp, first, published, kind, window, lo, hi in rows:
        key = (first["t"], first["s"], first["f"], first["r"])
        if loc not in firsts or key < firsts[loc]:
            firsts[loc] = key
        namespaces |= {n for n in (lo, hi) if n is not None}
        facts.append((loc, int(grp), bool(published), kind, None if window is None else int(window)))
    names = sorted(firsts, key=firsts.__getitem__)
    return _Stream(_Codes(names), sorted({f[1] for f in facts} or {0}), facts, namespaces)


def _refused(con: duckdb.DuckDBPyConnection, scenario: str, stream: _Stream) -> str | None:
    """Why ``scenario`` cannot be analyzed here, before anything is written (None: it can)."""
    q = _literal(scenario)
    ((rows, distinct, unknown),) = con.execute(
        "SELECT count(*), count(DISTINCT request_id), "
        f"count(*) FILTER (WHERE request_id IS NULL OR arrival_ns IS NULL) FROM requests WHERE scenario = {q}"
    ).fetchall()
    if unknown:
        return f"{unknown:,} of its requests have no request id or no arrival time"
    if distinct != rows:
        return f"{rows - distinct:,} of its request rows repeat another row's request id"
    ((lo, hi),) = con.execute(
        "SELECT min(namespace), max(namespace) FROM request_blocks "
        f"WHERE scenario = {q} AND block_tokens >= block_size_tokens").fetchall()
    spaces = stream.namespaces | {n for n in (lo, hi) if n is not None}
    if len(spaces) > 1:
        named = ", ".join(sorted(spaces)[:3])
        return (f"its events and blocks name {len(spaces)} namespaces or more ({named}): telling "
                "miss_incompatible apart needs the content of every store")
    return None


def _requests(con: duckdb.DuckDBPyConnection, scenario: str, path: Path) -> tuple[int, int]:
    """The scenario's requests in look-up time order (``k``: look-up, arrival, id, the order
    ``ledger_outcomes`` admits them in) with their partial tail, block size and count of full blocks
    (outcomes.py ``_needed``), written to ``path`` sorted by ``k``; (requests, full blocks)."""
    q = _literal(scenario)
    con.execute(f"""COPY (
        WITH r AS (SELECT request_id, scenario, replica, arrival_ns, queue_ms, prompt_tokens, cached_tokens,
                          ttft_ms, CAST(source AS VARCHAR) AS source, {_LOOKUP} AS lookup_ns
                   FROM requests WHERE scenario = {q}),
             c AS (SELECT request_id, sum(block_tokens) AS full_tokens, max(block_size_tokens) AS block_size,
                          count(*) AS n_full
                   FROM request_blocks WHERE scenario = {q} AND block_tokens >= block_size_tokens
                   GROUP BY request_id)
        SELECT row_number() OVER (ORDER BY r.lookup_ns, r.arrival_ns, r.request_id) - 1 AS k, r.*,
               CAST(coalesce(c.block_size, 16) AS BIGINT) AS block_size, coalesce(c.n_full, 0) AS n_full,
               coalesce(r.prompt_tokens, coalesce(c.full_tokens, 0)) > coalesce(c.full_tokens, 0) AS tail
        FROM r LEFT JOIN c USING (request_id) ORDER BY k
    ) TO {_literal(str(path))} (FORMAT parquet, ROW_GROUP_SIZE 65536)""")
    ((n_req, n_rows),) = con.execute(
        f"SELECT count(*), coalesce(sum(n_full), 0) FROM read_parquet({_literal(str(path))})").fetchall()
    return int(n_req), int(n_rows)


def _add_replicas(con: duckdb.DuckDBPyConnection, path: Path, locs: _Codes) -> None:
    """The requests' replicas that publish no events get codes after the event locations, in
    look-up order (``ledger_outcomes``' ``locs.encode(req["replica"])``)."""
    for (name,) in con.execute(f"SELECT coalesce(replica, '') FROM read_parquet({_literal(str(path))}) "
                               "GROUP BY 1 ORDER BY min(k)").fetchall():
        if name not in locs.index:
            locs.index[name] = len(locs.names)
            locs.names.append(name)


def _candidate(r: str) -> str:
    """SQL: request ``r`` (an alias) is one admission tries to anchor, on a location that anchors."""
    return f"{r}.n_full > 0 AND coalesce({r}.source, '') <> '{SIMULATED}'"


def _anchored(con: duckdb.DuckDBPyConnection, path: Path, locs: _Codes, anchors: np.ndarray) -> list[int]:
    """The location codes of the requests with full blocks that admission tries to anchor at their
    own stores (analyzers/admission.py ``admission_cuts``' candidates: not the simulator's, on a
    location whose runs anchor, ``anchors``), in code order."""
    names = [locs.names[c] for c in np.flatnonzero(anchors >= 0) if c < len(locs.names)]
    if not names:
        return []
    rows = con.execute(f"SELECT DISTINCT coalesce(replica, '') FROM read_parquet({_literal(str(path))}) "
                       f"r WHERE {_candidate('r')} AND list_contains(?, coalesce(replica, ''))",
                       [names]).fetchall()
    return sorted(locs.index[name] for (name,) in rows)


def _spill_events(con: duckdb.DuckDBPyConnection, events: str, spill: Path, partitions: int) -> int:
    """The events, coded and with their stream places (``place``: the index in the one-process
    replay's sorted stream), into ``spill/events/part=P`` (``h mod K``; clears into ``part=K``);
    how many there are. The places are the row numbers of one file written sorted by the stream's
    key (an ORDER BY, which DuckDB sorts out of core), read back with ``file_row_number``."""
    ordered = spill / "events-sorted.parquet"
    with settings(con, preserve_insertion_order=True):  # (the sorted file is written in order)
        con.execute(f"""COPY (
            SELECT e.ts0, CAST(e.seq0 AS BIGINT) AS seq0, CAST(e.kind AS TINYINT) AS kind, l.code AS loc,
                   CAST(e.tier AS TINYINT) AS tier, g.code AS grp, e.h, e.parent,
                   CAST(e.copies_left AS BIGINT) AS copies_left,
                   CASE WHEN e.kind = {_CLEARED} THEN {partitions} ELSE e.h % {partitions} END AS part
            FROM ({events}) e JOIN _ooc_locs l ON l.name = e.loc_name JOIN _ooc_groups g ON g.grp = e.grp
            JOIN _ooc_segments s ON s.path = e._segment
            ORDER BY e.ts0, e.seq0, s.seg, e._row
        ) TO {_literal(str(ordered))} (FORMAT parquet, COMPRESSION lz4)""")
    con.execute(f"""COPY (
        SELECT CAST(file_row_number AS BIGINT) AS place, * EXCLUDE (file_row_number)
        FROM read_parquet({_literal(str(ordered))}, file_row_number = true)
    ) TO {_literal(str(spill / "events"))} (FORMAT parquet, PARTITION_BY (part), COMPRESSION lz4)""")
    ((n,),) = con.execute(f"SELECT count(*) FROM read_parquet({_literal(str(ordered))})").fetchall()
    ordered.unlink()
    return int(n)


def _files_under(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/*.parquet")) if directory.is_dir() else []


def _events_glob(spill: Path) -> str:
    return _literal(str(spill / "events" / "*" / "*.parquet"))


def _time_cuts(con: duckdb.DuckDBPyConnection, spill: Path, requests: Path, out: Path, n_events: int) -> None:
    """``requests`` with ``time_cut``, each look-up's place under the time rule (the events stamped
    before it: analyzers/admission.py ``searchsorted(ev_ts, lookup)``), into ``out``: each look-up
    joined (as of) to the first place of the first event time at or after it."""
    source = _literal(str(requests))
    if n_events:
        query = f"""WITH t AS (SELECT ts0, min(place) AS first FROM read_parquet({_events_glob(spill)})
                               GROUP BY ts0)
                    SELECT r.*, coalesce(t.first, {n_events}) AS time_cut
                    FROM read_parquet({source}) r ASOF LEFT JOIN t ON r.lookup_ns <= t.ts0"""
    else:
        query = f"SELECT r.*, CAST(0 AS BIGINT) AS time_cut FROM read_parquet({source}) r"
    con.execute(f"COPY ({query} ORDER BY k) TO {_literal(str(out))} (FORMAT parquet, ROW_GROUP_SIZE 65536)")


def _spill_admission(con: duckdb.DuckDBPyConnection, scenario: str, spill: Path, requests: Path,
                     anchored: list[int]) -> None:
    """For admission per replica: the events of the ``anchored`` locations, with their places, into
    ``spill/admit/events/loc=L``, their candidate requests into ``spill/admit/requests/loc=L`` and
    those requests' full blocks into ``spill/admit/chains/loc=L``."""
    (spill / "admit").mkdir(exist_ok=True)
    reqs = f"read_parquet({_literal(str(requests))}) r JOIN _ooc_locs l ON l.name = coalesce(r.replica, '')"
    candidates = f"{_candidate('r')} AND list_contains(?, l.code)"
    queries = {
        "events": f"""SELECT place, ts0, seq0, kind, loc, grp, h, parent, copies_left
                      FROM read_parquet({_events_glob(spill)}) WHERE list_contains(?, loc)""",
        "requests": f"""SELECT r.k, r.request_id, r.arrival_ns, r.lookup_ns, r.source, r.block_size,
                               r.time_cut, l.code AS loc
                        FROM {reqs} WHERE {candidates}""",
        "chains": f"""SELECT r.k, b.position, b.block_hash, l.code AS loc
                      FROM request_blocks b JOIN {reqs} ON b.request_id = r.request_id
                      WHERE b.scenario = {_literal(scenario)} AND b.block_tokens >= b.block_size_tokens
                            AND {candidates}"""}
    for what, query in queries.items():
        con.execute(f"COPY ({query}) TO {_literal(str(spill / 'admit' / what))} "
                    "(FORMAT parquet, PARTITION_BY (loc), COMPRESSION lz4)", [anchored])


def _admit_rows(spill: Path, what: str, loc: int) -> pl.DataFrame:
    """Location ``loc``'s rows of ``spill/admit/what`` (``_spill_admission``)."""
    return pl.read_parquet(_files(spill / "admit" / what / f"loc={loc}"), hive_partitioning=False)


_BARRIER = 3  # a row standing for other locations' events between two of a replica's (no event kind)


def _replica_events(spill: Path, loc: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Location ``loc``'s events as ``admission_cuts`` reads them, in stream order, and their stream
    places; where other locations' events lie between two of its rows (or before its first), one
    barrier row stands for them (kind ``_BARRIER``, location and group -1, the next row's time, the
    first of them's place), so that row adjacency reads as in the whole stream."""
    ev = _admit_rows(spill, "events", loc).sort("place")
    place = _owned(ev["place"], np.int64)
    prev = np.concatenate([[-1], place[:-1]])
    gap = place != prev + 1
    at = np.arange(place.shape[0]) + np.cumsum(gap)  # each row's local index, after the barriers before it
    n = place.shape[0] + int(gap.sum())
    barriers = at[gap] - 1

    def spread(values: np.ndarray, fill: int | np.ndarray, dtype: type) -> np.ndarray:
        out = np.empty(n, dtype)
        out[at] = values
        out[barriers] = fill
        return out

    local = {
        "ev_ts": spread(_owned(ev["ts0"], np.int64), _owned(ev["ts0"], np.int64)[gap], np.int64),
        "ev_kind": spread(_owned(ev["kind"], np.int8), _BARRIER, np.int8),
        "ev_loc": spread(np.full(place.shape[0], loc, np.int32), -1, np.int32),
        "ev_grp": spread(_owned(ev["grp"], np.int32), -1, np.int32),
        "ev_h": spread(_hashes(ev["h"]), 0, np.int64),
        "ev_left": spread(_owned(ev["copies_left"], np.int64), -1, np.int64),
        "ev_seq": spread(_owned(ev["seq0"], np.int64), 0, np.int64),
        "ev_parent": spread(_hashes(ev["parent"]), 0, np.int64),
    }
    return local, spread(place, prev[gap] + 1, np.int64)


def _admit_replica(spill: Path, loc: int, pool_loc: int, anchors: np.ndarray,
                   windows: np.ndarray) -> pl.DataFrame:
    """Admission (``admission_cuts``) of location ``loc``'s candidate requests on its own events:
    per request (``k``), its look-up's stream place (``cut``), and for a cut at its own run the span
    between that run and its time cut (``lo``, ``hi``: a shared pool's event there gives the time
    cut back, ``_numbered``). Its local answers map to stream places: a run's first row ``r`` ->
    ``place[r]``; a place after a store at row ``r`` (``_all_held``) -> ``place[r] + 1``; a time
    cut -> the request's time cut over the whole stream."""
    req, chains = _admit_rows(spill, "requests", loc).sort("k"), _admit_rows(spill, "chains", loc)
    full = (chains.with_columns(block_hash_i64=pl.Series(_hashes(chains["block_hash"])))
            .join(req.select("k", "request_id"), on="k").select("request_id", "position", "block_hash_i64"))
    del chains
    ev, place = _replica_events(spill, loc)
    got = admission_cuts(ev, req, full, np.full(req.height, loc, np.int32), -1, anchors=anchors,
                         windows=windows)
    ts, look = ev["ev_ts"], req["lookup_ns"].to_numpy()
    cut = _owned(req["time_cut"], np.int64)
    owns = got.owns
    own = np.where(owns >= 0, owns, 0)
    run = (owns >= 0) & (ts[own] > look)  # cut at its own run's admission (unless it crossed the pool)
    cut[run] = place[got.cuts[run]]
    held = (owns == -1) & (got.cuts > np.searchsorted(ts, look, side="left"))  # just after a store
    cut[held] = place[got.cuts[held] - 1] + 1
    time_cut = req["time_cut"].to_numpy()
    lo = np.where(run, np.minimum(time_cut, place[own]), 0)
    hi = np.where(run, np.maximum(time_cut, place[own]), 0)
    del ev, place, got
    if pool_loc < 0:
        run[:] = False
    return pl.DataFrame({"k": req["k"], "cut": cut, "run": run, "lo": lo, "hi": hi},
                        schema={"k": pl.Int64, "cut": pl.Int64, "run": pl.Boolean, "lo": pl.Int64,
                                "hi": pl.Int64})


def _numbered(con: duckdb.DuckDBPyConnection, spill: Path, timed: Path, admitted: list[Path], pool_loc: int,
              out: Path) -> None:
    """The requests of ``timed`` with their look-up places (``cut``: admission's where ``admitted``
    gives one, else the time cut) and numbered in the one-process replay's order (``i``: cut, look-up,
    arrival, id), into ``out``. A cut at a request's own run whose span to its time cut holds a shared
    pool's event (``pool_loc``) is the time cut (admission.py ``_crosses``): the pool's first event
    at or after the span's start, an as-of join, lies before its end."""
    source = f"read_parquet({_literal(str(timed))})"
    if admitted:
        files = "[" + ", ".join(_literal(str(f)) for f in admitted) + "]"
        if pool_loc >= 0 and _files_under(spill / "events"):
            a = f"""(SELECT a.*, p.place AS pool_place FROM read_parquet({files}) a ASOF LEFT JOIN
                     (SELECT place FROM read_parquet({_events_glob(spill)}) WHERE loc = {pool_loc}) p
                     ON a.lo <= p.place)"""
            crossed = "a.run AND a.pool_place < a.hi"
        else:
            a, crossed = f"read_parquet({files})", "false"
        query = f"""WITH c AS (SELECT k, CASE WHEN {crossed} THEN NULL ELSE a.cut END AS cut FROM {a} a),
                         r AS (SELECT r.*, coalesce(c.cut, r.time_cut) AS cut
                               FROM {source} r LEFT JOIN c USING (k))"""
    else:
        query = f"WITH r AS (SELECT *, time_cut AS cut FROM {source})"
    con.execute(f"""COPY ({query}
        SELECT row_number() OVER (ORDER BY cut, lookup_ns, arrival_ns, request_id) - 1 AS i,
               * EXCLUDE (k, time_cut)
        FROM r ORDER BY i
    ) TO {_literal(str(out))} (FORMAT parquet, ROW_GROUP_SIZE 65536)""")


def _spill_rows(con: duckdb.DuckDBPyConnection, lake: Path, scenario: str, requests: Path, spill: Path,
                partitions: int) -> None:
    """Every needed full block with its request's number (``i``), look-up place (``cut``) and location
    code and
    its load (outcomes.py ``_needed``: a transfer the serving replica received for it, ``ok`` if
    any succeeded, with the first successful one's origin), into ``spill/rows/part=P``."""
    q = _literal(scenario)
    ok = "CAST(t.status AS VARCHAR) = 'ok'"
    con.execute(f"""COPY (
        WITH q AS (SELECT r.i, r.request_id, r.replica, r.cut, l.code AS loc
                   FROM read_parquet({_literal(str(requests))}) r
                   JOIN _ooc_locs l ON l.name = coalesce(r.replica, '')),
             x AS (SELECT t.request_id, t.block_hash, coalesce(bool_or({ok}), false) AS ok,
                          arg_min_null(CAST(t.origin AS VARCHAR), struct_pack(f := t._segment, r := t._row))
                              FILTER (WHERE {ok}) AS origin
                   FROM ({positioned_sql(con, lake, "transfers")}) t JOIN q ON t.request_id = q.request_id
                   WHERE t.scenario = {q} AND t.block_hash IS NOT NULL
                         AND (t.replica IS NULL OR t.replica = q.replica)
                   GROUP BY t.request_id, t.block_hash)
        SELECT q.i, b.position, b.block_hash, b.block_tokens, q.cut, q.loc,
               CAST(CASE WHEN x.ok IS NULL THEN {XFER_NONE} WHEN x.ok THEN {XFER_OK} ELSE {XFER_FAILED} END
                    AS TINYINT) AS xfer, x.origin, coalesce(b.block_hash, 0) % {partitions} AS part
        FROM request_blocks b JOIN q ON b.request_id = q.request_id
        LEFT JOIN x ON x.request_id = b.request_id AND x.block_hash = b.block_hash
        WHERE b.scenario = {q} AND b.block_tokens >= b.block_size_tokens
    ) TO {_literal(str(spill / "rows"))} (FORMAT parquet, PARTITION_BY (part), COMPRESSION lz4)""")


def _owned(series: pl.Series, dtype: type) -> np.ndarray:
    """A writable, contiguous copy of ``series`` (the compiled kernels' argument types: a read-only
    view would be another signature, compiled again)."""
    return np.array(series.to_numpy(), dtype=dtype, copy=True)


def _hashes(series: pl.Series) -> np.ndarray:
    return _owned(series.fill_null(0), np.uint64).view(np.int64)


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.parquet")) if directory.is_dir() else []


_PHASE_ONE_EVENTS = ["place", "ts0", "kind", "loc", "tier", "grp", "h", "copies_left"]
_PHASE_ONE = {"i": pl.Int64, "position": pl.Int32, "block_hash": pl.UInt64, "block_tokens": pl.Int32,
              "xfer": pl.Int8, "origin": pl.String, "reusable": pl.Boolean, "cause": pl.Int8,
              "holder": pl.Int32, "rem_ts": pl.Int64, "rem_loc": pl.Int32}


def _phase_one(spill: Path, p: int, partitions: int, stream: _Stream, loc_grp: np.ndarray, span: int,
               ranges: int) -> int:
    """Partition ``p``'s phase 1, written by ranges of ``span`` requests
    (``spill/phase1/range=B/part-P.parquet``); its rows."""
    files = _files(spill / "rows" / f"part={p}")
    if not files:
        return 0
    rows = pl.read_parquet(files, hive_partitioning=False).sort("i", "position", nulls_last=False)
    ev_files = _files(spill / "events" / f"part={p}") + _files(spill / "events" / f"part={partitions}")
    if ev_files:
        ev = pl.read_parquet(ev_files, hive_partitioning=False, columns=_PHASE_ONE_EVENTS).sort("place")
    else:
        ev = pl.DataFrame(schema={"place": pl.Int64, "ts0": pl.Int64, "kind": pl.Int8, "loc": pl.Int32,
                                  "tier": pl.Int8, "grp": pl.Int32, "h": pl.UInt64, "copies_left": pl.Int64})
    blk_h = _hashes(rows["block_hash"])
    # a row sees the events before its look-up's place (``cut``); removals record the events' times
    got = block_states(_owned(ev["place"], np.int64), _owned(ev["ts0"], np.int64),
                       _owned(ev["kind"], np.int8), _owned(ev["loc"], np.int32), _owned(ev["tier"], np.int8),
                       _owned(ev["grp"], np.int32), _hashes(ev["h"]), _owned(ev["copies_left"], np.int64),
                       _owned(rows["cut"], np.int64),
                       _owned(rows["loc"], np.int32), blk_h, _owned(rows["xfer"], np.int8),
                       int(loc_grp.shape[0]), stream.locs.index.get(POOL_LOCATION, -1), loc_grp, -1)
    del ev
    src, cause, holder, rem_ts, rem_loc = got[:5]
    # An unbounded cache serves a block some earlier request needed: every row of a hash is in this
    # partition, in look-up order.
    reusable = np.ones(blk_h.shape[0], np.bool_)
    reusable[np.unique(blk_h, return_index=True)[1]] = False
    out = rows.select(*(pl.col(c).cast(t) for c, t in _PHASE_ONE.items() if c in rows.columns)).with_columns(
        reusable=pl.Series(reusable), cause=pl.Series(cause), holder=pl.Series(holder),
        rem_ts=pl.Series(rem_ts), rem_loc=pl.Series(rem_loc),
        **{f"src{g}": pl.Series(src[:, g]) for g in range(src.shape[1])})
    edges = np.searchsorted(out["i"].to_numpy(), np.arange(ranges + 1, dtype=np.int64) * span)
    for b in range(ranges):
        lo, hi = int(edges[b]), int(edges[b + 1])
        if hi > lo:
            where = spill / "phase1" / f"range={b}"
            where.mkdir(parents=True, exist_ok=True)
            out.slice(lo, hi - lo).write_parquet(where / f"part-{p}.parquet", compression="lz4")
    return out.height


@dataclass(frozen=True)
class _Scope:
    """What every range's phase 2 reads besides its own rows."""

    scenario: str
    stream: _Stream
    loc_grp: np.ndarray
    windows: np.ndarray
    bytes_per_token: int
    group_bytes_per_token: Sequence[int] | None
    gaps: pl.DataFrame
    clears: pl.DataFrame


def _phase_two(con: duckdb.DuckDBPyConnection, spill: Path, b: int, span: int,
               scope: _Scope) -> tuple[pl.DataFrame, pl.DataFrame] | None:
    """Range ``b``'s requests decided: its ``block_outcomes`` and ``request_ledger`` rows."""
    first = b * span
    reqs = (pl.scan_parquet(spill / "requests.parquet")
            .filter((pl.col("i") >= first) & (pl.col("i") < first + span)).collect())
    if not reqs.height:
        return None
    if not np.array_equal(reqs["i"].to_numpy(), np.arange(first, first + reqs.height)):
        raise RuntimeError(f"out-of-core range {b}: its requests are not numbered {first} on")
    files = _files(spill / "phase1" / f"range={b}")
    n_groups = len(scope.stream.group_idx)
    rows = (pl.read_parquet(files, hive_partitioning=False).sort("i", "position", nulls_last=False) if files
            else pl.DataFrame(schema={**_PHASE_ONE, **{f"src{g}": pl.Int8 for g in range(n_groups)}}))
    off = np.zeros(reqs.height + 1, np.int64)
    np.cumsum(reqs["n_full"].to_numpy(), out=off[1:])
    if off[-1] != rows.height:
        raise RuntimeError(f"out-of-core range {b}: {rows.height:,} block rows read back, its requests "
                           f"have {int(off[-1]):,}")
    locs = scope.stream.locs
    req_loc = reqs["replica"].fill_null("").replace_strict(locs.index, return_dtype=pl.Int32)
    src = np.ascontiguousarray(np.column_stack([rows[f"src{g}"].to_numpy() for g in range(n_groups)])
                               .reshape(rows.height, n_groups), dtype=np.int8)
    outputs = decide_requests(
        _owned(req_loc, np.int32), _owned(reqs["tail"], np.bool_), _owned(reqs["block_size"], np.int64), off,
        scope.loc_grp, scope.windows, src, _owned(rows["xfer"], np.int8), _owned(rows["cause"], np.int8),
        _owned(rows["holder"], np.int32), _owned(rows["rem_ts"], np.int64), _owned(rows["rem_loc"], np.int32),
        np.full(rows.height, -1, np.int32))  # no other namespace: one at most (``_refused``)
    at = rows["i"] - first
    full = pl.DataFrame({"request_id": reqs["request_id"].gather(at), "replica": reqs["replica"].gather(at),
                         "arrival_ns": reqs["arrival_ns"].gather(at), "position": rows["position"],
                         "block_hash": rows["block_hash"], "block_tokens": rows["block_tokens"],
                         "reusable": rows["reusable"], "origin": rows["origin"]})
    frame = _frame(scope.scenario, full, outputs, scope.stream.group_idx, scope.bytes_per_token,
                   scope.group_bytes_per_token, locs, _Codes(sorted(scope.stream.namespaces)))
    requests = con.from_arrow(reqs.select("scenario", "replica", "request_id", "arrival_ns", "prompt_tokens",
                                          "cached_tokens", "ttft_ms", "queue_ms").to_arrow())
    per_request = mark_incomplete(request_ledger(block_outcomes=frame, requests=requests), scope.gaps,
                                  scope.clears)
    return frame, per_request


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _merged(parts: list[pl.DataFrame]) -> pl.DataFrame:
    """``miss_ledger`` of the whole scenario from its ranges': sums of sums, by the same keys."""
    keys = ["scenario", "replica", "outcome"]
    return (pl.concat(parts).group_by(keys)
            .agg(pl.col("blocks").sum(), pl.col("tokens").sum(), pl.col("bytes").sum(),
                 pl.col("events_incomplete").any())
            .sort(keys, nulls_last=True))


def ledger_out_of_core(con: duckdb.DuckDBPyConnection, lake: str | os.PathLike[str], scenario: str,
                       spill: Path, *, bytes_per_token: int,
                       group_bytes_per_token: Sequence[int] | None = None, plan: OutOfCore = OutOfCore(),
                       result: OutOfCoreResult | None = None,
                       say: Callable[[str], object] = lambda _: None,
                       runner: Partitions | None = None) -> Iterator[tuple[str, pl.DataFrame]]:
    """``scenario``'s ``block_outcomes`` and ``request_ledger`` rows, a range of requests at a time,
    then its ``miss_ledger``: ``ledger_outcomes``' (and analyze_scenario's) rows, computed with
    ``spill`` (a directory this creates; the caller removes it) holding what is not in memory.
    ``con``: a connection with the lake's views (kvlens.lake.open_lake); ``result``: filled in.
    ``runner``: what runs phase 1's partitions (``kvlens analyze --out-of-core --ray``: Ray tasks,
    analyzers/ray_runner.py; default one after another here). A partition's task reads its rows
    from ``spill`` and writes its states there, so every worker must see ``spill`` at the same
    path (one machine, or a shared filesystem). Raises ConfigError, before anything is written,
    for a scenario this cannot analyze."""
    result = result if result is not None else OutOfCoreResult()
    lake = Path(lake)
    t = time.perf_counter()
    events = _events_sql(con, lake, scenario)
    stream = _stream(con, events)
    refused = _refused(con, scenario, stream)
    if refused is not None:
        raise ConfigError(f"scenario {scenario} cannot be analyzed out of core: {refused}; analyze it "
                          "without --out-of-core")
    spill.mkdir(parents=True, exist_ok=True)
    by_lookup, timed = spill / "requests-by-lookup.parquet", spill / "requests-timed.parquet"
    requests = spill / "requests.parquet"  # numbered by look-up place (phase 2 reads it)
    t = result.timed("codes and checks", t)
    result.requests, result.needed_blocks = _requests(con, scenario, by_lookup)
    t = result.timed("requests", t)
    _add_replicas(con, by_lookup, stream.locs)
    loc_grp, windows = stream.arrays()
    anchors = anchor_groups(loc_grp, windows)
    anchored = _anchored(con, by_lookup, stream.locs, anchors)
    pool_loc = stream.locs.index.get(POOL_LOCATION, -1)
    n_req, n_rows = result.requests, result.needed_blocks
    k = plan.partitions or max(1, math.ceil(n_rows / plan.rows_per_partition))
    span = max(1, math.ceil(n_req / max(1, math.ceil(n_rows / plan.rows_per_range))))
    ranges = max(1, math.ceil(n_req / span))
    result.partitions, result.ranges = k, ranges
    segments = [r[0] for r in con.execute(
        f"SELECT DISTINCT _segment FROM ({positioned_sql(con, lake, 'kv_events')}) "
        f"WHERE scenario = {_literal(scenario)} ORDER BY 1").fetchall()]
    registered = {
        "_ooc_locs": pl.DataFrame({"name": stream.locs.names, "code": range(len(stream.locs.names))},
                                  schema={"name": pl.String, "code": pl.Int32}),
        "_ooc_groups": pl.DataFrame({"grp": stream.group_idx, "code": range(len(stream.group_idx))},
                                    schema={"grp": pl.Int32, "code": pl.Int32}),
        "_ooc_segments": pl.DataFrame({"path": segments, "seg": range(len(segments))},
                                      schema={"path": pl.String, "seg": pl.Int32})}
    for name, frame in registered.items():
        con.register(name, frame)
    try:
        # (the spills' row order is not kept: each is sorted where it is read)
        with settings(con, preserve_insertion_order=False):
            say("out of core: events by block hash")
            t = result.timed("codes and checks", t)
            n_events = _spill_events(con, events, spill, k)
            t = result.timed("events by block hash", t)
        with settings(con, preserve_insertion_order=True):  # (the requests' files are read in order)
            _time_cuts(con, spill, by_lookup, timed, n_events)
            t = result.timed("time cuts", t)
            admitted = []
            if anchored:
                _spill_admission(con, scenario, spill, timed, anchored)
                result.spill_bytes = _size(spill)
                for n, loc in enumerate(anchored):
                    say(f"out of core: admission at replica {stream.locs.names[loc]} "
                        f"({n + 1}/{len(anchored)})")
                    cuts = _admit_replica(spill, loc, pool_loc, anchors, np.where(loc_grp, windows, 0))
                    admitted.append(spill / "admit" / f"cuts-{loc}.parquet")
                    cuts.write_parquet(admitted[-1])
                    del cuts
                    memory.check()
                t = result.timed("admission", t)
            _numbered(con, spill, timed, admitted, pool_loc, requests)
            shutil.rmtree(spill / "admit", ignore_errors=True)
            by_lookup.unlink()
            timed.unlink()
            t = result.timed("look-up places", t)
        with settings(con, preserve_insertion_order=False):
            say("out of core: needed blocks by block hash")
            _spill_rows(con, lake, scenario, requests, spill, k)
            t = result.timed("needed blocks by block hash", t)
    finally:
        for name in registered:
            con.unregister(name)
    result.spill_bytes = max(result.spill_bytes, _size(spill))
    memory.check()
    t = time.perf_counter()
    run = runner.run if runner is not None else in_process
    result.where = runner.where if runner is not None else "in process"
    parts = ((spill, p, k, stream, loc_grp, span, ranges) for p in range(k))
    for p, _ in enumerate(run(_phase_one, parts)):  # (gathered in partition order)
        shutil.rmtree(spill / "rows" / f"part={p}", ignore_errors=True)
        memory.check()
        say(f"ledger partition {p + 1}/{k}")
    result.spill_bytes = max(result.spill_bytes, _size(spill))
    shutil.rmtree(spill / "events", ignore_errors=True)
    gaps, clears = event_gaps(
        metric_samples=con.table("metric_samples").filter(f"scenario = {_literal(scenario)}"),
        kv_events=con.table("kv_events").filter(f"scenario = {_literal(scenario)}"))
    scope = _Scope(scenario, stream, loc_grp, windows, bytes_per_token, group_bytes_per_token, gaps, clears)
    t = result.timed("phase 1", t)
    misses = []
    for b in range(ranges):
        got = _phase_two(con, spill, b, span, scope)
        shutil.rmtree(spill / "phase1" / f"range={b}", ignore_errors=True)
        if got is None:
            continue
        frame, per_request = got
        misses.append(miss_ledger(block_outcomes=frame, incomplete=per_request))
        memory.check()
        t = result.timed("phase 2", t)
        yield "block_outcomes", frame
        yield "request_ledger", per_request
        del frame, per_request, got
        t = result.timed("writing the rows", t)
        say(f"ledger range {b + 1}/{ranges}")
    if misses:
        yield "miss_ledger", _merged(misses)
