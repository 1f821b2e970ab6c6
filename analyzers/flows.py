"""Analyzers: byte flows: reads, writes and replica copies per replica, tier and time window.

Where each byte is counted (DESIGN.md section 1, question 3):

- **write**: a ``stored`` kv_event, ``block_tokens x bytes_per_token``, in the window of the
  event, on the publishing location (a replica, or ``pool``) and its medium.
- **read**: a hit of the ledger, in the window of the request's look-up (arrival plus queue
  time): ``hit_local`` reads the serving replica's GPU-class tier (any medium but cpu/disk),
  ``hit_offload`` its cpu/disk tier, ``hit_remote`` the origin of its ok transfer (``pool``,
  another replica's GPU-class tier, or, when the origin names a medium, that tier of the
  serving replica). Each read is matched to the store that put the block there: the latest
  store of the same location, tier class and block at or before the look-up (else the first
  after it: the simulator's shared pool can be written by a request that started a little
  later). The read's tier is the matched store's medium. Reads with no store at all are
  counted in ``read_unwritten_bytes`` (events collected after the store), so flows conserve
  bytes: ``read_bytes - read_unwritten_bytes`` is read from blocks the lake saw written.
- **replica copy**: an ok transfer whose origin is another location (a replica or ``pool``), in
  the window of its start, on the receiving location; its tier is ``pool`` for the pool, else
  ``gpu``.
- **never read**: a store whose residency (until the next removal, clear, or re-store of the
  same location, medium and block) ended by a removal or a clear with no read matched to it;
  counted in the window of the store, so ``never_read_bytes <= write_bytes`` on every row.
  Stores still resident at the end of the lake with no read are ``unread_resident_bytes``.

Windows are aligned to multiples of ``window_ns`` since the epoch (default 15 minutes), so
the worst 15-minute window is a ``GROUP BY window_start_ns`` away.

**Continuing** (``kvlens analyze``'s incremental runs, ``flows_continued``). At the ledger's
checkpoint ``S`` (analyzers/ledger_state.py: no row stamped before it can still arrive, and the
requests that look up before it are settled) flows keep a ``FlowsState``: the sums of every
contribution no later row can change, and what later rows still can change, which the next run
recomputes with the rows from ``S`` on. Settled: a copy stamped before ``S``; a store's write
before ``S``; a read that looked up before ``S`` matched to a store before ``S`` (a later store
cannot be an earlier one's successor nor come before the read); a store before ``S`` whose
residency ended before ``S`` and that is not the latest store of its location, tier class and
block before ``S`` (only that one can still be matched by a later read). Kept open: the other
stores before ``S`` (with whether they were read, and how their residency ended when that is
known: then its never-read bytes are in the sums already, and a later read of it takes them back,
so the next runs do not sum every block evicted unread again) and the other reads before ``S``
(with no store matched yet, or one from ``S`` on). The
reads of the requests that look up from ``S`` on come from the ledger again. The sizes of events
without ``block_tokens`` follow the ledger's median block: a state that used it is refused when it
moved, as are one of another window or model (the run is then a full one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import duckdb
import polars as pl

from kvlens.analysis_db import settings
from kvlens.analyzers.outcomes import LOOKUP_SQL, in_order
from kvlens.analyzers.state_blob import pack, still_counted, unpack
from kvlens.schema import HIT_OUTCOMES, Medium, Outcome

__all__ = ["FLOWS_TABLE", "ROWS_PER_PARTITION", "FlowsState", "flows", "flows_continued",
           "flows_out_of_core"]

DEFAULT_WINDOW_NS = 15 * 60 * 1_000_000_000
_LOWER = [Medium.CPU.value, Medium.DISK.value]
# An origin naming one of these is a tier of the receiving replica; `pool` is the shared pool.
_LOCAL_TIERS = [m.value for m in Medium if m != Medium.POOL]
_SUMS = ["read_bytes", "write_bytes", "replica_bytes", "never_read_bytes", "read_unwritten_bytes",
         "unread_resident_bytes"]
_KEY = ["loc", "cls", "block_hash"]
FLOWS_TABLE = "kvlens_flows"  # a scenario's FlowsState, in the analysis DB beside its rows
_READ_COLS = ["lookup_ns", "loc", "cls", "block_hash", "bytes", "default_tier"]
_STORE_COLS = ["n", "ts_ns", "loc", "tier", "cls", "block_hash", "bytes", "filled"]
_GROUP = ["loc", "window_start_ns", "tier"]
# A request's look-up: its arrival plus its queue time (the ledger's, analyzers/outcomes.py).
_LOOKUP = pl.col("arrival_ns") + (pl.col("queue_ms").fill_null(0) * 1e6).round().cast(pl.Int64)
# Out of core: rows (events, hits and transfers together) of one block-hash partition in memory at once.
ROWS_PER_PARTITION = 2_000_000


@dataclass(frozen=True)
class FlowsState:
    """flows at checkpoint ``checkpoint_ns``: the settled sums and the open stores and reads (see
    the module docstring), with what continuing from it must agree with."""

    checkpoint_ns: int
    events: int  # events stamped before the checkpoint: the next run numbers its events from here
    window_ns: int
    bytes_per_token: int
    fill_tokens: int  # the tokens an event without block_tokens was given
    filled: bool  # a store before the checkpoint had no block_tokens (its bytes used fill_tokens)
    sums: pl.DataFrame  # loc, window_start_ns, tier, and the byte columns: the settled contributions
    stores: pl.DataFrame  # _STORE_COLS, read, ended, end_ts: the open stores
    reads: pl.DataFrame  # _READ_COLS: the open reads

    def to_bytes(self) -> bytes:
        return pack({"checkpoint_ns": self.checkpoint_ns, "events": self.events, "window_ns": self.window_ns,
                     "bytes_per_token": self.bytes_per_token, "fill_tokens": self.fill_tokens,
                     "filled": self.filled},
                    {"sums": self.sums, "stores": self.stores, "reads": self.reads})

    @classmethod
    def from_bytes(cls, data: bytes) -> FlowsState:
        head, frames = unpack(data)
        return cls(int(head["checkpoint_ns"]), int(head["events"]), int(head["window_ns"]),
                   int(head["bytes_per_token"]), int(head["fill_tokens"]), bool(head["filled"]),
                   frames["sums"], frames["stores"], frames["reads"])


def _asof(left: pl.DataFrame, right: pl.DataFrame, on: tuple[str, str], by: str | list[str],
          strategy: Literal["backward", "forward"]) -> pl.DataFrame:
    # The callers sort both sides on the join key; polars cannot check that within groups.
    return left.join_asof(right, left_on=on[0], right_on=on[1], by=by, strategy=strategy,
                          check_sortedness=False)


def _cls(medium: pl.Expr) -> pl.Expr:
    """Tier class as the replay sees it: 1 for cpu/disk, 0 for every other medium."""
    return pl.when(medium.is_in(_LOWER)).then(1).otherwise(0).cast(pl.Int8)


def _fill_tokens(median: object) -> int:
    """The tokens of an event without ``block_tokens``: the median of the outcomes' (16 with none)."""
    return int(median) if isinstance(median, int | float) else 16


