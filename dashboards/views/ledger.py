"""Dashboards: the overview and misses pages, both read from the miss ledger."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import (
    Context,
    empty,
    fmt_bytes,
    fmt_ratio,
    label,
    origin,
    provenance_note,
    show_chart,
)
from kvlens.dashboards.queries import (
    hit_ratios,
    ledger_by_outcome,
    pick_bucket_ns,
    reconciliation,
    scenario_span_ns,
    trend,
)
from kvlens.dashboards.read import has_rows
from kvlens.dashboards.views.decision import decision
from kvlens.schema import HIT_OUTCOMES

__all__ = ["misses", "overview"]


def _outcome_totals(ledger: pl.DataFrame) -> pl.DataFrame:
    totals = ledger.group_by("outcome").agg(
        pl.col("blocks").sum(), pl.col("tokens").sum(), pl.col("bytes").sum()
    )
    return totals.with_columns((pl.col("tokens") / pl.col("tokens").sum()).alias("share")).sort(
        "tokens", descending=True
    )


def _headline(ctx: Context) -> None:
    ratios = hit_ratios(ctx.cur, ctx.scenario, ctx.window)
    tails = has_rows(ctx.cur, "latency_tails", ctx.scenario)
    worst = analyses.worst_tail(ctx.cur, ctx.scenario, ctx.window) if tails else {}
    found = origin(ctx)
    per_token = found.kv_bytes_per_token
    geometry = f"{found.model}, {per_token:,} B/token" if per_token else "unrecorded"
    a, b, c, d = st.columns(4)
    a.metric("Requests", f"{ratios.get('requests') or 0:,}")
    b.metric(
        label("Token hit ratio", found),
        fmt_ratio(ratios.get("token_hit_ratio")),
        help="hit tokens over every prompt token (partial tails included)",
    )
    c.metric(
        label("Byte hit ratio", found),
        fmt_ratio(ratios.get("byte_hit_ratio")),
        help=f"hit KV bytes over {fmt_bytes(ratios.get('prompt_bytes'))} of prompt KV ({geometry}, "
        f"{found.model_source or 'source unrecorded'})",
    )
    if ratios.get("unobserved_tokens"):
        prompt = ratios.get("prompt_tokens") or 0
        unobserved = ratios["unobserved_tokens"] / prompt if prompt else None
        reusable = (ratios.get("reusable_tokens") or 0) / prompt if prompt else None
        st.info(f"{fmt_ratio(unobserved)} of prompt tokens ran on replicas that published no KV events "
                "(outcome unobserved): whether they were cached is unknown. An unbounded cache could have "
                f"served {fmt_ratio(reusable)} of all prompt tokens (modelled: every full block an earlier "
                "request needed).")
    if ratios.get("incomplete_requests"):
        st.warning(f"Incomplete: {ratios['incomplete_requests']:,} of {ratios['requests']:,} requests "
                   "arrived after the collector lost KV-event batches of their replica that the engine's "
                   "replay no longer held (measured: kvlens_collector_gap_batches); their outcomes, and the "
                   "ratios above, may be off until that replica's cache was cleared.")
    if worst:
        where = f"{worst['replica']}, " + (
            "whole scenario" if worst["window"] is None else f"{worst['window']:%H:%M}"
        )
        d.metric(found.ttft("Worst TTFT P99/P50"), f"{worst['p99_p50_ratio']:.1f}x",
                 help=f"{where}; flagged above 5")
    else:
        d.metric("Worst TTFT P99/P50", "n/a", help="latency_tails has no rows yet for this scenario")


def overview(ctx: Context) -> None:
    """Hit ratios, the ledger by outcome per replica, the trend over time, the worst tail."""
    st.header(f"Overview: {ctx.scenario}")
    provenance_note(ctx)
    if empty(ctx, "miss_ledger"):
        return
    decision(ctx)  # the report's first screen, in its order; the whole selected range follows
    st.subheader("The selected range")
    _headline(ctx)
    ledger = ledger_by_outcome(ctx.cur, ctx.scenario, ctx.window)
    show_chart(charts.ledger_chart(ledger))
    span = scenario_span_ns(ctx.cur, ctx.scenario)
    if span is not None:
        lo = ctx.window.start_ns if ctx.window.start_ns is not None else span[0]
        hi = ctx.window.end_ns - 1 if ctx.window.end_ns is not None else span[1]  # the last ns in it
        bucket_ns = pick_bucket_ns(max(hi - lo, 1))
        show_chart(
            charts.hit_ratio_trend_chart(
                trend(ctx.cur, ctx.scenario, ctx.window, bucket_ns),
                title=f"How did the token hit ratio move ({bucket_ns // 60_000_000_000} min buckets)?",
            )
        )
    st.subheader("Ledger by outcome")
    st.dataframe(
        _outcome_totals(ledger),
        hide_index=True,
        column_config={"share": st.column_config.NumberColumn(format="percent")},
    )
    empty(ctx, "latency_tails")  # says so when it is
    if has_rows(ctx.cur, "reconciliation", ctx.scenario):  # only where the engines' /metrics were scraped
        _reconciliation(ctx)


def _reconciliation(ctx: Context) -> None:
    """The engines' own prefix-cache hit counters beside the ledger (kvlens analyze --metrics-from)."""
    st.subheader("Engine counters against the ledger")
    st.caption("Increase of the engines' prefix-cache hit counters (local + external) over the scraped "
               "span, beside the ledger's hit tokens and the per-request cached tokens the engines "
               "reported; whole scenario.")
    frame = reconciliation(ctx.cur, ctx.scenario)
    show_chart(charts.reconciliation_chart(frame))
    st.dataframe(frame, hide_index=True,
                 column_config={"difference_ratio": st.column_config.NumberColumn(format="percent")})


def misses(ctx: Context) -> None:
    """Drill from an outcome to the replicas, to the requests, to the blocks behind it."""
    st.header(f"Misses: {ctx.scenario}")
    provenance_note(ctx)
    if empty(ctx, "block_outcomes"):
        return
    totals = _outcome_totals(ledger_by_outcome(ctx.cur, ctx.scenario, ctx.window))
    misses_only = totals.filter(~pl.col("outcome").is_in(HIT_OUTCOMES) & (pl.col("tokens") > 0))
    if misses_only.height == 0:
        st.success("no missed blocks in this window")
        return
    st.dataframe(
        misses_only,
        hide_index=True,
        column_config={"share": st.column_config.NumberColumn("share of tokens", format="percent")},
    )
    outcome = st.selectbox("Outcome", misses_only["outcome"].to_list(), key="miss_outcome")
    replicas = analyses.outcome_replicas(ctx.cur, ctx.scenario, ctx.window, outcome)
    show_chart(charts.replica_bar_chart(replicas, title=f"Which replicas had the {outcome} tokens?"))
    if replicas.height == 0:
        return
    replica = st.selectbox("Replica", replicas["replica"].to_list(), key="miss_replica")
    requests = analyses.outcome_requests(ctx.cur, ctx.scenario, ctx.window, outcome, replica)
    st.subheader(f"Requests on {replica} with {outcome} blocks (top {requests.height} by tokens)")
    st.dataframe(requests, hide_index=True)
    if requests.height == 0:
        return
    request_id = st.selectbox("Request", requests["request_id"].to_list(), key="miss_request")
    st.subheader(f"Blocks of {request_id}")
    st.dataframe(analyses.request_blocks(ctx.cur, ctx.scenario, request_id), hide_index=True)
