"""Tests for kvlens/schema.py: the contract, its docs page, units and vocabularies."""

from __future__ import annotations

import re
from pathlib import Path

from kvlens.schema import ANALYSIS_TABLES, ENUMS, LAKE_TABLES, TABLES, Outcome, render_markdown

ROOT = Path(__file__).resolve().parents[1]

# Columns the CLI synopsis promises other tools (DESIGN.md section 6).
CORE = {
    "requests": {"scenario", "request_id", "replica", "prompt_tokens", "ttft_ms"},
    "kv_events": {"scenario", "replica", "seq", "kind", "block_hash", "medium"},
    "miss_ledger": {"scenario", "replica", "outcome", "blocks", "tokens", "bytes"},
    "block_outcomes": {"scenario", "request_id", "position", "outcome", "tokens", "bytes"},
    "mrc": {"scenario", "stream", "method", "capacity_blocks", "capacity_bytes", "hit_ratio_blocks",
            "hit_ratio_bytes"},
}


def test_docs_page_is_generated_from_the_schema() -> None:
    committed = (ROOT / "docs" / "schema.md").read_text()
    assert committed == render_markdown(), "docs/schema.md is stale: run `make schema-docs`"


def test_core_column_names_exist() -> None:
    for table, cols in CORE.items():
        assert cols <= set(TABLES[table].names), table


def test_design_tables_are_all_declared() -> None:
    assert {t.name for t in LAKE_TABLES} == {
        "kv_events", "requests", "request_blocks", "transfers", "metric_samples", "probe_runs", "simulations"}
    assert {t.name for t in ANALYSIS_TABLES} == {
        "scenarios", "block_outcomes", "miss_ledger", "request_ledger", "request_sources", "reuse",
        "mrc", "capacity", "ttl_coverage", "flows", "fanout", "latency_tails", "prefix_ranking", "crossover",
        "hygiene",
        "isolation_findings", "warmup", "reconciliation", "tier_reconciliation", "tier_payoff",
    }


def test_every_table_has_a_scenario_and_documented_columns() -> None:
    for t in TABLES.values():
        assert "scenario" in t.names, t.name
        assert len(set(t.names)) == len(t.names), t.name
        for c in t.columns:
            assert c.doc, (t.name, c.name)


def test_units_in_names_match_declared_units() -> None:
    suffix_unit = {"_ns": "ns", "_ms": "ms", "_bytes": "bytes", "_tokens": "tokens", "_blocks": "blocks",
                   "_ratio": "ratio"}
    for t in TABLES.values():
        for c in t.columns:
            if "_ratio" in c.name:  # hit_ratio_blocks is a ratio counted by blocks
                assert c.unit == "ratio", (t.name, c.name)
                continue
            for suffix, unit in suffix_unit.items():
                if c.name.endswith(suffix):
                    assert c.unit == unit, (t.name, c.name, c.unit)


def test_outcome_order_matches_design() -> None:
    design = [
        "hit_local", "hit_offload", "hit_remote", "recomputed_last", "miss_group", "miss_load_failed",
        "miss_after_gap", "miss_routing", "miss_evicted", "miss_incompatible", "miss_cold", "unobserved",
    ]
    assert [o.value for o in Outcome] == design
    # README's outcome table lists them in the same order, one row each.
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)` \|", readme[readme.index("| outcome |"):], re.M)
    assert rows[:len(design)] == design


def test_enum_columns_name_a_declared_vocabulary() -> None:
    types = {c.type for t in TABLES.values() for c in t.columns}
    for ty in types:
        assert re.match(r"^[A-Z]", ty) or ty in ENUMS, ty
