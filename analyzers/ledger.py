"""Analyzers: the miss ledger: blocks, tokens and bytes per outcome per replica, from block outcomes."""

from __future__ import annotations

import duckdb
import polars as pl

__all__ = ["miss_ledger"]

MISS_LEDGER_SQL = """
SELECT b.scenario, coalesce(b.replica, '') AS replica, b.outcome,
       count(*) AS blocks, sum(b.tokens) AS tokens, sum(b.bytes) AS bytes,
       coalesce(bool_or(i.events_incomplete), false) AS events_incomplete
FROM block_outcomes b LEFT JOIN incomplete i USING (request_id)
GROUP BY ALL
ORDER BY scenario, replica, outcome
"""


def miss_ledger(*, block_outcomes: pl.DataFrame, incomplete: pl.DataFrame | None = None) -> pl.DataFrame:
    """Columns: scenario, replica ('' when unrouted), outcome, blocks, tokens, bytes, events_incomplete.

    ``incomplete``: request_id, events_incomplete (analyzers/gaps.py); a row is incomplete when
    any of its blocks belongs to such a request. Sorted by scenario, replica, outcome. A hit
    ratio from it is a ratio of sums.
    """
    if incomplete is None:
        incomplete = pl.DataFrame(schema={"request_id": pl.String, "events_incomplete": pl.Boolean})
    con = duckdb.connect()
    con.register("block_outcomes", block_outcomes)
    con.register("incomplete", incomplete.select("request_id", "events_incomplete"))
    return con.sql(MISS_LEDGER_SQL).pl()
