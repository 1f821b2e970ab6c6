"""Ground truth, hybrid attention under memory pressure: a real vLLM 0.32 capture of a two-group model
whose KV cache holds two or three prompts, serving sixteen clients at once, so that requests queue for
blocks and running ones are preempted (tests/data/vllm-preempting-hybrid-capture, README there).

vLLM reports a request's cached tokens from its first scheduled prefill only
(vllm/v1/core/sched/scheduler.py: ``request.prefill_stats.set`` when ``num_preemptions <= 0``), and a
request queued for blocks is looked up when it is admitted, not when it arrived: a request that
stored nothing then found every block its hit needed held, in the sliding window group too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from capture_lines import analyze_capture, capture_lake

from kvlens.analyzers import admission
from kvlens.query import query

CAPTURE = Path(__file__).parent / "data" / "vllm-preempting-hybrid-capture"
REQUESTS = 960


def _metric(name: str) -> int:
    m = re.search(rf"^vllm:{name}\{{[^}}]*\}} ([0-9.e+]+)$", (CAPTURE / "metrics.txt").read_text(), re.M)
    assert m, name
    return int(float(m.group(1)))


def _analyzed(tmp: Path) -> Path:
    return analyze_capture(capture_lake(CAPTURE, tmp, "tiny-gemma2"), tmp / "kvlens.duckdb", "gemma-2-27b")


def _wrong(db: Path) -> list[tuple[str, int, int]]:
    rows = query("SELECT request_id, hit_tokens, cached_tokens FROM request_ledger "
                 "WHERE scenario = 'capture'", db=db)[1]
    assert len(rows) == REQUESTS
    return [r for r in rows if r[1] != r[2]]


def test_the_engine_preempted_and_every_request_matches_its_cached_tokens(tmp_path: Path) -> None:
    assert _metric("num_preemptions_total") > 0  # the capture is what it says
    db = _analyzed(tmp_path)
    wrong = _wrong(db)
    assert not wrong, f"{len(wrong)} of {REQUESTS} differ, first: {wrong[:3]}"
    (total,) = query("SELECT sum(hit_tokens) FROM request_ledger WHERE scenario = 'capture'", db=db)[1][0]
    assert total == _metric("prefix_cache_hits_total") == 18_240


def test_without_the_window_groups_tail_a_queued_request_is_looked_up_too_early(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The rule before: a request that stored nothing was placed where the full-attention group
    # held its blocks; one queued 117 ms was looked up at its arrival, where the sliding window
    # group had just evicted two of them (measured: 32 hit tokens where the engine had 96).
    monkeypatch.setattr(admission, "_window_tail", lambda chain, window, block_size: [])
    wrong = _wrong(_analyzed(tmp_path))
    assert len(wrong) >= 1 and all(hit < cached for _, hit, cached in wrong), wrong
