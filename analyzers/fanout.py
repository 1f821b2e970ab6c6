"""Analyzers: prefix fan-out: how many replicas needed, and pulled, the same block per time window.

A block hash is chained over its whole prefix, so one block stands for one prefix. Per window
(aligned to multiples of ``window_ns`` since the epoch, by request arrival): a block's
*fan-out* is the number of distinct replicas whose requests needed it; its *pull fan-out* is
the number of distinct replicas that loaded it remotely (``hit_remote``). ``duplicate_bytes``
is what a fleet without sharing computes or holds more than once: each needed block's bytes
times (fan-out - 1). The N of a pre-warm's ``N·W/Δt`` (DESIGN.md question 7) is a fan-out.
"""

from __future__ import annotations

import polars as pl

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


def fanout(*, block_outcomes: pl.DataFrame, window_ns: int = DEFAULT_WINDOW_NS) -> pl.DataFrame:
    """Per scenario and window, how widely the same prefixes spread over replicas.

    Columns: scenario, window_start_ns (ns), needed_blocks (distinct blocks needed),
    shared_blocks (needed by two replicas or more), fanout_max_replicas, fanout_mean_replicas
    (over needed blocks), duplicate_bytes (bytes x (fan-out - 1), summed), pulled_bytes
    (hit_remote bytes), pulled_max_replicas (most replicas that loaded one block remotely),
    top_block_hash (the block with the largest fan-out; ties: smallest position, then hash).
    Sorted by scenario, window.
    """
    if window_ns <= 0:
        raise ValueError(f"window_ns must be positive, got {window_ns}")
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
