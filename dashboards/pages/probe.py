"""Dashboards: the probe page: measured transfer and prefill costs, and where loading wins."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import Context, show_chart

__all__ = ["probe"]


def probe(ctx: Context) -> None:
    """The measured crossover: per prefix length and path, recompute against load."""
    st.header("Probe: load against recompute")
    st.caption(f"Scenario `{ctx.scenario}`: the cost model's figures; the time window does not apply here.")
    how = f"run kvlens probe --lake LAKE, then kvlens analyze --lake LAKE --db {ctx.db}"
    frame = analyses.crossover(ctx.cur, ctx.scenario)
    if frame is None or frame.height == 0:
        st.info(f"`crossover`: no rows yet: {how}", icon=":material/info:")
        return
    _winners(frame)
    series = analyses.crossover_series(frame)
    if series is not None and series.height:
        show_chart(charts.crossover_chart(series))
    else:
        st.warning("crossover lacks prefix_tokens, recompute_ms or load_ms: no curve")
    first = [c for c in ("path", "prefix_tokens", "recompute_ms", "load_ms", "winner") if c in frame.columns]
    st.dataframe(frame.select(first + [c for c in frame.columns if c not in first]), hide_index=True)


def _winners(frame: pl.DataFrame) -> None:
    """Per load path, the shortest prefix from which loading beats recomputing."""
    if not {"path", "winner", "prefix_tokens"} <= set(frame.columns):
        return
    paths = frame["path"].unique(maintain_order=True).to_list()
    for col, path in zip(st.columns(len(paths)), paths, strict=True):
        wins = frame.filter((pl.col("path") == path) & (pl.col("winner") == "load"))["prefix_tokens"]
        col.metric(f"{path}: load wins from", f"{int(wins.min()):,} tokens" if wins.len() else "never")  # type: ignore[arg-type]
