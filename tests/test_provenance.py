"""scenarios.provenance comes from the requests' sources, never from a scenario's name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb
import polars as pl
from click.testing import CliRunner

from kvlens.cli import cli
from kvlens.lake import open_lake


def test_provenance_is_read_from_the_data(tmp_path: Path, mooncake3: Path,
                                          write_jsonl: Callable[..., Path]) -> None:
    lake, db, runner = tmp_path / "lake", tmp_path / "a.duckdb", CliRunner()
    # Names chosen to mislead: a trace called like a what-if, a simulation called like production.
    assert runner.invoke(cli, ["import", "mooncake", str(mooncake3), "--lake", str(lake),
                               "--scenario", "rr8-whatif"]).exit_code == 0
    assert runner.invoke(cli, ["simulate", "--lake", str(lake), "--from", "rr8-whatif", "--scenario",
                               "production", "--replicas", "2"]).exit_code == 0
    gw = write_jsonl("gw.jsonl", [{"request_id": "g1", "arrival_ns": 10**18, "prompt_tokens": 16,
                                   "block_size": 16, "block_hashes": [7], "ttft_ms": 12.5}])
    assert runner.invoke(cli, ["import", "gateway", str(gw), "--lake", str(lake),
                               "--scenario", "sim"]).exit_code == 0
    result = runner.invoke(cli, ["analyze", "--lake", str(lake), "--db", str(db), "--model", "llama-3.1-8b"])
    assert result.exit_code == 0, result.output
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("SELECT scenario, provenance, sources, ttft_label, assumptions IS NOT NULL, "
                       "model_source FROM scenarios ORDER BY scenario").fetchall()
    con.close()
    assert rows == [
        ("production", "simulated", "sim", "modelled", True, "given"),
        ("rr8-whatif", "measured", "mooncake", None, False, "given"),  # a trace without timings
        ("sim", "measured", "gateway", "measured", False, "given"),
    ]


def test_a_what_ifs_assumptions_are_what_the_simulator_ran(tmp_path: Path) -> None:
    """The words beside a modelled figure come from the simulate run itself (table simulations)."""
    from kvlens.analyzers.provenance import scenario_provenance
    from kvlens.analyzers.simulate import SimConfig, simulate
    from kvlens.lake import write_scenario
    from kvlens.models import get_model
    from kvlens.schema import RoutingPolicy

    reqs = pl.DataFrame({"request_id": ["a", "b"], "arrival_ns": [1_000, 2_000_000_000],
                         "prompt_tokens": [64, 64], "output_tokens": [4, 4], "model": [None, None],
                         "tenant": [None, None], "session_id": ["s", "s"], "replica": [None, None],
                         "queue_ms": [None, None], "ttft_ms": [None, None], "source": ["gateway"] * 2},
                        schema_overrides={"model": pl.String, "tenant": pl.String, "replica": pl.String,
                                          "queue_ms": pl.Float64, "ttft_ms": pl.Float64})
    blocks = pl.DataFrame({"request_id": ["a", "a", "b", "b"], "position": [0, 1, 0, 1],
                           "block_hash": [1, 2, 1, 2], "content_hash": [None] * 4, "block_tokens": [32] * 4,
                           "block_size_tokens": [32] * 4,
                           "arrival_ns": [1_000, 1_000, 2_000_000_000, 2_000_000_000],
                           "namespace": [None] * 4},
                          schema_overrides={"block_hash": pl.UInt64, "content_hash": pl.UInt64,
                                            "namespace": pl.String})
    config = SimConfig(replicas=3, routing=RoutingPolicy.PREFIX_HASH, gpu_blocks=40, max_seqs=4)
    result = simulate(requests=reqs, request_blocks=blocks, config=config, model=get_model("llama-3.1-8b"))
    write_scenario(tmp_path, "whatif", {k: v.to_arrow() for k, v in result.tables.items()}, writer_id="t")
    con = duckdb.connect()
    open_lake(con, tmp_path)
    found = scenario_provenance(requests=con.table("requests"), simulations=con.table("simulations"))
    assert found.provenance == "simulated"
    assumed = found.assumptions or ""
    assert "--engine vllm: 3 replica(s) routed prefix_hash" in assumed
    assert "block pool of 40 blocks of 32 tokens" in assumed and "at most 4 sequences" in assumed
    assert "20 ms per output token" not in assumed  # the LRU engine's service model is not what ran
