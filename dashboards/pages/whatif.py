"""Dashboards: the what-if page: scenarios side by side, with what each simulation assumed."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvlens.dashboards import charts
from kvlens.dashboards.common import (
    Context,
    fmt_ratio,
    label,
    no_rows,
    show_chart,
)
from kvlens.dashboards.pages.latency import flagged, percentiles_long
from kvlens.dashboards.provenance import origins
from kvlens.dashboards.queries import hit_ratios, scenario_ledgers, scenario_tails

__all__ = ["whatif"]


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
        show_chart(charts.tails_side_by_side_chart(percentiles_long(tails, "scenario")))
        st.dataframe(flagged(tails), hide_index=True)
    else:
        no_rows(ctx, "latency_tails")
