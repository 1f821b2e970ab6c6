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

from collections.abc import Sequence

import duckdb
import numpy as np
import polars as pl

from kvlens.analyzers.admission import admission_cuts
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
    replay_core,
)
from kvlens.schema import Medium

__all__ = ["POOL_LOCATION", "block_outcomes"]

# Replay tiers: 0 the GPU (and the pool's one tier, and an unknown medium), 1 CPU, 2 disk.
_TIER_CODES = {Medium.CPU.value: 1, Medium.DISK.value: 2}
_ORIGINS = {SRC_GPU: Medium.GPU.value, SRC_CPU: Medium.CPU.value, SRC_DISK: Medium.DISK.value,
            SRC_POOL: Medium.POOL.value}
_KIND_CODES = {"stored": 0, "removed": 1, "cleared": 2}
# The shared pool's location name (the simulator's pool replica, and where pool-medium events go).
POOL_LOCATION = Medium.POOL.value
# vLLM's KVCacheSpecKind values with a sliding window (vllm/v1/kv_cache_interface.py).
_SLIDING_KINDS = ("sliding_window", "sliding_window_mla")


def _u64_as_i64(series: pl.Series) -> np.ndarray:
    return series.fill_null(0).cast(pl.UInt64).to_numpy().view(np.int64)


