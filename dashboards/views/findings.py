"""Dashboards: the prefixes, probe, audit and hygiene pages (rankings and findings in words)."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import Context, empty, fmt_bytes, provenance_note, show_chart, windowed

__all__ = ["audit", "hygiene", "prefixes", "probe"]

_TOP_PREFIXES = 20


def prefixes(ctx: Context) -> None:
    """Prefix groups ranked by the expected benefit of publishing them, with the reasons."""
    st.header(f"Prefixes: {ctx.scenario}")
    provenance_note(ctx)
    st.caption("The ranking covers the whole scenario: the time window does not apply here.")
    if empty(ctx, "prefix_ranking"):
        return
    ranking = analyses.prefix_ranking(ctx.cur, ctx.scenario)
    counts = ranking.group_by("recommendation").len().sort("len", descending=True)
    for col, row in zip(st.columns(max(counts.height, 1)), counts.iter_rows(named=True), strict=False):
        col.metric(str(row["recommendation"]), f"{row['len']:,}")
    show_chart(
        charts.prefix_benefit_chart(
            ranking.head(_TOP_PREFIXES), title=f"Which {_TOP_PREFIXES} prefixes are worth publishing most?"
        )
    )
    st.dataframe(ranking, hide_index=True)


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


def audit(ctx: Context) -> None:
    """Isolation and compatibility findings: cross-tenant reuse, keys that cannot match."""
    st.header(f"Audit: {ctx.scenario}")
    st.caption("Findings cover the whole scenario: the time window does not apply here.")
    if empty(ctx, "isolation_findings"):
        return
    findings = analyses.isolation_findings(ctx.cur, ctx.scenario)
    kinds = (
        findings.group_by("finding").agg(pl.len().alias("findings"), pl.col("blocks").sum()).sort("finding")
    )
    for col, row in zip(st.columns(kinds.height), kinds.iter_rows(named=True), strict=True):
        col.metric(row["finding"], f"{row['findings']:,}", help=f"{row['blocks']:,} blocks")
    show_chart(charts.findings_chart(findings.head(30)))
    for row in findings.head(10).iter_rows(named=True):
        severity = f"[{row['severity']}] " if row.get("severity") else ""
        st.markdown(f"- {severity}**{row['finding']}** ({row['subject']}): {row['detail']}")
    st.dataframe(findings, hide_index=True)


def hygiene(ctx: Context) -> None:
    """Requests whose chains split early before repeated content: tokens lost, where, who."""
    st.header(f"Hygiene: {ctx.scenario}")
    provenance_note(ctx)
    by_split = windowed(ctx, "hygiene", analyses.hygiene_by_split, "no hygiene findings")
    if by_split is None:
        return
    a, b, c = st.columns(3)
    a.metric("Requests affected", f"{by_split['requests'].sum():,}")
    b.metric("Tokens lost", f"{by_split['lost_tokens'].sum():,}")
    c.metric("KV lost", fmt_bytes(by_split["lost_bytes"].sum()))
    show_chart(charts.hygiene_chart(by_split))
    groups = analyses.hygiene_offenders(ctx.cur, ctx.scenario, ctx.window)
    if groups is not None and groups.height:
        st.subheader("Offender groups (same repeated content after the same prefix)")
        st.dataframe(groups, hide_index=True)
    st.subheader("Top requests by tokens lost")
    st.dataframe(analyses.hygiene_requests(ctx.cur, ctx.scenario, ctx.window), hide_index=True)
