"""Gaps reach the ledger (analyzers/gaps.py): requests after an unfillable KV-event gap on their replica
are flagged ``events_incomplete`` until the replica's next clear, and so are their miss_ledger rows."""

from __future__ import annotations

from pathlib import Path

import duckdb
from test_ledger import _blocks, _ev, _request, _write, at

from kvlens.analyzers.analyze import analyze_lake

GAP = "kvlens_collector_gap_batches"


def _gap_lake(lake: Path) -> None:
    _write(lake, "live", "kv_events", [
        _ev(1, "A", 1, "stored", 301),
        _ev(2, "A", 2, "stored", 302),  # the last batch before the gap: seq 3 and 4 are lost
        _ev(6, "A", 5, "stored", 303),
        _ev(20, "A", 6, "cleared", medium=None),  # the engine restarted: A's cache is known again
        _ev(1, "B", 1, "stored", 301),
    ])
    _write(lake, "live", "metric_samples", [
        {"ts_ns": at(6.5), "replica": "A", "name": GAP, "value": 2.0,
         "labels": [("publisher", "A|t"), ("from_seq", "3"), ("to_seq", "4")]},
        {"ts_ns": at(6.5), "replica": "A", "name": "vllm:prefix_cache_hits_total", "value": 5.0,
         "labels": []},  # another metric: not a gap
    ])
    arrivals = {"Q1": (1.5, "A"), "Q2": (5, "A"), "Q3": (10, "A"), "Q4": (25, "A"), "Q5": (10, "B")}
    _write(lake, "live", "requests", [_request(r, t, rep, 32) for r, (t, rep) in arrivals.items()])
    _write(lake, "live", "request_blocks", [b for r, (t, _) in arrivals.items()
                                            for b in _blocks(r, t, [301, 302])])


def test_requests_after_an_unfillable_gap_are_incomplete_until_the_next_clear(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    _gap_lake(lake)
    db = analyze_lake(lake, tmp_path / "db.duckdb").db
    con = duckdb.connect(str(db), read_only=True)
    try:
        got = con.execute("SELECT request_id, events_incomplete FROM request_ledger ORDER BY 1").fetchall()
        assert got == [("Q1", False), ("Q2", True), ("Q3", True), ("Q4", False), ("Q5", False)]
        # a miss_ledger row is incomplete when a flagged request has blocks in it
        want = con.execute("SELECT b.replica, b.outcome, bool_or(r.events_incomplete) FROM block_outcomes b "
                           "JOIN request_ledger r USING (request_id) GROUP BY ALL ORDER BY 1, 2").fetchall()
        rows = con.execute("SELECT replica, outcome, events_incomplete FROM miss_ledger "
                           "ORDER BY 1, 2").fetchall()
        assert rows == want
        assert {(r, flag) for r, _, flag in rows} == {("A", True), ("A", False), ("B", False)}
    finally:
        con.close()


def test_no_gap_rows_no_flags(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    _write(lake, "live", "kv_events", [_ev(1, "A", 1, "stored", 301)])
    _write(lake, "live", "requests", [_request("Q1", 2, "A", 32)])
    _write(lake, "live", "request_blocks", _blocks("Q1", 2, [301, 302]))
    db = analyze_lake(lake, tmp_path / "db.duckdb").db
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT bool_or(events_incomplete) FROM request_ledger").fetchone() == (False,)
        assert con.execute("SELECT bool_or(events_incomplete) FROM miss_ledger").fetchone() == (False,)
    finally:
        con.close()


def _script(db: str, page: str) -> None:
    from kvlens.dashboards.app import run

    run(db, only=page)


def test_report_and_dashboard_say_so_beside_the_numbers(tmp_path: Path) -> None:
    from streamlit.testing.v1 import AppTest

    from kvlens.dashboards.report import build_report

    lake = tmp_path / "lake"
    _gap_lake(lake)
    db = analyze_lake(lake, tmp_path / "db.duckdb").db
    report = build_report(db)
    said = "Incomplete: 2 of 5 requests of live arrived after the collector lost KV-event batches"
    assert said in report.text and said in report.file_html
    at = AppTest.from_function(_script, args=(str(db), "overview"), default_timeout=60).run()
    assert not at.exception
    assert any(w.value.startswith("Incomplete: 2 of 5 requests arrived after") for w in at.warning)


def test_report_says_nothing_without_gaps(tmp_path: Path) -> None:
    from kvlens.dashboards.report import build_report

    lake = tmp_path / "lake"
    _write(lake, "live", "kv_events", [_ev(1, "A", 1, "stored", 301)])
    _write(lake, "live", "requests", [_request("Q1", 2, "A", 32)])
    _write(lake, "live", "request_blocks", _blocks("Q1", 2, [301, 302]))
    assert "Incomplete" not in build_report(analyze_lake(lake, tmp_path / "db.duckdb").db).text