class _Codes:
    """Dense integer codes for names (replicas, namespaces); -1 for NULL when asked."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}

    def encode(self, values: pl.Series, *, null: int | None = None) -> np.ndarray:
        names = values.cast(pl.Utf8)
        if null is None:
            names = names.fill_null("")
        for name in names.drop_nulls().unique(maintain_order=True).to_list():
            if name not in self.index:
                self.index[name] = len(self.names)
                self.names.append(name)
        return names.replace_strict(self.index, default=null, return_dtype=pl.Int32).to_numpy()

    def decode(self, codes: np.ndarray) -> list[str | None]:
        return [self.names[c] if c >= 0 else None for c in codes.tolist()]


def _events(kv_events: duckdb.DuckDBPyRelation, locs: _Codes,
            spaces: _Codes) -> tuple[dict[str, np.ndarray], pl.DataFrame]:
    """The replay core's event arrays, and each location's KV cache groups (location code,
    group_idx, group code, sliding window tokens or 0)."""
    ev = kv_events.select("ts_ns", "seq", "replica", "kind", "block_hash", "parent_hash", "medium",
                          "content_hash", "namespace", "group_idx", "spec_kind", "sliding_window_tokens",
                          "remaining_copies").pl()
    ev = ev.filter(pl.col("kind").cast(pl.Utf8).is_in(list(_KIND_CODES)))  # inactive changes no residency
    # Stable: events with equal time and sequence keep the order the collector wrote them in.
    order = np.lexsort((ev["seq"].fill_null(0).to_numpy(), ev["ts_ns"].fill_null(0).to_numpy()))
    ev = ev[order]
    medium = ev["medium"].cast(pl.Utf8)
    tier = medium.replace_strict(_TIER_CODES, default=0, return_dtype=pl.Int8).fill_null(0).to_numpy().copy()
    kind = ev["kind"].cast(pl.Utf8).replace_strict(_KIND_CODES, return_dtype=pl.Int8).to_numpy()
    tier[(kind == 2) & medium.is_null().to_numpy()] = -1  # a clear without a medium clears all
    pooled = (medium == Medium.POOL.value).fill_null(False)
    loc = locs.encode(ev.select(pl.when(pooled).then(pl.lit(POOL_LOCATION)).otherwise(ev["replica"]))
                      .to_series())
    ev = ev.with_columns(loc=pl.Series(loc, dtype=pl.Int32), group_idx=pl.col("group_idx").fill_null(0))
    codes = {g: c for c, g in enumerate(sorted(set(ev["group_idx"].to_list()) or {0}))}
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
    }, _groups(ev, codes)


def _groups(ev: pl.DataFrame, codes: dict[int, int]) -> pl.DataFrame:
    """Per location and group: its code and the sliding window it published (0: full attention)."""
    sliding = pl.col("spec_kind").is_in(_SLIDING_KINDS) & (pl.col("sliding_window_tokens") > 0)
    return (ev.group_by("loc", "group_idx")
            .agg(pl.col("spec_kind").cast(pl.Utf8).drop_nulls().first(),
                 pl.col("sliding_window_tokens").drop_nulls().first())
            .with_columns(code=pl.col("group_idx").replace_strict(codes, return_dtype=pl.Int32),
                          window=pl.when(sliding).then(pl.col("sliding_window_tokens")).otherwise(0)
                          .cast(pl.Int64))
            .sort("loc", "group_idx"))


def _windows(groups: pl.DataFrame, n_locs: int, n_groups: int) -> np.ndarray:
    windows = np.zeros((n_locs, n_groups), np.int64)
    for loc, code, window in groups.select("loc", "code", "window").iter_rows():
        windows[loc, code] = window
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
    return req, full


def _admitted(ev: dict[str, np.ndarray], req: pl.DataFrame, full: pl.DataFrame,
              locs: _Codes) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Requests and blocks with each look-up's place in the event stream (``cut``), in that order."""
    hashed = full.with_columns(block_hash_i64=pl.Series(_u64_as_i64(full["block_hash"]), dtype=pl.Int64))
    cuts = admission_cuts(ev, req, hashed, locs.encode(req["replica"]), locs.index.get(POOL_LOCATION, -1))
    req = (req.with_columns(cut=pl.Series(cuts, dtype=pl.Int64))
           .sort("cut", "lookup_ns", "arrival_ns", "request_id"))
    full = (full.join(req.select("request_id", "cut"), on="request_id")
            .sort("cut", "lookup_ns", "arrival_ns", "request_id", "position")
            .with_columns(reusable=~pl.col("block_hash").is_first_distinct()))
    return req, full


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
    req, full = _needed(requests, request_blocks, transfers)
    locs, spaces = _Codes(), _Codes()
    ev, groups = _events(kv_events, locs, spaces)
    req, full = _admitted(ev, req, full, locs)
    req_loc = locs.encode(req["replica"])
    blk_ns = spaces.encode(full["namespace"], null=-1)
    group_idx = sorted(set(groups["group_idx"].to_list())) or [0]
    pool_loc = locs.index.get(POOL_LOCATION, -1)
    n_locs = max(len(locs.names), 1)
    counts = full.group_by("request_id", maintain_order=True).len()
    per_req = (req.join(counts, on="request_id", how="left", maintain_order="left")["len"]
               .fill_null(0).to_numpy())
    req_off = np.concatenate([[0], np.cumsum(per_req)]).astype(np.int64)
    # The core compares look-up times with event times: handing it stream places for both
    # makes each look-up see exactly the events before its admission (analyzers/admission.py).
    places = np.arange(ev["ev_ts"].shape[0], dtype=np.int64)
    out, holder, rem_place, rem_loc, other_ns, cut, groups_served, source = replay_core(
        places, ev["ev_kind"], ev["ev_loc"], ev["ev_tier"], ev["ev_grp"], ev["ev_h"], ev["ev_c"],
        ev["ev_ns"], ev["ev_left"], req["cut"].to_numpy().astype(np.int64), req_loc,
        req["tail"].to_numpy().astype(np.bool_), req["block_size"].to_numpy().astype(np.int64), req_off,
        _u64_as_i64(full["block_hash"]), _u64_as_i64(full["content_hash"]), blk_ns,
        full["xfer"].to_numpy().astype(np.int8), n_locs, pool_loc, _windows(groups, n_locs, len(group_idx)))
    rem_ts = np.where(rem_place >= 0, ev["ev_ts"][np.maximum(rem_place, 0)], -1) if len(places) else rem_place
    outcome_names = [o.value for o in OUTCOME_CODES]
    return pl.DataFrame({
        "scenario": [scenario] * len(full),
        "request_id": full["request_id"],
        "replica": full["replica"],
        "arrival_ns": full["arrival_ns"],
        "position": full["position"],
        "block_hash": full["block_hash"],
        "outcome": [outcome_names[c] for c in out.tolist()],
        "tokens": full["block_tokens"],
        "bytes": _bytes(full["block_tokens"], groups_served, group_idx, bytes_per_token,
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
