"""Ground truth: a real vLLM 0.32 capture (tests/data/vllm-cpu-capture) through kvlens's real paths.

The engine's KV-event frames go through `kvlens import vllm-events` (the collector's decoder and
the lake writer); the client's prompts, as gateway lines with token ids, through the gateway
importer, whose vLLM-compatible hasher (sha256_cbor, PYTHONHASHSEED 0, 32-token blocks) turns
them into the engine's block keys; the OTLP bodies the engine posted through `kvlens import
otlp`; its /metrics, served on loopback, through `kvlens collect scrape`. `kvlens analyze`
replays the events, joins the spans and reconciles the counters. For every request, kvlens's
hit tokens must equal the engine's own `cached_tokens`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from capture_lines import gateway_lines
from click.testing import CliRunner
from metrics_endpoint import MetricsEndpoint

from kvlens.cli import cli
from kvlens.query import query

CAPTURE = Path(__file__).parent / "data" / "vllm-cpu-capture"



@pytest.fixture(scope="module")
def metrics_url() -> Iterator[str]:
    """The engine's /metrics, as the capture recorded it, on loopback."""
    endpoint = MetricsEndpoint([(200, (CAPTURE / "metrics.txt").read_bytes(), 0.0)])
    yield endpoint.url
    endpoint.close()


@pytest.fixture(scope="module")
def analysis_db(tmp_path_factory: pytest.TempPathFactory, metrics_url: str) -> Path:
    tmp = tmp_path_factory.mktemp("capture")
    lake, db = tmp / "lake", tmp / "kvlens.duckdb"
    runner = CliRunner()
    steps = [
        ["import", "vllm-events", str(CAPTURE / "kv_events.frames.jsonl"), "--scenario", "capture"],
        ["import", "gateway", str(gateway_lines(CAPTURE, tmp / "gateway.jsonl")), "--scenario", "capture"],
        ["import", "otlp", str(CAPTURE / "otlp_000.pb"), str(CAPTURE / "otlp_001.pb"),
         "--scenario", "capture-spans"],
        ["collect", "scrape", "--url", metrics_url, "--replica", "replica-a", "--interval", "0.2",
         "--duration", "0.5", "--scenario", "capture-metrics"],
    ]
    for args in steps:
        result = runner.invoke(cli, [*args, "--lake", str(lake)])
        assert result.exit_code == 0, (args, result.output)
    result = runner.invoke(cli, ["analyze", "--lake", str(lake), "--db", str(db), "--model", "llama-3.1-8b",
                                 "--scenario", "capture", "--join", "capture-spans",
                                 "--metrics-from", "capture-metrics"])
    assert result.exit_code == 0, result.output
    return db


def _query(db: Path, sql: str) -> list[tuple[object, ...]]:
    return query(sql, db=db)[1]


def test_every_request_matches_the_engines_cached_tokens(analysis_db: Path) -> None:
    rows = _query(analysis_db, "SELECT request_id, hit_tokens, cached_tokens FROM request_ledger "
                               "WHERE scenario = 'capture' ORDER BY arrival_ns")
    assert len(rows) == 300
    wrong = [r for r in rows if r[1] != r[2]]
    assert not wrong, f"{len(wrong)} of 300 differ, first: {wrong[:3]}"
    assert sum(r[2] for r in rows) > 0  # the comparison is not vacuous: the engine did hit


def test_the_ledger_total_equals_the_engines_hit_counter(analysis_db: Path) -> None:
    exposition = (CAPTURE / "metrics.txt").read_text()
    m = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", exposition, re.M)
    assert m, "the capture's /metrics has vllm:prefix_cache_hits_total"
    ((ledger,),) = _query(analysis_db, "SELECT sum(tokens) FROM miss_ledger WHERE scenario = 'capture' "
                                       "AND outcome IN ('hit_local', 'hit_offload', 'hit_remote')")
    assert ledger == int(float(m.group(1))) == 63_744


def test_the_engine_rule_and_the_misses_are_named(analysis_db: Path) -> None:
    # Every needed block has one outcome; misses here are evictions (a 96-block cache) and cold blocks.
    outcomes = dict(_query(analysis_db, "SELECT outcome, sum(tokens) FROM miss_ledger GROUP BY 1"))
    assert outcomes["miss_evicted"] > 0 and outcomes["miss_cold"] > 0
    ((prompt, full),) = _query(analysis_db, "SELECT sum(prompt_tokens), "
                                            "sum(prompt_tokens - tail_partial_tokens) FROM request_ledger")
    assert sum(outcomes.values()) == full < prompt


def test_the_spans_join_every_request_with_its_timings(analysis_db: Path) -> None:
    ((with_ttft, queued),) = _query(analysis_db, "SELECT count(ttft_ms), count(queue_ms) FROM request_ledger")
    assert with_ttft == queued == 300
    ((matched, missing, offset_ms),) = _query(analysis_db, "SELECT matched, missing, clock_offset_ms "
                                                           "FROM request_sources")
    # The engine stamps a span when the request reaches it, after the client sent it.
    assert (matched, missing) == (300, 0) and 0 < offset_ms < 500


def test_the_scraped_counters_reconcile_with_the_ledger(analysis_db: Path) -> None:
    rows = _query(analysis_db, "SELECT replica, engine_queries_tokens, engine_hit_tokens, ledger_hit_tokens, "
                               "difference_tokens FROM reconciliation")
    assert rows == [("replica-a", 104_998, 63_744, 63_744, 0)]
