"""Dashboards: the nightly report (build.py assembles it, lead.py its first screen, render.py its HTML and
text, mail.py its email), read from the analysis DB through the same layer as the dashboard.

The package's API is build.py's: its ``__all__`` is the one list of what the package exports."""

from kvlens.dashboards.report import build
from kvlens.dashboards.report.build import *  # noqa: F403

__all__ = build.__all__
