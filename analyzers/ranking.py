"""Analyzers: the publish ranking: which shared prefixes are worth publishing, pinning or keeping local.

A **prefix group** is a maximal shared chain. Block hashes are prefix-chained, so the blocks
of a scenario form a trie, each block needed by ``n`` requests (its count). Along a request's
chain counts never grow, and a child with its parent's count has its parent's requests. A
group's **tip** is a block needed by two or more requests none of whose children is needed by
all of them: the deepest block a set of requests shares. The group's **segment** is the run
of blocks above the tip with the tip's count: the blocks that group adds to its parent group
(the tip of the run before it). Segments tile the shared part of the trie, so sums over groups
never count a block access twice. The prefix itself is the whole chain from the root to the tip
(``prefix_tokens``, ``bytes``); its benefit is the segment's, given the parent is handled.

Per group, over the scenario (DESIGN.md section 1, question 5)::

    loads       = (miss_routing + miss_evicted + hit_remote tokens of the segment) / segment tokens
    h_remote    = loads / requests
    E[benefit]  = requests·h_remote·(T_recompute − T_remote) − P_stall − P_write − P_eviction

``T_recompute`` is the prefill the segment costs after its parent (cost model, without a
call's fixed cost), ``T_remote`` its load via the local lower tier (a group needed on one
replica) or the shared pool (several replicas). ``P_stall``: loads that failed
(``miss_load_failed``) waited a ``T_remote`` for nothing. ``P_write``: one publish of the
segment. ``P_eviction``: what the segment's bytes push out of a pool of the device's
``pool_capacity_bytes`` once the demand ``D`` (segment bytes of every group worth loading)
exceeds it: ``bytes · (V/D) · max(0, 1 − C/D)``, ``V`` the gross benefit of that demand.

**Out of core** (``prefix_ranking_out_of_core``, issue 17): the same frame from the analysis DB's
``block_outcomes``, by ranges of requests (a request's runs, tips and chain totals need only its own
rows and each block's count over the scenario) whose per-tip partial sums are merged by partitions
of tips, with one range's or one partition's rows in memory at a time.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import polars as pl

from kvlens.analyzers.costs import CostModel, LoadPath
from kvlens.schema import Outcome

__all__ = ["ROWS_IN_MEMORY", "prefix_ranking", "prefix_ranking_out_of_core"]

TOP_N = 200
# Out of core: the rows of one range of requests, or one partition of tips' partial rows, in memory at once.
ROWS_IN_MEMORY = 2_000_000

# block_outcomes' columns the ranking reads as they are (then the outcome as a string, tokens, bytes)
_COLUMNS = ("request_id", "replica", "arrival_ns", "position", "block_hash")

_MISS_CAUSES = tuple(o.value for o in (Outcome.MISS_ROUTING, Outcome.MISS_EVICTED, Outcome.HIT_REMOTE,
                                        Outcome.MISS_LOAD_FAILED))

PUBLISH, PIN, KEEP_LOCAL, DO_NOT = "publish to pool", "pin", "keep local", "do not publish"


def _in_request_order(outcomes: pl.DataFrame) -> tuple[pl.DataFrame, np.ndarray]:
    """``outcomes`` with each request's rows together, by position, and where each request's rows
    start (a mask): as given when they already are (the ledger writes a request's blocks in one
    run, by position), else sorted by request id."""
    for sort in (False, True):
        df = outcomes.sort("request_id", "position") if sort else outcomes
        run = df["request_id"].rle_id().to_numpy()
        starts = np.ones(df.height, bool)
        starts[1:] = run[1:] != run[:-1]
        pos = df["position"].to_numpy()
        # Together when no id starts two runs: the ids at the runs' starts are distinct (a count of
        # one id per request, not per row: the rows grow with the lake's age, on the whole sample
        # trace's 6th increment 276k rows for 12k requests)
        firsts = df["request_id"].filter(pl.Series(starts))
        if firsts.n_unique() == firsts.len() and bool(np.all(starts[1:] | (pos[1:] > pos[:-1]))):
            break
    return df, starts


def _segments(outcomes: pl.DataFrame) -> pl.DataFrame:
    """Each shared block access with its group's tip, parent tip, and chain totals.

    On arrays in request order: a run is a stretch of one request's consecutive positions of one
    count; its tip is its last block and its parent the tip of the request's run before it. Each
    block's count ``n`` (the scenario's accesses of its hash) is counted here, unless ``outcomes``
    carries it: out of core counts it over the whole scenario and gives whole requests' rows, for
    all that is computed here is within one request."""
    df, new_request = _in_request_order(outcomes)
    size = df.height
    n = (df["n"] if "n" in df.columns else df.select(pl.len().over("block_hash")).to_series()).to_numpy()
    pos, hashes = df["position"].to_numpy(), df["block_hash"].to_numpy()
    begin = np.maximum.accumulate(np.where(new_request, np.arange(size), 0))  # each row's request start
    brk = new_request.copy()
    brk[1:] |= (n[1:] != n[:-1]) | (pos[1:] != pos[:-1] + 1)
    run = np.cumsum(brk) - 1
    run_first = np.flatnonzero(brk)
    tip = hashes[np.concatenate([run_first[1:] - 1, [size - 1]])] if size else hashes
    parent = np.concatenate([[0], tip[:-1]]).astype(hashes.dtype)
    first_row = run_first[run]
    shared = n >= 2
    columns: dict[str, Any] = {"n": n[shared], "tip": tip[run][shared]}
    for name in ("tokens", "bytes"):
        own = df[name].to_numpy().astype(np.int64)
        total = np.cumsum(own)
        cum = total - np.concatenate([[0], total])[begin]  # the request's total up to each row
        columns[f"cum_{name}"] = cum[shared]
        columns[f"start_{name}"] = (cum - own)[first_row][shared]
    orphan = new_request[run_first][run][shared]  # the run starts its request: no parent
    return df.filter(pl.Series(shared)).with_columns(
        pl.Series("parent_hash", parent[run][shared]).set(pl.Series(orphan), None),
        *(pl.Series(k, v) for k, v in columns.items()))


def _partial(shared: pl.DataFrame) -> pl.DataFrame:
    """Per tip and replica, of ``shared`` (``_segments``' rows): what ``_merged`` sums and takes
    extremes of. Out of core, a tip's accesses are split over ranges of requests: each range's
    partial rows are merged per tip (integer sums, minima and maxima: exact in any grouping)."""
    tokens_of = [pl.col("tokens").cast(pl.Int64).filter(pl.col("outcome") == c).sum().alias(f"{c}_tokens")
                 for c in _MISS_CAUSES]
    return shared.group_by("tip", "replica").agg(
        pl.col("n").first(),
        pl.col("cum_tokens").max(), pl.col("cum_bytes").max(),
        pl.col("start_tokens").max(), pl.col("start_bytes").max(),
        pl.col("parent_hash").min(),  # one parent per tip: the chain above it is shared
        pl.col("arrival_ns").min().alias("first_arrival_ns"),
        pl.col("arrival_ns").max().alias("last_arrival_ns"),
        *tokens_of,
    )


def _merged(partial: pl.DataFrame) -> pl.DataFrame:
    """One row per prefix group (tip) of ``_partial``'s rows: its counts, sizes and miss tokens."""
    return partial.group_by("tip").agg(
        pl.col("n").first().alias("requests"),
        pl.col("replica").n_unique().alias("replicas"),
        pl.col("cum_tokens").max().alias("prefix_tokens"),
        pl.col("cum_bytes").max().alias("bytes"),
        pl.col("start_tokens").max(), pl.col("start_bytes").max(), pl.col("parent_hash").min(),
        pl.col("first_arrival_ns").min(), pl.col("last_arrival_ns").max(),
        *(pl.col(f"{c}_tokens").sum() for c in _MISS_CAUSES),
    ).rename({"tip": "prefix_hash"}).with_columns(
        (pl.col("prefix_tokens") - pl.col("start_tokens")).alias("segment_tokens"),
        (pl.col("bytes") - pl.col("start_bytes")).alias("segment_bytes"),
        (pl.col("miss_routing_tokens") + pl.col("miss_evicted_tokens")).alias("avoidable_miss_tokens"),
    ).filter(pl.col("segment_tokens") > 0)


Group = dict[str, Any]


def _i(g: Group, key: str) -> int:
    return int(g[key])


def _f(g: Group, key: str) -> float:
    return float(g[key])


def _answers(keys: pl.DataFrame, ask: Any, schema: dict[str, Any]) -> pl.DataFrame:
    """``keys`` (distinct questions to the cost model) with ``ask``'s answers to each, as columns
    ``schema`` (the model interpolates in Python: groups repeat segment sizes and starts, so it is
    asked once per distinct question, not once per group)."""
    answers = [ask(*row) for row in keys.iter_rows()]
    return keys.with_columns(pl.Series(name, [a[i] for a in answers], dtype=dtype)
                             for i, (name, dtype) in enumerate(schema.items()))


def _with_terms(groups: pl.DataFrame, costs: CostModel) -> pl.DataFrame:
    """Per group: the path, per-load figures and the gross benefit (before displacement), on
    columns (the figures are the same float64 operations, in the same order, as on one group)."""
    paths = {str(p): p for p in (LoadPath.LOCAL_TIER, LoadPath.POOL)}
    g = groups.with_columns(path=pl.when(pl.col("replicas") == 1).then(pl.lit(str(LoadPath.LOCAL_TIER)))
                            .otherwise(pl.lit(str(LoadPath.POOL))))

    def recompute(tokens: int, start: int) -> tuple[float, str]:
        saved, label = costs.saved_recompute_ms(tokens, start)
        return saved, str(label)

    def load(nbytes: int, path: str) -> tuple[float, str, float]:
        remote, label = costs.remote_ms(nbytes, paths[path])
        return remote, str(label), costs.write_ms(nbytes, paths[path])[0]

    keys = ["segment_tokens", "start_tokens"]
    g = g.join(_answers(g.select(keys).unique(), recompute,
                        {"recompute_ms": pl.Float64, "recompute_label": pl.String}), on=keys, how="left")
    keys = ["segment_bytes", "path"]
    g = g.join(_answers(g.select(keys).unique(), load,
                        {"remote_ms": pl.Float64, "remote_label": pl.String, "write_ms": pl.Float64}),
               on=keys, how="left")
    served = pl.col("miss_routing_tokens") + pl.col("miss_evicted_tokens") + pl.col("hit_remote_tokens")
    tokens = pl.col("segment_tokens").cast(pl.Float64)
    loads = served.cast(pl.Float64) / tokens
    return g.with_columns(
        h_remote_ratio=loads / pl.col("requests").cast(pl.Float64),
        gross_ms=loads * (pl.col("recompute_ms") - pl.col("remote_ms")),
        stall_ms=pl.col("miss_load_failed_tokens").cast(pl.Float64) / tokens * pl.col("remote_ms"))


def _worth(groups: pl.DataFrame) -> pl.DataFrame:
    """The groups worth loading at all (gross > 0): the pool's demand."""
    return groups.filter(pl.col("gross_ms") > 0)


def _with_eviction(groups: pl.DataFrame, capacity_bytes: int) -> pl.DataFrame:
    """P_eviction: a segment displaces its bytes of average-value content once the pool is full.

    Demand is the segment bytes of every group worth loading at all (gross > 0); the share of
    it that cannot fit, ``1 − C/D``, is what a new segment's bytes push out, each byte worth
    the average ``V/D`` of that demand.
    """
    worth = _worth(groups)
    # fsum: exact whatever order group_by returned the groups in, so two analyses agree to the bit
    return _evicting(groups, _per_byte(math.fsum(worth["gross_ms"].to_list()),
                                       int(worth["segment_bytes"].sum()), capacity_bytes))


def _per_byte(value: float, demand: int, capacity_bytes: int) -> float:
    """What a byte pushed out of the pool is worth: ``(V/D) · max(0, 1 − C/D)``."""
    return value / demand * max(0.0, 1.0 - capacity_bytes / demand) if demand else 0.0


def _evicting(groups: pl.DataFrame, per_byte: float) -> pl.DataFrame:
    """``groups`` with their eviction_ms at ``per_byte`` (``_per_byte``) and their benefit_ms."""
    evicted = pl.lit(per_byte, pl.Float64) * pl.col("segment_bytes").cast(pl.Float64)
    return groups.with_columns(eviction_ms=evicted).with_columns(
        benefit_ms=pl.col("gross_ms") - pl.col("stall_ms") - pl.col("write_ms") - pl.col("eviction_ms"))


def _recommend(r: Group) -> tuple[str, str]:
    """The recommendation and its reason in words, numbers included."""
    benefit, gain = _f(r, "benefit_ms"), _f(r, "recompute_ms") - _f(r, "remote_ms")
    size = (f"{_i(r, 'segment_tokens'):,} tokens ({_i(r, 'segment_bytes') / 1e6:,.0f} MB) beyond "
            f"{'the root' if r['parent_hash'] is None else 'its parent prefix'}")
    served = (f"{_i(r, 'requests')} requests on {_i(r, 'replicas')} replica(s) need it; "
              f"{_i(r, 'avoidable_miss_tokens'):,} of their tokens were miss_routing/miss_evicted "
              f"(h_remote {_f(r, 'h_remote_ratio'):.2f})")
    per_load = (f"a load via {r['path']} takes {_f(r, 'remote_ms'):,.1f} ms ({r['remote_label']}) against "
                f"{_f(r, 'recompute_ms'):,.1f} ms of prefill ({r['recompute_label']})")
    if benefit <= 0:
        why = ("no access missed it for a reason a publish fixes" if _f(r, "h_remote_ratio") == 0 else
               "loading is no faster than recomputing" if gain <= 0 else
               f"the {_f(r, 'gross_ms'):,.1f} ms saved do not cover write {_f(r, 'write_ms'):,.1f} ms, "
               f"stall {_f(r, 'stall_ms'):,.1f} ms and eviction {_f(r, 'eviction_ms'):,.1f} ms")
        return DO_NOT, f"{size}: {served}; {per_load}; {why}."
    if r["replicas"] == 1:
        rec, how = KEEP_LOCAL, "only one replica needs it, so its own lower tier is enough"
    elif _i(r, "miss_evicted_tokens") > _i(r, "miss_routing_tokens"):
        rec, how = PIN, "most of its misses were evictions, so publishing alone would lose it again"
    else:
        rec, how = PUBLISH, "other replicas held it when it missed"
    return rec, f"{size}: {served}; {per_load}; expected benefit {benefit:,.1f} ms; {how}."


def prefix_ranking(*, block_outcomes: pl.DataFrame, costs: CostModel, scenario: str,
                   top_n: int = TOP_N) -> pl.DataFrame:
    """The ``top_n`` prefix groups of ``scenario`` by expected benefit of publishing (its block outcomes).

    Columns: scenario, rank, prefix_hash (tip), parent_hash (the parent group's tip, NULL at
    the root), prefix_tokens, bytes (KV of the whole chain), segment_tokens, segment_bytes
    (what it adds to its parent), requests, reuses (requests − 1), replicas,
    miss_routing_tokens, miss_evicted_tokens, hit_remote_tokens, miss_load_failed_tokens,
    avoidable_miss_tokens (routing + evicted), h_remote_ratio, path (local_tier or pool),
    recompute_ms and remote_ms (per load of the segment, each with its _label), gross_ms,
    stall_ms, write_ms, eviction_ms, benefit_ms, recommendation (publish to pool / pin /
    keep local / do not publish: only positive benefit is recommended), reason,
    first_arrival_ns, last_arrival_ns. Sorted by benefit, best first (rank 1).
    """
    rows = block_outcomes.select(*_COLUMNS, pl.col("outcome").cast(pl.String), "tokens", "bytes")
    groups = _merged(_partial(_segments(rows)))
    if groups.height == 0:
        return pl.DataFrame(schema=_SCHEMA)
    ranked = _with_eviction(_with_terms(groups, costs), costs.device.pool_capacity_bytes)
    return _ranked(_best(ranked, top_n), scenario)


def _best(ranked: pl.DataFrame, top_n: int) -> pl.DataFrame:
    """The ``top_n`` best of ``ranked``, best first, ties by tip (+ 0.0: a benefit of -0.0 ranks
    as 0.0 does): an order on the tips alone, so the best of the best of each part are the best."""
    return ranked.sort(pl.col("benefit_ms") + 0.0, "prefix_hash", descending=[True, False]).head(top_n)


def _ranked(best: pl.DataFrame, scenario: str) -> pl.DataFrame:
    """``best`` (``_best``'s rows) ranked, each with its recommendation and reason."""
    top = best.to_dicts()
    for i, g in enumerate(top, 1):
        g["rank"], g["scenario"], g["reuses"] = i, scenario, int(g["requests"]) - 1
        g["recommendation"], g["reason"] = _recommend(g)
    return pl.DataFrame(top, schema=_SCHEMA)


def prefix_ranking_out_of_core(con: duckdb.DuckDBPyConnection, scenario: str, *, work: Path, partitions: int,
                               costs: CostModel, top_n: int = TOP_N,
                               rows_in_memory: int = ROWS_IN_MEMORY) -> pl.DataFrame:
    """``prefix_ranking`` of ``scenario`` from the ``block_outcomes`` table on ``con`` (the analysis
    DB out of core builds), holding at most about ``rows_in_memory`` rows in Python at once.

    1. One DuckDB pass counts each block hash's accesses (``n``) and writes every access, with its
       count, to the range of requests ``hash(request_id) mod R`` (R: ``partitions``, or more to keep
       ranges near ``rows_in_memory``). What ``_segments`` derives from ``n`` (runs, tips, parents,
       chain totals) is within one request, so each range gives its requests' rows exactly.
    2. Per range: ``_segments`` and ``_partial`` (per tip and replica: integer sums, minima, maxima),
       written to ``work``. DuckDB moves the partial rows to partitions ``tip mod K``.
    3. Per partition of tips: ``_merged`` (one row per group; a tip's partial rows are all in its
       partition, and sums, extremes and distinct replicas merge exactly), then ``_with_terms``,
       row by row as in memory. The pool's demand sums integers; its value is summed exactly
       (``_ExactSum``) and rounded once, as ``math.fsum`` rounds: the same float. The groups with
       their terms are written to ``work``.
    4. Per partition again: the eviction at that value per byte, and its ``top_n`` best (``_best``:
       an order on the tips alone, so the best of every partition's best are the best); those ranked.

    Exact: the frame equals ``prefix_ranking``'s, every float to the bit (tests/test_ooc_ranking.py).
    Memory in Python: O(``rows_in_memory``) rows at a time: one range's accesses (about ``1/R`` of
    the scenario's), or one partition's partial rows or groups (a tip has at most one partial row per
    range and replica, so no group, however popular, outgrows a partition), and ``top_n`` rows per
    partition of tips. DuckDB's count, join and partitioned writes spill past its memory limit.
    ``work``: an empty directory for the spill files (the accesses' copy is removed once read).
    """
    ((total,),) = con.execute("SELECT count(*) FROM block_outcomes WHERE scenario = ?", [scenario]).fetchall()
    if not total:
        return pl.DataFrame(schema=_SCHEMA)
    ranges = max(1, partitions, math.ceil(total / rows_in_memory))
    by_range, partial, by_tip, terms = (work / name for name in ("by_range", "partial", "by_tip", "terms"))
    partial.mkdir()
    terms.mkdir()
    con.execute(f"""
        COPY (WITH o AS (SELECT * FROM block_outcomes WHERE scenario = $scenario),
                   counts AS (SELECT block_hash, CAST(count(*) AS UINTEGER) AS n FROM o GROUP BY block_hash)
              SELECT {", ".join(_COLUMNS)}, CAST(outcome AS VARCHAR) AS outcome, tokens, bytes, n,
                     hash(request_id) % {ranges} AS r
              FROM o JOIN counts USING (block_hash))
        TO '{_quoted(by_range)}' (FORMAT parquet, PARTITION_BY (r))""", {"scenario": scenario})
    rows = 0
    for i, part in enumerate(_parts(by_range)):
        shared = _partial(_segments(pl.read_parquet(part / "*.parquet", hive_partitioning=False)))
        shared.write_parquet(partial / f"{i}.parquet")
        rows += shared.height
    shutil.rmtree(by_range, ignore_errors=True)  # the largest spill: every access once
    if not rows:
        return pl.DataFrame(schema=_SCHEMA)
    tips = max(1, partitions, math.ceil(rows / rows_in_memory))
    con.execute(f"""
        COPY (SELECT *, tip % {tips} AS p FROM read_parquet('{_quoted(partial / "*.parquet")}'))
        TO '{_quoted(by_tip)}' (FORMAT parquet, PARTITION_BY (p))""")
    demand, value = 0, _ExactSum()
    for i, part in enumerate(_parts(by_tip)):
        groups = _merged(pl.read_parquet(part / "*.parquet", hive_partitioning=False))
        if groups.height:
            groups = _with_terms(groups, costs)
            worth = _worth(groups)
            demand += int(worth["segment_bytes"].sum())
            value.add(worth["gross_ms"].to_numpy())
            groups.write_parquet(terms / f"{i}.parquet")
    per_byte = _per_byte(value.total(), demand, costs.device.pool_capacity_bytes)
    best = [_best(_evicting(pl.read_parquet(part), per_byte), top_n) for part in sorted(terms.iterdir())]
    if not best:
        return pl.DataFrame(schema=_SCHEMA)
    return _ranked(_best(pl.concat(best), top_n), scenario)


def _quoted(path: Path) -> str:
    """``path`` inside a SQL string literal."""
    return str(path).replace("'", "''")


def _parts(directory: Path) -> list[Path]:
    """The partitions DuckDB wrote under ``directory`` (none when it wrote no rows)."""
    return sorted(directory.iterdir()) if directory.exists() else []


class _ExactSum:
    """The exact sum of floats added an array at a time, rounded once at the end to the nearest
    float (ties to even), as ``math.fsum`` rounds the sum of all of them at once: the same float
    however they are split. A finite float is a whole number of units of 2**-1126 (its 53-bit
    mantissa times a power of two), so the sum is kept as that whole number: a Python int of a
    few hundred bits. Infinities and NaNs are kept aside and summed with it by ``math.fsum``."""

    _UNIT = 1126  # -log2 of the unit: the smallest subnormal is 2**-1074 = (2**52 / 2**53) * 2**-1073
    _HALF = 26  # mantissas are summed in two halves of 27 bits at most, so int64 sums cannot overflow

    def __init__(self) -> None:
        self.units = 0
        self.special: list[float] = []

    def add(self, values: np.ndarray) -> None:
        x = np.asarray(values, dtype=np.float64)
        finite = np.isfinite(x)
        self.special.extend(x[~finite].tolist())
        mantissa, exponent = np.frexp(x[finite])  # x = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
        if not exponent.size:
            return
        order = np.argsort(exponent, kind="stable")
        exponent = exponent[order]
        whole = (mantissa[order] * 2.0**53).astype(np.int64)  # exact: x = whole * 2**(exponent - 53)
        starts = np.flatnonzero(np.concatenate([[True], exponent[1:] != exponent[:-1]]))
        high = np.add.reduceat(whole >> self._HALF, starts).tolist()
        low = np.add.reduceat(whole & ((1 << self._HALF) - 1), starts).tolist()
        for e, h, lo in zip(exponent[starts].tolist(), high, low, strict=True):
            self.units += ((h << self._HALF) + lo) << (e - 53 + self._UNIT)

    def total(self) -> float:
        exact = self.units / (1 << self._UNIT)  # int / int: correctly rounded
        return math.fsum([*self.special, exact]) if self.special else exact


_SCHEMA = {
    "scenario": pl.String, "rank": pl.Int64, "prefix_hash": pl.UInt64, "parent_hash": pl.UInt64,
    "prefix_tokens": pl.Int64, "bytes": pl.Int64, "segment_tokens": pl.Int64, "segment_bytes": pl.Int64,
    "requests": pl.Int64, "reuses": pl.Int64, "replicas": pl.Int64, "miss_routing_tokens": pl.Int64,
    "miss_evicted_tokens": pl.Int64, "hit_remote_tokens": pl.Int64, "miss_load_failed_tokens": pl.Int64,
    "avoidable_miss_tokens": pl.Int64, "h_remote_ratio": pl.Float64, "path": pl.String,
    "recompute_ms": pl.Float64, "recompute_label": pl.String, "remote_ms": pl.Float64,
    "remote_label": pl.String, "gross_ms": pl.Float64, "stall_ms": pl.Float64, "write_ms": pl.Float64,
    "eviction_ms": pl.Float64, "benefit_ms": pl.Float64, "recommendation": pl.String, "reason": pl.String,
    "first_arrival_ns": pl.Int64, "last_arrival_ns": pl.Int64,
}
