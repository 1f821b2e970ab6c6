"""Analyzers: tiers: where hits came from, against the engines' per-source counters, and what each tier paid.

Two tables from the block outcomes (each hit's ``origin``: gpu, cpu, disk, pool, or the replica a
transfer came from) and the KV events:

- ``tier_reconciliation``, per replica and source (``device``, ``host``, ``disk``, ``remote``):
  the ledger's hit tokens by origin; the engine's per-request split where requests carry it
  (SGLang's ``cached_tokens_details``: device, host, storage; kvlens counts SGLang's storage, its
  L3, as remote, the tier its EXTERNAL events name); and the increase of the engine's per-source
  counter over the scraped samples: vLLM's ``vllm:prompt_tokens_cached_by_source_total{source}``
  (vllm/v1/metrics/loggers.py: device, host, disk, p2p, external_unspecified; the last two are
  remote) or SGLang's ``sglang:cached_tokens_total{cache_source}``. Increases are counted as
  ``reconcile`` counts them (resets, a created-at zero), over every sample of the replica.
- ``tier_payoff``, per location (a replica, or ``pool``) and tier: the blocks stored there (one
  per stored event: a physical copy written), the removals, the GPU removals that were demotions
  (the block stayed on the same location's lower tier, stored in the same batch or before:
  SGLang's hierarchical cache publishes a ``CPU_PINNED`` store when the host copy lands and a
  ``GPU`` removal when the device copy goes, sgl-project/sglang#39108), and the hits the tier
  served, in blocks, tokens and bytes. A tier ``paid_off`` when it served at least the bytes
  written to it: each byte stored was read back once on average.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import polars as pl

from kvlens.analyzers.reconcile import series_increase
from kvlens.analyzers.scans import Scans, grouped
from kvlens.schema import HIT_OUTCOMES, Medium

__all__ = ["tier_payoff", "tier_reconciliation"]

SOURCES = ("device", "host", "disk", "remote")
# The engine's source label -> kvlens's source.
_VLLM = {"device": "device", "host": "host", "disk": "disk", "p2p": "remote",
         "external_unspecified": "remote"}
_SGLANG = {"device": "device", "host": "host", "storage": "remote"}
_COUNTERS = {"vllm:prompt_tokens_cached_by_source_total": ("source", _VLLM),
             "sglang:cached_tokens_total": ("cache_source", _SGLANG)}
_ORIGIN_SOURCE = {Medium.GPU.value: "device", Medium.CPU.value: "host", Medium.DISK.value: "disk"}
_REPORTED = {"device": "cached_device_tokens", "host": "cached_host_tokens",
             "remote": "cached_storage_tokens"}

SAMPLE_COLUMNS = ("coalesce(replica, '') AS replica, name, CAST(labels AS VARCHAR) AS series, ts_ns, value, "
                  "coalesce(labels['source'], labels['cache_source']) AS label")


def _engine_counters(metric_samples: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    """(replica, source, engine_counter_tokens) from the per-source counters, summed over series."""
    counters = tuple(_COUNTERS)
    names = [*counters, *(n.removesuffix("_total") + "_created" for n in counters)]
    cond = duckdb.ColumnExpression("name").isin(*(duckdb.ConstantExpression(n) for n in names))
    samples = metric_samples.filter(cond).project(SAMPLE_COLUMNS).pl()
    empty = pl.DataFrame(schema={"replica": pl.Utf8, "source": pl.Utf8, "engine_counter_tokens": pl.Int64})
    if samples.height == 0:
        return empty
    label_of = samples.select("replica", "name", "series", "label").unique(["replica", "name", "series"])
    up = series_increase(samples.drop("label"), counters).join(label_of, on=["replica", "name", "series"])
    sources = pl.DataFrame([{"name": n, "label": k, "source": v} for n, (_, m) in _COUNTERS.items()
                            for k, v in m.items()])
    return (up.join(sources, on=["name", "label"])
            .group_by("replica", "source")
            .agg(pl.col("increase").sum().round().cast(pl.Int64).alias("engine_counter_tokens")))


def _hits_sql(select: str) -> str:
    """SQL over the relation ``outcomes`` (one scenario's block outcomes, out of core): ``select``
    over its hits, grouped by the columns it names first (GROUP BY ALL)."""
    hits = ", ".join(f"'{o}'" for o in sorted(HIT_OUTCOMES))
    return f"SELECT {select} FROM outcomes WHERE CAST(outcome AS VARCHAR) IN ({hits}) GROUP BY ALL"


# A hit's source and location as the frame's expressions give them (an origin not in the map,
# NULL included, is remote; a NULL origin's location is NULL and its tier gpu).
_SOURCE_SQL = ("CASE " + " ".join(f"WHEN origin = '{k}' THEN '{v}'" for k, v in _ORIGIN_SOURCE.items())
               + " ELSE 'remote' END")
_LOCAL_SQL = f"origin IN ('{Medium.GPU.value}', '{Medium.CPU.value}', '{Medium.DISK.value}')"
_SERVED_SQL = _hits_sql(
    f"CASE WHEN {_LOCAL_SQL} THEN coalesce(replica, '') WHEN origin = '{Medium.POOL.value}' THEN 'pool' "
    f"ELSE origin END AS location, CASE WHEN {_LOCAL_SQL} OR origin = '{Medium.POOL.value}' THEN origin "
    f"ELSE '{Medium.GPU.value}' END AS tier, count(*) AS hit_blocks, "
    "coalesce(sum(tokens), 0) AS hit_tokens, coalesce(sum(bytes), 0) AS hit_bytes")


def _ledger_sources(block_outcomes: pl.DataFrame | duckdb.DuckDBPyRelation) -> pl.DataFrame:
    if isinstance(block_outcomes, duckdb.DuckDBPyRelation):
        sql = _hits_sql(f"coalesce(replica, '') AS replica, {_SOURCE_SQL} AS source, "
                        "coalesce(sum(tokens), 0) AS ledger_hit_tokens")
        sums = grouped(block_outcomes, sql)
        return sums.with_columns(pl.col("ledger_hit_tokens").cast(pl.Int64))
    hits = block_outcomes.filter(pl.col("outcome").cast(pl.Utf8).is_in(list(HIT_OUTCOMES)))
    source = pl.col("origin").replace_strict(_ORIGIN_SOURCE, default="remote")
    return (hits.with_columns(pl.col("replica").fill_null(""), source=source)
            .group_by("replica", "source")
            .agg(pl.col("tokens").sum().cast(pl.Int64).alias("ledger_hit_tokens")))


def _reported(requests: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    req = requests.select("request_id", "replica", *_REPORTED.values()).pl()
    req = req.unique("request_id", keep="first").with_columns(pl.col("replica").fill_null(""))
    frames = [req.group_by("replica").agg(
        pl.lit(src).alias("source"),
        pl.when(pl.col(col).count() > 0).then(pl.col(col).sum()).cast(pl.Int64).alias("reported_tokens"))
        for src, col in _REPORTED.items()]
    return pl.concat(frames).filter(pl.col("reported_tokens").is_not_null())


def tier_reconciliation(*, block_outcomes: pl.DataFrame | duckdb.DuckDBPyRelation,
                        requests: duckdb.DuckDBPyRelation, metric_samples: duckdb.DuckDBPyRelation,
                        scenario: str) -> pl.DataFrame:
    """Hit tokens per replica and source: the ledger's, the engine's per request, its counters'.

    ``requests`` are the scenario's; ``metric_samples`` those of the scenario holding its scrapes.

    Columns: scenario, replica, source (device, host, disk, remote), ledger_hit_tokens,
    reported_tokens (requests' per-tier split, when reported), engine_counter_tokens (the
    per-source counter's increase, when scraped), difference_tokens (the counter, else the
    reported split, minus the ledger). One row per replica and source any side knows; sorted.
    ``block_outcomes``: a frame, or out of core a relation of the scenario's rows (DuckDB sums them).
    """
    keys = ["replica", "source"]
    out = (_ledger_sources(block_outcomes)
           .join(_reported(requests), on=keys, how="full", coalesce=True)
           .join(_engine_counters(metric_samples), on=keys, how="full", coalesce=True))
    engine = pl.coalesce("engine_counter_tokens", "reported_tokens")
    return out.select(
        pl.lit(scenario).alias("scenario"), *keys, pl.col("ledger_hit_tokens").fill_null(0),
        "reported_tokens", "engine_counter_tokens",
        (engine - pl.col("ledger_hit_tokens").fill_null(0)).alias("difference_tokens"),
    ).sort(keys)


EVENT_COLUMNS = ("CASE WHEN medium = 'pool' THEN 'pool' ELSE coalesce(replica, '') END AS location, "
                 "CAST(medium AS VARCHAR) AS tier, CAST(kind AS VARCHAR) AS kind, block_hash, "
                 "coalesce(group_idx, 0) AS group_idx, block_tokens, ts_ns")


def _stored(events: duckdb.DuckDBPyRelation, block_size_tokens: int, scans: Scans) -> pl.DataFrame:
    """Per location, tier and group: the blocks stored (one per stored event), their tokens, the
    removals (counted in DuckDB, and continued from the previous run's counts: ``scans``)."""
    return scans.aggregate(f"tiers.stored.{int(block_size_tokens)}", "kv_events", events,
                           ["location", "tier", "group_idx"], {
        "stored_blocks": ("CAST(count(*) FILTER (WHERE kind = 'stored') AS BIGINT)", "sum"),
        "stored_tokens": (f"CAST(coalesce(sum(coalesce(block_tokens, {int(block_size_tokens)})) "
                          "FILTER (WHERE kind = 'stored'), 0) AS BIGINT)", "sum"),
        "removed_blocks": ("CAST(count(*) FILTER (WHERE kind = 'removed') AS BIGINT)", "sum")})


def _demoted(events: duckdb.DuckDBPyRelation) -> pl.DataFrame:
    """Per location, the GPU removals that were demotions.

    A GPU removal is a demotion when the same location's latest lower-tier event for the block
    (same group), up to the removal's time, stored it; at that time a store, if any, wins over
    a removal of the same instant. Only the lower tiers' events and the GPU removals are read,
    and none of the removals when no lower tier has an event.
    """
    keys = ["location", "block_hash", "group_idx"]
    known = events.filter("block_hash IS NOT NULL AND ts_ns IS NOT NULL")
    lower = (known.filter(f"tier IN ('{Medium.CPU.value}', '{Medium.DISK.value}')")
             .aggregate("location, block_hash, group_idx, ts_ns, bool_or(kind = 'stored') AS stored").pl()
             .sort("ts_ns"))
    if lower.is_empty():
        return _demoted_none()
    removals = (known.filter(f"tier = '{Medium.GPU.value}' AND kind = 'removed'")
                .select(*keys, "ts_ns").pl().sort("ts_ns"))
    # Both sides are sorted on ts_ns; polars cannot check that within the by-groups.
    latest = removals.join_asof(lower, on="ts_ns", by=keys, strategy="backward", check_sortedness=False)
    return (latest.filter(pl.col("stored").fill_null(False)).group_by("location")
            .agg(pl.len().cast(pl.Int64).alias("demoted_blocks")).with_columns(tier=pl.lit(Medium.GPU.value)))


def _demoted_none() -> pl.DataFrame:
    return pl.DataFrame(schema={"location": pl.Utf8, "demoted_blocks": pl.Int64, "tier": pl.Utf8})


def _served(block_outcomes: pl.DataFrame | duckdb.DuckDBPyRelation) -> pl.DataFrame:
    """Hits by the location and tier that served them."""
    if isinstance(block_outcomes, duckdb.DuckDBPyRelation):
        return grouped(block_outcomes, _SERVED_SQL).with_columns(
            pl.col(c).cast(pl.Int64) for c in ("hit_blocks", "hit_tokens", "hit_bytes"))
    hits = block_outcomes.filter(pl.col("outcome").cast(pl.Utf8).is_in(list(HIT_OUTCOMES)))
    local = pl.col("origin").is_in([Medium.GPU.value, Medium.CPU.value, Medium.DISK.value])
    pool = pl.col("origin") == Medium.POOL.value
    return (hits.with_columns(
        location=pl.when(local).then(pl.col("replica").fill_null("")).when(pool).then(pl.lit("pool"))
        .otherwise(pl.col("origin")),
        tier=pl.when(local | pool).then(pl.col("origin")).otherwise(pl.lit(Medium.GPU.value)))
        .group_by("location", "tier")
        .agg(pl.len().cast(pl.Int64).alias("hit_blocks"),
             pl.col("tokens").sum().cast(pl.Int64).alias("hit_tokens"),
             pl.col("bytes").sum().cast(pl.Int64).alias("hit_bytes")))


def tier_payoff(*, block_outcomes: pl.DataFrame | duckdb.DuckDBPyRelation, kv_events: duckdb.DuckDBPyRelation,
                scenario: str, bytes_per_token: int, block_size_tokens: int = 16,
                group_bytes_per_token: Sequence[int] | None = None,
                scans: Scans | None = None) -> pl.DataFrame:
    """What each tier of each location stored, lost, demoted and served.

    Columns: scenario, replica (the location: a replica or ``pool``), tier (gpu, cpu, disk, pool),
    stored_blocks, stored_bytes, removed_blocks, demoted_blocks (GPU tier: removals whose block
    stayed on a lower tier there), evicted_blocks (removals that were not demotions), hit_blocks,
    hit_tokens, hit_bytes, served_per_stored_ratio (hit over stored bytes), paid_off (hit bytes at
    least the stored bytes; NULL when nothing was stored). ``bytes_per_token`` prices a stored
    block (``group_bytes_per_token``: each KV cache group its own rate, as for block outcomes);
    ``block_size_tokens`` stands in for an event without a block size. ``scans``: continues the
    store counts from the previous run's (analyzers/scans.py). Sorted. ``block_outcomes``: a
    frame, or out of core a relation of the scenario's rows (DuckDB sums them).
    """
    cond = duckdb.ColumnExpression("kind") != duckdb.ConstantExpression("cleared")
    events = kv_events.filter(cond).project(EVENT_COLUMNS)
    stored = _stored(events, block_size_tokens, scans or Scans({"kv_events": (kv_events, "ts_ns")}))
    # Every event but a clear has a row in ``stored`` (its location, tier and group); with none on a
    # lower tier there is no demotion, and the lake's events need no second read (a read of every
    # event ever collected, where ``stored`` continues from the previous run's counts).
    lower = stored.filter(pl.col("tier").is_in([Medium.CPU.value, Medium.DISK.value]))
    demoted = _demoted(events) if lower.height else _demoted_none()
    rates = list(group_bytes_per_token or [])
    groups = sorted(set(stored["group_idx"].to_list()))
    per_group = len(rates) >= 2 and groups == list(range(len(rates)))
    rate = (pl.col("group_idx").replace_strict(dict(enumerate(rates)), default=bytes_per_token) if per_group
            else pl.lit(bytes_per_token))
    stored = (stored.with_columns(stored_bytes=pl.col("stored_tokens") * rate)
              .group_by("location", "tier")
              .agg(pl.col("stored_blocks").sum(), pl.col("stored_bytes").sum(),
                   pl.col("removed_blocks").sum()))
    out = (stored.join(_served(block_outcomes), on=["location", "tier"], how="full", coalesce=True)
           .join(demoted, on=["location", "tier"], how="left")
           .with_columns(pl.col(c).fill_null(0).cast(pl.Int64) for c in
                         ("stored_blocks", "stored_bytes", "removed_blocks", "demoted_blocks", "hit_blocks",
                          "hit_tokens", "hit_bytes")))
    ratio = pl.when(pl.col("stored_bytes") > 0).then(pl.col("hit_bytes") / pl.col("stored_bytes"))
    return out.select(
        pl.lit(scenario).alias("scenario"), pl.col("location").alias("replica"), "tier", "stored_blocks",
        "stored_bytes", "removed_blocks", "demoted_blocks",
        (pl.col("removed_blocks") - pl.col("demoted_blocks")).alias("evicted_blocks"), "hit_blocks",
        "hit_tokens", "hit_bytes", ratio.alias("served_per_stored_ratio"),
        pl.when(pl.col("stored_bytes") > 0).then(pl.col("hit_bytes") >= pl.col("stored_bytes"))
        .alias("paid_off"),
    ).sort("replica", "tier")
