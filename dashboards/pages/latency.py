"""Dashboards: the latency page: TTFT percentiles by prefix class and by replica."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import (
    Context,
    empty,
    origin,
    page_header,
    show_chart,
)

__all__ = ["flagged", "latency", "percentiles_long"]


_FLAG_RATIO = 5.0


def percentiles_long(frame: pl.DataFrame, key: str) -> pl.DataFrame:
    names = {"ttft_p50_ms": "p50", "ttft_p95_ms": "p95", "ttft_p99_ms": "p99"}
    long = frame.unpivot(index=[key], on=list(names), variable_name="percentile", value_name="ttft_ms")
    return long.with_columns(pl.col("percentile").replace_strict(names))


def flagged(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.with_columns((pl.col("p99_p50_ratio") > _FLAG_RATIO).alias("flag_p99_p50_above_5"))


def latency(ctx: Context) -> None:
    """TTFT percentiles per prefix class, over time, and per replica; tails above 5x flagged."""
    page_header(ctx, "Latency")
    if empty(ctx, "latency_tails"):
        return
    found = origin(ctx)
    by_class = analyses.latency_by_class(ctx.cur, ctx.scenario)
    if by_class.height:
        every = by_class.filter(pl.col("prefix_class") == "all")
        if every.height:
            row = every.row(0, named=True)
            a, b, c, d = st.columns(4)
            a.metric(found.ttft("TTFT P50"), f"{row['ttft_p50_ms']:,.0f} ms")
            b.metric(found.ttft("TTFT P99"), f"{row['ttft_p99_ms']:,.0f} ms")
            c.metric(found.ttft("P99/P50"), f"{row['p99_p50_ratio']:.1f}x")
            d.metric(found.ttft("Queue P50"), f"{row['queue_p50_ms']:,.0f} ms")
        st.caption(f"Per prefix class, whole scenario, all replicas; TTFT "
                   f"{found.ttft_label or 'unlabelled'}.")
        show_chart(charts.latency_class_chart(percentiles_long(by_class, "prefix_class")))
        st.dataframe(flagged(by_class), hide_index=True)
    trend = analyses.latency_trend(ctx.cur, ctx.scenario, ctx.window)
    if trend.height:
        show_chart(charts.latency_trend_chart(trend))
    else:
        st.info("latency_tails has no per-window rows in this time window")
    st.subheader("Per replica (whole scenario, every class)")
    st.dataframe(flagged(analyses.latency_by_replica(ctx.cur, ctx.scenario)), hide_index=True)
