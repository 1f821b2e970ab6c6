"""analyzers.reconcile: engine token counters (with resets) against the ledger, hand-computed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest

from kvlens.analyzers.reconcile import reconcile
from kvlens.collector.scrape import parse_exposition
from kvlens.lake import SegmentWriter, open_lake

S = 1_000_000_000
ENGINE0 = [("engine", "0"), ("model_name", "m")]
ENGINE1 = [("engine", "1"), ("model_name", "m")]


def _relation(lake: Path, rows: list[tuple[int, str, str, list[tuple[str, str]], float]],
              scenario: str = "live") -> duckdb.DuckDBPyRelation:
    with SegmentWriter(lake, "metric_samples", scenario=scenario, writer_id="t") as w:
        w.append_columns({"ts_ns": [r[0] for r in rows], "replica": [r[1] for r in rows],
                          "name": [r[2] for r in rows], "labels": [r[3] for r in rows],
                          "value": [r[4] for r in rows]})
    con = duckdb.connect()
    open_lake(con, lake)
    return con.table("metric_samples")


def _ledger(rows: list[tuple[str, int, int, int, int | None]]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema={"replica": pl.Utf8, "arrival_ns": pl.Int64, "prompt_tokens": pl.Int64,
                                      "hit_tokens": pl.Int64, "cached_tokens": pl.Int64}, orient="row")


def _series(replica: str, name: str, labels: list[tuple[str, str]], points: list[tuple[int, float]]
            ) -> list[tuple[int, str, str, list[tuple[str, str]], float]]:
    return [(t * S, replica, name, labels, v) for t, v in points]


# Hits 100 -> 150 -> 30 (restart) -> 80: increase 50 + 30 + 50 = 130, one reset.
HITS = _series("a", "vllm:prefix_cache_hits_total", ENGINE0, [(10, 100), (20, 150), (30, 30), (40, 80)])
QUERIES = _series("a", "vllm:prefix_cache_queries_total", ENGINE0,
                  [(10, 400), (20, 500), (30, 60), (40, 200)])
LEDGER = _ledger([("a", 5 * S, 99, 99, None),          # before the first scrape: outside the window
                  ("a", 12 * S, 150, 50, 50), ("a", 25 * S, 100, 40, 40), ("a", 33 * S, 90, 30, None),
                  ("a", 45 * S, 99, 99, None)])         # after the last scrape


def _one(df: pl.DataFrame, **where: Any) -> dict[str, Any]:
    rows = df.filter(*(pl.col(k) == v for k, v in where.items())).to_dicts()
    assert len(rows) == 1, rows
    return rows[0]


def test_counter_reset_increase_and_difference(tmp_path: Path) -> None:
    out = reconcile(metric_samples=_relation(tmp_path, HITS + QUERIES), request_ledger=LEDGER,
                    scenario="live")
    assert out.columns[:4] == ["scenario", "replica", "window_start_ns", "window_end_ns"]
    row = _one(out, replica="a")
    assert (row["window_start_ns"], row["window_end_ns"]) == (10 * S, 40 * S)
    assert row["engine_hit_tokens"] == 130
    assert row["engine_queries_tokens"] == 100 + 60 + 140
    assert row["engine_external_hit_tokens"] is None
    assert row["counter_resets"] == 2  # hits and queries both restarted
    assert (row["ledger_requests"], row["ledger_prompt_tokens"], row["ledger_hit_tokens"]) == (3, 340, 120)
    assert row["reported_cached_tokens"] == 90
    assert row["difference_tokens"] == 10
    assert row["difference_ratio"] == pytest.approx(10 / 130)
    assert row["reported_difference_tokens"] == 40


def test_windows_take_the_increase_at_the_later_sample(tmp_path: Path) -> None:
    out = reconcile(metric_samples=_relation(tmp_path, HITS), request_ledger=LEDGER, scenario="live",
                    window_ns=20 * S)
    got = {r["window_start_ns"] // S:
           (r["engine_hit_tokens"], r["ledger_hit_tokens"], r["window_end_ns"] // S) for r in out.to_dicts()}
    # ts 20: +50, ts 30: reset +30 -> window 20; ts 40: +50 -> window 40; ts 10 is the baseline.
    assert got == {0: (0, 50, 20), 20: (80, 70, 40), 40: (50, None, 60)}


def test_engines_sum_created_zero_and_deprecated_names_are_not_doubled(tmp_path: Path) -> None:
    rows = (_series("a", "vllm:prefix_cache_hits_total", ENGINE0, [(10, 100), (20, 160)])
            + _series("a", "vllm:prefix_cache_hits_total", ENGINE1, [(10, 7), (20, 9)])
            + _series("a", "vllm:prefix_cache_hits_created", ENGINE1, [(10, 4.0), (20, 4.0)])  # at 4 s
            + _series("a", "vllm:gpu_prefix_cache_hits_total", ENGINE0, [(10, 100), (20, 160)])
            + _series("a", "vllm:external_prefix_cache_hits_total", ENGINE0, [(10, 5), (20, 25)]))
    out = reconcile(metric_samples=_relation(tmp_path, rows), request_ledger=_ledger([]), scenario="live")
    row = _one(out, replica="a")
    # engine 0: 60; engine 1: 7 since its creation at 4 s, then 2; the deprecated copy is ignored.
    assert row["engine_hit_tokens"] == 60 + 7 + 2
    assert row["engine_external_hit_tokens"] == 20
    assert row["window_start_ns"] == 4 * S
    assert row["ledger_requests"] is None and row["difference_tokens"] == 89


def test_replica_map_and_replicas_without_samples(tmp_path: Path) -> None:
    ledger = _ledger([("pod-a", 15 * S, 10, 8, None), ("b", 3 * S, 10, 4, None), ("b", 9 * S, 20, 6, None)])
    out = reconcile(metric_samples=_relation(tmp_path, HITS), request_ledger=ledger, scenario="x",
                    replica_map={"a": "pod-a"})
    assert out["replica"].to_list() == ["b", "pod-a"]
    b = _one(out, replica="b")
    assert b["engine_hit_tokens"] is None and b["ledger_hit_tokens"] == 10
    assert (b["window_start_ns"], b["window_end_ns"]) == (3 * S, 9 * S)
    a = _one(out, replica="pod-a")
    assert (a["scenario"], a["engine_hit_tokens"], a["ledger_hit_tokens"], a["difference_tokens"]) == \
        ("x", 130, 8, 122)


def test_one_real_scrape_reconciles_the_whole_run_from_created(tmp_path: Path) -> None:
    text = (Path(__file__).parent / "data" / "vllm-cpu-capture" / "metrics.txt").read_text()
    t = 1_796_100_000 * S  # after the counters' creation (1.796064e9 s)
    rows = [(t, "replica-a", name, labels, value) for name, labels, value in parse_exposition(text)]
    ledger = _ledger([("replica-a", 1_796_070_000 * S, 104_998, 63_000, 63_744)])
    out = reconcile(metric_samples=_relation(tmp_path, rows), request_ledger=ledger, scenario="live")
    row = _one(out, replica="replica-a")
    assert (row["engine_queries_tokens"], row["engine_hit_tokens"]) == (104_998, 63_744)
    assert row["engine_external_hit_tokens"] == 0 and row["counter_resets"] == 0
    assert row["window_start_ns"] == pytest.approx(1_796_063_996.888 * S, abs=S)
    assert (row["difference_tokens"], row["reported_difference_tokens"]) == (744, 0)
