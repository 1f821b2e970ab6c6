"""Analyzers: prompt hygiene: requests whose chains split early before content that repeats.

A prefix cache reuses a block only when every earlier block of the prompt matches too, so a
timestamp or request id placed before a stable system prompt makes the whole prompt a miss.
This module finds such requests from ``request_blocks`` of one scenario:

- the **split position** ``s`` of a request is its first full block whose chained
  ``content_hash`` no earlier request (by arrival) had: the prompt diverged there;
- a later block ``p > s`` **repeats** when an earlier request that shared the same chain up to
  ``s - 1`` had the same token content (``token_hash``, not chained) at every position
  ``s + 1 .. p``: moving the dynamic block ``s`` to the end would have made ``s + 1 .. p`` a
  shared prefix, so those tokens are lost to prompt layout;
- requests losing the same content after the same split form one **offender group**, named by
  the first request that carried the content; groups are ranked by the tokens they lose.

The estimate is block-granular: moving a few dynamic tokens shifts block boundaries, which
a block hash cannot see. Only full blocks with both hashes (token ids known at collection,
e.g. gateway logs with ``token_ids``) take part; without them the frame is empty.
"""

from __future__ import annotations

import duckdb
import numpy as np
import polars as pl

__all__ = ["hygiene"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)

_SCHEMA: dict[str, type[pl.DataType] | pl.DataType] = {
    "scenario": pl.Utf8, "request_id": pl.Utf8, "split_position": pl.Int32, "lost_tokens": pl.Int64,
    "lost_bytes": pl.Int64, "arrival_ns": pl.Int64, "lost_blocks": pl.Int64,
    "repeated_token_hash": pl.UInt64, "first_request_id": pl.Utf8, "offender_rank": pl.Int64,
    "offender_requests": pl.Int64, "offender_lost_tokens": pl.Int64,
}