def _events(kv_events: duckdb.DuckDBPyRelation, bytes_per_token: int, block_tokens: int,
            first: int = 0) -> pl.DataFrame:
    """The events in stream order, numbered from ``first`` (``n``)."""
    ev = kv_events.select("ts_ns", "seq", "replica", "kind", "block_hash", "medium", "block_tokens").pl()
    # A scan in stream order is not sorted again (NULL times or sequences sort first: sorted).
    nulls = ev["ts_ns"].null_count() or ev["seq"].null_count()
    if nulls or not in_order(ev["ts_ns"].to_numpy(), ev["seq"].to_numpy()):
        ev = ev.with_row_index("ord").sort("ts_ns", "seq", "ord").drop("ord")
    ev = ev.with_row_index("n", offset=first)
    medium = pl.col("medium").cast(pl.Utf8)
    nbytes = pl.col("block_tokens").fill_null(block_tokens).cast(pl.Int64) * bytes_per_token
    return ev.select(
        pl.col("n").cast(pl.Int64), "ts_ns", loc=pl.col("replica").cast(pl.Utf8).fill_null(""),
        kind=pl.col("kind").cast(pl.Utf8), block_hash=pl.col("block_hash").cast(pl.UInt64), medium=medium,
        tier=medium.fill_null(Medium.UNKNOWN.value), cls=_cls(medium), bytes=nbytes,
        filled=pl.col("block_tokens").is_null())


