"""Analyzers: the miss ledger: blocks, tokens and bytes per outcome per replica, from block outcomes."""

from __future__ import annotations

import duckdb
import polars as pl

__all__ = ["miss_ledger"]

MISS_LEDGER_SQL = """
SELECT scenario, coalesce(replica, '') AS replica, outcome,
       count(*) AS blocks, sum(tokens) AS tokens, sum(bytes) AS bytes
FROM block_outcomes
GROUP BY ALL
ORDER BY scenario, replica, outcome
"""


def miss_ledger(*, block_outcomes: pl.DataFrame) -> pl.DataFrame:
    """Columns: scenario, replica ('' when unrouted), outcome, blocks, tokens, bytes.

    Sorted by scenario, replica, outcome. A hit ratio from it is a ratio of sums.
    """
    con = duckdb.connect()
    con.register("block_outcomes", block_outcomes)
    return con.sql(MISS_LEDGER_SQL).pl()
