"""Analyzers: the miss ledger's rows: one outcome per needed full block of every request.

Reads ``requests``, ``request_blocks``, ``kv_events`` and ``transfers`` of one scenario (the
caller scopes them), replays the cache state (analyzers/replay.py) and labels each full block with DESIGN.md's
outcome. The look-up time of a request is its arrival plus its queue time when known: the
moment the engine consults its prefix cache; where the request's own stores show its admission
in the event stream, the look-up is placed there instead (analyzers/admission.py), which is
exact with many requests in flight. Partial tails are not needed blocks: they are
``tail_partial`` tokens (analyzers/request_ledger.py), never a hit or a miss.

KV cache groups (hybrid models) come from the events: ``group_idx`` (NULL: group 0) with the
spec kind and sliding window the engine published for it; a group without a sliding window is
full attention. Events with medium ``pool`` (SGLang's EXTERNAL / L3 tier, the simulator's pool),
or from the location ``pool``, live in the shared pool, whichever replica published them.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import duckdb
import numpy as np
import polars as pl

from kvlens import memory
from kvlens.analyzers.admission import SIMULATED, Admission, admission_cuts, anchor_groups
from kvlens.analyzers.ledger_state import LedgerState, checkpoint
from kvlens.analyzers.partitions import Partitions, replay_partitioned_state
from kvlens.analyzers.replay import (
    OUTCOME_CODES,
    SRC_CPU,
    SRC_DISK,
    SRC_GPU,
    SRC_POOL,
    SRC_TRANSFER,
    XFER_FAILED,
    XFER_NONE,
    XFER_OK,
    loc_groups,
    replay_resume,
)
from kvlens.analyzers.state_blob import Pending, ready
from kvlens.schema import Medium

__all__ = ["LOOKUP_SQL", "POOL_LOCATION", "Ledger", "Prefetch", "Resume", "block_outcomes", "in_order",
           "ledger_outcomes", "rows_of"]

# Replay tiers: 0 the GPU (and the pool's one tier, and an unknown medium), 1 CPU, 2 disk.
_TIER_CODES = {Medium.CPU.value: 1, Medium.DISK.value: 2}
_ORIGINS = {SRC_GPU: Medium.GPU.value, SRC_CPU: Medium.CPU.value, SRC_DISK: Medium.DISK.value,
            SRC_POOL: Medium.POOL.value}
_KIND_CODES = {"stored": 0, "removed": 1, "cleared": 2}
# The shared pool's location name (the simulator's pool replica, and where pool-medium events go).
POOL_LOCATION = Medium.POOL.value
# A request's look-up time in SQL (``_needed`` computes it in Polars).
LOOKUP_SQL = "(arrival_ns + CAST(round(coalesce(queue_ms, 0) * 1e6) AS BIGINT))"
# vLLM's KVCacheSpecKind values with a sliding window (vllm/v1/kv_cache_interface.py).
_SLIDING_KINDS = ("sliding_window", "sliding_window_mla")


def _u64_as_i64(series: pl.Series) -> np.ndarray:
    return series.fill_null(0).cast(pl.UInt64).to_numpy().view(np.int64)


class _Codes:
    """Dense integer codes for names (replicas, namespaces); -1 for NULL when asked."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.names: list[str] = list(names)
        self.index: dict[str, int] = {name: i for i, name in enumerate(self.names)}

    def encode(self, values: pl.Series, *, null: int | None = None) -> np.ndarray:
        names = values.cast(pl.Utf8)
        if null is None:
            names = names.fill_null("")
        for name in names.drop_nulls().unique(maintain_order=True).to_list():
            if name not in self.index:
                self.index[name] = len(self.names)
                self.names.append(name)
        return names.replace_strict(self.index, default=null, return_dtype=pl.Int32).to_numpy()

    def decode(self, codes: np.ndarray) -> pl.Series:
        """The names of ``codes`` (NULL for -1), as a String series."""
        names = pl.Series([*self.names, None], dtype=pl.String)
        return names.gather(np.where(codes >= 0, codes, len(self.names)))


