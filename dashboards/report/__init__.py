"""Dashboards: the nightly report (build.py assembles it, lead.py its first screen, render.py its HTML and
text, mail.py its email), read from the analysis DB through the same layer as the dashboard."""

from kvlens.dashboards.report.build import (
    DAY_NS,
    Chart,
    Report,
    build_report,
    parse_duration_ns,
    png_size,
    save_html,
    write_report,
)

__all__ = [
    "DAY_NS", "Chart", "Report", "build_report", "parse_duration_ns", "png_size", "save_html", "write_report",
]
