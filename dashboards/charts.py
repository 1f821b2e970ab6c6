"""Dashboards: pure chart builders, a query frame in, an Altair chart out (no Streamlit here).

The dashboard shows these charts and the report renders the same ones to PNG (vl_convert),
so every builder takes a Polars frame with the columns its docstring names and returns a
self-contained chart of fixed width. An empty frame still gives a valid (empty) chart.
"""

from __future__ import annotations

from typing import TypeVar

import altair as alt
import polars as pl

from kvlens.schema import Outcome

__all__ = [
    "OUTCOME_COLORS",
    "crossover_chart",
    "fanout_chart",
    "findings_chart",
    "flows_chart",
    "hit_ratio_trend_chart",
    "hygiene_chart",
    "latency_class_chart",
    "latency_trend_chart",
    "ledger_chart",
    "ledger_share_chart",
    "mrc_chart",
    "prefix_benefit_chart",
    "replica_bar_chart",
    "tails_side_by_side_chart",
    "ttl_chart",
]

_C = TypeVar("_C", alt.Chart, alt.LayerChart)

WIDTH = 640
HEIGHT = 300

# Hits in greens, the one-token rule in blue, misses from warm to cold, unknown residency pale.
OUTCOME_COLORS: dict[str, str] = {
    Outcome.HIT_LOCAL: "#1a9850",
    Outcome.HIT_OFFLOAD: "#66bd63",
    Outcome.HIT_REMOTE: "#a6d96a",
    Outcome.RECOMPUTED_LAST: "#4575b4",
    Outcome.MISS_GROUP: "#8073ac",
    Outcome.MISS_LOAD_FAILED: "#762a83",
    Outcome.MISS_AFTER_GAP: "#c51b7d",
    Outcome.MISS_ROUTING: "#d73027",
    Outcome.MISS_EVICTED: "#f46d43",
    Outcome.MISS_INCOMPATIBLE: "#fdae61",
    Outcome.MISS_COLD: "#999999",
    Outcome.UNOBSERVED: "#e0e0e0",
}
_OUTCOME_SCALE = alt.Scale(domain=list(OUTCOME_COLORS), range=list(OUTCOME_COLORS.values()))
_OUTCOME_ORDER = {o: i for i, o in enumerate(OUTCOME_COLORS)}


def _sized(chart: _C, title: str) -> _C:
    return chart.properties(width=WIDTH, height=HEIGHT, title=title)


def _utc(frame: pl.DataFrame, col: str) -> pl.DataFrame:
    """Naive datetimes from the DB are UTC: say so, so Vega-Lite does not read them as local time."""
    dtype = frame.schema[col]
    if isinstance(dtype, pl.Datetime) and dtype.time_zone is None:
        return frame.with_columns(pl.col(col).dt.replace_time_zone("UTC"))
    return frame


def _time_x(col: str, title: str) -> alt.X:
    return alt.X(f"{col}:T", title=title, scale=alt.Scale(type="utc"), axis=alt.Axis(format="%H:%M"))


def _with_outcome_order(frame: pl.DataFrame) -> pl.DataFrame:
    order = (
        pl.col("outcome").cast(pl.String).replace_strict(_OUTCOME_ORDER, default=99, return_dtype=pl.Int32)
    )
    return frame.with_columns(pl.col("outcome").cast(pl.String), order.alias("outcome_order"))


def ledger_chart(
    frame: pl.DataFrame, *, title: str = "What did each replica's prompt tokens get?"
) -> alt.Chart:
    """Stacked bars: ``replica``, ``outcome``, ``tokens`` (one bar per replica)."""
    data = _with_outcome_order(frame)
    chart = (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X("replica:N", title="replica"),
            y=alt.Y("sum(tokens):Q", title="tokens"),
            color=alt.Color("outcome:N", scale=_OUTCOME_SCALE, title="outcome"),
            order=alt.Order("outcome_order:Q"),
            tooltip=["replica:N", "outcome:N", alt.Tooltip("sum(tokens):Q", format=",")],
        )
    )
    return _sized(chart, title)


