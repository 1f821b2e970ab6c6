"""kvlens export's windowed series: hand-computed on the tiny DB, bounded on the demo, each labelled."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_grafana import export_exposition
from tiny_analysis_db import T0_NS, make_tiny_db

from kvlens.dashboards.export import load_snapshot
from kvlens.dashboards.export_windows import WINDOW_SECONDS
from kvlens.errors import ConfigError

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
MIN_NS = 60 * 10**9


def samples(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_last_window_ledger_by_hand(tmp_path: Path) -> None:
    got = samples(export_exposition(make_tiny_db(tmp_path / "kvlens.duckdb")))
    key = (("basis", "measured"), ("outcome", "miss_routing"), ("replica", "replica-1"), ("scenario", "a"))
    assert got[("kvlens_ledger_window_tokens", key)] == 100
    assert got[("kvlens_ledger_window_bytes", key)] == 1000
    hit = (("basis", "modelled"), ("outcome", "hit_local"), ("replica", "replica-0"), ("scenario", "b"))
    assert got[("kvlens_ledger_window_tokens", hit)] == 100  # b is simulated: modelled
    worst = (("basis", "measured"), ("replica", "replica-1"), ("scenario", "a"))
    assert got[("kvlens_worst_window_miss_tokens", worst)] == 200  # miss_routing + miss_cold of r2
    assert got[("kvlens_ledger_window_start_timestamp_seconds", (("scenario", "a"),))] == T0_NS / 1e9
    # analyzed_ns is 0 in the tiny DB: no window had closed, so the open one is served, flagged
    assert got[("kvlens_ledger_window_incomplete", (("scenario", "a"),))] == 1
    assert got[("kvlens_ledger_window_seconds", ())] == WINDOW_SECONDS
    info = (("model", "tiny"), ("provenance", "simulated"), ("scenario", "b"), ("ttft", "modelled"))
    assert got[("kvlens_scenario_info", info)] == 1


def test_the_latest_closed_window_is_served_not_the_open_one(tmp_path: Path) -> None:
    db = make_tiny_db(tmp_path / "kvlens.duckdb")
    con = duckdb.connect(str(db))
    con.execute("UPDATE scenarios SET analyzed_ns = ?", [T0_NS + 20 * MIN_NS])
    # a request in the window still open when analyze ran (T0+15 min .. T0+30 min)
    con.execute("INSERT INTO block_outcomes (scenario, request_id, replica, arrival_ns, position, "
                "block_hash, outcome, tokens, bytes) "
                "VALUES ('a', 'r3', 'replica-0', ?, 0, 33, 'miss_evicted', 100, 1000)",
                [T0_NS + 16 * MIN_NS])
    con.close()
    w = load_snapshot(db).windows
    assert w is not None
    assert [r[:2] for r in w.last] == [("a", T0_NS), ("b", T0_NS)]
    assert not any(outcome == "miss_evicted" for _, _, outcome, _, _ in w.ledger)
    got = samples(export_exposition(db))
    assert got[("kvlens_ledger_window_incomplete", (("scenario", "a"),))] == 0  # closed, data from its start


def test_data_starting_inside_the_window_is_incomplete(tmp_path: Path) -> None:
    db = make_tiny_db(tmp_path / "kvlens.duckdb")
    con = duckdb.connect(str(db))
    con.execute("UPDATE scenarios SET analyzed_ns = ?", [T0_NS + 60 * MIN_NS])
    con.execute("UPDATE block_outcomes SET arrival_ns = arrival_ns + ? WHERE scenario = 'a'", [5 * MIN_NS])
    con.close()
    got = samples(export_exposition(db))
    assert got[("kvlens_ledger_window_incomplete", (("scenario", "a"),))] == 1
    assert got[("kvlens_ledger_window_incomplete", (("scenario", "b"),))] == 0


def test_demo_series_are_bounded_and_labelled(demo_workdir: Path) -> None:
    db = demo_workdir / "kvlens.duckdb"
    text = export_exposition(db)
    got = samples(text)
    scenarios = {dict(k)["scenario"] for name, k in got if name == "kvlens_scenario_info"}
    assert scenarios >= {"rr8", "cache8"}
    per_scenario: dict[str, int] = {}
    for name, labels in got:
        if name == "kvlens_prefix_lost_tokens":
            s = dict(labels)["scenario"]
            per_scenario[s] = per_scenario.get(s, 0) + 1
    assert per_scenario and max(per_scenario.values()) <= 10
    assert {dict(k)["path"] for name, k in got if name == "kvlens_crossover_prefix_tokens"} <= {
        "local_tier", "peer", "pool"}
    ratios = [v for (name, k), v in got.items() if name == "kvlens_ttft_p99_p50_ratio"]
    assert ratios and all(v >= 1 for v in ratios)
    # every kvlens family says measured or modelled, by a basis label or in its HELP text
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kvlens_ledger_window_tokens") or family.name in (
                "kvlens_worst_window_miss_tokens", "kvlens_ttft_p99_p50_ratio", "kvlens_prefix_lost_tokens",
                "kvlens_crossover_prefix_tokens"):
            assert all(s.labels["basis"] in ("measured", "modelled") for s in family.samples), family.name
            assert "measured" in family.documentation and "modelled" in family.documentation


def test_routing_share_of_the_last_window_is_highest_on_rr8(demo_workdir: Path) -> None:
    got = samples(export_exposition(demo_workdir / "kvlens.duckdb"))
    tokens: dict[str, float] = {}
    routing: dict[str, float] = {}
    for (name, labels), v in got.items():
        if name == "kvlens_ledger_window_tokens":
            d = dict(labels)
            tokens[d["scenario"]] = tokens.get(d["scenario"], 0) + v
            if d["outcome"] == "miss_routing":
                routing[d["scenario"]] = routing.get(d["scenario"], 0) + v
    share = {s: routing.get(s, 0) / t for s, t in tokens.items()}
    assert share["rr8"] > 0.05 > max(v for s, v in share.items() if s != "rr8")


def test_top_prefixes_is_bounded(demo_workdir: Path) -> None:
    w = load_snapshot(demo_workdir / "kvlens.duckdb", top_prefixes=3).windows
    assert w is not None and w.prefixes
    counts: dict[str, int] = {}
    for scenario, *_ in w.prefixes:
        counts[scenario] = counts.get(scenario, 0) + 1
    assert max(counts.values()) <= 3
    with pytest.raises(ConfigError, match="top_prefixes must be in"):
        load_snapshot(demo_workdir / "kvlens.duckdb", top_prefixes=101)
