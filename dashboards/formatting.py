"""Dashboards: how every figure is written, for the report, the email and the pages alike.

One place for units (B/KiB/MiB/GiB/TiB, ms/s, %, points, GPU-hours, USD) and thousands
separators, so that a table and the sentence above it never disagree on how a number reads.
"""

from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_gpu_hours", "fmt_int", "fmt_ms", "fmt_pct", "fmt_points", "fmt_usd"]


def fmt_pct(ratio: float | None) -> str:
    """A ratio as a percentage with one decimal: ``0.177`` -> ``17.7%``."""
    return "n/a" if ratio is None else f"{ratio:.1%}"


def fmt_points(points: float | None) -> str:
    """A change of a ratio in percentage points, signed: ``+1.1 pts``."""
    return "n/a" if points is None else f"{points:+.1f} pts"


def fmt_int(n: float | None) -> str:
    """A count with thousands separators: ``73,647,468``."""
    return "n/a" if n is None else f"{round(n):,}"


def fmt_ms(ms: float | None) -> str:
    """Seconds from one second up, milliseconds below."""
    if ms is None:
        return "n/a"
    return f"{ms / 1e3:,.2f} s" if abs(ms) >= 1000 else f"{ms:.1f} ms"


def fmt_bytes(n: float | None, digits: int = 2) -> str:
    """A byte count in binary units (the report's sentences and the dashboard's metrics)."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.{digits}f} {unit}"
        value /= 1024
    return f"{value:,.{digits}f} PiB"


def fmt_gpu_hours(hours: float | None) -> str:
    """GPU-hours readable at any size: ``1,234 GPU-h``, ``0.42 GPU-h``, below 0.1 GPU-h ``12.2 GPU-s``."""
    if hours is None:
        return "n/a"
    if abs(hours) >= 100:
        return f"{hours:,.0f} GPU-h"
    if abs(hours) >= 0.1:
        return f"{hours:,.1f} GPU-h" if abs(hours) >= 10 else f"{hours:,.2f} GPU-h"
    seconds = hours * 3600  # below six GPU-minutes, hours would read 0.00
    return f"{seconds:,.1f} GPU-s" if abs(seconds) >= 10 else f"{seconds:.3g} GPU-s"


def fmt_usd(usd: float | None) -> str:
    """Dollars with thousands separators: ``$12,345``; cents below ten dollars."""
    if usd is None:
        return "n/a"
    if 0 < abs(usd) < 0.005:
        return "<$0.01" if usd > 0 else ">-$0.01"
    return f"${usd:,.0f}" if abs(usd) >= 10 else f"${usd:,.2f}"
