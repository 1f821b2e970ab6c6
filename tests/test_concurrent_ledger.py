"""The ledger under concurrency: a real vLLM 0.32 serving six clients at once (vllm-concurrent-capture).

The capture goes into a lake through kvlens's real paths (the client's prompts as gateway lines
with token ids, hashed as the engine hashes them; the engine's KV-event frames; its OTLP spans)
and ``kvlens analyze`` replays it. With up to eight requests in flight, a request's look-up is
the engine's admission, after the requests admitted before it in the same step stored (and
evicted) blocks whose batch is stamped after the step (analyzers/admission.py). For every one
of the 360 requests, kvlens's hit tokens must equal the engine's own ``cached_tokens``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from capture_lines import gateway_lines
from click.testing import CliRunner

from kvlens.cli import cli
from kvlens.query import query

CAPTURE = Path(__file__).parent / "data" / "vllm-concurrent-capture"



@pytest.fixture(scope="module", params=["arrival", "spans"])
def analysis_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Once with look-up times from the client's arrivals only, once joined with the engine's
    # spans (arrival plus queue time): the admission rule must not depend on either estimate.
    tmp = tmp_path_factory.mktemp("concurrent")
    lake, db = tmp / "lake", tmp / "kvlens.duckdb"
    runner = CliRunner()
    steps = [["import", "vllm-events", str(CAPTURE / "kv_events.frames.jsonl"), "--scenario", "capture"],
             ["import", "gateway", str(gateway_lines(CAPTURE, tmp / "gateway.jsonl")),
              "--scenario", "capture"],
             ["import", "otlp", *map(str, sorted(CAPTURE.glob("otlp_*.pb"))), "--scenario", "capture-spans"]]
    for args in steps:
        result = runner.invoke(cli, [*args, "--lake", str(lake)])
        assert result.exit_code == 0, (args, result.output)
    join = ["--join", "capture-spans"] if request.param == "spans" else []
    result = runner.invoke(cli, ["analyze", "--lake", str(lake), "--db", str(db), "--model", "llama-3.1-8b",
                                 "--scenario", "capture", *join])
    assert result.exit_code == 0, result.output
    return db


def test_every_concurrent_request_matches_the_engines_cached_tokens(analysis_db: Path) -> None:
    rows = query("SELECT request_id, hit_tokens, cached_tokens FROM request_ledger "
                 "WHERE scenario = 'capture' ORDER BY arrival_ns", db=analysis_db)[1]
    assert len(rows) == 360
    wrong = [r for r in rows if r[1] != r[2]]
    assert not wrong, f"{len(wrong)} of 360 differ, first: {wrong[:3]}"
    assert sum(int(str(r[2])) for r in rows) == 112_704  # the engine hit: the comparison is not vacuous


def test_the_concurrent_ledger_total_equals_the_engines_hit_counter(analysis_db: Path) -> None:
    m = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$",
                  (CAPTURE / "metrics.txt").read_text(), re.M)
    assert m, "the capture's /metrics has vllm:prefix_cache_hits_total"
    ((ledger,),) = query("SELECT sum(tokens) FROM miss_ledger WHERE scenario = 'capture' "
                         "AND outcome IN ('hit_local', 'hit_offload', 'hit_remote')", db=analysis_db)[1]
    assert ledger == int(float(m.group(1))) == 112_704
