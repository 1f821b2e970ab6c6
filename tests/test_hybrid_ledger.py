"""Hybrid models in the ledger: hand-built lakes for vLLM's per-group hit rule, copies and bytes per group.

Replica H serves a hybrid model: KV cache group 0 is a sliding window of 33 tokens (with 16-token
blocks it needs ceil(32/16) = 2 contiguous blocks before the match point), group 1 full attention.
Expected outcomes are worked out by hand from vLLM 0.32's rule
(vllm/v1/core/single_type_kv_cache_manager.py::SlidingWindowManager.find_longest_cache_hit and
kv_cache_coordinator.py::HybridKVCacheCoordinator.find_longest_cache_hit).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest

from kvlens.analyzers import block_outcomes, request_ledger, scenario_rows
from kvlens.lake import SegmentWriter, open_lake
from kvlens.models import (
    KvGroup,
    ModelGeometry,
    group_bytes_per_token,
    kv_cache_groups,
    kv_groups_from_hf_config,
)

T0_NS = 1_735_689_600 * 10**9
BLOCK = 16
WINDOW = 33
SLIDING_RATE, FULL_RATE = 100, 300  # KV bytes per token of each group
B = [1000 + i for i in range(8)]  # one chain of blocks


def at(seconds: float) -> int:
    return T0_NS + int(seconds * 10**9)


def _ev(ts: float, seq: int, kind: str, h: int, group: int, left: int | None = None,
        replica: str = "H") -> dict[str, Any]:
    stored = kind == "stored"
    return {"ts_ns": at(ts), "recv_ns": at(ts), "replica": replica, "seq": seq, "kind": kind, "block_hash": h,
            "medium": "gpu", "block_tokens": BLOCK, "group_idx": group,
            "spec_kind": ("sliding_window" if group == 0 else "full_attention") if stored else None,
            "sliding_window_tokens": WINDOW if stored and group == 0 else None, "remaining_copies": left}


def _request(rid: str, arrival: float, hashes: list[int], tail: int, replica: str = "H",
             cached: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    req = {"request_id": rid, "arrival_ns": at(arrival), "replica": replica,
           "prompt_tokens": BLOCK * len(hashes) + tail, "queue_ms": 0.0, "cached_tokens": cached,
           "source": "hand"}
    blocks = [{"request_id": rid, "arrival_ns": at(arrival), "position": i, "block_hash": h,
               "block_tokens": BLOCK, "block_size_tokens": BLOCK, "namespace": "m"}
              for i, h in enumerate(hashes)]
    if tail:
        blocks.append({"request_id": rid, "arrival_ns": at(arrival), "position": len(hashes), "block_hash": 9,
                       "block_tokens": tail, "block_size_tokens": BLOCK, "namespace": "m"})
    return req, blocks


def _lake(root: Path, scenario: str, events: list[dict[str, Any]],
          requests: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> None:
    for table, rows in (("kv_events", events), ("requests", [r for r, _ in requests]),
                        ("request_blocks", [b for _, bs in requests for b in bs])):
        with SegmentWriter(root, table, scenario=scenario, writer_id="hand") as w:
            w.append_rows(rows)


def _full(ts: float, hashes: list[int]) -> list[dict[str, Any]]:
    return [_ev(ts, 1, "stored", h, 1) for h in hashes]


def _sliding(ts: float, hashes: list[int]) -> list[dict[str, Any]]:
    return [_ev(ts, 1, "stored", h, 0) for h in hashes]


@pytest.fixture
def hybrid_lake(tmp_path: Path) -> Path:
    root = tmp_path / "lake"
    # window: the full group holds B0..B5, the sliding group B3 and B4: the rightmost run of two
    # sliding blocks inside the six ends after B4, so five blocks hit and B5 is cut (miss_group).
    _lake(root, "window", [*_full(1, B[:6]), *_sliding(1, B[3:5])], [_request("w", 5, B[:6], 3)])
    # from_zero: the sliding group holds only B0: no run of two anywhere, so the hit is the run
    # from block 0 (one block), and the full group's other five are cut.
    _lake(root, "from_zero", [*_full(1, B[:6]), *_sliding(1, B[:1])], [_request("z", 5, B[:6], 3)])
    # aligned: a block-aligned prompt of four blocks, all held by both groups: the look-up stops
    # at prompt - 1 tokens, so three blocks hit (the window before the third: B1, B2) and the last
    # is given back (recomputed_last).
    _lake(root, "aligned", [*_full(1, B[:4]), *_sliding(1, B[:4])], [_request("a", 5, B[:4], 0)])
    # copies: B0..B2 stored twice in the full group (a second physical copy), one copy of B1
    # removed at 2 s (one left), then B2's copies removed at 3 s with remaining_copies 0 (none
    # left: newer vLLM says so in one event). The sliding group holds B0 and B1.
    _lake(root, "copies", [*_full(1, B[:3]), *_full(1.5, B[:3]), *_sliding(1, B[:2]),
                           _ev(2, 2, "removed", B[1], 1), _ev(3, 3, "removed", B[2], 1, left=0)],
          [_request("c", 5, B[:3], 1)])
    return root


@pytest.fixture
def con(hybrid_lake: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    c = duckdb.connect()
    open_lake(c, hybrid_lake)
    yield c
    c.close()


def _outcomes(con: duckdb.DuckDBPyConnection, scenario: str, rates: tuple[int, ...] | None = None,
              kv_events: duckdb.DuckDBPyRelation | None = None) -> pl.DataFrame:
    events = (scenario_rows(con, "kv_events", scenario) if kv_events is None
              else kv_events.filter(f"scenario = '{scenario}'"))
    return block_outcomes(requests=scenario_rows(con, "requests", scenario),
                          request_blocks=scenario_rows(con, "request_blocks", scenario), kv_events=events,
                          transfers=scenario_rows(con, "transfers", scenario), scenario=scenario,
                          bytes_per_token=SLIDING_RATE + FULL_RATE, group_bytes_per_token=rates)


def test_a_sliding_window_needs_only_the_blocks_before_the_match_point(
        con: duckdb.DuckDBPyConnection) -> None:
    out = _outcomes(con, "window", (SLIDING_RATE, FULL_RATE))
    assert out["outcome"].to_list() == ["hit_local"] * 5 + ["miss_group"]
    assert out["cut_group"].to_list() == [None] * 5 + [0]
    # Bytes per group: B0..B2 come from the full group alone, B3 and B4 (the window) from both;
    # the cut block is computed in both groups.
    both, full = (SLIDING_RATE + FULL_RATE) * BLOCK, FULL_RATE * BLOCK
    assert out["bytes"].to_list() == [full, full, full, both, both, both]
    per = request_ledger(block_outcomes=out, requests=scenario_rows(con, "requests", "window"))
    assert per.select("hit_tokens", "miss_tokens", "tail_partial_tokens").row(0) == (5 * BLOCK, BLOCK, 3)


def test_without_a_window_run_the_hit_is_the_run_from_block_zero(con: duckdb.DuckDBPyConnection) -> None:
    out = _outcomes(con, "from_zero")
    assert out["outcome"].to_list() == ["hit_local"] + ["miss_group"] * 5
    # Without per-group rates, bytes are tokens x the model's rate, as for a dense model.
    assert out["bytes"].to_list() == [(SLIDING_RATE + FULL_RATE) * BLOCK] * 6


def test_the_look_up_stops_one_token_short_in_every_group(con: duckdb.DuckDBPyConnection) -> None:
    out = _outcomes(con, "aligned", (SLIDING_RATE, FULL_RATE))
    assert out["outcome"].to_list() == ["hit_local"] * 3 + ["recomputed_last"]
    full, both = FULL_RATE * BLOCK, (SLIDING_RATE + FULL_RATE) * BLOCK
    assert out["bytes"].to_list() == [full, both, both, both]


def test_a_block_stays_resident_until_its_last_copy_goes(con: duckdb.DuckDBPyConnection) -> None:
    out = _outcomes(con, "copies")
    # B1 lost one of two copies and is still a hit; B2 was removed with none left.
    assert out["outcome"].to_list() == ["hit_local", "hit_local", "miss_evicted"]
    assert out["removed_ns"].to_list() == [None, None, at(3)]


def test_a_replay_blind_to_groups_gets_the_window_case_wrong(con: duckdb.DuckDBPyConnection) -> None:
    flat = con.sql("SELECT * REPLACE (NULL::INTEGER AS group_idx, NULL::VARCHAR AS spec_kind, "
                   "NULL::INTEGER AS sliding_window_tokens) FROM kv_events")
    out = _outcomes(con, "window", kv_events=flat)
    assert out["outcome"].to_list() == ["hit_local"] * 6  # the sliding group's cut is invisible


def test_a_replica_serving_a_dense_model_keeps_its_own_rule(tmp_path: Path) -> None:
    # One scenario, two models: replica D publishes group 0 as full attention, replica H group 0
    # as a sliding window. Group specs are per replica, so D's request hits its whole chain.
    root = tmp_path / "lake"
    dense = [{**e, "replica": "D", "spec_kind": "full_attention" if e["kind"] == "stored" else None,
              "sliding_window_tokens": None} for e in _sliding(1, B[:3])]
    _lake(root, "mixed", [*dense, *_full(1, B[:3]), *_sliding(1, B[:1])],
          [_request("d", 5, B[:3], 1, replica="D"), _request("h", 5, B[:3], 1)])
    c = duckdb.connect()
    open_lake(c, root)
    out = _outcomes(c, "mixed")
    c.close()
    assert out.select("request_id", "outcome").rows() == [
        ("d", "hit_local"), ("d", "hit_local"), ("d", "hit_local"),
        ("h", "hit_local"), ("h", "miss_group"), ("h", "miss_group")]


def test_kv_cache_groups_follow_vllm_grouping() -> None:
    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256, "sliding_window": 128,
              "torch_dtype": "bfloat16",
              "layer_types": ["sliding_attention", "full_attention"]}
    groups = kv_groups_from_hf_config(gemma2)
    assert [(g.group_idx, g.kind, g.layout.num_layers, g.sliding_window_tokens) for g in groups] == [
        (0, "sliding", 1, 128), (1, "full", 1, None)]
    # Gemma-3 style 5:1 over 62 layers: 52 sliding layers in groups of the 10 full ones' size,
    # every 6th layer per group (9, 9, 9, 9, 8, 8), then the full group.
    gemma3 = {"model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
              "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024,
              "sliding_window_pattern": 6}
    groups = kv_groups_from_hf_config(gemma3)
    assert [g.layout.num_layers for g in groups] == [9, 9, 9, 9, 8, 8, 10]
    assert [g.kind for g in groups] == ["sliding"] * 6 + ["full"] and {g.page_layers for g in groups} == {10}
    # The groups' rates add up to the model's (2 x layers x KV heads x head dim x 2 bytes).
    model = ModelGeometry("g", (KvGroup.sliding(23, 16, 128, 4096), KvGroup.full(23, 16, 128)), 32, 4608, 1e9)
    assert group_bytes_per_token(model) == (188_416, 188_416)
    assert sum(group_bytes_per_token(model)) == model.kv_bytes_per_token()
    # vLLM pads near-equal buckets to the larger: 12 sliding + 13 full layers are two groups of 13.
    gptoss = ModelGeometry("o", (KvGroup.sliding(12, 8, 64, 128), KvGroup.full(13, 8, 64)), 64, 2880, 1e9)
    assert [(g.layout.num_layers, g.page_layers) for g in kv_cache_groups(gptoss)] == [(12, 13), (13, 13)]
