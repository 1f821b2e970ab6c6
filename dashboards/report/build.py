"""Dashboards: the nightly report, built from the analysis DB as HTML (inline charts) and plain text.

``build_report`` reads the DB through a read-only connection and returns a ``Report``: the HTML
for email (images referenced as ``cid:``), the same page self-contained for a file (images as
``data:`` URIs), the plain-text part, and the PNGs. A section whose analysis has no rows is left
out. Windows are by request arrival: [now - since, now) against the one before it. ``now`` is
one time for every scenario when given; by default it is just after each scenario's own latest
arrival, so replayed traces from different epochs each get a full report.
"""

from __future__ import annotations

import base64
import logging
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import polars as pl

from kvlens.dashboards import charts
from kvlens.dashboards.decisions import Decisions, decide, pick_production
from kvlens.dashboards.findings import ranked_findings
from kvlens.dashboards.formatting import fmt_ms, fmt_pct
from kvlens.dashboards.provenance import Origin, bytes_sentence, origins, tagged
from kvlens.dashboards.queries import (
    SCENARIO_TAILS_SQL,
    Headline,
    headlines,
    latest_arrivals,
    ledger,
    pick_bucket_ns,
    scenario_span_ns,
    trend,
)
from kvlens.dashboards.queries import scenario_names as analyzed_scenarios
from kvlens.dashboards.read import Window, has_rows, open_db, rows
from kvlens.dashboards.report.lead import attribution_section, lead, worth_section
from kvlens.dashboards.report.render import Chart, Lead, Section, Table, png_size, render_html, render_text
from kvlens.dashboards.report_queries import CROSSOVER_POINTS_SQL, TOP_PREFIXES_SQL
from kvlens.errors import ConfigError, NoDataError

__all__ = [
    "DAY_NS", "Chart", "Report", "build_report", "parse_duration_ns", "png_size", "save_html", "write_report",
]