def _residencies(ev: pl.DataFrame, carried: pl.DataFrame | None = None) -> pl.DataFrame:
    """Every store with how its residency ended ('removed', 'cleared', 'restored' or None), when
    (``end_ts``), and whether it was read before (``read``: the carried stores' flag). ``carried``:
    a state's open stores, before every event of ``ev``; one whose end was known keeps it, and is
    ``counted``: the state's sums hold what it adds at its carried ``read`` flag (``_closed``). In
    no particular order (every reader sorts or sums)."""
    key = ["loc", "tier", "block_hash"]
    blocks = (ev.filter(pl.col("kind").is_in(["stored", "removed"]) & pl.col("block_hash").is_not_null())
              .select(*_STORE_COLS, "kind", read=pl.lit(False), known=pl.lit(None, pl.Utf8),
                      known_ts=pl.lit(None, pl.Int64)))
    closed = None
    if carried is not None and carried.height:
        # A carried store whose end is known keeps it, and no other carried store of its key comes
        # after it (that one would have ended it): only the still-resident ones meet ``ev``.
        closed = carried.filter(pl.col("ended").is_not_null())
        blocks = pl.concat([carried.filter(pl.col("ended").is_null())
                            .select(*_STORE_COLS, kind=pl.lit("stored"), read="read", known="ended",
                                    known_ts="end_ts"), blocks], how="vertical_relaxed")
    same = pl.all_horizontal(pl.col(k) == pl.col(k).shift(-1) for k in key)
    # Each key's rows together, by event: the hash first, so that the strings are compared only
    # between rows of one hash (a third of the time of a sort by location first, measured here).
    blocks = blocks.sort("block_hash", "loc", "tier", "n").with_columns(
        next_n=pl.when(same).then(pl.col("n").shift(-1)),
        next_kind=pl.when(same).then(pl.col("kind").shift(-1)),
        next_ts=pl.when(same).then(pl.col("ts_ns").shift(-1)))
    stores = blocks.filter(pl.col("kind") == "stored")
    clears = ev.filter(pl.col("kind") == "cleared").select("loc", "medium", clear_n="n", clear_ts="ts_ns")
    clears = clears.sort("clear_n")
    # A clear without a medium clears every tier of its location.
    every = clears.filter(pl.col("medium").is_null()).drop("medium")
    one = clears.filter(pl.col("medium").is_not_null()).rename(
        {"medium": "tier", "clear_n": "clear1_n", "clear_ts": "clear1_ts"})
    stores = _asof(stores.sort("n"), every, ("n", "clear_n"), "loc", "forward")
    stores = _asof(stores, one, ("n", "clear1_n"), ["loc", "tier"], "forward")
    clear_n = pl.min_horizontal("clear_n", "clear1_n")
    clear_ts = pl.when(pl.col("clear1_n").is_null() | (pl.col("clear_n") < pl.col("clear1_n"))) \
        .then(pl.col("clear_ts")).otherwise(pl.col("clear1_ts"))
    by_clear = clear_n.is_not_null() & (pl.col("next_n").is_null() | (clear_n < pl.col("next_n")))
    ended = (pl.when(by_clear).then(pl.lit("cleared"))
             .when(pl.col("next_kind") == "removed").then(pl.lit("removed"))
             .when(pl.col("next_kind") == "stored").then(pl.lit("restored")))
    end_ts = pl.when(by_clear).then(clear_ts).otherwise(pl.col("next_ts"))
    known = pl.col("known").is_not_null()
    out = stores.select(*_STORE_COLS, "read", ended=pl.when(known).then(pl.col("known")).otherwise(ended),
                        end_ts=pl.when(known).then(pl.col("known_ts")).otherwise(end_ts),
                        counted=pl.lit(False))
    if closed is None or not closed.height:
        return out
    return pl.concat([out, closed.with_columns(counted=pl.lit(True)).select(out.columns)],
                     how="vertical_relaxed")


