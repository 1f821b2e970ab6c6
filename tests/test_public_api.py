"""Each package's public names, as an exact set: adding or dropping one is a decision made here."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "kvlens": {"SCHEMA_VERSION", "ConfigError", "InputError", "KvlensError", "NoDataError",
               "SchemaVersionError"},
    "kvlens.collector": {"FORMATS", "ImportResult", "import_files"},
    "kvlens.analyzers": {
        "LedgerPlan", "analyze_after_ledger", "analyze_scenario", "block_outcomes", "cost_model", "crossover",
        "effective_capacity",
        "fanout", "flows", "hygiene", "isolation_findings", "join_sources", "latency_tails", "miss_ledger",
        "mrc", "prefix_ranking", "reconcile", "request_ledger", "reuse", "tier_payoff", "tier_reconciliation",
        "ttl_coverage", "warmup"},
    "kvlens.analyzers.analyze": {"AnalyzeResult", "analyze_lake", "scenario_model"},
    "kvlens.collector.imports": {"FORMATS", "LINE_FORMATS", "ImportResult", "import_files"},
    "kvlens.dashboards": set(),
    "kvlens.gpu_probe": {
        "DelayCheck", "INTERMEDIATE_SIZES", "LayerShape", "Measurement", "ProbePath", "ProbePlan",
        "ProbeReport", "ProbeSource", "delay_injection_check", "layer_shape", "measure_transfers",
        "parse_prefix_tokens", "plan_probe", "prefill_flops", "probe_rows", "render_table", "run_probe",
        "write_probe_rows"},
    "kvlens.sample_data": {"MOONCAKE_CONVERSATION"},
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_names_are_exactly_these(name: str) -> None:
    module = importlib.import_module(name)
    assert set(module.__all__) == PUBLIC[name]
    assert len(module.__all__) == len(set(module.__all__)), "a name listed twice"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"
