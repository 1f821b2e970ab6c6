"""scenarios.provenance comes from the requests' sources, never from a scenario's name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb
from click.testing import CliRunner

from kvlens.cli import cli


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