def _loads(transfers: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    xfer = transfers.select("request_id", "block_hash", "replica", "origin", "status").pl()
    return (xfer.filter((pl.col("status").cast(pl.Utf8) == "ok") & pl.col("block_hash").is_not_null())
            .select("request_id", block_hash=pl.col("block_hash").cast(pl.UInt64),
                    receiver=pl.col("replica").cast(pl.Utf8), origin=pl.col("origin").cast(pl.Utf8)))


def _reads(block_outcomes: pl.DataFrame, request_ledger: pl.DataFrame,
           transfers: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    lookup = request_ledger.select("request_id", lookup_ns=_LOOKUP)
    hits = (block_outcomes.filter(pl.col("outcome").cast(pl.Utf8).is_in(HIT_OUTCOMES))
            .with_columns(pl.col("block_hash").cast(pl.UInt64), outcome=pl.col("outcome").cast(pl.Utf8),
                          replica=pl.col("replica").cast(pl.Utf8).fill_null(""))
            .join(lookup.unique("request_id"), on="request_id", how="left")
            .with_columns(pl.col("lookup_ns").fill_null(pl.col("arrival_ns"))))
    remote = (hits.filter(pl.col("outcome") == Outcome.HIT_REMOTE.value)
              .join(_loads(transfers), on=["request_id", "block_hash"], how="left")
              .filter(pl.col("receiver").is_null() | (pl.col("receiver") == pl.col("replica")))
              .unique(["request_id", "block_hash", "position"], keep="first"))
    origin = pl.col("origin").fill_null(Medium.POOL.value)
    is_tier = origin.is_in(_LOCAL_TIERS)
    remote = remote.with_columns(
        loc=pl.when(is_tier).then(pl.col("replica")).otherwise(origin), cls=_cls(origin),
        default_tier=pl.when(is_tier | (origin == Medium.POOL.value)).then(origin)
        .otherwise(pl.lit(Medium.GPU.value)))
    offload = pl.col("outcome") == Outcome.HIT_OFFLOAD.value
    local = hits.filter(pl.col("outcome") != Outcome.HIT_REMOTE.value).with_columns(
        loc=pl.col("replica"), cls=pl.when(offload).then(1).otherwise(0).cast(pl.Int8),
        default_tier=pl.when(offload).then(pl.lit(Medium.CPU.value)).otherwise(pl.lit(Medium.GPU.value)))
    cols = ["lookup_ns", "loc", "cls", "block_hash", "bytes", "default_tier"]
    return pl.concat([local.select(cols), remote.select(cols)]).with_columns(pl.col("bytes").cast(pl.Int64))


def _match(reads: pl.DataFrame, stores: pl.DataFrame) -> pl.DataFrame:
    """Each read with the store it came from (``store_n``), or NULL, and its tier."""
    # Only the stores of a block and location some read names can match (the joins are by key):
    # a continued run carries every block's latest store, most never read again.
    right = (stores.join(reads.select(_KEY).unique(), on=_KEY, how="semi", nulls_equal=True)
             .select(*_KEY, store_ts=pl.col("ts_ns"), store_n="n", store_tier="tier").sort("store_ts"))
    reads = reads.sort("lookup_ns")
    back = _asof(reads, right, ("lookup_ns", "store_ts"), _KEY, "backward")
    fwd = _asof(reads, right, ("lookup_ns", "store_ts"), _KEY, "forward")
    tier = pl.col("store_tier").fill_null(fwd["store_tier"]).fill_null(pl.col("default_tier"))
    return back.with_columns(store_n=pl.col("store_n").fill_null(fwd["store_n"]), tier=tier,
                             match_ts=pl.col("store_ts").fill_null(fwd["store_ts"]))


def _copies(transfers: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    x = transfers.select("ts_ns", "replica", "origin", "status", "bytes").pl()
    own_tier = pl.col("origin").cast(pl.Utf8).is_in(_LOCAL_TIERS)
    x = x.filter((pl.col("status").cast(pl.Utf8) == "ok") & ~own_tier)
    loc = pl.col("replica").cast(pl.Utf8).fill_null("")
    pool, gpu = pl.lit(Medium.POOL.value), pl.lit(Medium.GPU.value)
    tier = pl.when(loc == Medium.POOL.value).then(pool).otherwise(gpu)
    return x.select("ts_ns", loc=loc, tier=tier, replica_bytes=pl.col("bytes").fill_null(0).cast(pl.Int64))


def _matched(ev: pl.DataFrame, reads: pl.DataFrame,
             carried: pl.DataFrame | None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The stores of ``ev`` (and ``carried``: ``_residencies``) with ``read`` set where a read of
    ``reads`` matched them (``was_read``: the flag before), and the reads with their store
    (``_match``)."""
    stores = _residencies(ev, carried)
    reads = _match(reads, stores)
    stores = stores.with_columns(read=pl.col("read") | pl.col("n").is_in(reads["store_n"].drop_nulls()
                                                                           .unique().implode()),
                                 was_read=pl.col("read"))
    return stores, reads


def _parts(reads: pl.DataFrame, stores: pl.DataFrame, first: int = 0) -> list[pl.DataFrame]:
    """Each read's and store's bytes (a store numbered before ``first``, carried open from a state,
    has its write counted there already)."""
    unread = ~pl.col("read")
    evicted = unread & pl.col("ended").is_in(["removed", "cleared"])
    return [
        reads.select(ts_ns="lookup_ns", loc="loc", tier="tier", read_bytes="bytes",
                     read_unwritten_bytes=pl.when(pl.col("store_n").is_null())
                     .then(pl.col("bytes")).otherwise(0)),
        stores.select("ts_ns", "loc", "tier",
                      write_bytes=pl.when(pl.col("n") >= first).then(pl.col("bytes")).otherwise(0),
                      never_read_bytes=pl.when(evicted).then(pl.col("bytes")).otherwise(0),
                      unread_resident_bytes=pl.when(unread & pl.col("ended").is_null())
                      .then(pl.col("bytes")).otherwise(0)),
    ]


def _closed(stores: pl.DataFrame) -> pl.DataFrame:
    """What stores whose residency ended add besides their write (counted once, with the stores
    before a state's first event): the bytes of those evicted or cleared unread."""
    evicted = ~pl.col("read") & pl.col("ended").is_in(["removed", "cleared"])
    return stores.filter(evicted).select("ts_ns", "loc", "tier", never_read_bytes="bytes")


def _read_since(stores: pl.DataFrame) -> pl.DataFrame:
    """What the ``counted`` stores that a read of this run matched (``was_read``: their flag before
    it) no longer add: a state counted them evicted unread."""
    flipped = pl.col("counted") & pl.col("read") & ~pl.col("was_read")
    return _closed(stores.filter(flipped).with_columns(read=pl.lit(False))).with_columns(
        never_read_bytes=-pl.col("never_read_bytes"))


def _summed(frames: list[pl.DataFrame], window_ns: int) -> pl.DataFrame:
    """Contributions (ts_ns or window_start_ns, loc, tier, byte columns) summed per window."""
    window = (pl.col("ts_ns") // window_ns) * window_ns
    timed = [f.with_columns(window_start_ns=window).drop("ts_ns") if "ts_ns" in f.columns else f
             for f in frames]
    frame = pl.concat(timed, how="diagonal_relaxed")
    frame = frame.with_columns([pl.col(c).fill_null(0).cast(pl.Int64) if c in frame.columns
                                else pl.lit(0, pl.Int64).alias(c) for c in _SUMS])
    return (frame.group_by(*_GROUP).agg([pl.col(c).sum() for c in _SUMS])
            .select(pl.col("loc").cast(pl.Utf8), pl.col("window_start_ns").cast(pl.Int64),
                    pl.col("tier").cast(pl.Utf8), *_SUMS))


def _rows(sums: pl.DataFrame, scenario: str) -> pl.DataFrame:
    """The table's rows from the summed contributions (``_summed``): the non-zero ones, sorted."""
    out = sums.filter(pl.sum_horizontal(_SUMS) > 0)
    return (out.select(pl.lit(scenario).alias("scenario"), pl.col("loc").alias("replica"), "window_start_ns",
                       "tier", *_SUMS).sort("replica", "window_start_ns", "tier"))


def _state_at(at: int, first: int, ev: pl.DataFrame, stores: pl.DataFrame, reads: pl.DataFrame,
              copies: pl.DataFrame, before: FlowsState | None, window_ns: int, bytes_per_token: int,
              fill_tokens: int, idle: pl.DataFrame | None, taken_back: pl.DataFrame) -> FlowsState:
    """The state at ``at`` after a run that numbered its events from ``first`` (``before``: the
    state it continued from; ``idle``: its stores this run could not change, kept as they are;
    ``taken_back``: ``_read_since`` of ``stores``)."""
    early = reads.filter(pl.col("lookup_ns") < at)
    final_read = pl.col("match_ts").is_not_null() & (pl.col("match_ts") < at)
    pre = stores.filter(pl.col("ts_ns") < at)
    latest = pl.col("ts_ns") == pl.col("ts_ns").max().over(_KEY)
    final_store = pl.col("end_ts").is_not_null() & (pl.col("end_ts") < at) & ~latest
    pre = pre.with_columns(final=final_store)
    counted = pl.col("counted")
    settled_reads, settled_stores = early.filter(final_read), pre.filter(pl.col("final") & ~counted)
    parts = _parts(settled_reads, settled_stores, first)
    # every store before ``at`` has its write counted here once (the open ones' too)
    parts.append(pre.filter(~pl.col("final") & (pl.col("n") >= first)).select("ts_ns", "loc", "tier",
                                                                              write_bytes="bytes"))
    parts.append(copies.filter(pl.col("ts_ns") < at))
    known = pl.col("end_ts").is_not_null() & (pl.col("end_ts") < at)
    # A store kept with its end known is counted now, at the read flag it is kept with: the next run
    # sums only what a read of it takes back (``_read_since``), not every such store again.
    parts.append(_closed(pre.filter(~pl.col("final") & known & ~counted)))
    parts.append(taken_back)
    if before is not None:
        parts.append(before.sums)
    sums = _summed(parts, window_ns)
    open_stores = pre.filter(~pl.col("final")).select(
        *_STORE_COLS, "read", ended=pl.when(known).then(pl.col("ended")),
        end_ts=pl.when(known).then(pl.col("end_ts")))
    if idle is not None and idle.height:
        open_stores = pl.concat([open_stores, idle.select(open_stores.columns)], how="vertical_relaxed")
    events = first + int(ev.filter(pl.col("ts_ns") < at).height)
    filled = bool(pre["filled"].any()) or (before is not None and before.filled)
    return FlowsState(at, events, window_ns, bytes_per_token, fill_tokens, filled, sums,
                      open_stores, early.filter(~final_read).select(_READ_COLS))


def flows(*, block_outcomes: pl.DataFrame, request_ledger: pl.DataFrame, kv_events: duckdb.DuckDBPyRelation,
          transfers: duckdb.DuckDBPyRelation, scenario: str, bytes_per_token: int,
          window_ns: int = DEFAULT_WINDOW_NS) -> pl.DataFrame:
    """Bytes read, written, copied and never read, per location, window and tier of ``scenario``.

    ``kv_events`` and ``transfers`` are the scenario's rows; the frames its ledger's.

    Columns: scenario, replica (a replica, or ``pool``), window_start_ns (ns), tier (a
    Medium value), read_bytes, write_bytes, replica_bytes (copied in from another location),
    never_read_bytes (written in the window, evicted or cleared unread), read_unwritten_bytes
    (reads of blocks with no store in the lake), unread_resident_bytes (written in the window,
    unread, still resident at the end). Sorted by replica, window, tier; only non-zero rows.
    """
    return flows_continued(block_outcomes=block_outcomes, request_ledger=request_ledger, kv_events=kv_events,
                           transfers=transfers, scenario=scenario, bytes_per_token=bytes_per_token,
                           window_ns=window_ns)[0]


def flows_continued(*, block_outcomes: pl.DataFrame, request_ledger: pl.DataFrame,
                    kv_events: duckdb.DuckDBPyRelation, transfers: duckdb.DuckDBPyRelation, scenario: str,
                    bytes_per_token: int, window_ns: int = DEFAULT_WINDOW_NS,
                    resume: FlowsState | None = None, checkpoint_ns: int | None = None,
                    requests: duckdb.DuckDBPyRelation | None = None,
                    events_unchanged_before: int | None = None,
                    loads_from: int | None = None) -> tuple[pl.DataFrame, FlowsState | None]:
    """``flows``, continued from ``resume`` (the state at the checkpoint the ledger continued from:
    the outcomes of the requests that look up before it are those it was saved with) when it
    agrees, and the state at ``checkpoint_ns`` (the ledger's new checkpoint) when given.
    ``requests``: the scenario's requests (the ledger's), so that a continued run reads only the
    loads of the requests it reads again rather than every transfer of the lake.
    ``events_unchanged_before``: a time before which ``kv_events`` holds the rows it held when
    ``resume`` was saved (analyzers/incremental.py, ``new_rows_from``): with the state's checkpoint
    at or before it, its count of events is not read again. ``loads_from``: a time from which the
    transfers of the requests that look up from ``resume``'s checkpoint on all lie (the continued
    ledger's, ``Ledger.loads_from``), so that only those are read."""
    if window_ns <= 0:
        raise ValueError(f"window_ns must be positive, got {window_ns}")
    typical_tokens = _fill_tokens(block_outcomes["tokens"].median() if block_outcomes.height else None)
    if resume is not None and not _agrees(resume, kv_events, window_ns, bytes_per_token, typical_tokens,
                                          events_unchanged_before):
        resume = None
    first, since = (resume.events, resume.checkpoint_ns) if resume is not None else (0, None)
    if since is not None:
        kv_events = kv_events.filter(duckdb.ColumnExpression("ts_ns") >= duckdb.ConstantExpression(since))
    ev = _events(kv_events, bytes_per_token, typical_tokens, first)
    outcomes = block_outcomes
    if since is not None:  # the reads of the requests the ledger replayed, and the open ones
        replayed = request_ledger.filter(since <= _LOOKUP)["request_id"]
        outcomes = block_outcomes.filter(pl.col("request_id").is_in(replayed.implode()))
    loads = transfers
    if since is not None and requests is not None:
        # a superset of the replayed requests (SQL rounds half away from zero: 1 ns of slack);
        # only their rows join the replayed outcomes
        again = requests.filter(f"{LOOKUP_SQL} >= {since - 1}").select("request_id")
        scope = transfers if loads_from is None else transfers.filter(
            f"ts_ns >= {int(loads_from)} OR ts_ns IS NULL")
        loads = scope.set_alias("rows").join(again.set_alias("ids"), "request_id", how="semi")
    new_reads = _reads(outcomes, request_ledger, loads)
    if since is not None:
        new_reads = new_reads.filter(pl.col("lookup_ns") >= since)
    reads = pl.concat([resume.reads, new_reads], how="vertical_relaxed") if resume is not None else new_reads
    carried, idle = _touched(resume.stores, ev, reads) if resume is not None else (None, None)
    stores, reads = _matched(ev, reads, carried)
    copies = _copies(transfers if since is None else transfers.filter(
        duckdb.ColumnExpression("ts_ns") >= duckdb.ConstantExpression(since)))
    taken_back = _read_since(stores)
    parts = [*_parts(reads, stores.filter(~pl.col("counted")), first), copies, taken_back]
    if resume is not None:
        parts.append(resume.sums)
    out = _rows(_summed(parts, window_ns), scenario)
    state = None
    if checkpoint_ns is not None and (since is None or checkpoint_ns >= since):
        state = _state_at(checkpoint_ns, first, ev, stores, reads, copies, resume, window_ns, bytes_per_token,
                          typical_tokens, idle, taken_back)
    return out, state


def flows_out_of_core(con: duckdb.DuckDBPyConnection, scenario: str, *, work: Path, partitions: int,
                      bytes_per_token: int, window_ns: int = DEFAULT_WINDOW_NS,
                      rows_per_partition: int = ROWS_PER_PARTITION) -> pl.DataFrame:
    """``flows``' rows of ``scenario`` computed one block-hash partition at a time (``kvlens analyze
    --out-of-core``, issue 17): the full analysis, with no ``FlowsState``.

    ``con``: the analysis DB being built, its ``block_outcomes`` and ``request_ledger`` holding the
    scenario's rows and the lake views open; ``work``: an empty directory for the spill files.

    Every contribution but the copies is decided within one block: a store's residency ends at the
    next event of its location, tier and block, or at a clear of its location; a read is matched to a
    store of its location, tier class and block; a hit's load is a transfer of its block. So the
    events (stored and removed), the hits (with their request's look-up) and the transfers are
    written to Parquet by ``hash(block_hash) mod K`` (the clears to a file every partition reads),
    and each partition runs the one-process code (``_events``, ``_reads``, ``_matched``, ``_parts``,
    ``_copies``) on its rows; the copies are summed with the transfers of the partition they fall
    in. K is ``partitions``, or more so that a partition holds about ``rows_per_partition`` rows.

    **Exact**: the sums are integers, so summing each partition's sums gives the one-process sums.
    The order the one-process code depends on is kept: events in stream order (time, then batch
    number, both NULL first, then the order a scan of the lake view reads them in, which a first
    copy of the scenario's rows, written in scan order, numbers), and transfers in scan order (a hit
    with several loads of its block takes the first). The look-ups join ``request_ledger`` by id,
    which out of core holds once per request. The size of an event without ``block_tokens`` is the
    median of ``block_outcomes.tokens``, as in memory.

    **Memory** in Python: one partition's events, hits, their requests' look-ups and transfers, with
    every clear of the scenario (O(rows / K + clears)), and the sums (O(locations x windows x tiers)).
    Measured on a generated fleet of 3M block accesses (2.9M events), cut into 3 partitions of about
    2M rows: 1.1 GB peak resident (DuckDB, at 1 GB, included), where the one-process ``flows`` took 2.4.
    On disk in ``work``: the scenario's events and transfers twice (once while they are partitioned),
    and its hits.
    """
    if window_ns <= 0:
        raise ValueError(f"window_ns must be positive, got {window_ns}")
    if partitions < 1 or rows_per_partition < 1:
        raise ValueError("partitions and rows per partition must be positive")
    with settings(con, preserve_insertion_order=True):  # the copies in scan order rely on it
        return _flows_partitioned(con, scenario, work, partitions, bytes_per_token, window_ns,
                                  rows_per_partition)


def _quoted(text: str | Path) -> str:
    return "'" + str(text).replace("'", "''") + "'"


def _flows_partitioned(con: duckdb.DuckDBPyConnection, scenario: str, work: Path, partitions: int,
                       bytes_per_token: int, window_ns: int, rows_per_partition: int) -> pl.DataFrame:
    name = _quoted(scenario)
    ((typical,),) = con.execute("SELECT median(tokens) FROM block_outcomes WHERE scenario = ?",
                                [scenario]).fetchall()
    typical_tokens = _fill_tokens(typical)  # (DuckDB's median of integers averages the middle two too)
    # The rows each partition reads, in scan order where the one-process code depends on it.
    events, transfers = work / "events.parquet", work / "transfers.parquet"
    con.execute(f"""COPY (SELECT ts_ns, seq, replica, CAST(kind AS VARCHAR) AS kind, block_hash,
                                 CAST(medium AS VARCHAR) AS medium, block_tokens
                          FROM kv_events WHERE scenario = {name}
                          AND (CAST(kind AS VARCHAR) = 'cleared' OR (block_hash IS NOT NULL
                               AND CAST(kind AS VARCHAR) IN ('stored', 'removed'))))
                    TO {_quoted(events)} (FORMAT parquet)""")
    con.execute(f"""COPY (SELECT ts_ns, request_id, block_hash, replica, origin,
                                 CAST(status AS VARCHAR) AS status, bytes
                          FROM transfers WHERE scenario = {name}) TO {_quoted(transfers)} (FORMAT parquet)""")
    is_hit = f"CAST(o.outcome AS VARCHAR) IN ({', '.join(_quoted(o) for o in HIT_OUTCOMES)})"
    hits = f"""SELECT o.request_id, o.replica, o.arrival_ns, o.position, o.block_hash,
                      CAST(o.outcome AS VARCHAR) AS outcome, o.bytes, r.request_id IS NOT NULL AS in_ledger,
                      r.arrival_ns AS ledger_arrival_ns, r.queue_ms AS ledger_queue_ms
               FROM block_outcomes o LEFT JOIN (SELECT request_id, arrival_ns, queue_ms FROM request_ledger
                                                WHERE scenario = {name}) r ON o.request_id = r.request_id
               WHERE o.scenario = {name} AND {is_hit}"""
    # (the join adds no rows: out of core holds one ledger row per request id)
    ((rows,),) = con.execute(f"""SELECT (SELECT count(*) FROM read_parquet({_quoted(events)}))
                                        + (SELECT count(*) FROM read_parquet({_quoted(transfers)}))
                                        + (SELECT count(*) FROM block_outcomes o
                                           WHERE o.scenario = {name} AND {is_hit})""").fetchall()
    k = max(partitions, math.ceil(int(rows) / rows_per_partition), 1)
    part = f"CAST(hash(CAST(block_hash AS UBIGINT)) % {k} AS BIGINT)"
    positioned = "* EXCLUDE (file_row_number), file_row_number AS _pos"
    con.execute(f"""COPY (SELECT {positioned}, CASE WHEN kind = 'cleared' THEN -1 ELSE {part} END AS p
                          FROM read_parquet({_quoted(events)}, file_row_number = true))
                    TO {_quoted(work / "events")} (FORMAT parquet, PARTITION_BY (p))""")
    # (a transfer without a block is only a copy: any partition sums it)
    con.execute(f"""COPY (SELECT {positioned}, CASE WHEN block_hash IS NULL THEN file_row_number % {k}
                                                ELSE {part} END AS p
                          FROM read_parquet({_quoted(transfers)}, file_row_number = true))
                    TO {_quoted(work / "transfers")} (FORMAT parquet, PARTITION_BY (p))""")
    con.execute(f"COPY (SELECT *, {part} AS p FROM ({hits})) TO {_quoted(work / 'hits')} "
                "(FORMAT parquet, PARTITION_BY (p))")
    # The copies in scan order are not read again: only their columns are kept (a partition of none).
    events, transfers = _emptied(con, events), _emptied(con, transfers)
    stream = "ts_ns NULLS FIRST, seq NULLS FIRST, _pos"
    clears = _files(work / "events", -1)
    total: pl.DataFrame | None = None
    for i in range(k):
        own, loads, hit_files = (_files(work / table, i) for table in ("events", "transfers", "hits"))
        if not (own or loads or hit_files) and (total is not None or i < k - 1):
            continue  # nothing of this partition (the last one runs when none did: the frame's columns)
        ev = _events(con.sql(f"SELECT * EXCLUDE (_pos) FROM {_source(own + clears, _none_of(events))} "
                             f"ORDER BY {stream}"), bytes_per_token, typical_tokens)
        xfer = con.sql(f"SELECT * EXCLUDE (_pos) FROM {_source(loads, _none_of(transfers))} ORDER BY _pos")
        hit = con.sql(f"SELECT * FROM {_source(hit_files, f'({hits} LIMIT 0)')}").pl()
        ledger = hit.filter(pl.col("in_ledger")).select(
            "request_id", arrival_ns="ledger_arrival_ns", queue_ms="ledger_queue_ms")
        reads = _reads(hit.drop("in_ledger", "ledger_arrival_ns", "ledger_queue_ms"), ledger, xfer)
        stores, reads = _matched(ev, reads, None)
        sums = _summed([*_parts(reads, stores), _copies(xfer)], window_ns)
        total = sums if total is None else _summed([total, sums], window_ns)
    assert total is not None
    return _rows(total, scenario)


def _files(root: Path, partition: int) -> list[str]:
    """The Parquet files of one partition a ``PARTITION_BY (p)`` copy wrote under ``root``."""
    return sorted(str(f) for f in (root / f"p={partition}").glob("*.parquet"))


def _emptied(con: duckdb.DuckDBPyConnection, path: Path) -> Path:
    """A file of ``path``'s columns and no rows, in place of ``path`` (removed: disk it no longer needs)."""
    empty = path.with_suffix(".empty.parquet")
    con.execute(f"COPY (SELECT * FROM read_parquet({_quoted(path)}) LIMIT 0) TO {_quoted(empty)} "
                "(FORMAT parquet)")
    path.unlink()
    return empty


def _none_of(path: Path) -> str:
    """No rows of the file ``path`` (``_emptied``): its columns, and the place ``_pos``."""
    return f"(SELECT *, CAST(NULL AS BIGINT) AS _pos FROM read_parquet({_quoted(path)}))"


def _source(files: list[str], empty: str) -> str:
    """A FROM clause reading ``files`` (no partition column), or ``empty`` when there are none."""
    if not files:
        return empty
    return f"read_parquet([{', '.join(_quoted(f) for f in files)}], hive_partitioning = false)"


def _touched(carried: pl.DataFrame, ev: pl.DataFrame,
             reads: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """A state's stores split: those this run's events and reads can change, and the rest. A kept
    store whose end is known is counted and the latest of its location, tier class and block (else
    it would have been settled): only a new store of its block can make it settled, only a read of
    its block can read it. So one whose block no new event and no read names stays as it is (most of
    them: a block evicted unread is seldom needed again), and is carried into the next state without
    being matched, sorted or summed."""
    named = pl.concat([ev["block_hash"], reads["block_hash"]]).drop_nulls().unique()
    # (the mask once, not once per side: the kept stores grow with the lake's age)
    idle = carried.select(pl.col("ended").is_not_null() & ~pl.col("block_hash").is_in(named.implode()))
    mask = idle.to_series()
    return carried.filter(~mask), carried.filter(mask)


def _agrees(st: FlowsState, kv_events: duckdb.DuckDBPyRelation, window_ns: int, bytes_per_token: int,
            fill_tokens: int, unchanged_before: int | None = None) -> bool:
    """Whether a run can continue from ``st``: the same window and bytes per token, the same size
    for events without block_tokens if the state used it, and as many events before its checkpoint."""
    if (st.window_ns, st.bytes_per_token) != (window_ns, bytes_per_token):
        return False
    if st.filled and st.fill_tokens != fill_tokens:
        return False
    if still_counted(unchanged_before, st.checkpoint_ns):
        return True  # the events before its checkpoint are those it counted
    ((before,),) = kv_events.filter(duckdb.ColumnExpression("ts_ns") < duckdb.ConstantExpression(
        st.checkpoint_ns)).aggregate("count(*)").fetchall()
    return int(before) == st.events
