"""Ground truth, chunked prefill under memory pressure: two real vLLM 0.32 captures with a token budget
of 256 per step, so that prompts are prefilled in chunks, and a KV cache small enough that requests
queue for blocks and running ones are preempted (tests/data/vllm-chunked-capture, one KV cache
group; tests/data/vllm-chunked-hybrid-capture, two; tests/data/vllm-chat-hybrid-capture, two, in
multi-turn chats whose prompts hold the engine's earlier answers). Every request must get the
engine's own ``cached_tokens``; without each of admission's rules for these engines, some must not.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from capture_lines import analyze_capture, capture_lake

from kvlens.analyzers import admission
from kvlens.query import query

DATA = Path(__file__).parent / "data"
CAPTURES = {"dense": (DATA / "vllm-chunked-capture", "tiny", "llama-3.1-8b", 960),
            "hybrid": (DATA / "vllm-chunked-hybrid-capture", "tiny-gemma2", "gemma-2-27b", 960),
            "chat": (DATA / "vllm-chat-hybrid-capture", "tiny-gemma2", "gemma-2-27b", 720)}


def _metric(capture: Path, name: str) -> int:
    m = re.search(rf"^vllm:{name}\{{[^}}]*\}} ([0-9.e+]+)$", (capture / "metrics.txt").read_text(), re.M)
    assert m, name
    return int(float(m.group(1)))


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: capture_lake(capture, tmp_path_factory.mktemp(f"chunked-{name}"), served)
            for name, (capture, served, _, _) in CAPTURES.items()}


def _wrong(name: str, lake: Path, db: Path) -> tuple[list[Any], int]:
    model, requests = CAPTURES[name][2:]
    analyze_capture(lake, db, model)
    rows = query("SELECT request_id, hit_tokens, cached_tokens FROM request_ledger "
                 "WHERE scenario = 'capture'", db=db)[1]
    assert len(rows) == requests
    return [r for r in rows if r[1] != r[2]], sum(r[1] for r in rows)


@pytest.mark.parametrize("name", list(CAPTURES))
def test_every_request_matches_the_engines_cached_tokens(name: str, lakes: dict[str, Path],
                                                         tmp_path: Path) -> None:
    capture = CAPTURES[name][0]
    assert _metric(capture, "num_preemptions_total") > 0  # the captures are what they say
    wrong, hits = _wrong(name, lakes[name], tmp_path / "kvlens.duckdb")
    assert not wrong, f"{len(wrong)} differ, first: {wrong[:3]}"
    assert hits == _metric(capture, "prefix_cache_hits_total")


def test_without_the_arrival_order_a_short_prompt_takes_a_longer_ones_first_chunk(
        lakes: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # measured: 4 requests in two pairs, each pair's hit tokens swapped (0 for 224 and 224 for 0)
    monkeypatch.setattr(admission, "_REORDER_NS", 10**18)
    wrong, hits = _wrong("dense", lakes["dense"], tmp_path / "kvlens.duckdb")
    assert len(wrong) >= 2 and hits == _metric(CAPTURES["dense"][0], "prefix_cache_hits_total"), wrong


def test_without_claiming_its_later_chunks_a_request_takes_anothers_chunk(
        lakes: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # measured: a 574-token request read 0 hit tokens where the engine had 224
    cut = admission._cut
    monkeypatch.setattr(admission, "_cut", lambda *a, **k: cut(*a, **k)[:1])
    wrong, _ = _wrong("hybrid", lakes["hybrid"], tmp_path / "kvlens.duckdb")
    assert wrong, "every request matched without the chunk claims"
