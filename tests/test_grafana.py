"""Grafana dashboard and alert rules: committed files match the generator, every PromQL parses and
names only series that a real exposition holds (kvlens export, the collector, vLLM's /metrics)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collector.live import CollectorMetrics
from dashboards.export import serve
from dashboards.grafana.build import DASHBOARD_JSON, RULES_YAML, build_dashboard, render_dashboard
from dashboards.grafana.spec import PANELS, RULES, grafana_exprs, render_rules_yaml

DATA = Path(__file__).parent / "data"
VLLM_METRICS = (DATA / "vllm-cpu-capture" / "metrics.txt", DATA / "vllm-concurrent-capture" / "metrics.txt")


def _sample_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def export_exposition(db: Path) -> str:
    """What a Prometheus scrape of ``kvlens export`` on ``db`` reads (over HTTP, on loopback)."""
    server, _, port = serve(db, port=0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            return str(response.read().decode())
    finally:
        server.shutdown()
        server.server_close()


def collector_exposition() -> str:
    """The live collector's exposition with every labelled counter touched once (as after a gap)."""
    m = CollectorMetrics()
    m.gaps.labels(replica="r0").inc()
    m.lost_batches.labels(replica="r0").inc()
    m.decode_errors.labels(reason="bad_frame").inc()
    return str(generate_latest(m.registry).decode())


def selector_names(node: Any) -> set[str]:
    """Metric names of every vector selector in a parsed PromQL expression."""
    if isinstance(node, promql_parser.VectorSelector):
        return {node.name} if node.name else set()
    names: set[str] = set()
    for attr in ("lhs", "rhs", "expr", "param", "vector_selector"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, str | int | float):
            names |= selector_names(child)
    for arg in getattr(node, "args", None) or ():
        names |= selector_names(arg)
    return names


def test_committed_files_are_the_generators_output() -> None:
    assert DASHBOARD_JSON.read_text() == render_dashboard(), "run python -m dashboards.grafana.build"
    assert RULES_YAML.read_text() == render_rules_yaml(), "run python -m dashboards.grafana.build"


def test_dashboard_round_trips_through_grafanas_schema_types() -> None:
    from grafana_foundation_sdk.models.dashboard import Dashboard

    board = json.loads(DASHBOARD_JSON.read_text())
    typed = Dashboard.from_json(board)
    assert typed.uid == "kvlens-ledger" and typed.panels is not None and len(typed.panels) == len(PANELS)
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert exprs == [t.expr for p in PANELS for t in p.targets]
    assert build_dashboard() == board


def test_every_expression_parses_and_names_exported_series(demo_workdir: Path) -> None:
    known = _sample_names(export_exposition(demo_workdir / "kvlens.duckdb"))
    known |= _sample_names(collector_exposition())
    for path in VLLM_METRICS:
        known |= _sample_names(path.read_text())
    used: set[str] = set()
    for expr in grafana_exprs() + [r.expr for r in RULES]:
        names = selector_names(promql_parser.parse(expr))
        assert names, f"no series in {expr!r}"
        assert names <= known, f"{expr!r} names series nothing exports: {sorted(names - known)}"
        used |= names
    assert {"vllm:prefix_cache_hits_total", "kvlens_ledger_window_tokens", "kvlens_ttft_p99_p50_ratio",
            "kvlens_crossover_prefix_tokens", "kvlens_collector_sequence_gaps_total"} <= used


def test_a_misspelt_series_is_caught() -> None:
    expr = 'sum by (a) (rate(vllm:prefix_cache_hit_total[5m])) / x{b="c"}'
    names = selector_names(promql_parser.parse(expr))
    assert names == {"vllm:prefix_cache_hit_total", "x"}
    with pytest.raises(ValueError):
        promql_parser.parse("sum by (replica (kvlens_ledger_window_tokens)")


def test_rules_have_what_alertmanager_routes_on() -> None:
    assert len({r.alert for r in RULES}) == len(RULES)
    for r in RULES:
        assert r.severity in ("info", "warning", "critical") and r.summary and r.description
    text = RULES_YAML.read_text()
    assert all(f"alert: {r.alert}" in text for r in RULES)


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="no promtool (Debian: apt-get install prometheus; make test installs it as root)")
def test_promtool_checks_the_rule_file() -> None:
    done = subprocess.run(["promtool", "check", "rules", str(RULES_YAML)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(RULES)} rules found" in done.stdout
