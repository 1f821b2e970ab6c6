"""Latency tails: prefix classes, percentiles and the roll-up convention, by hand."""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pytest

from kvlens.analyzers.tails import latency_tails

W = 1000  # window, ns


def _ledger(rows: list[dict[str, object]]) -> pl.DataFrame:
    base = {"scenario": "s", "replica": "r0", "arrival_ns": 0, "hit_tokens": 0, "recomputed_last_tokens": 0,
            "miss_tokens": 0, "dominant_miss": None, "ttft_ms": 10.0, "queue_ms": 0.0}
    full = [{**base, "request_id": f"q{i}", **row} for i, row in enumerate(rows)]
    return pl.DataFrame(full, schema_overrides={"dominant_miss": pl.Utf8}, infer_schema_length=None)


def _cell(out: pl.DataFrame, replica: str, window: int | None, cls: str) -> dict[str, object]:
    win = pl.col("window_start_ns").is_null() if window is None else pl.col("window_start_ns") == window
    rows = out.filter((pl.col("replica") == replica) & win & (pl.col("prefix_class") == cls))
    assert rows.height == 1, (replica, window, cls, rows)
    return rows.row(0, named=True)


def test_prefix_classes() -> None:
    ledger = _ledger([
        {"hit_tokens": 32},                                              # full hit
        {"recomputed_last_tokens": 16},                                  # only the given-back block
        {"hit_tokens": 16, "miss_tokens": 16, "dominant_miss": "miss_evicted"},
        {"miss_tokens": 32, "dominant_miss": "miss_routing"},
        {},                                                              # shorter than a block
    ])
    out = latency_tails(request_ledger=ledger, window_ns=W)
    cells = out.filter((pl.col("replica") == "r0") & pl.col("window_start_ns").is_not_null())
    assert dict(zip(cells["prefix_class"], cells["requests"], strict=True)) == {
        "full_hit": 2, "partial_hit": 1, "miss:miss_routing": 1, "no_full_block": 1}


def test_percentiles_interpolate_and_flag() -> None:
    ledger = _ledger([{"hit_tokens": 16, "ttft_ms": t, "queue_ms": q}
                      for t, q in ((10, 0), (20, 1), (30, 2), (40, 3), (1000, 4))])
    row = _cell(latency_tails(request_ledger=ledger, window_ns=W), "r0", 0, "full_hit")
    # Order statistics 10, 20, 30, 40, 1000: P50 at index 2; P95 at 3.8; P99 at 3.96.
    assert row["ttft_p50_ms"] == pytest.approx(30.0)
    assert row["ttft_p95_ms"] == pytest.approx(40 + 0.8 * 960)
    assert row["ttft_p99_ms"] == pytest.approx(40 + 0.96 * 960)
    assert row["p99_p50_ratio"] == pytest.approx((40 + 0.96 * 960) / 30)
    assert row["flagged"] is True
    assert row["queue_p50_ms"] == pytest.approx(2.0)


def test_flat_latency_is_not_flagged_and_zero_median_has_no_ratio() -> None:
    flat = _ledger([{"hit_tokens": 16, "ttft_ms": 10.0 + i} for i in range(4)])
    assert _cell(latency_tails(request_ledger=flat, window_ns=W), "r0", 0, "full_hit")["flagged"] is False
    zero = _ledger([{"hit_tokens": 16, "ttft_ms": 0.0}])
    row = _cell(latency_tails(request_ledger=zero, window_ns=W), "r0", 0, "full_hit")
    assert row["p99_p50_ratio"] is None
    assert row["flagged"] is False


def test_rollups_follow_the_convention() -> None:
    ledger = _ledger([
        {"replica": "r0", "arrival_ns": 10, "hit_tokens": 16, "ttft_ms": 1.0},
        {"replica": "r0", "arrival_ns": 1500, "miss_tokens": 16, "dominant_miss": "miss_cold",
         "ttft_ms": 3.0},
        {"replica": "r1", "arrival_ns": 20, "hit_tokens": 16, "ttft_ms": 5.0},
        {"replica": "r1", "arrival_ns": 1600, "hit_tokens": 16, "ttft_ms": 7.0},
    ])
    out = latency_tails(request_ledger=ledger, window_ns=W)
    assert _cell(out, "*", None, "all")["requests"] == 4
    assert _cell(out, "*", None, "all")["ttft_p50_ms"] == pytest.approx(4.0)
    assert _cell(out, "*", None, "full_hit")["requests"] == 3
    assert _cell(out, "*", None, "miss:miss_cold")["requests"] == 1
    assert _cell(out, "r0", None, "all")["requests"] == 2
    assert _cell(out, "r1", None, "all")["ttft_p50_ms"] == pytest.approx(6.0)
    assert _cell(out, "*", 0, "all")["requests"] == 2
    assert _cell(out, "*", 1000, "all")["ttft_p50_ms"] == pytest.approx(5.0)
    assert _cell(out, "r1", 1000, "full_hit")["requests"] == 1
    # Exactly the five groupings: 4 cells, 2 (*, NULL, class), 1 (*, NULL, all), 2 (replica, NULL, all),
    # 2 (*, window, all).
    assert out.height == 4 + 2 + 1 + 2 + 2
    assert out.filter((pl.col("replica") == "*") & pl.col("window_start_ns").is_not_null()
                      & (pl.col("prefix_class") != "all")).height == 0


def test_demo_tails_match_the_ledger(demo_workdir: Path) -> None:
    con = duckdb.connect(str(demo_workdir / "kvlens.duckdb"), read_only=True)
    per_scenario = dict(con.execute("SELECT scenario, count(*) FROM request_ledger GROUP BY 1").fetchall())
    assert per_scenario
    for scenario, n in per_scenario.items():
        ((total,),) = con.execute(
            "SELECT requests FROM latency_tails WHERE scenario = ? AND replica = '*' "
            "AND window_start_ns IS NULL AND prefix_class = 'all'", [scenario]).fetchall()
        assert total == n
        for where in ("replica = '*' AND window_start_ns IS NULL AND prefix_class <> 'all'",
                      "replica <> '*' AND window_start_ns IS NULL AND prefix_class = 'all'",
                      "replica = '*' AND window_start_ns IS NOT NULL AND prefix_class = 'all'",
                      "replica <> '*' AND window_start_ns IS NOT NULL"):
            sql = f"SELECT sum(requests) FROM latency_tails WHERE scenario = ? AND {where}"
            ((part,),) = con.execute(sql, [scenario]).fetchall()
            assert part == n, where
    # Round robin spreads a shared system prompt's conversations: the fleet's tail is flagged.
    ((flagged,),) = con.execute("SELECT flagged FROM latency_tails WHERE scenario = 'rr8' AND replica = '*' "
                                "AND window_start_ns IS NULL AND prefix_class = 'all'").fetchall()
    assert flagged is True
