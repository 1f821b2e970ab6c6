"""Analyzers: the engine's own prefix-cache token counters reconciled with the ledger, per replica and window.

The engine side is the increase of its cumulative token counters over the scraped
``metric_samples`` (first name present per replica wins, so a vLLM that exports both the new
and the deprecated names is not counted twice):

- hits: ``vllm:prefix_cache_hits_total``, else ``vllm:gpu_prefix_cache_hits_total``, else
  SGLang's ``sglang:cached_tokens_total``;
- queries: ``vllm:prefix_cache_queries_total``, else ``vllm:gpu_prefix_cache_queries_total``,
  else ``sglang:prompt_tokens_total``;
- external hits (KV connector: LMCache, offloading, P2P): ``vllm:external_prefix_cache_hits_total``.

Increase follows Prometheus' ``increase()`` without extrapolation: per series (name and label
set, so each ``engine`` of a data-parallel replica separately), the sum of the positive
differences between consecutive samples, and after a decrease (a counter reset: the engine
restarted) the value after the reset. When a series exposes its ``<name>_created`` timestamp
and that precedes its first sample, a zero sample is placed at the creation time (as
Prometheus' created-timestamp zero ingestion does), so one scrape after a run reconciles the
whole run. Series increases are summed per replica.

The window: by default one per replica, from its first (possibly created-at) sample to its
last; with ``window_ns``, aligned windows of that width, an increase belonging to the window
of the later sample. The ledger side sums the ``request_ledger`` rows of requests arriving
inside the replica's sampled span, by window of arrival. The engine counts a request's
tokens when it schedules it, slightly after arrival: a request arriving just before a scrape
can fall on the other side of a window edge. A ledger replica without samples gets a row
with NULL engine columns (its window spans its arrivals); samples without ledger requests
get NULL ledger columns.
"""

from __future__ import annotations

from collections.abc import Mapping

import duckdb
import polars as pl

__all__ = ["reconcile", "series_increase"]

COUNTERS: dict[str, tuple[str, ...]] = {
    "hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total",
             "sglang:cached_tokens_total"),
    "queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total",
                "sglang:prompt_tokens_total"),
    "external_hits": ("vllm:external_prefix_cache_hits_total",),
}
_CREATED = {n: n.removesuffix("_total") + "_created" for names in COUNTERS.values() for n in names}
_SERIES = ["replica", "name", "series"]


