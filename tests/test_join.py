"""Tests for analyzers/join.py: gateway blocks joined with span timings by request id."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from kvlens.analyzers.join import join_sources
from kvlens.cli import cli
from kvlens.collector.importer import import_files
from kvlens.lake import SegmentWriter, open_lake

T0 = 1_796_000_000 * 10**9
MS = 10**6


@pytest.fixture
def lake(tmp_path: Path, write_jsonl: Callable[..., Path]) -> Path:
    # A gateway log with replica and blocks (r2 repeats r1's first block), and spans from the
    # engine whose clock runs 5 ms ahead: they know r1 and r2 but not r3, and also r9.
    gw = write_jsonl("gw.jsonl", [
        {"request_id": "r1", "arrival_ns": T0, "replica": "a", "prompt_tokens": 40, "block_size": 16,
         "block_hashes": [1, 2]},
        {"request_id": "r2", "arrival_ns": T0 + 100 * MS, "replica": "a", "prompt_tokens": 32,
         "block_size": 16, "block_hashes": [1, 3]},
        {"request_id": "r3", "arrival_ns": T0 + 200 * MS, "replica": "a", "prompt_tokens": 16,
         "block_size": 16, "block_hashes": [4]},
    ])
    root = tmp_path / "lake"
    import_files("gateway", [gw], root, scenario="gw")
    with SegmentWriter(root, "requests", scenario="spans", replace=True) as w:
        w.append_rows([
            {"request_id": rid, "arrival_ns": T0 + off * MS + 5 * MS, "ttft_ms": ttft, "queue_ms": 0.0,
             "prompt_tokens": p, "cached_tokens": cached, "source": "otlp"}
            for rid, off, ttft, p, cached in (("r1", 0, 80.0, 40, 0), ("r2", 100, 12.5, 32, 16),
                                              ("r9", 300, 50.0, 8, 0))])
    return root


def test_join_fills_timings_and_reports_matches_and_clock_offset(lake: Path) -> None:
    con = duckdb.connect()
    open_lake(con, lake)
    joined, report = join_sources(requests=con.table("requests"), scenario="gw", sources=["spans"])
    got = joined.select("request_id", "replica", "ttft_ms", "cached_tokens", "source").rows()
    assert got == [("r1", "a", 80.0, 0, "gateway"), ("r2", "a", 12.5, 16, "gateway"),
                   ("r3", "a", None, None, "gateway")]
    assert report.rows(named=True) == [{
        "scenario": "gw", "source_scenario": "spans", "source": "otlp", "requests": 3, "matched": 2,
        "missing": 1, "only_in_source": 1, "matched_by_suffix": 0, "ambiguous": 0, "clock_offset_ms": 5.0,
        "clock_offset_iqr_ms": 0.0}]


def test_vllm_suffixed_engine_ids_match_for_every_index(tmp_path: Path,
                                                       write_jsonl: Callable[..., Path]) -> None:
    # The gateway logs API ids; vLLM's spans carry the engine's <id>-<prompt index> (completions)
    # or <id>_<index> (chat with several inputs). A gateway id that itself ends in -0 keeps it.
    ids = ["cmpl-a", "cmpl-b", "chatcmpl-c", "bar-0", "bar", "cmpl-d", "cmpl-e"]
    gw = write_jsonl("gw.jsonl", [{"request_id": rid, "arrival_ns": T0 + i * MS, "prompt_tokens": 16,
                                   "block_size": 16, "block_hashes": [i + 1]} for i, rid in enumerate(ids)])
    root = tmp_path / "lake"
    import_files("gateway", [gw], root, scenario="gw")
    spans = [("cmpl-a-0", 10.0), ("cmpl-b-3", 20.0), ("chatcmpl-c_1", 30.0), ("bar-0", 40.0),
             ("cmpl-d-0", 50.0), ("cmpl-d-1", 51.0), ("cmpl-e", 60.0), ("cmpl-e-0", 61.0), ("zzz-0", 70.0)]
    with SegmentWriter(root, "requests", scenario="spans", replace=True) as w:
        w.append_rows([{"request_id": rid, "arrival_ns": T0, "ttft_ms": ttft, "source": "otlp"}
                       for rid, ttft in spans])
    con = duckdb.connect()
    open_lake(con, root)
    joined, report = join_sources(requests=con.table("requests"), scenario="gw", sources=["spans"])
    assert joined.select("request_id", "ttft_ms").rows() == [
        ("cmpl-a", 10.0), ("cmpl-b", 20.0), ("chatcmpl-c", 30.0),
        ("bar-0", 40.0),  # its own id, matched exactly
        ("bar", None),  # bar-0 belongs to the request named bar-0
        ("cmpl-d", None),  # two prompts of one call: ambiguous, not guessed
        ("cmpl-e", 60.0)]  # the exact id wins over a suffixed one
    row = report.row(0, named=True)
    assert (row["matched"], row["matched_by_suffix"], row["ambiguous"], row["missing"]) == (5, 3, 1, 2)
    assert row["only_in_source"] == len(spans) - 5


def test_suffixed_ids_match_when_the_spans_are_the_scenario(tmp_path: Path) -> None:
    # Calibration joins the other way round: the spans' scenario (engine ids <id>-<n>) takes the
    # gateway's cached tokens (API ids). Two engine requests of one call share a gateway row: ambiguous.
    root = tmp_path / "lake"
    with SegmentWriter(root, "requests", scenario="spans", replace=True) as w:
        w.append_rows([{"request_id": rid, "arrival_ns": T0, "ttft_ms": 1.0, "source": "otlp"}
                       for rid in ("cmpl-a-0", "chatcmpl-b_2", "cmpl-d-0", "cmpl-d-1", "zzz-0")])
    with SegmentWriter(root, "requests", scenario="gw", replace=True) as w:
        w.append_rows([{"request_id": rid, "arrival_ns": T0, "cached_tokens": n, "source": "gateway"}
                       for rid, n in (("cmpl-a", 16), ("chatcmpl-b", 32), ("cmpl-d", 48))])
    con = duckdb.connect()
    open_lake(con, root)
    joined, report = join_sources(requests=con.table("requests"), scenario="spans", sources=["gw"])
    assert joined.select("request_id", "cached_tokens").rows() == [
        ("cmpl-a-0", 16), ("chatcmpl-b_2", 32), ("cmpl-d-0", None), ("cmpl-d-1", None), ("zzz-0", None)]
    row = report.row(0, named=True)
    assert (row["matched"], row["matched_by_suffix"], row["ambiguous"], row["missing"]) == (2, 2, 2, 3)


def test_analyze_join_lets_the_ledger_be_cut_by_ttft(lake: Path, tmp_path: Path) -> None:
    db = tmp_path / "a.duckdb"
    runner = CliRunner()
    result = runner.invoke(cli, ["analyze", "--lake", str(lake), "--db", str(db), "--scenario", "gw",
                                 "--join", "spans"])
    assert result.exit_code == 0, result.output
    con = duckdb.connect(str(db), read_only=True)
    ledger = con.execute(
        "SELECT request_id, ttft_ms, cached_tokens FROM request_ledger ORDER BY 1").fetchall()
    assert ledger == [("r1", 80.0, 0), ("r2", 12.5, 16), ("r3", None, None)]
    # The ledger cut by TTFT: tokens by outcome for requests whose first token took over 50 ms.
    slow = con.execute("""
        SELECT outcome, sum(tokens) FROM block_outcomes JOIN request_ledger USING (scenario, request_id)
        WHERE ttft_ms > 50 GROUP BY 1 ORDER BY 1""").fetchall()
    assert slow == [("unobserved", 32)]  # a gateway log without KV events: residency unknown
    assert con.execute("SELECT matched, missing FROM request_sources").fetchall() == [(2, 1)]
    con.close()


def test_analyze_join_with_an_unknown_scenario_is_one_error_line(lake: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["analyze", "--lake", str(lake), "--db", str(tmp_path / "a.duckdb"),
                                      "--join", "nope"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error:") and "nope" in result.stderr
