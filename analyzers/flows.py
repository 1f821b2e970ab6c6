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
"""

from __future__ import annotations

from typing import Literal

import duckdb
import polars as pl

from kvlens.schema import HIT_OUTCOMES, Medium, Outcome

__all__ = ["flows"]

DEFAULT_WINDOW_NS = 15 * 60 * 1_000_000_000
_LOWER = [Medium.CPU.value, Medium.DISK.value]
# An origin naming one of these is a tier of the receiving replica; `pool` is the shared pool.
_LOCAL_TIERS = [m.value for m in Medium if m != Medium.POOL]
_SUMS = ["read_bytes", "write_bytes", "replica_bytes", "never_read_bytes", "read_unwritten_bytes",
         "unread_resident_bytes"]
_KEY = ["loc", "cls", "block_hash"]


def _asof(left: pl.DataFrame, right: pl.DataFrame, on: tuple[str, str], by: str | list[str],
          strategy: Literal["backward", "forward"]) -> pl.DataFrame:
    # The callers sort both sides on the join key; polars cannot check that within groups.
    return left.join_asof(right, left_on=on[0], right_on=on[1], by=by, strategy=strategy,
                          check_sortedness=False)


def _cls(medium: pl.Expr) -> pl.Expr:
    """Tier class as the replay sees it: 1 for cpu/disk, 0 for every other medium."""
    return pl.when(medium.is_in(_LOWER)).then(1).otherwise(0).cast(pl.Int8)


def _events(kv_events: duckdb.DuckDBPyRelation, bytes_per_token: int, block_tokens: int) -> pl.DataFrame:
    ev = kv_events.select("ts_ns", "seq", "replica", "kind", "block_hash", "medium", "block_tokens").pl()
    ev = ev.with_row_index("ord").sort("ts_ns", "seq", "ord").with_row_index("n")
    medium = pl.col("medium").cast(pl.Utf8)
    nbytes = pl.col("block_tokens").fill_null(block_tokens).cast(pl.Int64) * bytes_per_token
    return ev.select(
        "n", "ts_ns", loc=pl.col("replica").cast(pl.Utf8).fill_null(""), kind=pl.col("kind").cast(pl.Utf8),
        block_hash=pl.col("block_hash").cast(pl.UInt64), medium=medium,
        tier=medium.fill_null(Medium.UNKNOWN.value), cls=_cls(medium), bytes=nbytes)


def _residencies(ev: pl.DataFrame) -> pl.DataFrame:
    """Every store with how its residency ended: 'removed', 'cleared', 'restored' or None."""
    key = ["loc", "tier", "block_hash"]
    blocks = ev.filter(pl.col("kind").is_in(["stored", "removed"]) & pl.col("block_hash").is_not_null())
    same = pl.all_horizontal(pl.col(k) == pl.col(k).shift(-1) for k in key)
    blocks = blocks.sort(*key, "n").with_columns(next_n=pl.when(same).then(pl.col("n").shift(-1)),
                                                 next_kind=pl.when(same).then(pl.col("kind").shift(-1)))
    stores = blocks.filter(pl.col("kind") == "stored")
    clears = ev.filter(pl.col("kind") == "cleared").select("loc", "medium", clear_n="n").sort("clear_n")
    # A clear without a medium clears every tier of its location.
    every = clears.filter(pl.col("medium").is_null()).drop("medium")
    one = clears.filter(pl.col("medium").is_not_null()).rename({"medium": "tier", "clear_n": "clear1_n"})
    stores = _asof(stores.sort("n"), every, ("n", "clear_n"), "loc", "forward")
    stores = _asof(stores, one, ("n", "clear1_n"), ["loc", "tier"], "forward")
    clear_n = pl.min_horizontal("clear_n", "clear1_n")
    ended = (pl.when(clear_n.is_not_null() & (pl.col("next_n").is_null() | (clear_n < pl.col("next_n"))))
             .then(pl.lit("cleared"))
             .when(pl.col("next_kind") == "removed").then(pl.lit("removed"))
             .when(pl.col("next_kind") == "stored").then(pl.lit("restored")))
    return stores.select("n", "ts_ns", "loc", "tier", "cls", "block_hash", "bytes", ended=ended)


def _loads(transfers: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    xfer = transfers.select("request_id", "block_hash", "replica", "origin", "status").pl()
    return (xfer.filter((pl.col("status").cast(pl.Utf8) == "ok") & pl.col("block_hash").is_not_null())
            .select("request_id", block_hash=pl.col("block_hash").cast(pl.UInt64),
                    receiver=pl.col("replica").cast(pl.Utf8), origin=pl.col("origin").cast(pl.Utf8)))


def _reads(block_outcomes: pl.DataFrame, request_ledger: pl.DataFrame,
           transfers: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    queue_ns = (pl.col("queue_ms").fill_null(0) * 1e6).round().cast(pl.Int64)
    lookup = request_ledger.select("request_id", lookup_ns=pl.col("arrival_ns") + queue_ns)
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
    right = stores.select(*_KEY, store_ts=pl.col("ts_ns"), store_n="n", store_tier="tier").sort("store_ts")
    reads = reads.sort("lookup_ns")
    back = _asof(reads, right, ("lookup_ns", "store_ts"), _KEY, "backward")
    fwd = _asof(reads, right, ("lookup_ns", "store_ts"), _KEY, "forward")
    tier = pl.col("store_tier").fill_null(fwd["store_tier"]).fill_null(pl.col("default_tier"))
    return back.with_columns(store_n=pl.col("store_n").fill_null(fwd["store_n"]), tier=tier)


def _copies(transfers: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    x = transfers.select("ts_ns", "replica", "origin", "status", "bytes").pl()
    own_tier = pl.col("origin").cast(pl.Utf8).is_in(_LOCAL_TIERS)
    x = x.filter((pl.col("status").cast(pl.Utf8) == "ok") & ~own_tier)
    loc = pl.col("replica").cast(pl.Utf8).fill_null("")
    pool, gpu = pl.lit(Medium.POOL.value), pl.lit(Medium.GPU.value)
    tier = pl.when(loc == Medium.POOL.value).then(pool).otherwise(gpu)
    return x.select("ts_ns", loc=loc, tier=tier, replica_bytes=pl.col("bytes").fill_null(0).cast(pl.Int64))


def _parts(reads: pl.DataFrame, stores: pl.DataFrame) -> list[pl.DataFrame]:
    unread = ~pl.col("read")
    evicted = unread & pl.col("ended").is_in(["removed", "cleared"])
    return [
        reads.select(ts_ns="lookup_ns", loc="loc", tier="tier", read_bytes="bytes",
                     read_unwritten_bytes=pl.when(pl.col("store_n").is_null())
                     .then(pl.col("bytes")).otherwise(0)),
        stores.select("ts_ns", "loc", "tier", write_bytes="bytes",
                      never_read_bytes=pl.when(evicted).then(pl.col("bytes")).otherwise(0),
                      unread_resident_bytes=pl.when(unread & pl.col("ended").is_null())
                      .then(pl.col("bytes")).otherwise(0)),
    ]


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
    if window_ns <= 0:
        raise ValueError(f"window_ns must be positive, got {window_ns}")
    typical = block_outcomes["tokens"].median() if block_outcomes.height else None
    typical_tokens = int(typical) if isinstance(typical, int | float) else 16
    stores = _residencies(_events(kv_events, bytes_per_token, typical_tokens))
    reads = _match(_reads(block_outcomes, request_ledger, transfers), stores)
    stores = stores.with_columns(read=pl.col("n").is_in(reads["store_n"].drop_nulls().unique().implode()))
    frame = pl.concat([*_parts(reads, stores), _copies(transfers)], how="diagonal_relaxed")
    frame = frame.with_columns([pl.col(c).fill_null(0).cast(pl.Int64) for c in _SUMS])
    window = (pl.col("ts_ns") // window_ns) * window_ns
    out = (frame.group_by(replica="loc", window_start_ns=window, tier="tier")
           .agg([pl.col(c).sum() for c in _SUMS])
           .filter(pl.sum_horizontal(_SUMS) > 0))
    return (out.select(pl.lit(scenario).alias("scenario"), "replica", "window_start_ns", "tier", *_SUMS)
            .sort("replica", "window_start_ns", "tier"))
