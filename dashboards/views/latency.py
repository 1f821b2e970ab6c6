"""Dashboards: the latency page (TTFT by prefix class) and the what-if page (scenarios side by side)."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import (
    Context,
    empty,
    fmt_ratio,
    label,
    no_rows,
    origin,
    provenance_note,
    show_chart,
)
from kvlens.dashboards.provenance import origins
from kvlens.dashboards.queries import hit_ratios, scenario_ledgers, scenario_tails

__all__ = ["latency", "whatif"]

_FLAG_RATIO = 5.0


def _percentiles_long(frame: pl.DataFrame, key: str) -> pl.DataFrame:
    names = {"ttft_p50_ms": "p50", "ttft_p95_ms": "p95", "ttft_p99_ms": "p99"}
    long = frame.unpivot(index=[key], on=list(names), variable_name="percentile", value_name="ttft_ms")
    return long.with_columns(pl.col("percentile").replace_strict(names))


def _flagged(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.with_columns((pl.col("p99_p50_ratio") > _FLAG_RATIO).alias("flag_p99_p50_above_5"))


def latency(ctx: Context) -> None:
    """TTFT percentiles per prefix class, over time, and per replica; tails above 5x flagged."""
    st.header(f"Latency: {ctx.scenario}")
    provenance_note(ctx)
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
        show_chart(charts.latency_class_chart(_percentiles_long(by_class, "prefix_class")))
        st.dataframe(_flagged(by_class), hide_index=True)
    trend = analyses.latency_trend(ctx.cur, ctx.scenario, ctx.window)
    if trend.height:
        show_chart(charts.latency_trend_chart(trend))
    else:
        st.info("latency_tails has no per-window rows in this time window")
    st.subheader("Per replica (whole scenario, every class)")
    st.dataframe(_flagged(analyses.latency_by_replica(ctx.cur, ctx.scenario)), hide_index=True)


def _ratio_metrics(ctx: Context, names: list[str]) -> pl.DataFrame:
    rows = []
    found = origins(ctx.cur, names)
    for name in names:
        ratios = hit_ratios(ctx.cur, name, ctx.window)
        rows.append(
            {
                "scenario": name,
                "figures": found[name].label,
                "requests": ratios.get("requests", 0),  # a scenario with no request in the window: 0
                "token_hit_ratio": ratios.get("token_hit_ratio"),
                "byte_hit_ratio": ratios.get("byte_hit_ratio"),
            }
        )
    return pl.DataFrame(
        rows,
        schema={
            "scenario": pl.String,
            "figures": pl.String,
            "requests": pl.Int64,
            "token_hit_ratio": pl.Float64,
            "byte_hit_ratio": pl.Float64,
        },
    )


def _assumptions(ctx: Context, names: list[str]) -> None:
    """Which of the scenarios are simulated, and on what model, beside their numbers."""
    found = origins(ctx.cur, names)
    modelled = [n for n in names if found[n].label == "modelled"]
    if modelled:
        texts = sorted({found[n].assumptions or "unrecorded" for n in modelled})
        st.caption(f"Modelled, not measured: {', '.join(modelled)} (simulated what-ifs; {'; '.join(texts)}).")


def whatif(ctx: Context) -> None:
    """The same ledger and tails for each scenario (routing policies and capacities simulated)."""
    st.header("What-if: scenarios side by side")
    names = st.multiselect("Scenarios", list(ctx.scenarios), default=list(ctx.scenarios), key="whatif")
    if not names:
        st.info("pick at least one scenario")
        return
    if not ctx.window.whole:
        st.caption("The sidebar's time window applies to every scenario here (tails are whole-scenario).")
    _assumptions(ctx, names)
    ratios = _ratio_metrics(ctx, names)
    found = origins(ctx.cur, names)
    for col, row in zip(st.columns(len(names)), ratios.iter_rows(named=True), strict=True):
        col.metric(label(f"{row['scenario']}: token hit ratio", found[row["scenario"]]),
                   fmt_ratio(row["token_hit_ratio"]))
    ledgers = scenario_ledgers(ctx.cur, names, ctx.window)
    # Streamlit fits the legend inside the chart's height: leave room for the ten outcomes.
    show_chart(charts.ledger_share_chart(ledgers).properties(height=max(260, 40 * len(names))))
    table = ledgers.pivot(on="outcome", index="scenario", values="tokens").fill_null(0)
    st.dataframe(
        ratios.join(table, on="scenario", how="left"),
        hide_index=True,
        column_config={
            c: st.column_config.NumberColumn(format="percent") for c in ("token_hit_ratio", "byte_hit_ratio")
        },
    )
    st.subheader("TTFT tails")
    tails = scenario_tails(ctx.cur, names)
    if tails.height:
        ttft = {n: o.ttft_label for n, o in found.items()}
        label_of = pl.col("scenario").replace_strict(ttft, default=None, return_dtype=pl.String)
        tails = tails.with_columns(label_of.alias("ttft")).select("scenario", "ttft",
                                                                  pl.exclude("scenario", "ttft"))
        show_chart(charts.tails_side_by_side_chart(_percentiles_long(tails, "scenario")))
        st.dataframe(_flagged(tails), hide_index=True)
    else:
        no_rows(ctx, "latency_tails")
