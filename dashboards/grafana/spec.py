"""Dashboards: the Grafana panels and Prometheus alerting rules, declared once as PromQL.

The series they name are ``kvlens export``'s (dashboards/export.py, dashboards/export_windows.py),
the live collector's own (collector/live.py ``CollectorMetrics``) and vLLM's ``vllm:`` counters
(vllm/v1/metrics/loggers.py ``PrometheusStatLogger``: ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits``, counted in tokens). ``$scenario`` is the dashboard's scenario variable;
``grafana_exprs`` substitutes it for checks outside Grafana. Pure: no I/O, no third-party imports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

__all__ = ["GROUP", "PANELS", "ROUTING_MISS_SHARE", "RULES", "SCENARIO_VARIABLE", "TAIL_RATIO", "Panel",
           "Rule", "Target", "grafana_exprs", "render_rules_yaml"]

ROUTING_MISS_SHARE = 0.05  # of a scenario's needed tokens in the last window lost to routing
TAIL_RATIO = 5.0  # analyzers/tails.py FLAG_RATIO
GROUP = "kvlens"
SCENARIO_VARIABLE = "label_values(kvlens_scenario_info, scenario)"
_S = 'scenario=~"$scenario"'
_BY_OUTCOME = "{{replica}} {{outcome}}"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries, stat, table
    unit: str
    description: str
    targets: tuple[Target, ...]
    stacked: bool = False
    threshold: float | None = None  # drawn as a red line / colour step


@dataclass(frozen=True)
class Rule:
    alert: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    labels: dict[str, str] = field(default_factory=dict)


_HIT_RATIO_VLLM = ("sum by (instance) (rate(vllm:prefix_cache_hits_total[5m])) "
                   "/ sum by (instance) (rate(vllm:prefix_cache_queries_total[5m]))")

PANELS: tuple[Panel, ...] = (
    Panel("Ledger by outcome per replica (last window, tokens)", "timeseries", "short",
          "Tokens of needed full blocks per outcome in each scenario's last 15-minute analysis window "
          "(kvlens_ledger_window_tokens; basis label: measured or modelled).",
          (Target(f"sum by (replica, outcome) (kvlens_ledger_window_tokens{{{_S}}})", _BY_OUTCOME),),
          stacked=True),
    Panel("Ledger by outcome per replica (last window, KV bytes)", "timeseries", "bytes",
          "KV bytes of the same blocks, modelled from the model's KV geometry.",
          (Target(f"sum by (replica, outcome) (kvlens_ledger_window_bytes{{{_S}}})", _BY_OUTCOME),),
          stacked=True),
    Panel("Hit ratio per token and per byte, beside vLLM's own counter", "timeseries", "percentunit",
          "kvlens's ledger hit ratio (whole history, unit tokens or bytes) and vLLM's "
          "vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total over 5 minutes (tokens, as "
          "the engine counts them).",
          (Target(f"kvlens_hit_ratio{{{_S}}}", "kvlens {{scenario}} {{replica}} per {{unit}}"),
           Target(_HIT_RATIO_VLLM, "vLLM {{instance}} per token"))),
    Panel("Miss causes over time (last window, tokens)", "timeseries", "short",
          "Miss tokens per cause in the last analysis window, every replica together.",
          (Target(f'sum by (scenario, outcome) (kvlens_ledger_window_tokens{{{_S}, outcome=~"miss_.*"}})',
                  "{{scenario}} {{outcome}}"),), stacked=True),
    Panel("Routing-miss share (last window)", "timeseries", "percentunit",
          "Share of needed tokens that another replica or the pool held (miss_routing); the alert "
          f"KvlensRoutingMissShareHigh fires above {ROUTING_MISS_SHARE:g}.",
          (Target(f'sum by (scenario) (kvlens_ledger_window_tokens{{{_S}, outcome="miss_routing"}}) '
                  f"/ sum by (scenario) (kvlens_ledger_window_tokens{{{_S}}})", "{{scenario}}"),),
          threshold=ROUTING_MISS_SHARE),
    Panel("Worst windows (miss tokens per replica)", "table", "short",
          "Most miss tokens in any one analysis window, and when that window started.",
          (Target(f"kvlens_worst_window_miss_tokens{{{_S}}}", "{{scenario}} {{replica}}"),
           Target(f"kvlens_worst_window_start_timestamp_seconds{{{_S}}} * 1000",
                  "{{scenario}} {{replica}} start"))),
    Panel("TTFT P99/P50 per prefix class (last window)", "timeseries", "short",
          f"TTFT tail ratio per prefix class, all replicas; flagged above {TAIL_RATIO:g} "
          "(basis label: measured or modelled TTFT).",
          (Target(f'kvlens_ttft_p99_p50_ratio{{{_S}, replica="*"}}', "{{scenario}} {{prefix_class}}"),),
          threshold=TAIL_RATIO),
    Panel("P99/P50 flags per replica", "stat", "short",
          "Prefix classes whose TTFT P99/P50 is above 5 in the last window, per replica.",
          (Target(f'sum by (scenario, replica) (kvlens_ttft_tail_flagged{{{_S}, replica!="*"}})',
                  "{{scenario}} {{replica}}"),), threshold=1),
    Panel("Load-versus-recompute crossover (prefix tokens)", "stat", "short",
          "Shortest prefix whose KV load beats recomputing it, per load path (basis: measured by the "
          "GPU probe, or modelled).",
          (Target(f"kvlens_crossover_prefix_tokens{{{_S}}}", "{{scenario}} {{path}} ({{basis}})"),)),
    Panel("Top prefixes by lost tokens", "table", "short",
          "Prefixes with the most avoidable miss tokens (miss_routing + miss_evicted); kvlens export "
          "serves at most --top-prefixes of them per scenario.",
          (Target(f"topk(10, kvlens_prefix_lost_tokens{{{_S}}})", "{{scenario}} {{prefix}}"),)),
    Panel("Incomplete last window", "stat", "short",
          "1 when a scenario's last window covers less than 15 minutes of data: read its ratios with care.",
          (Target(f"kvlens_ledger_window_incomplete{{{_S}}}", "{{scenario}}"),), threshold=1),
    Panel("Collector: sequence gaps and decode errors (per 10 minutes)", "timeseries", "short",
          "The live collector's own counters: gaps in the engines' event sequence, batches the replay "
          "could not fill, frames skipped as undecodable.",
          (Target("sum by (instance, replica) (increase(kvlens_collector_sequence_gaps_total[10m]))",
                  "gaps {{instance}} {{replica}}"),
           Target("sum by (instance, replica) "
                  "(increase(kvlens_collector_unrecoverable_gap_batches_total[10m]))",
                  "lost batches {{instance}} {{replica}}"),
           Target("sum by (instance, reason) (increase(kvlens_collector_decode_errors_total[10m]))",
                  "decode errors {{instance}} {{reason}}"))),
)

RULES: tuple[Rule, ...] = (
    Rule("KvlensRoutingMissShareHigh",
         'sum by (scenario) (kvlens_ledger_window_tokens{outcome="miss_routing"}) '
         f"/ sum by (scenario) (kvlens_ledger_window_tokens) > {ROUTING_MISS_SHARE:g}",
         "0m", "warning",
         "Routing misses are {{ $value | humanizePercentage }} of needed tokens in {{ $labels.scenario }}",
         "In the last analysis window another replica or the pool held blocks the serving replica "
         "recomputed: prefix-aware routing would have reused them. The figure is already a 15-minute "
         "window, so the rule waits no longer."),
    Rule("KvlensTtftTailRatioHigh", f'kvlens_ttft_p99_p50_ratio{{prefix_class="all"}} > {TAIL_RATIO:g}', "0m",
         "warning",
         "TTFT P99/P50 is {{ $value | humanize }} on {{ $labels.replica }} in {{ $labels.scenario }}",
         "The last window's TTFT tail is more than five times its median "
         "(basis label: measured or modelled)."),
    Rule("KvlensWindowIncomplete", "kvlens_ledger_window_incomplete == 1", "30m", "info",
         "The last analysis window of {{ $labels.scenario }} covers less than a full window",
         "No window had closed when kvlens analyze ran, or the data starts inside it: its ratios rest on "
         "less than 15 minutes of traffic."),
    Rule("KvlensCollectorSequenceGaps", "increase(kvlens_collector_sequence_gaps_total[10m]) > 0", "0m",
         "warning", "The collector saw sequence gaps from {{ $labels.replica }}",
         "KV events were missed and replay was asked for; "
         "kvlens_collector_unrecoverable_gap_batches_total says what the replay could not fill."),
    Rule("KvlensCollectorLostBatches", "increase(kvlens_collector_unrecoverable_gap_batches_total[10m]) > 0",
         "0m", "critical", "KV-event batches from {{ $labels.replica }} are lost",
         "The replay buffer no longer held them: the ledger for this replica is missing events "
         "(raise the engine's replay buffer or restart the collector sooner)."),
    Rule("KvlensCollectorDecodeErrors",
         "sum by (instance, reason) (increase(kvlens_collector_decode_errors_total[10m])) > 0",
         "0m", "warning", "The collector skipped undecodable frames ({{ $labels.reason }})",
         "Frames, batches or events were skipped; the collector logs the first bytes of each."),
    Rule("KvlensExportDown", "kvlens_export_up == 0", "10m", "warning",
         "kvlens export cannot reload its analysis DB",
         "It serves the previous snapshot; check that kvlens analyze writes a readable DB at --db."),
)


def grafana_exprs() -> list[str]:
    """Every panel's PromQL with the dashboard variable substituted (matching every scenario)."""
    return [t.expr.replace("$scenario", ".+") for p in PANELS for t in p.targets]


def _q(text: str) -> str:
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def render_rules_yaml() -> str:
    """The Prometheus rule file (https://prometheus.io/docs/prometheus/latest/configuration/alerting_rules/)."""
    lines = ["# Generated by python -m dashboards.grafana.build from dashboards/grafana/spec.py: edit that.",
             "groups:", f"  - name: {GROUP}", "    rules:"]
    for r in RULES:
        lines += [f"      - alert: {r.alert}", f"        expr: {_q(r.expr)}", f"        for: {r.for_}",
                  "        labels:", f"          severity: {r.severity}"]
        lines += [f"          {k}: {_q(v)}" for k, v in sorted(r.labels.items())]
        lines += ["        annotations:", f"          summary: {_q(r.summary)}",
                  f"          description: {_q(r.description)}"]
    return "\n".join(lines) + "\n"