log = logging.getLogger(__name__)
DAY_NS = 86_400 * 10**9
_UNITS_NS = {"s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9, "d": DAY_NS, "w": 7 * DAY_NS}


def parse_duration_ns(text: str) -> int:
    """``90s``, ``30m``, ``24h``, ``7d``, ``1w``, or a sum such as ``1h30m``, in nanoseconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhdw])", text.strip().lower())
    if not parts or "".join(n + u for n, u in parts) != text.strip().lower().replace(" ", ""):
        raise ConfigError(f"duration {text!r} is not understood: write e.g. 24h, 30m, 7d or 1h30m")
    total = sum(int(float(n) * _UNITS_NS[u]) for n, u in parts)
    if total <= 0:
        raise ConfigError(f"duration {text!r} must be longer than zero")
    return total


@dataclass(frozen=True)
class Report:
    """The report: ``html`` for email (``cid:`` images), ``file_html`` self-contained, ``text``."""

    subject: str
    html: str
    file_html: str
    text: str
    charts: tuple[Chart, ...]

    @property
    def images(self) -> dict[str, bytes]:
        """Content-ID (without angle brackets) -> PNG bytes."""
        return {c.cid: c.png for c in self.charts}


def _png(chart: object, cid: str, title: str) -> Chart:
    import vl_convert

    return Chart(cid, title, vl_convert.vegalite_to_png(chart.to_json(), scale=1))  # type: ignore[attr-defined]


# (window, scenarios): one for all with --now, else one per distinct latest arrival.
Groups = list[tuple[Window, list[str]]]


def _groups(con: duckdb.DuckDBPyConnection, names: list[str], since_ns: int, now_ns: int | None) -> Groups:
    if now_ns is not None:
        return [(Window(now_ns - since_ns, now_ns), names)]
    by_end: dict[int, list[str]] = {}
    for name, end in latest_arrivals(con, names).items():
        by_end.setdefault(end, []).append(name)
    latest_first = sorted(by_end.items(), reverse=True)
    return [(Window(end - since_ns, end), sorted(group)) for end, group in latest_first]


def _assumption_sentences(found: dict[str, Origin]) -> list[str]:
    """Per distinct assumption: which scenarios' figures are modelled, and on what."""
    by: dict[str, list[str]] = {}
    for o in found.values():
        if o.label == "modelled":
            by.setdefault(o.assumptions or "a model kvlens did not record", []).append(o.scenario)
    def what(n: list[str]) -> str:
        return "a simulated what-if" if len(n) == 1 else "simulated what-ifs"

    return [f"Modelled, not measured: {', '.join(sorted(n))} ({what(n)}; {text})."
            for text, n in sorted(by.items())]


def _headline_section(heads: dict[str, Headline], groups: Groups, quiet: list[str],
                      found: dict[str, Origin]) -> Section:
    body = tuple((h.scenario, found[h.scenario].label or "not recorded", f"{h.requests:,}",
                  f"{h.prompt_tokens:,}", fmt_pct(h.token_hit_ratio), fmt_pct(h.byte_hit_ratio),
                  found[h.scenario].ttft(fmt_ms(h.ttft_p50_ms)),
                  found[h.scenario].ttft(fmt_ms(h.ttft_p99_ms))) for h in heads.values())
    said = [f"Requests arriving {w.label()}" + (f": {', '.join(n)}." if len(groups) > 1 else ".")
            for w, n in groups]
    if quiet:
        said.append(f"No requests in the window for {', '.join(quiet)}.")
    said += [f"Incomplete: {h.incomplete_requests:,} of {h.requests:,} requests of {h.scenario} arrived "
             "after the collector lost KV-event batches of their replica that the replay could not fill "
             "(measured: kvlens_collector_gap_batches); their ratios may be off." for h in heads.values()
             if h.incomplete_requests]
    said += _assumption_sentences({n: found[n] for n in heads})
    note = bytes_sentence({n: found[n] for n in heads})
    if note:
        said.append(note)
    return Section("Every scenario (what-ifs named as such)", paragraphs=said, tables=[Table(
        ("scenario", "figures", "requests", "prompt tokens", "token hit ratio", "byte hit ratio", "TTFT P50",
         "TTFT P99"), body)])


def _ledger_section(con: duckdb.DuckDBPyConnection, groups: Groups, heads: dict[str, Headline],
                    origin: dict[str, Origin]) -> Section | None:
    found = sorted((r for w, n in groups for r in ledger(con, n, w)), key=lambda r: (r.scenario, r.outcome))
    if not found:
        return None
    frame = pl.DataFrame([{"scenario": r.scenario, "outcome": r.outcome, "tokens": r.tokens} for r in found])
    chart = _png(charts.ledger_share_chart(frame, title="Which outcome did the prompt tokens get?"),
                 "ledger", "Ledger by outcome")
    outcomes = [o for o in charts.OUTCOME_COLORS if any(r.outcome == o for r in found)]
    by = {(r.scenario, r.outcome): r.tokens for r in found}
    body = tuple((o, *(fmt_pct(by.get((s, o), 0) / heads[s].prompt_tokens)
                       if heads[s].prompt_tokens else "n/a" for s in heads)) for o in outcomes)
    tails = tuple(fmt_pct(h.tail_partial_tokens / h.prompt_tokens) if h.prompt_tokens else "n/a"
                  for h in heads.values())
    return Section("Ledger by outcome", paragraphs=[
        "Share of prompt tokens per outcome; the partial last block of a prompt is always recomputed."],
        tables=[Table(("outcome", *(tagged(s, origin) for s in heads)), (*body, ("partial tail", *tails)))],
        charts=[chart])


def _change(prev: float | None, cur: float | None, *, points: bool) -> str:
    if prev is None or cur is None:
        return "n/a"
    if points:
        return f"{(cur - prev) * 100:+.1f} pts"
    return f"{(cur - prev) / prev:+.1%}" if prev else "n/a"


def _day_over_day_section(con: duckdb.DuckDBPyConnection, groups: Groups, heads: dict[str, Headline],
                          found: dict[str, Origin]) -> Section:
    section = Section("Change against the previous window")
    for window, names in groups:
        prev = headlines(con, names, window.previous())
        who = f" ({', '.join(names)})" if len(groups) > 1 else ""
        section.paragraphs.append(f"{window.label()} against {window.previous().label()}{who}.")
        if not prev:
            section.paragraphs.append("No requests arrived in the previous window: nothing to compare.")
        _compare(section, {n: heads[n] for n in names if n in heads}, prev, found)
    return section


def _compare(section: Section, cur: dict[str, Headline], prev: dict[str, Headline],
             found: dict[str, Origin]) -> None:
    for name, c in cur.items():
        p = prev.get(name)
        if p is None:
            if prev:
                section.paragraphs.append(f"{name}: no requests in the previous window, nothing to compare.")
            continue
        metrics = [
            ("requests", p.requests, c.requests, f"{p.requests:,}", f"{c.requests:,}", False),
            ("prompt tokens", p.prompt_tokens, c.prompt_tokens, f"{p.prompt_tokens:,}",
             f"{c.prompt_tokens:,}", False),
            ("token hit ratio", p.token_hit_ratio, c.token_hit_ratio, fmt_pct(p.token_hit_ratio),
             fmt_pct(c.token_hit_ratio), True),
            ("byte hit ratio", p.byte_hit_ratio, c.byte_hit_ratio, fmt_pct(p.byte_hit_ratio),
             fmt_pct(c.byte_hit_ratio), True),
            (found[name].ttft("TTFT P50"), p.ttft_p50_ms, c.ttft_p50_ms, fmt_ms(p.ttft_p50_ms),
             fmt_ms(c.ttft_p50_ms), False),
            (found[name].ttft("TTFT P99"), p.ttft_p99_ms, c.ttft_p99_ms, fmt_ms(p.ttft_p99_ms),
             fmt_ms(c.ttft_p99_ms), False),
        ]
        section.tables.append(Table((tagged(name, found), "previous", "current", "change"), tuple(
            (label, ps, cs, _change(pv, cv, points=pts)) for label, pv, cv, ps, cs, pts in metrics)))


def _trend_section(con: duckdb.DuckDBPyConnection, groups: Groups) -> Section | None:
    found = [_trend_chart(con, names, window, f"trend-{i + 1}" if i else "trend",
                          "" if len(groups) == 1 else f" ({', '.join(names)})")
             for i, (window, names) in enumerate(groups)]
    made = [c for c in found if c is not None]
    return Section("Trend", charts=made) if made else None


def _trend_chart(con: duckdb.DuckDBPyConnection, names: list[str], window: Window, cid: str,
                 who: str) -> Chart | None:
    frames = []
    start, end = window.bounds()
    for name in names:
        span = scenario_span_ns(con, name)
        if span is None:
            continue
        lo, hi = max(span[0], start), min(span[1], end - 1)  # the first and last ns that can arrive in it
        frame = trend(con, name, window, pick_bucket_ns(max(hi - lo, 0)))
        frames.append(frame.with_columns(pl.lit(name).alias("scenario")))
    data = pl.concat(frames) if frames else pl.DataFrame()
    if data.is_empty():
        return None
    title = f"How did the token hit ratio move over the window{who}?"
    return _png(charts.hit_ratio_trend_chart(data, title=title).encode(color="scenario:N"), cid, title)


def _latency_section(con: duckdb.DuckDBPyConnection, names: list[str],
                     origin: dict[str, Origin]) -> Section | None:
    tails = rows(con, SCENARIO_TAILS_SQL, {"names": names}) if has_rows(con, "latency_tails") else []
    found = [r[:6] for r in tails]  # without the queue's P50 (the dashboard shows it)
    if not found:
        return None
    frame = pl.DataFrame([{"scenario": s, "percentile": q, "ttft_ms": v} for s, _, p50, p95, p99, _ in found
                          for q, v in (("p50", p50), ("p95", p95), ("p99", p99))])
    chart = _png(charts.tails_side_by_side_chart(frame, title="How long to the first token, per scenario?"),
                 "tails", "TTFT percentiles per scenario")
    body = tuple((s, f"{n:,}", *(origin[s].ttft(fmt_ms(v)) for v in (p50, p95, p99)),
                  "n/a" if r is None else origin[s].ttft(f"{r:.1f}x")) for s, n, p50, p95, p99, r in found)
    said = [f"TTFT of {', '.join(s for s, *_ in found if origin[s].ttft_label == label)} is {label}."
            for label in ("measured", "modelled") if any(origin[s].ttft_label == label for s, *_ in found)]
    return Section("Latency tails (whole scenario)", paragraphs=said, tables=[Table(
        ("scenario", "requests", "TTFT P50", "TTFT P95", "TTFT P99", "P99/P50"), body)], charts=[chart])


def _prefix_section(con: duckdb.DuckDBPyConnection, names: list[str],
                    origin: dict[str, Origin]) -> Section | None:
    found = rows(con, TOP_PREFIXES_SQL, {"names": names}) if has_rows(con, "prefix_ranking") else []
    if not found:
        return None
    # A what-if's benefit rests on its simulated misses: modelled whatever the cost model measured.
    body = tuple((s, f"{h:016x}", f"{t:,}", f"{r:,}", f"{n:,}",
                  f"{(ms or 0) / 1e3:,.1f} s ({'modelled' if origin[s].label == 'modelled' else label})", rec)
                 for s, h, t, r, n, _, ms, rec, label in found)
    return Section("Prefixes worth publishing (top 5 per scenario, whole scenario)", tables=[Table(
        ("scenario", "prefix", "tokens", "re-accesses", "replicas", "benefit", "recommendation"), body)])


def _crossover_section(con: duckdb.DuckDBPyConnection, names: list[str]) -> Section | None:
    found = rows(con, CROSSOVER_POINTS_SQL, {"names": names}) if has_rows(con, "crossover") else []
    if not found:
        return None
    device, model = found[0][0], found[0][1]
    mine = [r for r in found if (r[0], r[1]) == (device, model)]
    points = {(t, "recompute", rms, rl) for _, _, _, t, rms, rl, _, _, _ in mine}
    points |= {(t, f"load {path}", lms, ll) for _, _, path, t, _, _, lms, ll, _ in mine}
    frame = pl.DataFrame(sorted(points, key=lambda r: (r[1], r[0])),
                         schema=["prefix_tokens", "series", "ms", "label"], orient="row")
    question = f"From what prefix length does loading beat recompute ({device})?"
    chart = _png(charts.crossover_chart(frame, title=question), "crossover", "Load against recompute")
    body = []
    for d, m, path in dict.fromkeys((r[0], r[1], r[2]) for r in found):
        cells = [r for r in found if (r[0], r[1], r[2]) == (d, m, path)]
        wins = [r[3] for r in cells if r[8] == "load"]
        longest = cells[-1]
        body.append((d, m, path, f"{min(wins):,}" if wins else "never", f"{longest[3]:,}",
                     f"{longest[4]:,.1f} ({longest[5]})", f"{longest[6]:,.1f} ({longest[7]})"))
    return Section("Load against recompute", tables=[Table(
        ("device", "model", "path", "load wins from (tokens)", "longest prefix", "recompute ms", "load ms"),
        tuple(body))], charts=[chart])


TOP_FINDINGS = 5  # the rest are one section away, at the end


def _decisions(con: duckdb.DuckDBPyConnection, groups: Groups, heads: dict[str, Headline],
               found: dict[str, Origin], usd_per_gpu_hour: float | None,
               production: str | None) -> Decisions | None:
    picked = pick_production(heads, found, production)
    if picked is None:
        return None
    window, names = next((w, n) for w, n in groups if picked[0] in n)
    mine = {n: heads[n] for n in names}
    return decide(con, mine, found, window, usd_per_gpu_hour=usd_per_gpu_hour, production=picked[0],
                  stand_in=picked[1])


def _sections(con: duckdb.DuckDBPyConnection, groups: Groups, usd_per_gpu_hour: float | None = None,
              production: str | None = None) -> tuple[Lead | None, list[Section]]:
    heads: dict[str, Headline] = {}
    for window, names in groups:
        heads.update(headlines(con, names, window))
    if not heads:
        window, names = groups[0]
        raise NoDataError(f"no requests arrived {window.label()} in scenarios {', '.join(names)}: "
                          "widen --since or pass --now")
    heads = dict(sorted(heads.items()))
    quiet = [n for _, names in groups for n in names if n not in heads]
    groups = [(w, [n for n in names if n in heads]) for w, names in groups]
    groups = [(w, names) for w, names in groups if names]
    found = origins(con, sorted(heads))
    decided = _decisions(con, groups, heads, found, usd_per_gpu_hour, production)
    out = [] if decided is None else [s for s in (attribution_section(decided.attribution),
                                                 worth_section(decided)) if s is not None]
    found_all = sorted(((f, t) for w, n in groups for f, t in ranked_findings(con, n, w)),
                       key=lambda ft: (ft[1] is None, -(ft[1] or 0)))
    ranked = [f for f, _ in found_all]
    said = (f"The {TOP_FINDINGS} of {len(ranked)} findings that concern the most recomputed tokens (the rest "
            "are under More findings, at the end)." if len(ranked) > TOP_FINDINGS else "")
    out.append(Section("Top findings", paragraphs=[said] if said else [], bullets=ranked[:TOP_FINDINGS]))
    out.append(_headline_section(heads, groups, quiet, found))
    for optional in (_ledger_section(con, groups, heads, found), _trend_section(con, groups)):
        if optional is not None:
            out.append(optional)
    out.append(_day_over_day_section(con, groups, heads, found))
    everyone = sorted(heads)
    out += [s for s in (_latency_section(con, everyone, found), _prefix_section(con, everyone, found),
                        _crossover_section(con, everyone)) if s is not None]
    if ranked[TOP_FINDINGS:]:
        out.append(Section("More findings", bullets=ranked[TOP_FINDINGS:]))
    return (None if decided is None else lead(decided),
            [s for s in out if s.paragraphs or s.bullets or s.tables or s.charts])


def build_report(db_path: str | Path, *, since_ns: int = DAY_NS, now_ns: int | None = None,
                 scenarios: list[str] | None = None, usd_per_gpu_hour: float | None = None,
                 production: str | None = None) -> Report:
    """The report for requests arriving in [now - since, now), compared with the window before."""
    started = time.perf_counter()
    con = open_db(db_path)
    try:
        names = analyzed_scenarios(con, scenarios)
        if not names:
            wanted = f" among {', '.join(scenarios)}" if scenarios else ""
            raise NoDataError(f"analysis DB {db_path} has no analyzed scenario{wanted}: run kvlens analyze")
        groups = _groups(con, names, since_ns, now_ns)
        first, sections = _sections(con, groups, usd_per_gpu_hour, production)
    finally:
        con.close()
    title = "kvlens report"
    now = max(w.bounds()[1] for w, _ in groups)
    if len(groups) == 1:
        meta = f"Scenarios {', '.join(names)}; window {groups[0][0].label()} ({_duration(since_ns)})."
    else:
        meta = (f"Scenarios {', '.join(names)}; windows of {_duration(since_ns)} ending at each scenario's "
                "latest arrival (their traces have different epochs; pass --now for one window).")
    all_charts = tuple(c for s in sections for c in s.charts)
    cid_src = {c.cid: f"cid:{c.cid}" for c in all_charts}
    data_src = {c.cid: "data:image/png;base64," + base64.b64encode(c.png).decode() for c in all_charts}
    report = Report(
        subject=f"kvlens report, {datetime.fromtimestamp(now / 1e9, tz=UTC):%Y-%m-%d %H:%M} UTC",
        html=render_html(title, meta, sections, cid_src, first),
        file_html=render_html(title, meta, sections, data_src, first),
        text=render_text(title, meta, sections, first),
        charts=all_charts,
    )
    log.info("report built in %.2f s: %d sections, %d charts", time.perf_counter() - started,
             len(sections), len(all_charts))
    return report


def _duration(ns: int) -> str:
    for unit in ("w", "d", "h", "m", "s"):
        if ns % _UNITS_NS[unit] == 0:
            return f"{ns // _UNITS_NS[unit]}{unit}"
    return f"{ns / 1e9:g}s"


def write_report(db_path: str | Path, out_path: str | Path, *, now_ns: int | None = None,
                 since_ns: int = DAY_NS) -> Path:
    """Build the report and write its self-contained HTML to ``out_path`` (atomically); the path."""
    return save_html(build_report(db_path, since_ns=since_ns, now_ns=now_ns), out_path)


def save_html(report: Report, out_path: str | Path) -> Path:
    """Write the self-contained page under a temporary name, then rename it into place."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(report.file_html, encoding="utf-8")
    tmp.replace(out)
    return out