def ledger_share_chart(
    frame: pl.DataFrame, *, title: str = "Which outcome did the prompt tokens get?"
) -> alt.Chart:
    """Normalised stacked bars: ``scenario``, ``outcome``, ``tokens`` (one bar per scenario)."""
    data = _with_outcome_order(frame)
    chart = (
        alt.Chart(data)
        .mark_bar()
        .encode(
            y=alt.Y("scenario:N", title="scenario"),
            x=alt.X("sum(tokens):Q", stack="normalize", title="share of tokens", axis=alt.Axis(format="%")),
            color=alt.Color("outcome:N", scale=_OUTCOME_SCALE, title="outcome"),
            order=alt.Order("outcome_order:Q"),
            tooltip=["scenario:N", "outcome:N", alt.Tooltip("sum(tokens):Q", format=",")],
        )
    )
    return chart.properties(width=WIDTH, height=max(60, 40 * frame["scenario"].n_unique()), title=title)


def hit_ratio_trend_chart(
    frame: pl.DataFrame, *, title: str = "How did the token hit ratio move over time?"
) -> alt.Chart:
    """Line: ``bucket`` (datetime), ``token_hit_ratio``, ``requests``."""
    chart = (
        alt.Chart(_utc(frame, "bucket"))
        .mark_line(point=True)
        .encode(
            x=_time_x("bucket", "time (UTC)"),
            y=alt.Y(
                "token_hit_ratio:Q",
                title="token hit ratio",
                axis=alt.Axis(format="%"),
                scale=alt.Scale(domain=[0, 1]),
            ),
            tooltip=[
                alt.Tooltip("utcyearmonthdatehoursminutes(bucket):T", title="bucket"),
                alt.Tooltip("token_hit_ratio:Q", format=".1%"),
                "requests:Q",
            ],
        )
    )
    return _sized(chart, title)


def replica_bar_chart(
    frame: pl.DataFrame, *, title: str = "Which replica holds the most tokens?"
) -> alt.Chart:
    """Bars: ``replica``, ``tokens``."""
    chart = (
        alt.Chart(frame)
        .mark_bar(color="#d73027")
        .encode(
            x=alt.X("replica:N", sort="-y", title="replica"),
            y=alt.Y("tokens:Q", title="tokens"),
            tooltip=["replica:N", alt.Tooltip("tokens:Q", format=",")],
        )
    )
    return _sized(chart, title)


def mrc_chart(
    mrc: pl.DataFrame, capacity: pl.DataFrame, *,
    title: str = "How much would a larger cache serve (LRU byte hit ratio)?",
) -> alt.LayerChart:
    """Lines ``capacity_bytes`` x ``hit_ratio_bytes`` per ``method``; rules at ``capacity.c_eff_bytes``
    (and twice it), labelled with ``label``."""
    # A log axis shows the knee; a zero capacity has no place on it (and hits nothing anyway).
    data = mrc.filter(pl.col("capacity_bytes") > 0).with_columns(
        (pl.col("capacity_bytes") / 2**30).alias("capacity_gib")
    )
    lines = (
        alt.Chart(data)
        .mark_line()
        .encode(
            x=alt.X("capacity_gib:Q", title="capacity (GiB, log)", scale=alt.Scale(type="log")),
            y=alt.Y("hit_ratio_bytes:Q", title="byte hit ratio", axis=alt.Axis(format="%")),
            color=alt.Color("method:N", title="method"),
            tooltip=[
                alt.Tooltip("capacity_gib:Q", format=",.1f"),
                alt.Tooltip("hit_ratio_bytes:Q", format=".1%"),
                "method:N",
            ],
        )
    )
    marks = capacity.select((pl.col("c_eff_bytes") / 2**30).alias("capacity_gib"), pl.col("label"))
    rules = (
        alt.Chart(marks)
        .mark_rule(strokeDash=[4, 3], color="black")
        .encode(x="capacity_gib:Q", tooltip=["label:N", alt.Tooltip("capacity_gib:Q", format=",.1f")])
    )
    text = (
        alt.Chart(marks)
        .mark_text(align="left", dx=4, dy=-6, baseline="bottom")
        .encode(x="capacity_gib:Q", y=alt.value(12), text="label:N")
    )
    return alt.LayerChart(layer=[lines, rules, text]).properties(width=WIDTH, height=HEIGHT, title=title)


def ttl_chart(
    frame: pl.DataFrame, *, title: str = "How long must a block stay to be reused, and what does that pin?"
) -> alt.Chart:
    """Points ``ttl_s`` x ``covered_ratio``, sized by ``pinned_peak_bytes``."""
    chart = (
        alt.Chart(frame)
        .mark_line(point=True)
        .encode(
            x=alt.X("ttl_s:Q", title="TTL (s)", scale=alt.Scale(type="log")),
            y=alt.Y("covered_ratio:Q", title="re-accesses covered", axis=alt.Axis(format="%")),
            tooltip=[
                "ttl_s:Q",
                alt.Tooltip("covered_ratio:Q", format=".1%"),
                alt.Tooltip("pinned_peak_bytes:Q", format=",.0f"),
            ],
        )
    )
    return _sized(chart, title)