def _events(kv_events: duckdb.DuckDBPyRelation, locs: _Codes, spaces: _Codes,
            group_idx: Sequence[int] | None = None) -> tuple[dict[str, np.ndarray], pl.DataFrame, list[int]]:
    """The replay core's event arrays, the events' KV cache group specs in stream order (loc,
    group_idx, spec_kind, sliding_window_tokens) and the group codes' group_idx (``group_idx`` when
    given: a group outside it raises ``_CannotContinue``)."""
    ev = kv_events.select("ts_ns", "seq", "replica", "kind", "block_hash", "parent_hash", "medium",
                          "content_hash", "namespace", "group_idx", "spec_kind", "sliding_window_tokens",
                          "remaining_copies").pl()
    ev = ev.filter(pl.col("kind").cast(pl.Utf8).is_in(list(_KIND_CODES)))  # inactive changes no residency
    # Stable: events with equal time and sequence keep the order the collector wrote them in.
    seq, ts = ev["seq"].fill_null(0).to_numpy(), ev["ts_ns"].fill_null(0).to_numpy()
    if not in_order(ts, seq):  # (a lake's scan usually is: its segments are written in time order)
        ev = ev[np.lexsort((seq, ts))]
    medium = ev["medium"].cast(pl.Utf8)
    tier = medium.replace_strict(_TIER_CODES, default=0, return_dtype=pl.Int8).fill_null(0).to_numpy().copy()
    kind = ev["kind"].cast(pl.Utf8).replace_strict(_KIND_CODES, return_dtype=pl.Int8).to_numpy()
    tier[(kind == 2) & medium.is_null().to_numpy()] = -1  # a clear without a medium clears all
    pooled = (medium == Medium.POOL.value).fill_null(False)
    loc = locs.encode(ev.select(pl.when(pooled).then(pl.lit(POOL_LOCATION)).otherwise(ev["replica"]))
                      .to_series())
    ev = ev.with_columns(loc=pl.Series(loc, dtype=pl.Int32), group_idx=pl.col("group_idx").fill_null(0))
    seen = sorted(set(ev["group_idx"].to_list()) or {0})
    if group_idx is not None and not set(seen) <= set(group_idx):
        raise _CannotContinue(f"KV cache group(s) {sorted(set(seen) - set(group_idx))} appeared")
    known = list(group_idx) if group_idx is not None else seen
    codes = {g: c for c, g in enumerate(known)}
    memory.check()
    return {
        "ev_ts": ev["ts_ns"].fill_null(0).to_numpy().astype(np.int64),
        "ev_kind": kind.astype(np.int8),
        "ev_loc": loc,
        "ev_tier": tier,
        "ev_grp": ev["group_idx"].replace_strict(codes, return_dtype=pl.Int32).to_numpy(),
        "ev_h": _u64_as_i64(ev["block_hash"]),
        "ev_c": _u64_as_i64(ev["content_hash"]),
        "ev_ns": spaces.encode(ev["namespace"], null=-1),
        "ev_left": ev["remaining_copies"].fill_null(-1).to_numpy().astype(np.int64),
        "ev_seq": ev["seq"].fill_null(0).cast(pl.Int64).to_numpy(),
        "ev_parent": _u64_as_i64(ev["parent_hash"]),
    }, ev.select("loc", "group_idx", pl.col("spec_kind").cast(pl.Utf8), "sliding_window_tokens"), known


def in_order(ts: np.ndarray, seq: np.ndarray) -> bool:
    """Whether rows are already sorted by (``ts``, ``seq``): a stable sort would not move them."""
    if ts.shape[0] < 2:
        return True
    a, b = ts[:-1], ts[1:]  # (compared, not subtracted: unsigned sequences would wrap)
    return bool((b >= a).all() and (seq[1:] >= seq[:-1])[b == a].all())


def _firsts(specs: pl.DataFrame) -> pl.DataFrame:
    """Per location and group_idx: the first spec kind and sliding window published (in stream order)."""
    return (specs.group_by("loc", "group_idx", maintain_order=True)
            .agg(pl.col("spec_kind").drop_nulls().first(),
                 pl.col("sliding_window_tokens").drop_nulls().first()))


def _windows(firsts: pl.DataFrame, group_idx: Sequence[int], n_locs: int) -> np.ndarray:
    """Per location and group code: the sliding window a group published (0: full attention)."""
    windows = np.zeros((n_locs, len(group_idx)), np.int64)
    codes = {g: c for c, g in enumerate(group_idx)}
    for loc, g, kind, window in firsts.iter_rows():
        if kind in _SLIDING_KINDS and window is not None and window > 0:
            windows[loc, codes[g]] = window
    return windows


def _needed(requests: duckdb.DuckDBPyRelation, request_blocks: duckdb.DuckDBPyRelation,
            transfers: duckdb.DuckDBPyRelation) -> tuple[pl.DataFrame, pl.DataFrame]:
    req = requests.select("request_id", "arrival_ns", "queue_ms", "replica", "prompt_tokens", "source").pl()
    req = req.unique("request_id", keep="first").with_columns(
        lookup_ns=pl.col("arrival_ns") + (pl.col("queue_ms").fill_null(0) * 1e6).round().cast(pl.Int64))
    blocks = request_blocks.select("request_id", "position", "block_hash", "content_hash", "block_tokens",
                                   "block_size_tokens", "namespace").pl()
    full = blocks.filter(pl.col("block_tokens") >= pl.col("block_size_tokens"))
    covered = full.group_by("request_id").agg(full_tokens=pl.col("block_tokens").sum(),
                                              block_size=pl.col("block_size_tokens").max())
    req = (req.join(covered, on="request_id", how="left")
           .with_columns(pl.col("full_tokens").fill_null(0), pl.col("block_size").fill_null(16))
           .with_columns(tail=pl.col("prompt_tokens").fill_null(pl.col("full_tokens"))
                         > pl.col("full_tokens"))
           .sort("lookup_ns", "arrival_ns", "request_id"))
    # A load is a transfer the serving replica received for this request and block; a store
    # into the pool (received by the pool) is not.
    xfer = (transfers.select("request_id", "block_hash", "status", "replica", "origin").pl()
            .rename({"replica": "receiver"})
            .join(req.select("request_id", "replica"), on="request_id")
            .filter(pl.col("block_hash").is_not_null()
                    & (pl.col("receiver").is_null() | (pl.col("receiver") == pl.col("replica"))))
            .with_columns(is_ok=pl.col("status").cast(pl.Utf8) == "ok")
            .group_by("request_id", "block_hash")
            .agg(ok=pl.col("is_ok").any(), origin=pl.col("origin").filter(pl.col("is_ok")).first()))
    full = (full.join(req.select("request_id", "lookup_ns", "arrival_ns", "replica"), on="request_id")
            .join(xfer, on=["request_id", "block_hash"], how="left")
            .with_columns(xfer=pl.when(pl.col("ok").is_null()).then(XFER_NONE)
                          .when(pl.col("ok")).then(XFER_OK).otherwise(XFER_FAILED))
            .sort("lookup_ns", "arrival_ns", "request_id", "position")
            # An unbounded cache serves every block some earlier request already needed.
            .with_columns(reusable=~pl.col("block_hash").is_first_distinct()))
    memory.check()  # a safe point of the analysis' memory limit (kvlens/memory.py), as after each step here
    return req, full


