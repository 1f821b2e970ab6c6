"""Dashboards: the audit page: isolation and cache-key compatibility findings."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvlens.dashboards import analyses, charts
from kvlens.dashboards.common import Context, empty, show_chart

__all__ = ["audit"]


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