def flows_chart(
    frame: pl.DataFrame, *, title: str = "How many bytes moved per window, and how many were never read?"
) -> alt.Chart:
    """Stacked areas: ``window`` (datetime), ``flow`` (read/write/replica/never_read), ``bytes``."""
    data = _utc(frame, "window").with_columns((pl.col("bytes") / 2**30).alias("gib"))
    chart = (
        alt.Chart(data)
        .mark_area(opacity=0.8)
        .encode(
            x=_time_x("window", "window start (UTC)"),
            y=alt.Y("sum(gib):Q", title="GiB"),
            color=alt.Color("flow:N", title="flow"),
            tooltip=[
                alt.Tooltip("utchoursminutes(window):T", title="window"),
                "flow:N",
                alt.Tooltip("sum(gib):Q", format=",.2f"),
            ],
        )
    )
    return _sized(chart, title)


def fanout_chart(
    frame: pl.DataFrame, *, title: str = "How many replicas needed the same blocks?"
) -> alt.Chart:
    """Bars ``window`` (datetime) x ``duplicate_bytes``, with ``fanout_mean_replicas`` in the tooltip."""
    data = _utc(frame, "window").with_columns((pl.col("duplicate_bytes") / 2**30).alias("duplicate_gib"))
    chart = (
        alt.Chart(data)
        .mark_bar(color="#4575b4")
        .encode(
            x=_time_x("window", "window start (UTC)"),
            y=alt.Y("duplicate_gib:Q", title="duplicate KV (GiB)"),
            tooltip=[
                alt.Tooltip("utchoursminutes(window):T", title="window"),
                alt.Tooltip("duplicate_gib:Q", format=",.1f"),
                alt.Tooltip("fanout_mean_replicas:Q", format=".2f"),
                "fanout_max_replicas:Q",
            ],
        )
    )
    return _sized(chart, title)


def latency_class_chart(
    frame: pl.DataFrame, *, title: str = "Which prefix class waits longest for its first token?"
) -> alt.Chart:
    """Dots on a log axis (P50 and P99 can be 1000x apart, and a log axis cannot draw bars from 0):
    ``prefix_class``, ``percentile`` (p50/p95/p99), ``ttft_ms``."""
    chart = (
        alt.Chart(frame)
        .mark_point(filled=True, size=140)
        .encode(
            x=alt.X("prefix_class:N", title="prefix class"),
            xOffset=alt.XOffset("percentile:N", sort=["p50", "p95", "p99"]),
            y=alt.Y("ttft_ms:Q", title="TTFT (ms, log)", scale=alt.Scale(type="log")),
            color=alt.Color("percentile:N", sort=["p50", "p95", "p99"], title="percentile"),
            tooltip=["prefix_class:N", "percentile:N", alt.Tooltip("ttft_ms:Q", format=",.1f")],
        )
    )
    return _sized(chart, title)


def latency_trend_chart(
    frame: pl.DataFrame, *, title: str = "When was the first token slowest (TTFT P99 per window)?"
) -> alt.Chart:
    """Lines: ``window`` (datetime), ``prefix_class``, ``ttft_p99_ms``."""
    chart = (
        alt.Chart(_utc(frame, "window"))
        .mark_line(point=True)
        .encode(
            x=_time_x("window", "window start (UTC)"),
            y=alt.Y("ttft_p99_ms:Q", title="TTFT P99 (ms)"),
            color=alt.Color("prefix_class:N", title="prefix class"),
            tooltip=[
                alt.Tooltip("utchoursminutes(window):T", title="window"),
                "prefix_class:N",
                alt.Tooltip("ttft_p99_ms:Q", format=",.1f"),
            ],
        )
    )
    return _sized(chart, title)