class _CannotContinue(Exception):
    """The saved ledger state does not cover this lake: the ledger is rebuilt in full (the message
    says why)."""


def _admitted(ev: dict[str, np.ndarray], req: pl.DataFrame, full: pl.DataFrame,
              locs: _Codes, loc_grp: np.ndarray, windows: np.ndarray) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Requests (with ``cut``, the look-up's place in the event stream, and ``own``, admission's
    run place) and blocks, in look-up order."""
    hashed = full.with_columns(block_hash_i64=pl.Series(_u64_as_i64(full["block_hash"]), dtype=pl.Int64))
    got = admission_cuts(ev, req, hashed, locs.encode(req["replica"]), locs.index.get(POOL_LOCATION, -1),
                         anchors=anchor_groups(loc_grp, windows), windows=np.where(loc_grp, windows, 0))
    return _ordered(req.with_columns(_admission_columns(got)), full)


def _admission_columns(got: Admission) -> list[pl.Series]:
    """``cut``, ``own`` and ``chunks`` (the later chunks' runs a request claimed) of ``got``."""
    return [pl.Series("cut", got.cuts, dtype=pl.Int64), pl.Series("own", got.owns, dtype=pl.Int64),
            pl.Series("chunks", got.chunks, dtype=pl.List(pl.Int64))]


def _ordered(req: pl.DataFrame, full: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    req = req.sort("cut", "lookup_ns", "arrival_ns", "request_id")
    full = (full.join(req.select("request_id", "cut"), on="request_id")
            .sort("cut", "lookup_ns", "arrival_ns", "request_id", "position")
            .with_columns(reusable=~pl.col("block_hash").is_first_distinct()))
    return req, full


@dataclass(frozen=True)
class Resume:
    """What ``ledger_outcomes`` continues from: the saved state and the previous ledger's rows
    of the scenario (a relation in the order they were written)."""

    state: Pending[LedgerState]  # parsed, or still being parsed on a worker thread (None: unreadable)
    previous: duckdb.DuckDBPyRelation | Prefetch
    # the previous request_ledger rows of the scenario (analyzers/request_ledger.py ``settled``)
    requests: duckdb.DuckDBPyRelation | Prefetch | None = None
    saved_at: int | None = None  # the state's checkpoint, known before it is parsed

    @property
    def checkpoint_ns(self) -> int | None:
        """The saved state's checkpoint (None: its state does not read)."""
        if self.saved_at is not None:
            return self.saved_at
        state = ready(self.state)
        return state.checkpoint_ns if state is not None else None

    def drop(self) -> None:
        """Wait for the reads of the previous rows still running, and drop what they read: an
        analysis that stops before taking them closes their connection next."""
        for rows in (self.previous, self.requests):
            if isinstance(rows, Prefetch):
                rows.drop()


@dataclass(frozen=True)
class Ledger:
    """``ledger_outcomes``' result: every row, the state at the new checkpoint (when a horizon was
    given) and, when a resume was asked for and refused, why (the rows are then a full replay's)."""

    frame: pl.DataFrame
    state: LedgerState | None
    refused: str | None = None
    replayed: int = 0  # requests replayed (the rest carried from the previous rows)
    partitions: int = 0  # block-hash partitions the replay ran in (0: one process, one pass)
    # A continuation's rows that are not the previous rows: ``frame`` is the previous rows less
    # those of ``replaced`` (request ids), in their order, then these (an appending writer's delta).
    appended: pl.DataFrame | None = None
    replaced: pl.Series | None = None
    # A continuation's: the time from which it read the transfers of the requests it replayed (None:
    # all of them), which finds every one of them (``_transfer_marks``)
    loads_from: int | None = None


def block_outcomes(
    *,
    requests: duckdb.DuckDBPyRelation,
    request_blocks: duckdb.DuckDBPyRelation,
    kv_events: duckdb.DuckDBPyRelation,
    transfers: duckdb.DuckDBPyRelation,
    scenario: str,
    bytes_per_token: int,
    group_bytes_per_token: Sequence[int] | None = None,
) -> pl.DataFrame:
    """One row per needed full block per request of ``scenario``, from its rows of each table.

    Columns: scenario, request_id, replica, arrival_ns, position, block_hash, outcome (a
    kvlens.schema.Outcome value), tokens, bytes, holder (for miss_routing: a replica holding it),
    removed_ns and remover (for miss_evicted: the last removal before the look-up and where),
    key_diff (for miss_incompatible: the namespace the same content was stored under), cut_group
    (for miss_group: the group_idx of the KV cache group that cut the hit short), reusable (an
    earlier request needed the block), origin (for a hit: gpu, cpu, disk, pool, or the replica a
    transfer came from). Sorted by look-up (admission order), request, position.

    ``bytes`` is tokens x ``bytes_per_token``, unless ``group_bytes_per_token`` gives one rate
    per KV cache group (group_idx 0, 1, ...) for as many groups as the events name: then a hit
    counts the groups that served it (a sliding-window group only the blocks of its window) and
    any other block every group of the request, which computes it.
    """
    return ledger_outcomes(requests=requests, request_blocks=request_blocks, kv_events=kv_events,
                           transfers=transfers, scenario=scenario, bytes_per_token=bytes_per_token,
                           group_bytes_per_token=group_bytes_per_token).frame


def ledger_outcomes(
    *,
    requests: duckdb.DuckDBPyRelation,
    request_blocks: duckdb.DuckDBPyRelation,
    kv_events: duckdb.DuckDBPyRelation,
    transfers: duckdb.DuckDBPyRelation,
    scenario: str,
    bytes_per_token: int,
    group_bytes_per_token: Sequence[int] | None = None,
    horizon_ns: int | None = None,
    resume: Resume | None = None,
    partitions: Partitions | None = None,
) -> Ledger:
    """``block_outcomes``, continued from ``resume`` where its state covers the lake (else a full
    replay, with the reason in ``refused``), and with the state at a new checkpoint at most
    ``horizon_ns`` (analyzers/ledger_state.py) when given: the time before which no row can
    still arrive (the watermark less the lateness the next analysis accepts). With
    ``partitions``, a full replay runs in block-hash partitions (analyzers/partitions.py) and saves
    the state gathered from theirs; a continuation runs in this process (it replays only the
    requests after the checkpoint)."""
    refused = None
    if resume is not None:
        try:
            return _continued(resume, requests=requests, request_blocks=request_blocks, kv_events=kv_events,
                              transfers=transfers, scenario=scenario, bytes_per_token=bytes_per_token,
                              group_bytes_per_token=group_bytes_per_token, horizon_ns=horizon_ns)
        except _CannotContinue as e:
            refused = str(e)
    req, full = _needed(requests, request_blocks, transfers)
    locs, spaces = _Codes(), _Codes()
    ev, specs, group_idx = _events(kv_events, locs, spaces)
    event_locs = len(locs.names)
    locs.encode(req["replica"])  # replicas without events: codes after the event locations
    n_locs = max(len(locs.names), 1)
    loc_grp = loc_groups(ev["ev_kind"], ev["ev_loc"], ev["ev_grp"], n_locs, len(group_idx))
    windows = _windows(_firsts(specs), group_idx, n_locs)
    req, full = _admitted(ev, req, full, locs, loc_grp, windows)
    req_loc = locs.encode(req["replica"])
    blk_ns = spaces.encode(full["namespace"], null=-1)
    mark = None
    if horizon_ns is not None and not req["arrival_ns"].is_null().any():
        mark = checkpoint(ev["ev_ts"], 0, None, horizon_ns, req["lookup_ns"].to_numpy(),
                          req["cut"].to_numpy(), req["own"].to_numpy())
    places = np.arange(ev["ev_ts"].shape[0], dtype=np.int64)
    if partitions is not None:
        partitions = dataclasses.replace(partitions, count=partitions.for_rows(full.height))
    outputs, saved = _replay(_content(ev, spaces), places, req, full, req_loc, blk_ns, locs, loc_grp, windows,
                             _empty_state(n_locs, len(group_idx)), mark[1] if mark else -1, partitions)
    frame = _frame(scenario, full, outputs, group_idx, bytes_per_token, group_bytes_per_token, locs, spaces)
    state = None
    if mark is not None:
        start = LedgerState(
            checkpoint_ns=0, events=0, locations=tuple(locs.names), event_locations=event_locs,
            prefix_locations=0, namespaces=(), group_idx=tuple(group_idx), loc_grp=loc_grp, windows=windows,
            prefix_specs="[]", arrays=(), needed=np.zeros(0, np.int64), settled_transfers=0, loads_from=None,
            claimed=np.zeros(0, np.int64))
        (settled,), first = _transfer_marks(requests, transfers, [mark[0]], mark[0])
        state = _next_state(start, mark, ev, specs, req, full, spaces, saved, settled, first)
    return Ledger(frame, state, refused, req.height, (partitions.count or 0) if partitions else 0)


def _continued(resume: Resume, *, requests: duckdb.DuckDBPyRelation, request_blocks: duckdb.DuckDBPyRelation,
               kv_events: duckdb.DuckDBPyRelation, transfers: duckdb.DuckDBPyRelation, scenario: str,
               bytes_per_token: int, group_bytes_per_token: Sequence[int] | None,
               horizon_ns: int | None) -> Ledger:
    """The ledger from ``resume``: its settled rows, and a replay of the requests from its
    checkpoint on, from its state, over the events from the checkpoint on."""
    t_c = resume.checkpoint_ns
    if t_c is None:
        raise _CannotContinue("its saved state is unreadable")
    # Every request that may look up from t_c on (SQL rounds half away from zero where Polars
    # rounds half to even: one nanosecond of slack), split exactly once its look-up is computed.
    is_recent = f"{LOOKUP_SQL} >= {t_c - 1}"
    recent = requests.filter(is_recent)
    # One pass, grouped by id: the recent rows, their distinct ids, every row of an id with a recent
    # row, the rows without an arrival time, and the first arrival of the recent ones. (A window
    # over every request row took 11 ms where the group-by takes 7, on the whole sample trace's 6th
    # increment: the query reads every request the lake holds.)
    ((rows, distinct, everywhere, unknown, first),) = requests.aggregate(
        f"request_id, count(*) AS n, count(*) FILTER (WHERE {is_recent}) AS r, "
        f"count(*) FILTER (WHERE arrival_ns IS NULL) AS u, min(arrival_ns) FILTER (WHERE {is_recent}) AS f",
        "request_id",
    ).aggregate("coalesce(sum(r), 0), count(*) FILTER (WHERE r > 0), "
                "coalesce(sum(n) FILTER (WHERE r > 0), 0), coalesce(sum(u), 0), min(f)").fetchall()
    if everywhere != rows or distinct != rows:
        raise _CannotContinue(f"{everywhere - distinct} request row(s) repeat the id of a request after the "
                              "checkpoint")
    if unknown:
        raise _CannotContinue(f"{unknown} request(s) have no arrival time")
    # A request's blocks carry its arrival (kvlens.schema: request_blocks.arrival_ns, written from the
    # request's by every collector and importer), so the recent requests' blocks arrived no earlier
    # than the first of them: the join reads the segments from there on (parquet statistics), not a
    # lake that grows with its age. (A block row without an arrival is read wherever it is.)
    blocks = request_blocks if first is None else request_blocks.filter(
        f"arrival_ns >= {int(first)} OR arrival_ns IS NULL")
    st = ready(resume.state)  # (parsed on a worker thread meanwhile, when the caller gave one)
    if st is None:
        raise _CannotContinue("its saved state is unreadable")
    # The transfers of these requests: from the earliest the state names, or the checkpoint if earlier
    # (``_transfer_marks`` says why that finds them all), not every transfer the lake ever held.
    loads_from = t_c if st.loads_from is None else min(st.loads_from, t_c)
    loads = transfers.filter(f"ts_ns >= {int(loads_from)} OR ts_ns IS NULL")
    # ``_needed`` keeps only the blocks and loads of ``recent``'s requests (it joins them to the
    # requests on request_id), so they are read without a semi-join of their own: on the whole
    # sample trace's 6th increment one took 46 to 56 ms with two, 37 to 44 without.
    req, full = _needed(recent, blocks, loads)
    req = req.filter(pl.col("lookup_ns") >= t_c)
    full = full.join(req.select("request_id"), on="request_id", how="semi")
    locs, spaces = _Codes(st.locations), _Codes(st.namespaces)
    anchors = anchor_groups(st.loc_grp, st.windows)
    simulated = (req["source"] == SIMULATED).fill_null(False).to_numpy()
    has_blocks = req["request_id"].is_in(full["request_id"].unique()).to_numpy()
    on_anchor = req["replica"].is_in([st.locations[i] for i in np.flatnonzero(anchors >= 0)]) \
        .fill_null(False).to_numpy()
    # Anchored at their own stores (a real vLLM's requests): admission reads the whole stream, so
    # the replay's events are its suffix from the checkpoint on, not a second read of the lake.
    anchored = bool((on_anchor & ~simulated & has_blocks).any())
    if anchored:
        whole, specs, group_idx = _events(kv_events, locs, spaces, st.group_idx)
        start = int(np.searchsorted(whole["ev_ts"], t_c, side="left"))
        if start != st.events:
            raise _CannotContinue("the events stamped before the checkpoint are not those it counted")
        ev, specs = {k: v[start:] for k, v in whole.items()}, specs.slice(start)
    else:
        after = kv_events.filter(duckdb.ColumnExpression("ts_ns") >= t_c)
        ev, specs, group_idx = _events(after, locs, spaces, st.group_idx)
    n_locs = st.loc_grp.shape[0]
    if (ev["ev_loc"] >= st.event_locations).any():
        raise _CannotContinue("a location started publishing KV events")
    first_seen = [c for c in pl.Series(ev["ev_loc"]).unique(maintain_order=True).to_list()
                  if c >= st.prefix_locations]
    if first_seen != list(range(st.prefix_locations, st.event_locations)):
        raise _CannotContinue("locations first seen after the checkpoint appear in another order")
    places = st.events + np.arange(ev["ev_ts"].shape[0], dtype=np.int64)
    cut = st.events + np.searchsorted(ev["ev_ts"], req["lookup_ns"].to_numpy(), side="left")
    req, full = _ordered(req.with_columns(cut=pl.Series(cut, dtype=pl.Int64),
                                          own=pl.lit(-2, dtype=pl.Int64)), full)
    req_loc = locs.encode(req["replica"])
    if max(len(locs.names), 1) != n_locs:
        raise _CannotContinue(f"new replica(s) {', '.join(locs.names[len(st.locations):])}")
    loc_grp = loc_groups(ev["ev_kind"], ev["ev_loc"], ev["ev_grp"], n_locs, len(group_idx))
    if (loc_grp & ~st.loc_grp).any():
        raise _CannotContinue("a location published a KV cache group it had not")
    windows = _windows(_firsts(pl.concat([_specs_of(st.prefix_specs, specs), specs])), group_idx, n_locs)
    if not np.array_equal(windows, st.windows):
        raise _CannotContinue("a KV cache group's sliding window changed")
    if anchored:
        got = _admitted_after(whole, req, full, locs, st, anchors)
        req, full = _ordered(req.with_columns(_admission_columns(got)), full.drop("cut"))
        req_loc = locs.encode(req["replica"])
    full = full.with_columns(reusable=pl.col("reusable") | pl.Series(_u64_as_i64(full["block_hash"]))
                             .is_in(pl.Series(st.needed).implode()))
    mark = None
    if horizon_ns is not None:
        mark = checkpoint(ev["ev_ts"], st.events, t_c, horizon_ns, req["lookup_ns"].to_numpy(),
                          req["cut"].to_numpy(), req["own"].to_numpy())
    # the loads the state counted, and those the next state counts and its earliest transfer, in one
    # query (over the transfers read above: from at most t_c on, so every load these count)
    settled, first_load = _transfer_marks(requests, loads, [t_c, *([mark[0]] if mark else [])],
                                          mark[0] if mark else None)
    if settled[0] != st.settled_transfers:
        raise _CannotContinue("a request settled at the checkpoint has a load stamped after it")
    blk_ns = spaces.encode(full["namespace"], null=-1)
    if len(spaces.names) > 1 >= len(st.namespaces):
        raise _CannotContinue("a second namespace appeared: the saved state holds no content maps (_content)")
    replaced = req["request_id"]
    for rows in (resume.previous, resume.requests):  # read while the replay's one thread runs
        if isinstance(rows, Prefetch):
            rows.start(excluding=replaced)
    outputs, saved = _replay(_content(ev, spaces), places, req, full, req_loc, blk_ns, locs, st.loc_grp,
                             st.windows, st.arrays, mark[1] if mark else -1)
    new = _frame(scenario, full, outputs, group_idx, bytes_per_token, group_bytes_per_token, locs, spaces)
    # A scan returns a table's rows in the order they were written (DuckDB's default
    # preserve_insertion_order, a setting of the database, so the prefetch's cursor keeps it too, as
    # build_analysis_db does): no sort by rowid.
    kept = rows_of(resume.previous, replaced).select(new.columns)
    # One chunk: every analysis after the ledger reads these rows (the read back comes in DuckDB's
    # vectors; on the whole sample trace's 6th increment miss_ledger took 22 ms on them, 14 rechunked)
    frame = pl.concat([kept.cast(new.schema), new], rechunk=True)
    state = _next_state(st, mark, ev, specs, req, full, spaces, saved, settled[-1],
                        first_load) if mark else None
    return Ledger(frame, state, None, req.height, appended=new, replaced=replaced, loads_from=loads_from)


class Prefetch:
    """The rows of ``scenario`` in ``table`` (in the order they were written), read on a thread of
    their own over a second connection to ``con``'s database from ``start`` on: a continuation
    starts it as its replay begins, which keeps one core busy, and takes the rows after. The
    previous ledger's rows grow with the lake's age (on the whole sample trace's 6th increment,
    230k rows read in 29 ms). Not started, it reads in ``result``."""

    def __init__(self, con: duckdb.DuckDBPyConnection, table: str, scenario: str) -> None:
        self._con, self._table, self._scenario = con, table, scenario
        self._thread: threading.Thread | None = None
        self._rows: pl.DataFrame | None = None
        self._error: BaseException | None = None
        self._dropped: pl.Series | None = None  # the request ids the thread dropped (``start``)

    def _read(self, cursor: duckdb.DuckDBPyConnection) -> None:
        try:
            rows = cursor.table(self._table).filter(
                duckdb.ColumnExpression("scenario") == duckdb.ConstantExpression(self._scenario)).pl()
            self._rows = rows if self._dropped is None else _without(rows, self._dropped)
        except BaseException as e:  # (raised again in result, on the caller's thread)
            self._error = e
        finally:
            cursor.close()

    def start(self, excluding: pl.Series | None = None) -> None:
        """Read from now on, and drop there the rows of the request ids ``excluding``: a filter of
        every previous row, off the caller's thread (on the whole sample trace's 6th increment,
        6 to 19 ms and a copy of 230k rows)."""
        if self._thread is None:
            self._dropped = excluding
            self._thread = threading.Thread(target=self._read, args=(self._con.cursor(),), daemon=True,
                                            name=f"read {self._table}")
            self._thread.start()

    def take(self, excluding: pl.Series | None = None) -> pl.DataFrame:
        """The rows without those of the request ids ``excluding`` (dropped on the thread when
        ``start`` was given them), once: the prefetch keeps no reference to them (they are as many
        as the scenario's rows, and the analyses after the ledger can reuse their memory once the
        caller is done with them)."""
        self.start()
        assert self._thread is not None
        self._thread.join()
        if self._error is not None:
            raise self._error
        rows, self._rows = self._rows, None
        if rows is None:
            raise RuntimeError(f"the {self._table} rows of {self._scenario} were taken already")
        if excluding is not None and not (self._dropped is not None and excluding.equals(self._dropped)):
            rows = _without(rows, excluding)
        return rows

    def drop(self) -> None:
        """Wait for a read that was started (its cursor is the connection's), and keep nothing."""
        if self._thread is not None:
            self._thread.join()
        self._rows = None


def _without(rows: pl.DataFrame, ids: pl.Series) -> pl.DataFrame:
    return rows.filter(~pl.col("request_id").is_in(ids.implode()))


def rows_of(rows: duckdb.DuckDBPyRelation | Prefetch, excluding: pl.Series | None = None) -> pl.DataFrame:
    """The rows of a ``Resume``'s relation, or of its prefetch (taken: read them once), without
    those of the request ids ``excluding``."""
    if isinstance(rows, Prefetch):
        return rows.take(excluding)
    frame = rows.pl()
    return frame if excluding is None else _without(frame, excluding)


def _admitted_after(ev: dict[str, np.ndarray], req: pl.DataFrame, full: pl.DataFrame, locs: _Codes,
                    st: LedgerState, anchors: np.ndarray) -> Admission:
    """Admission (analyzers/admission.py) of the requests after the checkpoint, in ``req``'s order:
    over the whole event stream (a request's own run, or the stores it found held, may lie before
    the checkpoint), with the runs the settled requests claimed taken already. The settled
    requests come first in look-up order, so their claims are exactly those a full admission
    makes before it reaches these requests: the cuts are a full admission's."""
    hashed = full.with_columns(block_hash_i64=pl.Series(_u64_as_i64(full["block_hash"]), dtype=pl.Int64))
    return admission_cuts(ev, req, hashed, locs.encode(req["replica"]), locs.index.get(POOL_LOCATION, -1),
                          claimed=st.claimed.tolist(), anchors=anchors,
                          windows=np.where(st.loc_grp, st.windows, 0))


def _next_state(st: LedgerState, mark: tuple[int, int], ev: dict[str, np.ndarray], specs: pl.DataFrame,
                req: pl.DataFrame, full: pl.DataFrame, spaces: _Codes, arrays: tuple[np.ndarray, ...],
                settled_transfers: int, loads_from: int | None) -> LedgerState:
    """The state at checkpoint ``mark`` (time, stream place), from ``st`` (the one the replay started
    at) and what the replay read after it: its events (``ev``, ``specs``), requests (``req``, with
    admission's ``own`` run) and blocks (``full``); ``settled_transfers`` and ``loads_from``:
    ``_transfer_marks``' at ``mark``."""
    local = mark[1] - st.events  # events of ``ev`` before the new checkpoint
    prefix = _specs_of(st.prefix_specs, specs)
    runs = req.filter((pl.col("lookup_ns") < mark[0]) & (pl.col("own") >= 0))
    if "chunks" in runs.columns:  # a run's later chunks are claimed with it
        runs = runs.select(pl.concat_list("own", "chunks").alias("own")).explode("own")
    settled = runs["own"].to_numpy()
    return dataclasses.replace(
        st, checkpoint_ns=mark[0], events=mark[1], namespaces=tuple(spaces.names), arrays=arrays,
        prefix_locations=max(st.prefix_locations, int(ev["ev_loc"][:local].max()) + 1 if local else 0),
        prefix_specs=json.dumps(_firsts(pl.concat([prefix, specs.head(local)])).rows()),
        needed=_with(st.needed, _hashes(full.filter(pl.col("lookup_ns") < mark[0]))),
        settled_transfers=settled_transfers, loads_from=loads_from,
        claimed=np.union1d(st.claimed, settled).astype(np.int64))


def _with(known: np.ndarray, more: np.ndarray) -> np.ndarray:
    """``np.union1d(known, more)`` for a sorted, unique ``known`` (a state's, as large as the
    history) and a sorted, unique ``more``: the values not yet there are inserted in place, a
    copy instead of a sort of both."""
    if not known.shape[0]:
        return more.astype(known.dtype)
    at = np.searchsorted(known, more)
    fresh = (at == known.shape[0]) | (known[np.minimum(at, known.shape[0] - 1)] != more)
    return np.insert(known, at[fresh], more[fresh])


def _specs_of(saved: str, like: pl.DataFrame) -> pl.DataFrame:
    """A state's ``prefix_specs`` as a frame of ``_firsts``' columns (the schema from none of
    ``like``'s rows: they are the events read, and aggregating them for it took 10 ms a call)."""
    return pl.DataFrame(json.loads(saved), schema=_firsts(like.clear()).schema, orient="row")


def _empty_state(n_locs: int, n_groups: int) -> tuple[np.ndarray, ...]:
    words = (3 * n_locs * n_groups + 62) // 63  # analyzers/replay.py's bit words per row
    no = np.zeros(0, np.int64)
    bits = np.zeros((0, words), np.int64)
    return (no, bits, bits.copy(), no, no, no, no, no, no, no, no)


def _hashes(full: pl.DataFrame) -> np.ndarray:
    return np.unique(_u64_as_i64(full["block_hash"]))


def _transfer_marks(requests: duckdb.DuckDBPyRelation, transfers: duckdb.DuckDBPyRelation,
                    times: Sequence[int], pending_from: int | None) -> tuple[list[int], int | None]:
    """What a state records of the transfers, in one query over ``transfers``: per time ``t`` of
    ``times``, the loads (``_needed``'s: a block the serving replica received) stamped from ``t``
    on for requests that may look up before it (with the slack of ``LOOKUP_SQL``'s rounding: a
    superset of the settled ones); and, with ``pending_from`` (else None), the earliest transfer
    (ts_ns) of a request that may look up from it on (the same slack, as a continuation from it
    finds its requests), or of one no row of ``requests`` names (its row may come later), None when
    there is none.

    A continuation from ``pending_from`` needs every transfer of the requests that look up from it
    on, and reads the transfers from the earlier of that earliest time and it. Those already in the
    lake here are counted: a request with a row here is one of the first kind, and one without a row
    yet is of the second (a row of it stamped before ``pending_from`` that lands later is in a late
    segment, and ``kvlens analyze`` rebuilds). A transfer that lands later is stamped from
    ``pending_from`` on, or its segment is late too (the checkpoint is at most the horizon the next
    run checks new segments against). ``transfers`` may be a continuation's own such read (from at
    most its earliest time): it holds every transfer of a request still without a row, because the
    count that bounded it held them."""
    rows = (transfers.filter("request_id IS NOT NULL").set_alias("t")
            .join(requests.project(f"request_id, replica, {LOOKUP_SQL} AS lookup").set_alias("r"),
                  "t.request_id = r.request_id", how="left"))
    load = ("r.request_id IS NOT NULL AND t.block_hash IS NOT NULL "
            "AND (t.replica IS NULL OR t.replica = r.replica)")
    marks = [f"count(*) FILTER (WHERE {load} AND r.lookup < {t + 1} AND t.ts_ns >= {t})" for t in times]
    if pending_from is not None:
        marks.append(f"min(t.ts_ns) FILTER (WHERE r.request_id IS NULL OR r.lookup >= {pending_from - 1})")
    (got,) = rows.aggregate(", ".join(marks)).fetchall()
    first = got[len(times)] if pending_from is not None else None
    return [int(n) for n in got[:len(times)]], None if first is None else int(first)


def _content(ev: dict[str, np.ndarray], spaces: _Codes) -> dict[str, np.ndarray]:
    """``ev`` as the replay reads it: the content hashes only where two namespaces or more are
    known (``spaces``, the events' and the blocks'). ``miss_incompatible`` is a block stored under
    another namespace than the request's: with one namespace no block is, and the replay's content
    maps (one entry per stored content, two table probes per store) would answer nothing. On the
    whole sample trace's 6th increment (one namespace) the replay kernel took 42 to 58 ms with them,
    20 to 24 ms without (measured here). So a state saved with at most one namespace holds no
    content maps, and a continuation that meets a second one replays in full (``_continued``)."""
    if len(spaces.names) > 1:
        return ev
    return {**ev, "ev_c": np.zeros_like(ev["ev_c"])}


def _replay(ev: dict[str, np.ndarray], places: np.ndarray, req: pl.DataFrame, full: pl.DataFrame,
            req_loc: np.ndarray, blk_ns: np.ndarray, locs: _Codes, loc_grp: np.ndarray, windows: np.ndarray,
            state: tuple[np.ndarray, ...], snap: int,
            parts: Partitions | None = None) -> tuple[tuple[np.ndarray, ...], ...]:
    """The compiled replay of ``req``'s look-ups (in order) at their stream places ``cut``, and the
    state at stream place ``snap`` (``state`` when ``snap`` < 0); with ``parts``, in block-hash
    partitions from an empty state (analyzers/partitions.py), the state gathered from theirs."""
    counts = full.group_by("request_id", maintain_order=True).len()
    per_req = (req.join(counts, on="request_id", how="left", maintain_order="left")["len"]
               .fill_null(0).to_numpy())
    req_off = np.concatenate([[0], np.cumsum(per_req)]).astype(np.int64)
    # The core compares look-up places with event places: each look-up sees exactly the events
    # before its admission (analyzers/admission.py); removals record the events' times.
    args = (places, ev["ev_ts"], ev["ev_kind"], ev["ev_loc"], ev["ev_tier"], ev["ev_grp"], ev["ev_h"],
            ev["ev_c"], ev["ev_ns"], ev["ev_left"], req["cut"].to_numpy().astype(np.int64), req_loc,
            req["tail"].to_numpy().astype(np.bool_), req["block_size"].to_numpy().astype(np.int64), req_off,
            _u64_as_i64(full["block_hash"]), _u64_as_i64(full["content_hash"]), blk_ns,
            full["xfer"].to_numpy().astype(np.int8), loc_grp.shape[0], locs.index.get(POOL_LOCATION, -1),
            windows, loc_grp)
    if parts is not None:
        outputs, saved = replay_partitioned_state(*args, partitions=parts.for_rows(full.height), snap=snap,
                                                  run=parts.run)
        memory.check()
        return outputs, state if saved is None else saved
    replayed = replay_resume(*args, state, snap)
    memory.check()
    return replayed


def _frame(scenario: str, full: pl.DataFrame, outputs: tuple[np.ndarray, ...], group_idx: Sequence[int],
           bytes_per_token: int, group_bytes_per_token: Sequence[int] | None, locs: _Codes,
           spaces: _Codes) -> pl.DataFrame:
    out, holder, rem_ts, rem_loc, other_ns, cut, groups_served, source = outputs
    outcome_names = pl.Series([o.value for o in OUTCOME_CODES], dtype=pl.String)
    return pl.DataFrame({
        "scenario": [scenario] * len(full),
        "request_id": full["request_id"],
        "replica": full["replica"],
        "arrival_ns": full["arrival_ns"],
        "position": full["position"],
        "block_hash": full["block_hash"],
        "outcome": outcome_names.gather(out),
        "tokens": full["block_tokens"],
        "bytes": _bytes(full["block_tokens"], groups_served, list(group_idx), bytes_per_token,
                        group_bytes_per_token),
        "holder": locs.decode(holder),
        "removed_ns": pl.Series(rem_ts, dtype=pl.Int64).replace(-1, None),
        "remover": locs.decode(rem_loc),
        "key_diff": spaces.decode(other_ns),
        "cut_group": pl.Series(np.asarray(group_idx, np.int32)[np.maximum(cut, 0)], dtype=pl.Int32)
        .set(pl.Series(cut < 0), None),
        "reusable": full["reusable"],
        "origin": _origins(source, full["origin"]),
    })


def _origins(source: np.ndarray, transfer_origin: pl.Series) -> pl.Series:
    """Where each hit came from: gpu, cpu, disk, pool, or a transfer's origin (else NULL)."""
    src = pl.Series(source)
    tier = src.replace_strict(_ORIGINS, default=None, return_dtype=pl.Utf8)
    moved = transfer_origin.cast(pl.Utf8).fill_null(Medium.POOL.value)
    return pl.select(pl.when(src == SRC_TRANSFER).then(moved).otherwise(tier)).to_series().alias("origin")


def _bytes(tokens: pl.Series, served: np.ndarray, group_idx: list[int], bytes_per_token: int,
           group_rates: Sequence[int] | None) -> pl.Series:
    """KV bytes per block: tokens x the rates of the groups in its ``served`` bit mask."""
    if group_rates is None or len(group_idx) < 2 or sorted(group_idx) != list(range(len(group_rates))):
        return tokens.cast(pl.Int64) * bytes_per_token
    rate = np.zeros(served.shape[0], np.int64)
    for code, g in enumerate(group_idx):
        rate += np.where((served >> min(code, 62)) & 1 == 1, int(group_rates[g]), 0)
    rate[served == 0] = sum(int(r) for r in group_rates)  # unobserved: every group computes it
    return tokens.cast(pl.Int64) * pl.Series(rate)
