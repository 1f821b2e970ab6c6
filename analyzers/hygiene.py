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

``hygiene_out_of_core`` computes the same rows with one partition of rows in memory at a time
(``kvlens analyze --out-of-core``, issue 17): the parts below are each run on a partition that
keeps their computation whole (by request, by content hash, by run key) and their results merged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pyarrow.parquet as pq

__all__ = ["hygiene", "hygiene_out_of_core"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# Rows in memory at once out of core: one partition of block rows or of key rows, as
# analyzers/out_of_core.py's partitions. Measured on tests/scale_lake.py's fleet (10.2M accesses),
# the peak resident memory grows by some 300 bytes per row of it: 0.74 GiB at 500k, 1.18 at 2M.
_ROWS = 2_000_000

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


# The rows that take part (filtered in the scan: most lakes have no token hash, only a gateway with
# --keep-tokens or a trace with token ids gives one, and DuckDB then skips the row groups whose
# token_hash is all NULL rather than handing every row of a lake that grows with its age over to
# be dropped), and the columns read.
_FULL = "block_tokens >= block_size_tokens AND content_hash IS NOT NULL AND token_hash IS NOT NULL"
_COLUMNS = ("request_id", "arrival_ns", "position", "content_hash", "token_hash", "block_tokens",
            "block_size_tokens")


def _first_rows(blocks: pl.DataFrame) -> pl.DataFrame:
    """One row per (request, position): the first one read where a lake repeats it."""
    return blocks.unique(["request_id", "position"], keep="first")


def _in_order(blocks: pl.DataFrame, order: pl.DataFrame) -> pl.DataFrame:
    """``blocks`` with their request's place ``req`` (from ``order``: request_id, req), sorted by
    (req, position), and ``run``: the running sum of ``_mix`` over them. It wraps modulo 2**64, so
    its differences within one request are exact whatever rows come before the request."""
    blocks = blocks.join(order, on="request_id").sort("req", "position")
    mixed = _mix(blocks["position"].to_numpy(), blocks["token_hash"].to_numpy())
    with np.errstate(over="ignore"):
        run = np.cumsum(mixed, dtype=np.uint64)
    return blocks.with_columns(run=pl.Series(run, dtype=pl.UInt64))


def _blocks(request_blocks: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    blocks = _first_rows(request_blocks.filter(_FULL).select(*_COLUMNS).pl())
    order = (blocks.group_by("request_id").agg(pl.col("arrival_ns").min())
             .sort("arrival_ns", "request_id").with_row_index("req", offset=0)
             .select("request_id", pl.col("req").cast(pl.Int64)))
    return _in_order(blocks, order)


def _news(blocks: pl.DataFrame) -> pl.DataFrame:
    """Per request: the least position of its blocks whose content hash no earlier request had
    (req, split_position). ``blocks`` must hold every row of each content hash it holds."""
    first = blocks.group_by("content_hash").agg(first_req=pl.col("req").min())
    return (blocks.join(first, on="content_hash").filter(pl.col("first_req") == pl.col("req"))
            .group_by("req").agg(split_position=pl.col("position").min()))


def _rooted(new: pl.DataFrame, blocks: pl.DataFrame) -> pl.DataFrame:
    """``new`` with ``root``: the content hash of the block before the split (0 at the root or
    where the request has no such block). ``blocks`` must hold every row of ``new``'s requests."""
    root = blocks.select("req", pl.col("position") + 1, root=pl.col("content_hash"))
    return (new.join(root, left_on=["req", "split_position"], right_on=["req", "position"], how="left")
            .with_columns(pl.col("root").fill_null(0)))


def _splits(blocks: pl.DataFrame) -> pl.DataFrame:
    """Per request: split position, the shared chain's last content hash (0 at the root)."""
    return _rooted(_news(blocks), blocks)


def _at_root(blocks: pl.DataFrame, splits: pl.DataFrame) -> pl.DataFrame:
    """Every (request, split s, root) where the request shares the chain up to s - 1 with a request
    that split at s (``splits``: every request's); ``own`` marks the request's own split. Rows of
    ``blocks``' requests only: ``blocks`` may be some requests' rows, all of each."""
    cases = splits.select("split_position", "root").unique()
    at_root = pl.concat([
        blocks.join(cases.filter(pl.col("split_position") > 0).with_columns(pos=pl.col("split_position") - 1),
                    left_on=["position", "content_hash"], right_on=["pos", "root"])
        .select("req", "split_position", root=pl.col("content_hash")),
        blocks.select("req").unique().join(cases.filter(pl.col("split_position") == 0), how="cross"),
    ])
    return (at_root.join(splits.select("req", own_split="split_position"), on="req", how="left")
            .with_columns(own=pl.col("own_split") == pl.col("split_position")).drop("own_split"))


def _expand(blocks: pl.DataFrame, at_root: pl.DataFrame) -> pl.DataFrame:
    """One key per block p > s of each row of ``at_root``, equal for equal (s, prefix, token run
    s + 1 .. p). ``blocks`` must hold every row of ``at_root``'s requests."""
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


def _run_keys(blocks: pl.DataFrame, splits: pl.DataFrame) -> pl.DataFrame:
    """For every (request, split s) where the request shares the chain up to s - 1 with a
    request that split at s: one key per block p > s, equal for equal (s, prefix, token run
    s + 1 .. p); ``own`` marks the request's own split."""
    return _expand(blocks, _at_root(blocks, splits))


def _losses(keys: pl.DataFrame) -> pl.DataFrame:
    """Per (request, its own split): the blocks after the split whose key an earlier request had,
    as ``_merged`` adds them up. ``keys`` must hold every row of each key it holds."""
    own = (keys.with_columns(first_req=pl.col("req").min().over("key"))
           .filter(pl.col("own") & (pl.col("first_req") < pl.col("req"))))
    return _merged(own.select("req", "split_position", "first_req", lost_blocks=pl.lit(1, pl.Int64),
                              lost_tokens=pl.col("block_tokens").cast(pl.Int64), first_position="position",
                              repeated_token_hash="token_hash"))


def _merged(losses: pl.DataFrame) -> pl.DataFrame:
    """Losses of one (request, split) added up: blocks and tokens summed (integers: exact in any
    order); the repeated token hash and the first request are the lost block's at the least
    position (``first_position``)."""
    return losses.group_by("req", "split_position").agg(
        lost_blocks=pl.col("lost_blocks").sum(), lost_tokens=pl.col("lost_tokens").sum(),
        repeated_token_hash=pl.col("repeated_token_hash").sort_by("first_position").first(),
        first_req=pl.col("first_req").sort_by("first_position").first(),
        first_position=pl.col("first_position").min())


def _offenders(lost: pl.DataFrame, names: pl.DataFrame, scenario: str, bytes_per_token: int) -> pl.DataFrame:
    """The table's rows from the losses and the names (req, request_id, arrival_ns) of their
    requests and first requests: offender groups, their totals and ranks."""
    lost = (lost.join(names, on="req")
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
    lost = _losses(_run_keys(blocks, _splits(blocks)))
    names = blocks.select("req", "request_id", "arrival_ns").unique("req")
    return _offenders(lost, names, scenario, bytes_per_token)



class _Spill:
    """Frames written into ``k`` Parquet files by a partition number, as they come: one writer a
    partition, kept open, so each file grows by row groups and keeps its rows in the order written."""

    def __init__(self, directory: Path, k: int) -> None:
        directory.mkdir(parents=True)
        self.directory, self.k, self.rows = directory, k, 0
        self.schema: pl.Schema | None = None
        self._writers: dict[int, pq.ParquetWriter] = {}

    def write(self, frame: pl.DataFrame, part: pl.Expr) -> None:
        """``frame``'s rows, each into partition ``part`` (an expression giving 0 .. k - 1)."""
        self.schema = frame.schema
        self.rows += frame.height
        for key, piece in frame.with_columns(_part=part).partition_by("_part", as_dict=True).items():
            p = int(key[0])
            table = piece.drop("_part").to_arrow()
            if p not in self._writers:
                self._writers[p] = pq.ParquetWriter(self.directory / f"{p}.parquet", table.schema,
                                                    compression="lz4")
            self._writers[p].write_table(table)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def read(self, p: int, columns: Sequence[str] | None = None) -> pl.DataFrame:
        """Partition ``p``'s rows in the order written (no file: none)."""
        path = self.directory / f"{p}.parquet"
        frame = pl.read_parquet(path) if path.exists() else pl.DataFrame(schema=self.schema)
        return frame.select(columns) if columns is not None else frame

    def take(self, p: int) -> pl.DataFrame:
        """Partition ``p``'s rows, its file removed (read once: the disk it held is freed)."""
        frame = self.read(p)
        (self.directory / f"{p}.parquet").unlink(missing_ok=True)
        return frame


def _literal(path: Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def _numbered(con: duckdb.DuckDBPyConnection, scenario: str, work: Path, k: int,
              rows: int) -> tuple[_Spill, Path]:
    """The rows that take part, in the order a scan returns them, by request id into ``k``
    partitions; per partition, the first row of each (request, position) (``_first_rows``);
    the requests numbered ``req`` by (least arrival, request id), as ``_blocks`` numbers them, in
    ``work/order/part=P`` (request_id, arrival_ns, req): (the kept rows, that directory)."""
    raw = _Spill(work / "raw", k)
    reader = con.sql(f"SELECT {', '.join(_COLUMNS)} FROM request_blocks WHERE scenario = ? AND {_FULL}",
                     params=[scenario]).to_arrow_reader(max(rows // 4, 1))
    for batch in reader:
        frame = pl.from_arrow(batch)
        assert isinstance(frame, pl.DataFrame)
        # a row without a request id joins no request in ``_blocks``: it takes no part
        raw.write(frame.filter(pl.col("request_id").is_not_null()), pl.col("request_id").hash() % k)
    raw.close()
    kept = _Spill(work / "kept", k)
    (work / "arrivals").mkdir()
    for p in range(k):
        blocks = _first_rows(raw.take(p))
        kept.write(blocks, pl.lit(p, pl.Int64))
        (blocks.group_by("request_id").agg(pl.col("arrival_ns").min()).with_columns(part=pl.lit(p, pl.Int64))
         .write_parquet(work / "arrivals" / f"{p}.parquet"))
    kept.close()
    order = work / "order"
    con.execute(f"""COPY (
        SELECT request_id, arrival_ns, part,
               row_number() OVER (ORDER BY arrival_ns ASC NULLS FIRST, request_id ASC NULLS FIRST) - 1 AS req
        FROM read_parquet({_literal(work / "arrivals" / "*.parquet")})
    ) TO {_literal(order)} (FORMAT parquet, PARTITION_BY (part))""")
    return kept, order


def _order_of(order: Path, p: int) -> pl.DataFrame:
    """Request partition ``p``'s numbers (request_id, req)."""
    files = sorted((order / f"part={p}").glob("*.parquet"))
    if not files:
        return pl.DataFrame(schema={"request_id": pl.Utf8, "req": pl.Int64})
    return pl.read_parquet(files, columns=["request_id", "req"], hive_partitioning=False)


def _merging(parts: Iterator[pl.DataFrame], merge: Callable[[pl.DataFrame], pl.DataFrame],
             rows: int) -> pl.DataFrame:
    """Partial results merged into one by ``merge``: once each time about ``rows`` rows have come
    since the last merge, and at the end (so at most the merged result and ``rows`` rows are held)."""
    held: list[pl.DataFrame] = []
    since = 0
    for part in parts:
        held.append(part)
        since += part.height
        if since > rows:
            held, since = [merge(pl.concat(held))], 0
    return merge(pl.concat(held))


def _sizes(cases: pl.DataFrame, blocks: pl.DataFrame) -> pl.DataFrame:
    """Per request of ``cases`` (``_at_root``'s rows), the most key rows ``_expand`` gives it: its
    cases times its blocks (req, est), sorted by req."""
    return (cases.group_by("req").len("n").join(blocks.group_by("req").len("blocks"), on="req")
            .select("req", est=pl.col("n").cast(pl.Int64) * pl.col("blocks").cast(pl.Int64)).sort("req"))


def _chunks(sizes: pl.DataFrame, rows: int) -> list[pl.DataFrame]:
    """``sizes`` (req, est: key rows at most), sorted by req, cut into runs of requests of about
    ``rows`` key rows each (a request with more is a run of its own)."""
    start = sizes["est"].cum_sum() - sizes["est"]
    return sizes.with_columns(chunk=start // max(rows, 1)).partition_by("chunk", include_key=False)


def hygiene_out_of_core(con: duckdb.DuckDBPyConnection, scenario: str, *, work: Path, partitions: int,
                        bytes_per_token: int, rows: int = _ROWS) -> pl.DataFrame:
    """``hygiene``'s rows for ``scenario``, with one partition of about ``rows`` rows in memory at
    a time (``kvlens analyze --out-of-core``, issue 17). ``con`` has the lake views open (it reads
    ``request_blocks``); ``work`` is an empty directory for spill files; ``partitions`` the least
    count of request partitions (one per ``rows`` rows that take part at least).

    ``hygiene``'s parts, each given a partition that keeps its computation whole:

    1. The rows that take part are read once, in the order a scan returns them (as ``hygiene``
       reads them), into K partitions by request id; per partition the first row of each
       (request, position) is kept. DuckDB numbers the requests by (least arrival, request id)
       (``req``; it spills past its memory limit).
    2. Per request partition, ``run`` (``_in_order``: its differences within a request are all that
       is used); the rows again by content hash.
    3. Per content partition, each request's first new block (``_news``: every row of a content
       hash is in its partition); the least over the partitions is the request's split. Per
       request partition, the splits' roots (``_rooted``).
    4. Per request partition, the cases each request meets (``_at_root``, given every request's
       split), and by runs of requests of about ``rows`` key rows, their run keys (``_expand``),
       written by key into K2 partitions (one per ``rows`` key rows at least, counted from the
       cases). Per key partition, ``_losses`` (every row of a key is in its partition), added up
       over the partitions (``_merged``).
    5. The names of the losing requests and of their first requests are read from the numbering;
       ``_offenders`` makes the groups and ranks.

    **Exact**: the rows ``hygiene`` gives, with no float anywhere (tests/test_ooc_hygiene.py),
    given what ``hygiene`` takes for granted too: the scan keeps its order
    (``preserve_insertion_order``, DuckDB's default), which decides the first of a repeated
    (request, position); and a request's rows carry one arrival time (``hygiene`` names a
    request with any of its rows' times, here with the least).

    **Memory** in Python: one partition at a time (a request or content partition, a run of
    requests' key rows, a key partition: about ``rows`` rows each, as hashing spreads them), and
    O(requests) in a few integer columns: each request's first new block, then its split (req,
    split_position, root: some 20 bytes a request, needed by every partition in step 4), and the
    losses (a row per losing request, with the names of the losing and first requests: the size
    of the output). Measured with DuckDB at 1 GB, on tests/scale_lake.py's fleet with token hashes
    planted (three requests in four lose tokens): peak resident memory 1.06 GiB at 4.1M accesses
    (``hygiene``: 1.54), 1.18 GiB at 10.2M (``hygiene``: 2.96), 1.33 GiB at 26.6M (650k requests;
    152 s), the same rows as ``hygiene`` where both ran.
    """
    ((count,),) = con.execute(f"SELECT count(*) FROM request_blocks WHERE scenario = ? AND {_FULL}",
                              [scenario]).fetchall()
    if not count:
        return pl.DataFrame(schema=_SCHEMA)
    k = max(partitions, math.ceil(count / rows), 1)
    kept, order = _numbered(con, scenario, work, k, rows)
    runs, content = _Spill(work / "runs", k), _Spill(work / "content", k)
    for p in range(k):
        ordered = _in_order(kept.take(p), _order_of(order, p)).select(
            "req", "position", "content_hash", "token_hash", "block_tokens", "run")
        runs.write(ordered, pl.lit(p, pl.Int64))
        content.write(ordered.select("req", "position", "content_hash"), pl.col("content_hash") % k)
    runs.close()
    content.close()
    if not runs.rows:
        return pl.DataFrame(schema=_SCHEMA)
    new = _merging((_news(content.take(p)) for p in range(k)),
                   lambda news: news.group_by("req").agg(pl.col("split_position").min()), rows)
    chain = ("req", "position", "content_hash")
    splits = pl.concat([_rooted(new.join(part.select("req"), on="req", how="semi"), part)
                        for part in (runs.read(p, chain) for p in range(k))])
    # The cases each request meets, and how many key rows they give at most.
    (work / "cases").mkdir()
    total = 0
    for p in range(k):
        part = runs.read(p, chain)
        cases = _at_root(part, splits)
        cases.write_parquet(work / "cases" / f"{p}.parquet")
        total += int(_sizes(cases, part)["est"].sum())
    k2 = max(k, math.ceil(total / rows), 1)
    keys = _Spill(work / "keys", k2)
    for p in range(k):
        part, cases = runs.take(p), pl.read_parquet(work / "cases" / f"{p}.parquet")
        (work / "cases" / f"{p}.parquet").unlink()
        for chunk in _chunks(_sizes(cases, part), rows):
            some = chunk.select("req")
            keys.write(_expand(part.join(some, on="req", how="semi"), cases.join(some, on="req", how="semi")),
                       pl.col("key") % k2)
    keys.close()
    if not keys.rows:
        return pl.DataFrame(schema=_SCHEMA)
    lost = _merging((_losses(keys.take(j)) for j in range(k2)), _merged, rows)
    pl.concat([lost["req"], lost["first_req"]]).unique().to_frame("req").write_parquet(work / "named.parquet")
    named = work / "named.parquet"
    names = con.sql(
        f"SELECT req, request_id, arrival_ns FROM read_parquet({_literal(order / '*' / '*.parquet')}, "
        f"hive_partitioning = false) WHERE req IN (SELECT req FROM read_parquet({_literal(named)}))").pl()
    return _offenders(lost, names, scenario, bytes_per_token)