def _mix(position: np.ndarray, token_hash: np.ndarray) -> np.ndarray:
    """splitmix64 of (token hash, position): summed per request, an order-aware run key."""
    with np.errstate(over="ignore"):
        x = token_hash ^ (position.astype(np.uint64) * _GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _blocks(request_blocks: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    # Filtered in the scan: most lakes have no token hash (only a gateway with --keep-tokens or a
    # trace with token ids gives one), and DuckDB then skips the row groups whose token_hash is all
    # NULL rather than handing every row of a lake that grows with its age over to be dropped.
    rel = request_blocks.filter(
        "block_tokens >= block_size_tokens AND content_hash IS NOT NULL AND token_hash IS NOT NULL"
    ).select("request_id", "arrival_ns", "position", "content_hash", "token_hash", "block_tokens",
             "block_size_tokens")
    blocks = rel.pl().unique(["request_id", "position"], keep="first")
    order = (blocks.group_by("request_id").agg(pl.col("arrival_ns").min())
             .sort("arrival_ns", "request_id").with_row_index("req", offset=0)
             .select("request_id", pl.col("req").cast(pl.Int64)))
    blocks = blocks.join(order, on="request_id").sort("req", "position")
    mixed = _mix(blocks["position"].to_numpy(), blocks["token_hash"].to_numpy())
    with np.errstate(over="ignore"):
        run = np.cumsum(mixed, dtype=np.uint64)  # wraps modulo 2**64: differences stay exact
    return blocks.with_columns(run=pl.Series(run, dtype=pl.UInt64))


def _splits(blocks: pl.DataFrame) -> pl.DataFrame:
    """Per request: split position, the shared chain's last content hash (0 at the root)."""
    first = blocks.group_by("content_hash").agg(first_req=pl.col("req").min())
    new = (blocks.join(first, on="content_hash").filter(pl.col("first_req") == pl.col("req"))
           .group_by("req").agg(split_position=pl.col("position").min()))
    root = blocks.select("req", pl.col("position") + 1, root=pl.col("content_hash"))
    return (new.join(root, left_on=["req", "split_position"], right_on=["req", "position"], how="left")
            .with_columns(pl.col("root").fill_null(0)))


def _run_keys(blocks: pl.DataFrame, splits: pl.DataFrame) -> pl.DataFrame:
    """For every (request, split s) where the request shares the chain up to s - 1 with a
    request that split at s: one key per block p > s, equal for equal (s, prefix, token run
    s + 1 .. p); ``own`` marks the request's own split."""
    cases = splits.select("split_position", "root").unique()
    at_root = pl.concat([
        blocks.join(cases.filter(pl.col("split_position") > 0).with_columns(pos=pl.col("split_position") - 1),
                    left_on=["position", "content_hash"], right_on=["pos", "root"])
        .select("req", "split_position", root=pl.col("content_hash")),
        blocks.select("req").unique().join(cases.filter(pl.col("split_position") == 0), how="cross"),
    ])
    at_root = (at_root.join(splits.select("req", own_split="split_position"), on="req", how="left")
               .with_columns(own=pl.col("own_split") == pl.col("split_position")).drop("own_split"))
    base = at_root.join(blocks.select("req", "position", base=pl.col("run")),
                        left_on=["req", "split_position"], right_on=["req", "position"])
    rows = (base.join(blocks.select("req", "position", "run", "token_hash", "block_tokens"), on="req")
            .filter(pl.col("position") > pl.col("split_position")))
    with np.errstate(over="ignore"):
        case = _mix(rows["split_position"].to_numpy(), rows["root"].to_numpy())
        run = rows["run"].to_numpy() - rows["base"].to_numpy()
        key = _mix(rows["position"].to_numpy(), run ^ case)
    return rows.select("req", "split_position", "own", "position", "token_hash", "block_tokens",
                       key=pl.Series(key, dtype=pl.UInt64))


def hygiene(*, request_blocks: duckdb.DuckDBPyRelation, scenario: str, bytes_per_token: int) -> pl.DataFrame:
    """Requests of ``scenario`` that lose reusable tokens to an early divergence (its request_blocks).

    Columns: scenario, request_id, split_position (block index where the request's chain
    diverged from every earlier request), lost_tokens (tokens of the full blocks after the
    split whose content an earlier request with the same prefix had, in an unbroken run from
    split_position + 1: reusable if the dynamic part moved to the end), lost_bytes
    (lost_tokens x ``bytes_per_token``), arrival_ns, lost_blocks, repeated_token_hash (token
    hash of the first repeated block), first_request_id (the earliest request that carried the
    repeated content after the same prefix: names the offender group), offender_rank (1 = the
    group losing most tokens), offender_requests and offender_lost_tokens (the group's totals).
    One row per request with lost_tokens > 0; sorted by offender_rank, arrival_ns, request_id.
    """
    blocks = _blocks(request_blocks)
    if blocks.is_empty():
        return pl.DataFrame(schema=_SCHEMA)
    splits = _splits(blocks)
    keys = _run_keys(blocks, splits)
    own = (keys.with_columns(first_req=pl.col("req").min().over("key"))
           .filter(pl.col("own") & (pl.col("first_req") < pl.col("req"))))
    names = blocks.select("req", "request_id", "arrival_ns").unique("req")
    lost = (own.group_by("req", "split_position").agg(
                lost_blocks=pl.len().cast(pl.Int64), lost_tokens=pl.col("block_tokens").cast(pl.Int64).sum(),
                repeated_token_hash=pl.col("token_hash").sort_by("position").first(),
                first_req=pl.col("first_req").sort_by("position").first())
            .join(names, on="req")
            .join(names.select(pl.col("req").alias("first_req"), first_request_id=pl.col("request_id")),
                  on="first_req"))
    if lost.is_empty():
        return pl.DataFrame(schema=_SCHEMA)
    group = ["split_position", "first_request_id"]
    lost = lost.with_columns(offender_requests=pl.len().over(group).cast(pl.Int64),
                             offender_lost_tokens=pl.col("lost_tokens").sum().over(group).cast(pl.Int64))
    ranks = (lost.select(*group, "offender_lost_tokens").unique()
             .sort(["offender_lost_tokens", *group], descending=[True, False, False])
             .with_row_index("offender_rank", offset=1)
             .select(*group, pl.col("offender_rank").cast(pl.Int64)))
    return (lost.join(ranks, on=group)
            .with_columns(scenario=pl.lit(scenario), split_position=pl.col("split_position").cast(pl.Int32),
                          lost_bytes=pl.col("lost_tokens") * bytes_per_token)
            .select(list(_SCHEMA)).cast(_SCHEMA)  # type: ignore[arg-type]
            .sort("offender_rank", "arrival_ns", "request_id"))