def tails_side_by_side_chart(
    frame: pl.DataFrame, *, title: str = "How long to the first token, per scenario?"
) -> alt.Chart:
    """Grouped bars: ``scenario``, ``percentile``, ``ttft_ms``."""
    chart = (
        alt.Chart(frame)
        .mark_bar()
        .encode(
            x=alt.X("scenario:N", title="scenario"),
            xOffset=alt.XOffset("percentile:N", sort=["p50", "p95", "p99"]),
            y=alt.Y("ttft_ms:Q", title="TTFT (ms)"),
            color=alt.Color("percentile:N", sort=["p50", "p95", "p99"], title="percentile"),
            tooltip=["scenario:N", "percentile:N", alt.Tooltip("ttft_ms:Q", format=",.1f")],
        )
    )
    return _sized(chart, title)


def prefix_benefit_chart(
    frame: pl.DataFrame, *, title: str = "Which prefixes are worth publishing?"
) -> alt.Chart:
    """Horizontal bars: ``prefix`` (label), ``benefit_ms``, ``recommendation``, ``reason``."""
    chart = (
        alt.Chart(frame)
        .mark_bar()
        .encode(
            y=alt.Y("prefix:N", sort="-x", title="prefix"),
            x=alt.X("benefit_ms:Q", title="expected benefit (ms)"),
            color=alt.Color("recommendation:N", title="recommendation"),
            tooltip=["prefix:N", alt.Tooltip("benefit_ms:Q", format=",.1f"), "recommendation:N", "reason:N"],
        )
    )
    return chart.properties(width=WIDTH, height=max(HEIGHT, 16 * frame.height), title=title)


def crossover_chart(
    frame: pl.DataFrame, *, title: str = "From what prefix length does loading beat recompute?"
) -> alt.Chart:
    """Lines: ``prefix_tokens``, ``ms``, ``series`` (e.g. ``recompute`` or ``load h2d_pinned``),
    ``label`` (measured / modelled, drawn as the point shape)."""
    chart = (
        alt.Chart(frame)
        .mark_line(point=True)
        .encode(
            x=alt.X("prefix_tokens:Q", title="prefix (tokens)", scale=alt.Scale(type="log")),
            y=alt.Y("ms:Q", title="time (ms)", scale=alt.Scale(type="log")),
            color=alt.Color("series:N", title="path"),
            shape=alt.Shape("label:N", title="source"),
            tooltip=["series:N", "prefix_tokens:Q", alt.Tooltip("ms:Q", format=",.3f"), "label:N"],
        )
    )
    return _sized(chart, title)


def findings_chart(
    frame: pl.DataFrame, *, title: str = "How many blocks does each finding involve?"
) -> alt.Chart:
    """Bars: ``finding``, ``subject``, ``blocks``."""
    chart = (
        alt.Chart(frame)
        .mark_bar()
        .encode(
            y=alt.Y("subject:N", sort="-x", title="subject"),
            x=alt.X("blocks:Q", title="blocks"),
            color=alt.Color("finding:N", title="finding"),
            tooltip=["finding:N", "subject:N", alt.Tooltip("blocks:Q", format=",")],
        )
    )
    return chart.properties(width=WIDTH, height=max(180, 20 * frame.height), title=title)


def hygiene_chart(
    frame: pl.DataFrame, *, title: str = "Where do prompt chains split, and what does it lose?"
) -> alt.Chart:
    """Bars: ``split_position``, ``lost_tokens``, ``requests``."""
    chart = (
        alt.Chart(frame)
        .mark_bar(color="#f46d43")
        .encode(
            x=alt.X("split_position:O", title="split position (blocks)"),
            y=alt.Y("lost_tokens:Q", title="tokens lost"),
            tooltip=["split_position:O", alt.Tooltip("lost_tokens:Q", format=","), "requests:Q"],
        )
    )
    return _sized(chart, title)


def reconciliation_chart(
    frame: pl.DataFrame, *, title: str = "Do the engines' hit counters agree with the ledger?"
) -> alt.Chart:
    """Grouped bars per ``replica``: ``engine_hit_tokens``, ``ledger_hit_tokens`` and, when known,
    ``reported_cached_tokens``."""
    cols = [c for c in ("engine_hit_tokens", "ledger_hit_tokens", "reported_cached_tokens")
            if c in frame.columns and frame[c].null_count() < frame.height]
    data = frame.unpivot(index="replica", on=cols, variable_name="source", value_name="tokens")
    chart = (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X("replica:N", title="replica"),
            xOffset=alt.XOffset("source:N"),
            y=alt.Y("tokens:Q", title="hit tokens"),
            color=alt.Color("source:N", title="source"),
            tooltip=["replica:N", "source:N", alt.Tooltip("tokens:Q", format=",")],
        )
    )
    return _sized(chart, title)
