"""Analyzers: one row per request from several sources: gateway blocks, engine span timings, API usage.

A scenario's ``requests`` (typically from a gateway log, with replica and blocks) is joined by
request id with the ``requests`` of other scenarios (an OTLP span import, an API usage log):
a column the scenario lacks (NULL) is taken from the first joined source that has it. The
sources' clocks differ, so the offset of each source is estimated as the median of
``source.arrival_ns − scenario.arrival_ns`` over the matched requests (with its interquartile
range) and reported; times are not shifted, since the ledger's look-up time comes from the
scenario's own clock.

Ids are compared as sent, never rewritten. A source row matches the scenario's row of the same id;
failing that, vLLM's suffixed form: vLLM 0.32 names each engine request of a completions call
``<API id>-<prompt index>`` (``vllm/entrypoints/openai/completion/serving.py``,
``create_completion``: ``request_id_item = f"{request_id}-{i}"``) and each of several engine
inputs of a chat or responses call ``<API id>_<index>`` (``chat_completion/serving.py``,
``responses/serving.py``), and its ``llm_request`` span carries that id
(``vllm/v1/engine/output_processor.py``: ``GEN_AI_REQUEST_ID: req_state.external_req_id``; the
8 random characters ``input_processor.assign_request_id`` appends stay internal). So a source id
``X-<digits>`` or ``X_<digits>`` matches a scenario request ``X`` that has no exact match, for
any index, when exactly one source row has that form, and a scenario request ``X-<digits>`` (the
spans as the scenario, the gateway as the source) matches a source row ``X`` in the same way;
several candidates either way (one API call of many prompts) are ambiguous, left unmatched and
counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import polars as pl

__all__ = ["FILLED_COLUMNS", "join_sources"]

# Columns a joined source may fill where the scenario's row has NULL.
FILLED_COLUMNS = ("first_token_ns", "end_ns", "replica", "model", "tenant", "session_id", "output_tokens",
                  "cached_tokens", "ttft_ms", "queue_ms", "prefill_ms")


# vLLM's suffixes: "-<prompt index>" (completions), "_<index>" (chat / responses with several inputs).
_VLLM_SUFFIX = r"[-_][0-9]+$"


def _rows(requests: duckdb.DuckDBPyRelation, scenario: str) -> pl.DataFrame:
    cond = duckdb.ColumnExpression("scenario") == duckdb.ConstantExpression(scenario)
    return requests.filter(cond).pl().unique("request_id", keep="first", maintain_order=True)


def _pairs(base: pl.DataFrame, other: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """(request_id, source_id, by_suffix) for every match, and how many requests were ambiguous.

    Exact ids first; then vLLM's suffixed form on either side (the spans may be the scenario and
    the gateway the source, or the other way round). A request with several candidates, or a
    source id claimed by several requests (one completions call of several prompts), is ambiguous
    and left unmatched.
    """
    exact = (base.select("request_id").join(other.select("request_id"), on="request_id")
             .with_columns(source_id=pl.col("request_id"), by_suffix=pl.lit(False)))
    free_other = other.select(source_id="request_id").join(
        exact.select(source_id="request_id"), on="source_id", how="anti")
    free_base = base.select("request_id").join(exact.select("request_id"), on="request_id", how="anti")
    stripped = pl.col("source_id").str.replace(_VLLM_SUFFIX, "")
    other_suffixed = (free_other.with_columns(key=stripped).filter(pl.col("key") != pl.col("source_id"))
                      .join(free_base, left_on="key", right_on="request_id").select(
                          request_id="key", source_id="source_id"))
    base_suffixed = (free_base.with_columns(key=pl.col("request_id").str.replace(_VLLM_SUFFIX, ""))
                     .filter(pl.col("key") != pl.col("request_id"))
                     .join(free_other, left_on="key", right_on="source_id")
                     .select("request_id", source_id="key"))
    cand = pl.concat([other_suffixed, base_suffixed]).unique()
    by_request = cand.group_by("request_id").agg(n=pl.len())
    by_source = cand.group_by("source_id").agg(m=pl.len())
    unique = (cand.join(by_request, on="request_id").join(by_source, on="source_id")
              .filter((pl.col("n") == 1) & (pl.col("m") == 1))
              .select("request_id", "source_id", by_suffix=pl.lit(True)))
    ambiguous = cand.select("request_id").unique().height - unique.height
    return pl.concat([exact.select("request_id", "source_id", "by_suffix"), unique]), ambiguous


def _report(scenario: str, source: str, base: pl.DataFrame, other: pl.DataFrame, pairs: pl.DataFrame,
            ambiguous: int) -> dict[str, object]:
    matched = (base.join(pairs, on="request_id")
               .join(other.select(source_id="request_id", other_arrival="arrival_ns"), on="source_id"))
    offsets = (matched["other_arrival"] - matched["arrival_ns"]).drop_nulls().cast(pl.Float64) / 1e6
    kinds = other["source"].drop_nulls().unique().sort().to_list()
    return {
        "scenario": scenario, "source_scenario": source, "source": ",".join(kinds) or None,
        "requests": base.height, "matched": matched.height, "missing": base.height - matched.height,
        "only_in_source": other.height - matched.height,
        "matched_by_suffix": int(matched["by_suffix"].sum()), "ambiguous": ambiguous,
        "clock_offset_ms": offsets.median() if offsets.len() else None,
        "clock_offset_iqr_ms": (offsets.quantile(0.75) - offsets.quantile(0.25))  # type: ignore[operator]
        if offsets.len() else None,
    }


def join_sources(*, requests: duckdb.DuckDBPyRelation, scenario: str, sources: Sequence[str],
                 matched_ids: bool = False) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The scenario's requests with NULL columns filled from ``sources``, and a report.

    Returns (requests, report). ``requests`` has the columns of table `requests`, one row per
    request id of ``scenario`` (ids as the scenario has them), in its original order. ``report``
    has one row per source scenario: scenario, source_scenario, source (formats seen), requests,
    matched, missing (scenario requests the source lacks), only_in_source, matched_by_suffix (of
    matched, through vLLM's ``<id>-<index>`` / ``<id>_<index>`` form), ambiguous (requests whose id
    several suffixed source ids share, left unmatched), clock_offset_ms (median of source minus
    scenario arrival over matched requests), clock_offset_iqr_ms. With ``matched_ids``,
    ``requests`` also has ``source_request_id``: the id of the first source row each request
    matched (NULL where none did), for callers that key results by the other side's ids.
    """
    base = _rows(requests, scenario)
    joined = base.with_columns(source_request_id=pl.lit(None, pl.String))
    reports = []
    for source in sources:
        other = _rows(requests, source)
        pairs, ambiguous = _pairs(base, other)
        reports.append(_report(scenario, source, base, other, pairs, ambiguous))
        fill = pairs.join(other.select(pl.col("request_id").alias("source_id"),
                                       *[pl.col(c).alias(f"{c}__src") for c in FILLED_COLUMNS]),
                          on="source_id").drop("by_suffix")
        joined = (joined.join(fill, on="request_id", how="left", maintain_order="left")
                  .with_columns([pl.coalesce(c, f"{c}__src").alias(c) for c in FILLED_COLUMNS])
                  .with_columns(source_request_id=pl.coalesce("source_request_id", "source_id"))
                  .drop([f"{c}__src" for c in FILLED_COLUMNS] + ["source_id"]))
    report = pl.DataFrame(reports, schema={
        "scenario": pl.String, "source_scenario": pl.String, "source": pl.String, "requests": pl.Int64,
        "matched": pl.Int64, "missing": pl.Int64, "only_in_source": pl.Int64, "matched_by_suffix": pl.Int64,
        "ambiguous": pl.Int64, "clock_offset_ms": pl.Float64, "clock_offset_iqr_ms": pl.Float64})
    return joined.select(base.columns + (["source_request_id"] if matched_ids else [])), report
