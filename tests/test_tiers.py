"""Tiers: hand-built lakes for each tier rule, with exact expected ledgers.

- offload hit: a block on the serving replica's CPU or disk tier is ``hit_offload`` (origin cpu/disk);
- demotion: a GPU ``BlockRemoved`` of a block the replica keeps on a lower tier (stored in the same
  batch, or earlier: SGLang's hierarchical cache, sgl-project/sglang#39108) is not an eviction: the
  block is still found there, and when it is evicted later the eviction is the lower tier's;
- pool hit: a block stored with medium EXTERNAL (SGLang's L3 tier, kvlens's ``pool``) by replica S
  is a pool hit (``hit_remote``, origin pool) for any replica, with no transfer row.

Then the per-tier payoff table and the reconciliation with per-source engine counters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest

from kvlens.analyzers import block_outcomes, request_ledger, tier_payoff, tier_reconciliation
from kvlens.collector.vllm_events import medium_of
from kvlens.lake import SegmentWriter, open_lake

T0_NS = 1_735_689_600 * 10**9
BLOCK = 16
RATE = 10  # KV bytes per token
T1, T2, T3, D1, P1, X1, P2 = 301, 302, 303, 304, 305, 306, 307


def at(seconds: float) -> int:
    return T0_NS + int(seconds * 10**9)


def _ev(ts: float, replica: str, seq: int, kind: str, h: int, medium: str) -> dict[str, Any]:
    return {"ts_ns": at(ts), "recv_ns": at(ts), "replica": replica, "seq": seq, "kind": kind, "block_hash": h,
            "medium": medium_of(medium), "block_tokens": BLOCK}


def _req(rid: str, arrival: float, replica: str, h: int, **reported: int) -> tuple[dict[str, Any], list[Any]]:
    req = {"request_id": rid, "arrival_ns": at(arrival), "replica": replica, "prompt_tokens": BLOCK + 1,
           "queue_ms": 0.0, "cached_tokens": reported.pop("cached", None), "source": "hand", **reported}
    return req, [{"request_id": rid, "arrival_ns": at(arrival), "position": 0, "block_hash": h,
                  "block_tokens": BLOCK, "block_size_tokens": BLOCK},
                 {"request_id": rid, "arrival_ns": at(arrival), "position": 1, "block_hash": 9,
                  "block_tokens": 1, "block_size_tokens": BLOCK}]


# Engine medium names as published (vLLM GPU/CPU/STORAGE, SGLang GPU/EXTERNAL), mapped by the
# collector's own table.
EVENTS = [
    _ev(1, "A", 1, "stored", T1, "GPU"), _ev(1, "A", 1, "stored", T2, "GPU"),
    _ev(1, "A", 1, "stored", T3, "GPU"),
    _ev(1, "A", 1, "stored", D1, "STORAGE"),
    # One batch at 2 s: T1's GPU copy goes and its CPU copy lands (a demotion); T2's GPU copy goes
    # with no lower copy anywhere (an eviction).
    _ev(2, "A", 2, "removed", T1, "GPU"), _ev(2, "A", 2, "stored", T1, "CPU"),
    _ev(2, "A", 2, "removed", T2, "GPU"),
    # T3's host copy lands first (write-through), its GPU copy goes later: also a demotion.
    _ev(2.5, "A", 3, "stored", T3, "CPU"), _ev(3, "A", 4, "removed", T3, "GPU"),
    # Later the CPU tier evicts T1.
    _ev(6, "A", 5, "removed", T1, "CPU"),
    # SGLang replica S writes P1 to its GPU and to the shared L3 store (EXTERNAL); B caches X1.
    _ev(1, "S", 1, "stored", P1, "GPU"), _ev(1, "S", 1, "stored", P1, "EXTERNAL"),
    _ev(1, "S", 1, "stored", P2, "EXTERNAL"),  # only in the pool: not S's local copy
    _ev(1, "B", 1, "stored", X1, "GPU"),
]
REQUESTS = [
    _req("r1", 5, "A", T1, cached=BLOCK),  # demoted to CPU at 2 s: an offload hit
    _req("r2", 5, "A", T3, cached=BLOCK),  # demoted after its host copy landed: an offload hit
    _req("r3", 5, "A", T2, cached=0),  # evicted from the GPU at 2 s, kept nowhere
    _req("r4", 5, "A", D1, cached=BLOCK),  # on A's disk tier
    _req("r5", 5, "B", P1, cached=BLOCK, cached_storage_tokens=BLOCK),  # in the pool: any replica loads it
    _req("r6", 5, "S", P1, cached=BLOCK, cached_device_tokens=BLOCK),  # S's own GPU copy
    _req("r7", 7, "A", T1, cached=0),  # the CPU tier evicted it at 6 s
    _req("r8", 7, "S", P2, cached=BLOCK, cached_storage_tokens=BLOCK),  # the publisher loads it from the pool
]
EXPECTED = [
    # request, outcome, origin, removed_ns, remover
    ("r1", "hit_offload", "cpu", None, None),
    ("r2", "hit_offload", "cpu", None, None),
    ("r3", "miss_evicted", None, at(2), "A"),
    ("r4", "hit_offload", "disk", None, None),
    ("r5", "hit_remote", "pool", None, None),
    ("r6", "hit_local", "gpu", None, None),
    ("r7", "miss_evicted", None, at(6), "A"),  # the CPU eviction, not the GPU demotion at 2 s
    ("r8", "hit_remote", "pool", None, None),
]


@pytest.fixture
def con(tmp_path: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    root = tmp_path / "lake"
    for table, rows in (("kv_events", EVENTS), ("requests", [r for r, _ in REQUESTS]),
                        ("request_blocks", [b for _, bs in REQUESTS for b in bs])):
        with SegmentWriter(root, table, scenario="tiers", writer_id="hand") as w:
            w.append_rows(rows)
    with SegmentWriter(root, "metric_samples", scenario="tiers", writer_id="hand") as w:
        counter = "vllm:prompt_tokens_cached_by_source"
        w.append_rows([{"ts_ns": at(8), "replica": "A", "name": f"{counter}_total",
                        "labels": {"engine": "0", "source": source}, "value": value}
                       for source, value in (("device", 0.0), ("host", 32.0), ("disk", 16.0), ("p2p", 0.0))]
                      + [{"ts_ns": at(8), "replica": "A", "name": f"{counter}_created",
                          "labels": {"engine": "0", "source": source}, "value": at(0) / 1e9}
                         for source in ("device", "host", "disk", "p2p")])
    c = duckdb.connect()
    open_lake(c, root)
    yield c
    c.close()


def _outcomes(con: duckdb.DuckDBPyConnection) -> Any:
    return block_outcomes(requests=con.table("requests"), request_blocks=con.table("request_blocks"),
                          kv_events=con.table("kv_events"), transfers=con.table("transfers"),
                          scenario="tiers", bytes_per_token=RATE)


def test_each_tier_rule_gives_its_exact_ledger(con: duckdb.DuckDBPyConnection) -> None:
    out = _outcomes(con).sort("request_id")
    assert out.select("request_id", "outcome", "origin", "removed_ns", "remover").rows() == EXPECTED
    per = request_ledger(block_outcomes=out, requests=con.table("requests"))
    per = per.sort("request_id")
    assert per.select("request_id", "device_hit_tokens", "host_hit_tokens", "disk_hit_tokens",
                      "remote_hit_tokens").rows() == [
        ("r1", 0, 16, 0, 0), ("r2", 0, 16, 0, 0), ("r3", 0, 0, 0, 0), ("r4", 0, 0, 16, 0),
        ("r5", 0, 0, 0, 16), ("r6", 16, 0, 0, 0), ("r7", 0, 0, 0, 0), ("r8", 0, 0, 0, 16)]
    # Every request gets the engine's cached_tokens back.
    assert (per["hit_tokens"] == per["cached_tokens"]).all()


def test_tier_payoff_counts_demotions_apart_from_evictions(con: duckdb.DuckDBPyConnection) -> None:
    out = _outcomes(con)
    pay = tier_payoff(block_outcomes=out, kv_events=con.table("kv_events"), scenario="tiers",
                      bytes_per_token=RATE)
    block = BLOCK * RATE
    columns = ("replica", "tier", "stored_blocks", "stored_bytes", "removed_blocks", "demoted_blocks",
               "evicted_blocks", "hit_blocks", "hit_bytes", "served_per_stored_ratio", "paid_off")
    assert pay.select(columns).rows() == [
        ("A", "cpu", 2, 2 * block, 1, 0, 1, 2, 2 * block, 1.0, True),
        ("A", "disk", 1, block, 0, 0, 0, 1, block, 1.0, True),
        ("A", "gpu", 3, 3 * block, 3, 2, 1, 0, 0, 0.0, False),  # T1 and T3 demoted, T2 evicted
        ("B", "gpu", 1, block, 0, 0, 0, 0, 0, 0.0, False),
        ("S", "gpu", 1, block, 0, 0, 0, 1, block, 1.0, True),
        ("pool", "pool", 2, 2 * block, 0, 0, 0, 2, 2 * block, 1.0, True),
    ]


def test_tier_attribution_reconciles_with_the_engines_per_source_counters(
        con: duckdb.DuckDBPyConnection) -> None:
    rec = tier_reconciliation(block_outcomes=_outcomes(con), requests=con.table("requests"),
                              metric_samples=con.table("metric_samples"), scenario="tiers")
    assert rec.select("replica", "source", "ledger_hit_tokens", "reported_tokens", "engine_counter_tokens",
                      "difference_tokens").rows() == [
        ("A", "device", 0, None, 0, 0),
        ("A", "disk", 16, None, 16, 0),
        ("A", "host", 32, None, 32, 0),
        ("A", "remote", 0, None, 0, 0),  # p2p
        ("B", "remote", 16, 16, None, 0),  # SGLang's storage split, per request
        ("S", "device", 16, 16, None, 0),
        ("S", "remote", 16, 16, None, 0),
    ]


def test_the_gateway_log_carries_sglangs_per_tier_split(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvlens.cli import cli

    line = {"request_id": "g1", "arrival_ns": at(1), "replica": "S", "prompt_tokens": 40, "block_size": 16,
            "block_hashes": [1, 2, 3], "cached_tokens": 32,
            "cached_tokens_details": {"device": 16, "host": 0, "storage": 16, "storage_backend": "mooncake"}}
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps(line) + "\n")
    bad.write_text(json.dumps({**line, "cached_tokens_details": {"device": "16"}}) + "\n")
    lake = tmp_path / "lake"
    runner = CliRunner()
    assert runner.invoke(cli, ["import", "gateway", str(good), "--lake", str(lake)]).exit_code == 0
    c = duckdb.connect()
    open_lake(c, lake)
    assert c.execute("SELECT cached_device_tokens, cached_host_tokens, cached_storage_tokens "
                     "FROM requests").fetchall() == [(16, 0, 16)]
    c.close()
    result = runner.invoke(cli, ["import", "gateway", str(bad), "--lake", str(lake)])
    assert result.exit_code == 1 and "cached_tokens_details" in result.output
