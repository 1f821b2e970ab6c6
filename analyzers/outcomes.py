"""Analyzers: the miss ledger's rows: one outcome per needed full block of every request.

Reads ``requests``, ``request_blocks``, ``kv_events`` and ``transfers`` of one scenario,
replays the cache state (analyzers/replay.py) and labels each full block with DESIGN.md's
outcome. The look-up time of a request is its arrival plus its queue time when known: the
moment the engine consults its prefix cache. Partial tails are not needed blocks: they are
``tail_partial`` tokens (analyzers/request_ledger.py), never a hit or a miss.
"""

from __future__ import annotations

import duckdb
import numpy as np
import polars as pl

from analyzers.replay import OUTCOME_CODES, XFER_FAILED, XFER_NONE, XFER_OK, replay_core
from kvlens.schema import Medium

__all__ = ["block_outcomes"]

_LOWER_TIERS = {Medium.CPU.value, Medium.DISK.value}
_KIND_CODES = {"stored": 0, "removed": 1, "cleared": 2}


def _scenario(rel: duckdb.DuckDBPyRelation, scenario: str, *cols: str) -> pl.DataFrame:
    cond = duckdb.ColumnExpression("scenario") == duckdb.ConstantExpression(scenario)
    return rel.filter(cond).select(*cols).pl()


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


def _events(kv_events: duckdb.DuckDBPyRelation, scenario: str, locs: _Codes,
            spaces: _Codes) -> dict[str, np.ndarray]:
    ev = _scenario(kv_events, scenario, "ts_ns", "seq", "replica", "kind", "block_hash", "medium",
                   "content_hash", "namespace")
    # Stable: events with equal time and sequence keep the order the collector wrote them in.
    order = np.lexsort((ev["seq"].fill_null(0).to_numpy(), ev["ts_ns"].fill_null(0).to_numpy()))
    ev = ev[order]
    medium = ev["medium"].cast(pl.Utf8)
    tier = np.where(medium.is_in(list(_LOWER_TIERS)).to_numpy(), 1, 0).astype(np.int8)
    kind = ev["kind"].cast(pl.Utf8).replace_strict(_KIND_CODES, return_dtype=pl.Int8).to_numpy()
    tier[(kind == 2) & medium.is_null().to_numpy()] = -1  # a clear without a medium clears all
    return {
        "ev_ts": ev["ts_ns"].fill_null(0).to_numpy().astype(np.int64),
        "ev_kind": kind.astype(np.int8),
        "ev_loc": locs.encode(ev["replica"]),
        "ev_tier": tier,
        "ev_h": _u64_as_i64(ev["block_hash"]),
        "ev_c": _u64_as_i64(ev["content_hash"]),
        "ev_ns": spaces.encode(ev["namespace"], null=-1),
    }


def _needed(requests: duckdb.DuckDBPyRelation, request_blocks: duckdb.DuckDBPyRelation,
            transfers: duckdb.DuckDBPyRelation, scenario: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    req = _scenario(requests, scenario, "request_id", "arrival_ns", "queue_ms", "replica", "prompt_tokens")
    req = req.unique("request_id", keep="first").with_columns(
        lookup_ns=pl.col("arrival_ns") + (pl.col("queue_ms").fill_null(0) * 1e6).round().cast(pl.Int64))
    blocks = _scenario(request_blocks, scenario, "request_id", "position", "block_hash", "content_hash",
                       "block_tokens", "block_size_tokens", "namespace")
    full = blocks.filter(pl.col("block_tokens") >= pl.col("block_size_tokens"))
    covered = full.group_by("request_id").agg(full_tokens=pl.col("block_tokens").sum())
    req = (req.join(covered, on="request_id", how="left")
           .with_columns(pl.col("full_tokens").fill_null(0))
           .with_columns(tail=pl.col("prompt_tokens").fill_null(pl.col("full_tokens"))
                         > pl.col("full_tokens"))
           .sort("lookup_ns", "arrival_ns", "request_id"))
    # A load is a transfer the serving replica received for this request and block; a store
    # into the pool (received by the pool) is not.
    xfer = (_scenario(transfers, scenario, "request_id", "block_hash", "status", "replica")
            .rename({"replica": "receiver"})
            .join(req.select("request_id", "replica"), on="request_id")
            .filter(pl.col("block_hash").is_not_null()
                    & (pl.col("receiver").is_null() | (pl.col("receiver") == pl.col("replica"))))
            .group_by("request_id", "block_hash").agg(ok=(pl.col("status").cast(pl.Utf8) == "ok").any()))
    full = (full.join(req.select("request_id", "lookup_ns", "arrival_ns", "replica"), on="request_id")
            .join(xfer, on=["request_id", "block_hash"], how="left")
            .with_columns(xfer=pl.when(pl.col("ok").is_null()).then(XFER_NONE)
                          .when(pl.col("ok")).then(XFER_OK).otherwise(XFER_FAILED))
            .sort("lookup_ns", "arrival_ns", "request_id", "position"))
    return req, full


def block_outcomes(
    *,
    requests: duckdb.DuckDBPyRelation,
    request_blocks: duckdb.DuckDBPyRelation,
    kv_events: duckdb.DuckDBPyRelation,
    transfers: duckdb.DuckDBPyRelation,
    scenario: str,
    bytes_per_token: int,
) -> pl.DataFrame:
    """One row per needed full block per request of ``scenario``.

    Columns: scenario, request_id, replica, arrival_ns, position, block_hash, outcome (a
    kvlens.schema.Outcome value), tokens, bytes (tokens x ``bytes_per_token``), holder (for
    miss_routing: a location holding it), removed_ns and remover (for miss_evicted: the last
    removal before the look-up and where), key_diff (for miss_incompatible: the namespace
    the same content was stored under). Sorted by look-up time, request, position.
    """
    req, full = _needed(requests, request_blocks, transfers, scenario)
    locs, spaces = _Codes(), _Codes()
    req_loc = locs.encode(req["replica"])
    blk_ns = spaces.encode(full["namespace"], null=-1)
    ev = _events(kv_events, scenario, locs, spaces)
    counts = full.group_by("request_id", maintain_order=True).len()
    per_req = (req.join(counts, on="request_id", how="left", maintain_order="left")["len"]
               .fill_null(0).to_numpy())
    req_off = np.concatenate([[0], np.cumsum(per_req)]).astype(np.int64)
    out, holder, rem_ts, rem_loc, other_ns = replay_core(
        ev["ev_ts"], ev["ev_kind"], ev["ev_loc"], ev["ev_tier"], ev["ev_h"], ev["ev_c"], ev["ev_ns"],
        req["lookup_ns"].to_numpy().astype(np.int64), req_loc, req["tail"].to_numpy().astype(np.bool_),
        req_off, _u64_as_i64(full["block_hash"]), _u64_as_i64(full["content_hash"]), blk_ns,
        full["xfer"].to_numpy().astype(np.int8), max(len(locs.names), 1))
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
        "bytes": full["block_tokens"].cast(pl.Int64) * bytes_per_token,
        "holder": locs.decode(holder),
        "removed_ns": pl.Series(rem_ts, dtype=pl.Int64).replace(-1, None),
        "remover": locs.decode(rem_loc),
        "key_diff": spaces.decode(other_ns),
    })
