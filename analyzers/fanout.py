"""Analyzers: prefix fan-out: how many replicas needed, and pulled, the same block per time window.

A block hash is chained over its whole prefix, so one block stands for one prefix. Per window
(aligned to multiples of ``window_ns`` since the epoch, by request arrival): a block's
*fan-out* is the number of distinct replicas whose requests needed it; its *pull fan-out* is
the number of distinct replicas that loaded it remotely (``hit_remote``). ``duplicate_bytes``
is what a fleet without sharing computes or holds more than once: each needed block's bytes
times (fan-out - 1). The N of a pre-warm's ``N·W/Δt`` (DESIGN.md question 7) is a fan-out.
"""

from __future__ import annotations

import duckdb
import polars as pl

from kvlens.analyzers.scans import grouped
from kvlens.schema import Outcome

__all__ = ["fanout", "fanout_since"]

DEFAULT_WINDOW_NS = 15 * 60 * 1_000_000_000


def fanout_since(appended: pl.DataFrame, window_ns: int = DEFAULT_WINDOW_NS) -> int | None:
    """The first window a continued ledger changed: that of the earliest arrival among its new and
    replayed rows (``appended``). Each window's row reads only the ledger rows that arrived in it,
    and every row before this window is one the previous ledger had: the previous analysis' rows
    for the earlier windows stand, and ``fanout`` of the rows from this window on gives the rest.
    None when nothing changed (every previous row stands)."""
    arrivals = appended["arrival_ns"].drop_nulls()
    if arrivals.is_empty():
        return None
    return (int(arrivals.cast(pl.Int64).to_numpy().min()) // window_ns) * window_ns


def fanout(*, block_outcomes: pl.DataFrame | duckdb.DuckDBPyRelation,
           window_ns: int = DEFAULT_WINDOW_NS) -> pl.DataFrame:
    """Per scenario and window, how widely the same prefixes spread over replicas.

    Columns: scenario, window_start_ns (ns), needed_blocks (distinct blocks needed),
    shared_blocks (needed by two replicas or more), fanout_max_replicas, fanout_mean_replicas
    (over needed blocks), duplicate_bytes (bytes x (fan-out - 1), summed), pulled_bytes
    (hit_remote bytes), pulled_max_replicas (most replicas that loaded one block remotely),
    top_block_hash (the block with the largest fan-out; ties: smallest position, then hash).
    Sorted by scenario, window.

    ``block_outcomes`` is a frame, or a relation of one scenario's rows (out of core, ``kvlens
    analyze --out-of-core``): then DuckDB groups them, spilling past its memory limit, and only the
    windows' sums come back (``_windows``); the figures are those the frame gives.
    """
    if window_ns <= 0:
        raise ValueError(f"window_ns must be positive, got {window_ns}")
    if isinstance(block_outcomes, duckdb.DuckDBPyRelation):
        return _windows(block_outcomes, window_ns)
    remote = pl.col("outcome").cast(pl.Utf8) == Outcome.HIT_REMOTE.value
    per_block = (block_outcomes
                 .with_columns(window_start_ns=(pl.col("arrival_ns") // window_ns) * window_ns,
                               replica=pl.col("replica").cast(pl.Utf8).fill_null(""))
                 .group_by("scenario", "window_start_ns", "block_hash")
                 .agg(replicas=pl.col("replica").n_unique(), bytes=pl.col("bytes").max(),
                      position=pl.col("position").min(),
                      pulled=pl.col("replica").filter(remote).n_unique(),
                      pulled_bytes=pl.col("bytes").filter(remote).sum()))
    top = pl.col("block_hash").sort_by(["replicas", "position", "block_hash"],
                                       descending=[True, False, False]).first()
    return (per_block.group_by("scenario", "window_start_ns")
            .agg(needed_blocks=pl.len().cast(pl.Int64),
                 shared_blocks=(pl.col("replicas") >= 2).sum().cast(pl.Int64),
                 fanout_max_replicas=pl.col("replicas").max().cast(pl.Int64),
                 fanout_mean_replicas=pl.col("replicas").mean(),
                 duplicate_bytes=((pl.col("replicas") - 1) * pl.col("bytes")).sum().cast(pl.Int64),
                 pulled_bytes=pl.col("pulled_bytes").sum().cast(pl.Int64),
                 pulled_max_replicas=pl.col("pulled").max().cast(pl.Int64),
                 top_block_hash=top)
            .sort("scenario", "window_start_ns"))


# One scenario's windows in DuckDB: per (window, block) as ``fanout``'s frame groups them, then per
# window the counts and sums ``fanout`` aggregates; the mean is their quotient (a sum of integers is
# exact in any order, so the quotient is the frame's mean). A window starts at the floor multiple of
# ``w`` (DuckDB's ``//`` truncates toward zero; polars' floors). The top block is the largest
# fan-out, then the smallest position, then the smallest hash (``~`` reverses a hash's order).
_WINDOWS_SQL = """
WITH per_block AS (
    SELECT scenario, arrival_ns - ((arrival_ns % {w}) + {w}) % {w} AS window_start_ns, block_hash,
           count(DISTINCT coalesce(replica, '')) AS replicas, max(bytes) AS bytes, min(position) AS position,
           count(DISTINCT coalesce(replica, '')) FILTER (WHERE outcome = '{remote}') AS pulled,
           coalesce(sum(bytes) FILTER (WHERE outcome = '{remote}'), 0) AS pulled_bytes
    FROM outcomes GROUP BY scenario, window_start_ns, block_hash)
SELECT scenario, window_start_ns, count(*) AS needed_blocks,
       count(*) FILTER (WHERE replicas >= 2) AS shared_blocks,
       max(replicas) AS fanout_max_replicas, sum(replicas) AS replicas_summed,
       sum((replicas - 1) * bytes) AS duplicate_bytes, sum(pulled_bytes) AS pulled_bytes,
       max(pulled) AS pulled_max_replicas,
       arg_max(block_hash, struct_pack(r := replicas, p := -position, h := (~block_hash))) AS top_block_hash
FROM per_block GROUP BY scenario, window_start_ns
"""


def _windows(block_outcomes: duckdb.DuckDBPyRelation, window_ns: int) -> pl.DataFrame:
    """``fanout`` of a relation of block outcomes, grouped in DuckDB."""
    sql = _WINDOWS_SQL.format(w=int(window_ns), remote=Outcome.HIT_REMOTE.value)
    sums = grouped(block_outcomes, sql)
    ints = ["window_start_ns", "needed_blocks", "shared_blocks", "fanout_max_replicas", "duplicate_bytes",
            "pulled_bytes", "pulled_max_replicas"]
    return (sums.with_columns(pl.col(c).cast(pl.Int64) for c in ints)
            .select(pl.col("scenario").cast(pl.Utf8), "window_start_ns", "needed_blocks",
                    "shared_blocks", "fanout_max_replicas",
                    (pl.col("replicas_summed").cast(pl.Float64) / pl.col("needed_blocks")).alias(
                        "fanout_mean_replicas"),
                    "duplicate_bytes", "pulled_bytes", "pulled_max_replicas",
                    pl.col("top_block_hash").cast(pl.UInt64))
            .sort("scenario", "window_start_ns"))
