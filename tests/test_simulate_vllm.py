"""The simulator's vLLM engine against real vLLM 0.32 captures (tests/data/): per request, event for event.

Each capture goes into a lake through kvlens's own importers (the client's prompts as gateway
lines with token ids, hashed as the engine hashes them; the engine's KV-event frames; its OTLP
spans), then ``kvlens simulate`` replays the requests at the engine's own configuration and
``--calibrate`` prices its steps from the spans. The simulated ``cached_tokens`` are held to
the engine's own, request by request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from kvlens.cli import cli
from kvlens.lake import open_lake

DATA = Path(__file__).parent / "data"
SEQUENTIAL = DATA / "vllm-cpu-capture"
CONCURRENT = DATA / "vllm-concurrent-capture"


def _gateway(client: Path, out: Path) -> Path:
    with open(client) as src, open(out, "w") as dst:
        for i, line in enumerate(src):
            r = json.loads(line)
            usage = r.get("usage")
            cached = usage["prompt_tokens_details"]["cached_tokens"] if usage else r["cached_tokens"]
            dst.write(json.dumps({
                "request_id": r["request_id"], "arrival_s": r.get("arrival_unix", 1.7e9 + i),
                "replica": "replica-a", "model": "tiny", "session_id": r.get("session"),
                "prompt_tokens": usage["prompt_tokens"] if usage else len(r["prompt_token_ids"]),
                **({"output_tokens": usage["completion_tokens"]} if usage else {}), "cached_tokens": cached,
                "token_ids": r["prompt_token_ids"], "block_size": 32, "hash_algo": "sha256_cbor",
                "hash_seed": "0"}) + "\n")
    return out


def run(*args: str | Path) -> Any:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def _lake(tmp: Path, client: Path, frames: Path, spans: list[Path]) -> Path:
    lake = tmp / "lake"
    run("import", "gateway", _gateway(client, tmp / "gateway.jsonl"), "--scenario", "capture", "--lake", lake)
    run("import", "vllm-events", frames, "--scenario", "capture", "--lake", lake)
    if spans:
        run("import", "otlp", *spans, "--scenario", "capture-spans", "--lake", lake)
    return lake


def _frame(lake: Path, sql: str, *params: object) -> pl.DataFrame:
    con = duckdb.connect()
    open_lake(con, lake)
    try:
        return con.sql(sql, params=list(params)).pl()
    finally:
        con.close()


def _compare(lake: Path, scenario: str) -> pl.DataFrame:
    return _frame(lake, "SELECT e.request_id, e.cached_tokens AS engine, s.cached_tokens AS sim, s.ttft_ms "
                        "FROM requests e JOIN requests s USING (request_id) "
                        "WHERE e.scenario = 'capture' AND s.scenario = ?", scenario)


@pytest.fixture(scope="module")
def sequential(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("sequential")
    lake = _lake(tmp, SEQUENTIAL / "client.jsonl", SEQUENTIAL / "kv_events.frames.jsonl",
                 sorted(SEQUENTIAL.glob("otlp_*.pb")))
    run("simulate", "--lake", lake, "--from", "capture", "--scenario", "sim", "--replicas", "1",
        "--gpu-blocks", "96", "--max-seqs", "8", "--max-batched-tokens", "2048",
        "--calibrate", "capture-spans")
    return lake


def test_the_shipped_capture_replays_request_for_request(sequential: Path) -> None:
    # The engine ran 300 requests one after another on 96 blocks (README there); replayed at that
    # configuration, priced by its own spans, every request gets the engine's cached tokens.
    rows = _compare(sequential, "sim")
    exact = int((rows["engine"] == rows["sim"]).sum())
    engine, sim = int(rows["engine"].sum()), int(rows["sim"].sum())
    print(f"\n   sequential capture: {exact} of {rows.height} requests exact; "
          f"cached {sim:,} vs engine {engine:,}")
    assert rows.height == 300 and engine == 63_744
    assert exact >= 0.99 * rows.height
    assert abs(sim - engine) <= 0.01 * engine


def test_the_simulated_events_are_the_engines_block_for_block(sequential: Path) -> None:
    # Every stored and removed block, in order, as the engine published it; a block that filled
    # with generated tokens (whose content no trace records) has a hash of its own in the
    # simulation, so it is compared as "generated" at its place in the stream.
    sql = "SELECT kind::VARCHAR AS kind, block_hash FROM kv_events WHERE scenario = ? ORDER BY ts_ns, seq"
    known = _frame(sequential, "SELECT DISTINCT block_hash FROM request_blocks WHERE scenario = 'capture'")
    prompts = set(known["block_hash"].to_list())

    def stream(scenario: str) -> list[tuple[str, object]]:
        rows = _frame(sequential, sql, scenario).rows()
        return [(kind, h if h in prompts else "generated") for kind, h in rows]

    engine, sim = stream("capture"), stream("sim")
    assert len(engine) == 2_432
    assert sim == engine
    assert sum(1 for _k, h in engine if h == "generated") > 100


def test_the_capture_head_replays_too(tmp_path: Path) -> None:
    # tests/data/vllm032_capture_head.*: the capture's first 12 prompts, without arrival times or
    # output lengths (taken as 1 s apart and 1 token): its blocks were all stored before the
    # first eviction, so those unknowns cannot move a hit.
    head = DATA / "vllm032_capture_head"
    lake = _lake(tmp_path, head.with_suffix(".client.jsonl"), head.with_suffix(".frames.jsonl"), [])
    run("simulate", "--lake", lake, "--from", "capture", "--scenario", "sim", "--replicas", "1",
        "--gpu-blocks", "96", "--max-seqs", "8")
    rows = _compare(lake, "sim")
    assert rows.height == 12 and int(rows["engine"].sum()) > 0
    assert rows["engine"].to_list() == rows["sim"].to_list()
    # Its scenario has no spans to calibrate on: one line saying what to import.
    bad = CliRunner().invoke(cli, ["simulate", "--lake", str(lake), "--from", "capture", "--scenario", "x",
                                   "--replicas", "1", "--calibrate", "capture"])
    assert bad.exit_code == 1 and bad.stdout == ""
    assert bad.stderr.startswith("Error: scenario 'capture' has 0 requests with measured prefill")
    assert "kvlens import otlp" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_a_concurrent_capture_within_2_percent_and_its_ttft_within_25(tmp_path: Path) -> None:
    lake = _lake(tmp_path, CONCURRENT / "client.jsonl", CONCURRENT / "kv_events.frames.jsonl",
                 sorted(CONCURRENT.glob("otlp_*.pb")))
    out = run("simulate", "--lake", lake, "--from", "capture", "--scenario", "sim", "--replicas", "1",
              "--gpu-blocks", "128", "--max-seqs", "8", "--max-batched-tokens", "2048",
              "--calibrate", "capture-spans").output
    assert "calibrated on scenario 'capture-spans' (360 measured spans)" in out
    rows = _compare(lake, "sim")
    spans = _frame(lake, "SELECT ttft_ms FROM requests WHERE scenario = 'capture-spans'")
    measured = spans["ttft_ms"].to_numpy()
    engine, sim = int(rows["engine"].sum()), int(rows["sim"].sum())
    p_meas, p_sim = np.percentile(measured, [50, 90]), np.percentile(rows["ttft_ms"].to_numpy(), [50, 90])
    exact = int((rows["engine"] == rows["sim"]).sum())
    print(f"\n   concurrent capture: cached {sim:,} vs engine {engine:,} ({(sim - engine) / engine:+.2%}), "
          f"{exact} of {rows.height} requests exact; TTFT P50 {p_sim[0]:.1f} vs {p_meas[0]:.1f} ms, "
          f"P90 {p_sim[1]:.1f} vs {p_meas[1]:.1f} ms (simulated vs measured)")
    assert rows.height == 360 and engine == 112_704
    assert abs(sim - engine) <= 0.02 * engine
    assert np.all(np.abs(p_sim / p_meas - 1) <= 0.25)
