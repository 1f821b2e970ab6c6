"""Dashboards: windowed Prometheus series from the analysis DB, beside the whole-history ledger.

``kvlens export`` serves these next to dashboards/export.py's totals. A window is the analyzers'
(analyzers/tails.py, analyzers/flows.py): aligned to multiples of ``WINDOW_SECONDS`` since the
epoch. The *last* window of a scenario is the one holding its last arrival. Series (all gauges;
``basis`` says whether the figure was ``measured`` from recorded engine data or ``modelled``: a
simulated scenario, a FLOP model, a configured bandwidth):

    kvlens_ledger_window_tokens{scenario,replica,outcome,basis}   tokens per outcome, last window
    kvlens_ledger_window_bytes{scenario,replica,outcome,basis}    their KV bytes
    kvlens_ledger_window_start_timestamp_seconds{scenario}        where that window starts
    kvlens_ledger_window_incomplete{scenario}                     1: no window had closed when analysed,
                                                                  or the data starts inside it
    kvlens_ledger_window_seconds                                  the window length
    kvlens_worst_window_miss_tokens{scenario,replica,basis}       most miss tokens in any one window
    kvlens_worst_window_start_timestamp_seconds{scenario,replica} where that worst window starts
    kvlens_ttft_p99_p50_ratio{scenario,replica,prefix_class,basis} TTFT P99/P50, last window
    kvlens_ttft_tail_flagged{scenario,replica,prefix_class}       1 when that ratio is above 5
    kvlens_prefix_lost_tokens{scenario,prefix,basis}              top-N prefixes by avoidable miss
                                                                  tokens (miss_routing + miss_evicted)
    kvlens_crossover_prefix_tokens{scenario,path,device,basis}    shortest prefix where a load beats
                                                                  recomputing it (the probe's crossover)
    kvlens_scenario_info{scenario,provenance,model,ttft}          1 per scenario: what it was measured with

Label cardinality is bounded: outcomes are a closed vocabulary (kvlens/schema.py Outcome),
prefix classes are ``full_hit``, ``partial_hit``, ``no_full_block``, ``all`` and one ``miss:`` per
outcome, ``prefix`` takes at most ``top_prefixes`` values per scenario (default 10, at most
``MAX_TOP_PREFIXES``), ``path`` is ``local_tier``, ``peer`` or ``pool``; replicas and scenarios are
the operator's own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
from prometheus_client.core import GaugeMetricFamily

from kvlens.errors import ConfigError

__all__ = ["DEFAULT_TOP_PREFIXES", "MAX_TOP_PREFIXES", "WINDOW_SECONDS", "WindowSnapshot",
           "load_windows", "window_families"]

WINDOW_SECONDS = 15 * 60  # analyzers/tails.py and analyzers/flows.py DEFAULT_WINDOW_NS
DEFAULT_TOP_PREFIXES = 10
MAX_TOP_PREFIXES = 100
_WINDOW_NS = WINDOW_SECONDS * 1_000_000_000

# Per scenario, the last window: the latest that had closed when kvlens analyze ran and holds
# arrivals; when none had (all the data lies in the open window), that open window.
_LAST_CTE = """
WITH per AS (
    SELECT b.scenario, (b.arrival_ns // ?) * ? AS start_ns, any_value(s.analyzed_ns) AS analyzed_ns
    FROM block_outcomes b LEFT JOIN scenarios s USING (scenario)
    WHERE b.arrival_ns IS NOT NULL GROUP BY ALL
), last AS (
    SELECT scenario, coalesce(max(start_ns) FILTER (WHERE start_ns + ? <= analyzed_ns), max(start_ns))
               AS start_ns
    FROM per GROUP BY ALL
)
"""

_LAST_WINDOW_SQL = _LAST_CTE + """
SELECT l.scenario, l.start_ns, any_value(f.first_ns), any_value(s.analyzed_ns),
       CASE WHEN any_value(s.provenance) = 'measured' THEN 'measured' ELSE 'modelled' END AS basis
FROM last l
JOIN (SELECT scenario, min(arrival_ns) AS first_ns FROM block_outcomes GROUP BY ALL) f USING (scenario)
LEFT JOIN scenarios s USING (scenario)
GROUP BY l.scenario, l.start_ns ORDER BY 1
"""

_WINDOW_LEDGER_SQL = _LAST_CTE + """
SELECT b.scenario, coalesce(b.replica, '') AS replica, CAST(b.outcome AS VARCHAR) AS outcome,
       sum(b.tokens) AS tokens, sum(b.bytes) AS bytes
FROM block_outcomes b JOIN last w ON b.scenario = w.scenario
WHERE b.arrival_ns >= w.start_ns AND b.arrival_ns < w.start_ns + ?
GROUP BY ALL ORDER BY 1, 2, 3
"""

_WORST_WINDOW_SQL = """
WITH per AS (
    SELECT scenario, coalesce(replica, '') AS replica, (arrival_ns // ?) * ? AS start_ns,
           sum(tokens) AS miss_tokens
    FROM block_outcomes
    WHERE CAST(outcome AS VARCHAR) LIKE 'miss_%' AND arrival_ns IS NOT NULL
    GROUP BY ALL
)
SELECT scenario, replica, arg_max(start_ns, miss_tokens ORDER BY start_ns) AS start_ns, max(miss_tokens)
FROM per GROUP BY ALL ORDER BY 1, 2
"""

# The scenario's last window in latency_tails (window_start_ns NULL is the whole-scenario roll-up).
_TAILS_SQL = """
WITH last AS (
    SELECT scenario, max(window_start_ns) AS start_ns FROM latency_tails
    WHERE window_start_ns IS NOT NULL GROUP BY ALL
)
SELECT t.scenario, t.replica, t.prefix_class, t.p99_p50_ratio, t.flagged,
       coalesce(s.ttft_label, 'modelled') AS basis
FROM latency_tails t JOIN last l ON t.scenario = l.scenario AND t.window_start_ns = l.start_ns
LEFT JOIN scenarios s ON s.scenario = t.scenario
WHERE t.p99_p50_ratio IS NOT NULL AND isfinite(t.p99_p50_ratio)
ORDER BY 1, 2, 3
"""

_TOP_PREFIXES_SQL = """
WITH ranked AS (
    SELECT p.scenario, p.prefix_hash, p.avoidable_miss_tokens,
           row_number() OVER (PARTITION BY p.scenario
                              ORDER BY p.avoidable_miss_tokens DESC, p.prefix_hash) AS n
    FROM prefix_ranking p WHERE p.avoidable_miss_tokens > 0
)
SELECT r.scenario, printf('%016x', r.prefix_hash) AS prefix, r.avoidable_miss_tokens,
       CASE WHEN s.provenance = 'measured' THEN 'measured' ELSE 'modelled' END AS basis
FROM ranked r LEFT JOIN scenarios s USING (scenario)
WHERE r.n <= ? ORDER BY 1, 3 DESC, 2
"""

_CROSSOVER_SQL = """
SELECT scenario, path, device, min(prefix_tokens) AS prefix_tokens,
       CASE WHEN bool_and(recompute_label = 'measured' AND load_label = 'measured')
            THEN 'measured' ELSE 'modelled' END AS basis
FROM crossover WHERE winner = 'load'
GROUP BY ALL ORDER BY 1, 2, 3
"""

_INFO_SQL = """
SELECT scenario, coalesce(provenance, ''), coalesce(model, ''), coalesce(ttft_label, 'none')
FROM scenarios ORDER BY 1
"""


@dataclass(frozen=True)
class WindowSnapshot:
    last: list[tuple[Any, ...]]       # scenario, start_ns, first_ns, analyzed_ns, basis
    ledger: list[tuple[Any, ...]]     # scenario, replica, outcome, tokens, bytes
    worst: list[tuple[Any, ...]]      # scenario, replica, start_ns, miss tokens
    tails: list[tuple[Any, ...]]      # scenario, replica, prefix_class, ratio, flagged, basis
    prefixes: list[tuple[Any, ...]]   # scenario, prefix hex, lost tokens, basis
    crossover: list[tuple[Any, ...]]  # scenario, path, device, prefix tokens, basis
    info: list[tuple[Any, ...]]       # scenario, provenance, model, ttft label


def load_windows(con: duckdb.DuckDBPyConnection, *,
                 top_prefixes: int = DEFAULT_TOP_PREFIXES) -> WindowSnapshot:
    """Read the windowed figures from an open (read-only) analysis DB connection."""
    if not 0 <= top_prefixes <= MAX_TOP_PREFIXES:
        raise ConfigError(f"top_prefixes must be in [0, {MAX_TOP_PREFIXES}], got {top_prefixes}: "
                          "pass --top-prefixes within it")
    w = [_WINDOW_NS] * 3
    return WindowSnapshot(
        last=con.execute(_LAST_WINDOW_SQL, w).fetchall(),
        ledger=con.execute(_WINDOW_LEDGER_SQL, [*w, _WINDOW_NS]).fetchall(),
        worst=con.execute(_WORST_WINDOW_SQL, [_WINDOW_NS, _WINDOW_NS]).fetchall(),
        tails=con.execute(_TAILS_SQL).fetchall(),
        prefixes=con.execute(_TOP_PREFIXES_SQL, [top_prefixes]).fetchall(),
        crossover=con.execute(_CROSSOVER_SQL).fetchall(),
        info=con.execute(_INFO_SQL).fetchall(),
    )


def _incomplete(start_ns: int, first_ns: int, analyzed_ns: int | None) -> bool:
    """The last window is incomplete when it had not closed when analysed (no window had), or the
    data starts inside it: its figures then cover less than a full window."""
    end_ns = start_ns + _WINDOW_NS
    return first_ns > start_ns or (analyzed_ns is not None and analyzed_ns < end_ns)


def _gauge(name: str, doc: str, labels: Sequence[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _ledger_families(snap: WindowSnapshot) -> Iterator[GaugeMetricFamily]:
    basis = {r[0]: r[4] for r in snap.last}
    labels = ["scenario", "replica", "outcome", "basis"]
    tokens = _gauge("kvlens_ledger_window_tokens", "Tokens of needed full blocks per outcome in the "
                    "scenario's last analysis window (basis: measured from engine events, or modelled by a "
                    "simulation)",
                    labels)
    nbytes = _gauge("kvlens_ledger_window_bytes", "KV bytes of needed full blocks per outcome in the last "
                    "analysis window (bytes modelled from the model's KV geometry; basis as for tokens)",
                    labels)
    for scenario, replica, outcome, t, b in snap.ledger:
        tokens.add_metric([scenario, replica, outcome, basis[scenario]], float(t))
        nbytes.add_metric([scenario, replica, outcome, basis[scenario]], float(b))
    start = _gauge("kvlens_ledger_window_start_timestamp_seconds", "Start of the scenario's last analysis "
                   "window (the latest closed when analysed)", ["scenario"])
    flag = _gauge("kvlens_ledger_window_incomplete", "1 when no window had closed when analysed or the data "
                  "starts inside the last one: its figures cover less than a full window", ["scenario"])
    for scenario, start_ns, first_ns, analyzed_ns, _basis in snap.last:
        start.add_metric([scenario], start_ns / 1e9)
        flag.add_metric([scenario], float(_incomplete(start_ns, first_ns, analyzed_ns)))
    yield from (tokens, nbytes, start, flag)
    yield GaugeMetricFamily("kvlens_ledger_window_seconds", "Length of an analysis window (configured)",
                            value=float(WINDOW_SECONDS))


def _worst_families(snap: WindowSnapshot) -> Iterator[GaugeMetricFamily]:
    basis = {r[0]: r[4] for r in snap.last}
    worst = _gauge("kvlens_worst_window_miss_tokens", "Most miss tokens in one analysis window, per replica "
                   "(basis: measured or modelled)", ["scenario", "replica", "basis"])
    at = _gauge("kvlens_worst_window_start_timestamp_seconds", "Start of that worst window",
                ["scenario", "replica"])
    for scenario, replica, start_ns, miss in snap.worst:
        worst.add_metric([scenario, replica, basis.get(scenario, "modelled")], float(miss))
        at.add_metric([scenario, replica], start_ns / 1e9)
    yield from (worst, at)


def _tail_families(snap: WindowSnapshot) -> Iterator[GaugeMetricFamily]:
    ratio = _gauge("kvlens_ttft_p99_p50_ratio", "TTFT P99/P50 per prefix class in the last window (replica "
                   "'*' is all replicas; basis: the scenario's TTFT measured or modelled)",
                   ["scenario", "replica", "prefix_class", "basis"])
    flagged = _gauge("kvlens_ttft_tail_flagged", "1 when TTFT P99/P50 in the last window is above 5",
                     ["scenario", "replica", "prefix_class"])
    for scenario, replica, cls, value, flag, basis in snap.tails:
        ratio.add_metric([scenario, replica, cls, basis], float(value))
        flagged.add_metric([scenario, replica, cls], float(bool(flag)))
    yield from (ratio, flagged)


def _rank_families(snap: WindowSnapshot) -> Iterator[GaugeMetricFamily]:
    lost = _gauge("kvlens_prefix_lost_tokens", "Avoidable miss tokens (miss_routing + miss_evicted) of the "
                  "top prefixes (prefix: hex of its last block's hash; basis: measured or modelled)",
                  ["scenario", "prefix", "basis"])
    for scenario, prefix, tokens, basis in snap.prefixes:
        lost.add_metric([scenario, prefix, basis], float(tokens))
    cross = _gauge("kvlens_crossover_prefix_tokens", "Shortest prefix where loading its KV beats recomputing "
                   "it (basis: measured when both sides came from the GPU probe, else modelled)",
                   ["scenario", "path", "device", "basis"])
    for scenario, path, device, tokens, basis in snap.crossover:
        cross.add_metric([scenario, path, device or "", basis], float(tokens))
    info = _gauge("kvlens_scenario_info", "1 per analysed scenario: provenance (measured or simulated), "
                  "the model its bytes assume, and whether its TTFT is measured or modelled",
                  ["scenario", "provenance", "model", "ttft"])
    for scenario, provenance, model, ttft in snap.info:
        info.add_metric([scenario, provenance, model, ttft], 1.0)
    yield from (lost, cross, info)


def window_families(snap: WindowSnapshot) -> Iterator[GaugeMetricFamily]:
    """Every windowed metric family of one snapshot (pure: the snapshot in, families out)."""
    yield from _ledger_families(snap)
    yield from _worst_families(snap)
    yield from _tail_families(snap)
    yield from _rank_families(snap)