def _samples(metric_samples: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    names = sorted(set(_CREATED) | set(_CREATED.values()))
    cond = duckdb.ColumnExpression("name").isin(*(duckdb.ConstantExpression(n) for n in names))
    rel = metric_samples.filter(cond).project(
        "replica, name, CAST(labels AS VARCHAR) AS series, ts_ns, value")
    return rel.pl().with_columns(pl.col("replica").fill_null(""))


def _with_created_zero(samples: pl.DataFrame, created_of: Mapping[str, str] = _CREATED) -> pl.DataFrame:
    """Counter samples, plus a zero at each series' creation time when that comes first."""
    counters = samples.filter(pl.col("name").is_in(list(created_of)))
    created = (samples.filter(pl.col("name").is_in(list(created_of.values())))
               .sort("ts_ns").group_by(_SERIES).agg(pl.col("value").first().alias("created_s"))
               .with_columns(pl.col("name").replace({v: k for k, v in created_of.items()})))
    first = counters.group_by(_SERIES).agg(pl.col("ts_ns").min().alias("first_ns"))
    zeros = (first.join(created, on=_SERIES)
             .with_columns((pl.col("created_s") * 1e9).round().cast(pl.Int64).alias("ts_ns"))
             .filter(pl.col("ts_ns") < pl.col("first_ns"))
             .select(*_SERIES, "ts_ns", pl.lit(0.0).alias("value")))
    return pl.concat([counters.select(*_SERIES, "ts_ns", "value"), zeros])


def _deltas(samples: pl.DataFrame) -> pl.DataFrame:
    """Per counter sample: its increase over the previous sample of its series, and resets."""
    role_of = {n: role for role, names in COUNTERS.items() for n in names}
    rank_of = {n: i for names in COUNTERS.values() for i, n in enumerate(names)}
    df = (_with_created_zero(samples).sort([*_SERIES, "ts_ns"])
          .with_columns(pl.col("name").replace_strict(role_of).alias("role"),
                        pl.col("name").replace_strict(rank_of).alias("rank"),
                        pl.col("value").shift(1).over(_SERIES).alias("prev")))
    # Prefer the first-listed name of each role per replica (new vLLM names over deprecated ones).
    df = df.filter(pl.col("rank") == pl.col("rank").min().over(["replica", "role"]))
    reset = pl.col("prev").is_not_null() & (pl.col("value") < pl.col("prev"))
    delta = (pl.when(pl.col("prev").is_null()).then(0.0)
             .when(reset).then(pl.col("value")).otherwise(pl.col("value") - pl.col("prev")))
    return df.select("replica", "role", "ts_ns", delta.alias("delta"), reset.alias("reset"))


def series_increase(samples: pl.DataFrame, counters: tuple[str, ...]) -> pl.DataFrame:
    """Per series (replica, name, series: the label set as text) of ``counters``: its increase
    over the samples, as ``reconcile`` counts it (resets, a created-at zero), and its resets.

    ``samples`` has replica, name, series, ts_ns, value, with the ``<name>_created`` samples too.
    """
    created_of = {n: n.removesuffix("_total") + "_created" for n in counters}
    df = (_with_created_zero(samples, created_of).sort([*_SERIES, "ts_ns"])
          .with_columns(pl.col("value").shift(1).over(_SERIES).alias("prev")))
    reset = pl.col("prev").is_not_null() & (pl.col("value") < pl.col("prev"))
    delta = (pl.when(pl.col("prev").is_null()).then(0.0)
             .when(reset).then(pl.col("value")).otherwise(pl.col("value") - pl.col("prev")))
    return df.group_by(_SERIES).agg(delta.sum().alias("increase"), reset.sum().cast(pl.Int64).alias("resets"))


def _window(col: str, window_ns: int | None, first: str, last: str) -> list[pl.Expr]:
    if window_ns is None:
        return [pl.col(first).alias("window_start_ns"), pl.col(last).alias("window_end_ns")]
    start = (pl.col(col) // window_ns) * window_ns
    return [start.alias("window_start_ns"), (start + window_ns).alias("window_end_ns")]


def _engine(deltas: pl.DataFrame, spans: pl.DataFrame, window_ns: int | None) -> pl.DataFrame:
    df = deltas.join(spans, on="replica").with_columns(_window("ts_ns", window_ns, "first_ns", "last_ns"))
    keys = ["replica", "window_start_ns", "window_end_ns"]

    def role_sum(role: str) -> pl.Expr:
        has = (pl.col("role") == role).any()
        total = pl.col("delta").filter(pl.col("role") == role).sum().round().cast(pl.Int64)
        return pl.when(has).then(total)

    return df.group_by(keys).agg(
        role_sum("queries").alias("engine_queries_tokens"), role_sum("hits").alias("engine_hit_tokens"),
        role_sum("external_hits").alias("engine_external_hit_tokens"),
        pl.col("reset").sum().cast(pl.Int64).alias("counter_resets"))


def _ledger(request_ledger: pl.DataFrame, spans: pl.DataFrame, window_ns: int | None) -> pl.DataFrame:
    df = (request_ledger.select(pl.col("replica").fill_null(""), "arrival_ns", "prompt_tokens", "hit_tokens",
                                "cached_tokens")
          .join(spans, on="replica", how="left")
          .filter(pl.col("first_ns").is_null() | pl.col("arrival_ns").is_between("first_ns", "last_ns"))
          .with_columns(pl.col("first_ns").fill_null(pl.col("arrival_ns").min().over("replica")),
                        pl.col("last_ns").fill_null(pl.col("arrival_ns").max().over("replica")))
          .with_columns(_window("arrival_ns", window_ns, "first_ns", "last_ns")))
    cached = pl.col("cached_tokens").sum().cast(pl.Int64)
    return df.group_by(["replica", "window_start_ns", "window_end_ns"]).agg(
        pl.len().cast(pl.Int64).alias("ledger_requests"),
        pl.col("prompt_tokens").sum().cast(pl.Int64).alias("ledger_prompt_tokens"),
        pl.col("hit_tokens").sum().cast(pl.Int64).alias("ledger_hit_tokens"),
        pl.when(pl.col("cached_tokens").count() > 0).then(cached).alias("reported_cached_tokens"))


def reconcile(*, metric_samples: duckdb.DuckDBPyRelation, request_ledger: pl.DataFrame, scenario: str,
              replica_map: Mapping[str, str] | None = None, window_ns: int | None = None) -> pl.DataFrame:
    """Engine counter increases beside the ledger's hit tokens, per replica and window.

    ``metric_samples`` are the rows of the scenario holding the scrapes (``scenario`` itself, or
    another: live scrapes are in ``live``). ``request_ledger`` is that analysis' frame for
    ``scenario``. ``replica_map`` renames scraped replicas to the ledger's names (a
    ledger without replicas has ``''``). ``window_ns``: fixed windows instead of one per replica.

    Columns: scenario, replica, window_start_ns, window_end_ns, engine_queries_tokens,
    engine_hit_tokens, engine_external_hit_tokens, counter_resets, ledger_requests,
    ledger_prompt_tokens, ledger_hit_tokens, reported_cached_tokens, difference_tokens
    (engine hits + external hits - ledger hit tokens), difference_ratio (that over the engine's
    hits), reported_difference_tokens (engine hits + external hits - reported cached tokens).
    Sorted by replica, then window start.
    """
    if window_ns is not None and window_ns <= 0:
        raise ValueError(f"window_ns must be positive, got {window_ns}")
    samples = _samples(metric_samples)
    if replica_map:
        samples = samples.with_columns(pl.col("replica").replace(dict(replica_map)))
    deltas = _deltas(samples)
    spans = deltas.group_by("replica").agg(pl.col("ts_ns").min().alias("first_ns"),
                                           pl.col("ts_ns").max().alias("last_ns"))
    keys = ["replica", "window_start_ns", "window_end_ns"]
    out = _engine(deltas, spans, window_ns).join(_ledger(request_ledger, spans, window_ns), on=keys,
                                                 how="full", coalesce=True)
    engine_hits = pl.col("engine_hit_tokens") + pl.col("engine_external_hit_tokens").fill_null(0)
    diff = engine_hits - pl.col("ledger_hit_tokens").fill_null(0)
    return out.select(
        pl.lit(scenario).alias("scenario"), *keys, "engine_queries_tokens", "engine_hit_tokens",
        "engine_external_hit_tokens", "counter_resets", "ledger_requests", "ledger_prompt_tokens",
        "ledger_hit_tokens", "reported_cached_tokens", diff.alias("difference_tokens"),
        pl.when(engine_hits > 0).then(diff / engine_hits).alias("difference_ratio"),
        (engine_hits - pl.col("reported_cached_tokens")).alias("reported_difference_tokens"),
    ).sort(["replica", "window_start_ns"])
