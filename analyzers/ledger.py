"""Analyzers: the miss ledger: blocks, tokens and bytes per outcome per replica, from block outcomes."""

from __future__ import annotations

import polars as pl

from kvlens.analyzers.request_ledger import SUM_DTYPE

__all__ = ["miss_ledger"]

_KEYS = ["scenario", "replica", "outcome"]


def miss_ledger(*, block_outcomes: pl.DataFrame, incomplete: pl.DataFrame | None = None) -> pl.DataFrame:
    """Columns: scenario, replica ('' when unrouted), outcome, blocks, tokens, bytes, events_incomplete.

    ``incomplete``: request_id, events_incomplete (analyzers/gaps.py); a row is incomplete when
    any of its blocks belongs to such a request. Sorted by scenario, replica, outcome. A hit
    ratio from it is a ratio of sums.
    """
    if incomplete is None:
        incomplete = pl.DataFrame(schema={"request_id": pl.String, "events_incomplete": pl.Boolean})
    flags = incomplete.select("request_id", "events_incomplete")
    rows = block_outcomes.with_columns(pl.col("replica").cast(pl.Utf8).fill_null(""))
    # Most ledgers have no incomplete request: then no block is, and no join by request id is needed.
    rows = (rows.join(flags, on="request_id", how="left") if flags["events_incomplete"].any()
            else rows.with_columns(events_incomplete=pl.lit(False)))
    return (rows.group_by(_KEYS)
            .agg(blocks=pl.len().cast(pl.Int64), tokens=pl.col("tokens").cast(SUM_DTYPE).sum(),
                 bytes=pl.col("bytes").cast(SUM_DTYPE).sum(),
                 events_incomplete=pl.col("events_incomplete").any())
            .sort(_KEYS, nulls_last=True))
