"""Tests for the partitioned ledger (analyzers/partitions.py, analyzers/ray_runner.py): the replay
split into block-hash partitions (phase 1) and a pass per request (phase 2) decides every block as
the one-process replay does, row for row, for any number of partitions: on random streams against
``replay_core``, on real captures and simulated fleets against ``ledger_outcomes``, and through
``kvlens analyze --ray`` on a local Ray cluster of 2 workers against a one-process analysis."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from incremental_lake import assert_same_db
from polars.testing import assert_frame_equal
from test_ledger import _write_clear, _write_hand, replay_inputs
from test_ledger_resume import Lake, _captured, _ledger, _relations, _span

from kvlens.analyzers.partitions import Partitions, in_process, replay_partitioned
from kvlens.analyzers.replay import loc_groups, replay_core
from kvlens.cli import cli

DATA = Path(__file__).parent / "data"
_NAMES = ("outcome", "holder", "removed_ts", "remover", "other_namespace", "cut_group", "group_mask",
          "source")


def _partitioned(args: tuple[Any, ...], partitions: int) -> list[list[int]]:
    ev_ts, ev_kind, ev_loc, _, ev_grp = args[:5]
    n_locs, _, windows = args[-3:]
    loc_grp = loc_groups(ev_kind, ev_loc, ev_grp, n_locs, windows.shape[1])
    # The times order the events (their stream places) and are the times a removal records.
    got = replay_partitioned(ev_ts, *args, loc_grp, partitions=partitions)
    return [np.asarray(x).tolist() for x in got]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replay_inputs(), st.integers(1, 5))
def test_partitioned_replay_equals_the_one_process_replay(args: tuple[Any, ...], partitions: int) -> None:
    want = [np.asarray(x).tolist() for x in replay_core(*args)]
    got = _partitioned(args, partitions)
    for name, g, w in zip(_NAMES, got, want, strict=True):
        assert g == w, name


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replay_inputs(min_locs=32, max_locs=70), st.integers(1, 3))
def test_partitioned_replay_past_one_bit_word(args: tuple[Any, ...], partitions: int) -> None:
    want = [np.asarray(x).tolist() for x in replay_core(*args)]
    assert _partitioned(args, partitions) == want


# -- whole lakes: ledger_outcomes with and without partitions --------------------------------------

@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Lake]:
    from incremental_lake import source_lake

    tmp = tmp_path_factory.mktemp("partitions")
    for name in ("capture", "hybrid"):
        (tmp / name).mkdir()
    hand = tmp / "hand"
    _write_hand(hand)
    _write_clear(hand)
    return {
        "simulated": _span(source_lake(tmp / "sim", requests=200), "rr2"),
        "capture": _captured(tmp / "capture", DATA / "vllm-cpu-capture", "tiny"),
        "hybrid": _captured(tmp / "hybrid", DATA / "vllm-cpu-hybrid-capture", "tiny-gemma2"),
        "hand": _span(hand, "hand"),
        "clear": _span(hand, "clear"),
    }


@pytest.mark.parametrize("name", ["simulated", "capture", "hybrid", "hand", "clear"])
@pytest.mark.parametrize("count", [1, 3, 16])
def test_a_lake_partitioned_equals_its_ledger(lakes: dict[str, Lake], name: str, count: int) -> None:
    """The simulated fleet with a pool, the real vLLM capture (requests anchored at their own
    stores), the real hybrid capture (two KV cache groups) and the hand-built lakes (one of every
    outcome; clears): the partitioned ledger equals the one-process ledger, row for row."""
    lake = lakes[name]
    con = duckdb.connect()
    try:
        rel = _relations(con, lake, None)
        want = _ledger(rel, lake.scenario)
        seen: list[int] = []

        def counting(fn: Any, parts: Any) -> Any:
            for got in in_process(fn, parts):
                seen.append(len(got[0]))
                yield got

        got = _ledger(rel, lake.scenario, partitions=Partitions(count, counting))
    finally:
        con.close()
    assert_frame_equal(got.frame, want.frame)
    assert len(seen) == count and sum(seen) == want.frame.height
    assert got.state is None and want.frame.height > 0


# -- kvlens analyze --partitions / --ray ------------------------------------------------------------

def _analyze(lake: Path, db: Path, *flags: str) -> str:
    result = CliRunner().invoke(cli, ["analyze", "--lake", str(lake), "--db", str(db), "--full", *flags])
    assert result.exit_code == 0, result.output
    return result.output


def test_analyze_with_partitions_writes_the_same_db(lakes: dict[str, Lake], tmp_path: Path) -> None:
    lake = lakes["capture"].path
    _analyze(lake, tmp_path / "one.duckdb")
    said = _analyze(lake, tmp_path / "parts.duckdb", "--partitions", "4")
    assert "ledger replayed in 4 block-hash partitions in process" in said
    assert assert_same_db(tmp_path / "parts.duckdb", tmp_path / "one.duckdb")["block_outcomes"] > 0


def _ray_processes() -> set[int]:
    """Live processes of Ray's own (its GCS server, raylet, workers and their helpers)."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if proc.name.isdigit() and (b"ray/core/src" in cmd or b"gcs_server" in cmd or b"raylet" in cmd
                                    or b"ray::" in cmd or b"default_worker.py" in cmd):
            found.add(int(proc.name))
    return found


def test_analyze_on_a_local_ray_cluster_of_two_workers(demo_workdir: Path, tmp_path: Path) -> None:
    """``kvlens analyze --ray``, in a process of its own, on the demo's scenarios (six: the trace,
    three simulated fleets, the agents and their fleet with a pool) and the two hand-built ledger
    lakes' scenarios in one lake: it starts a local Ray cluster (one worker per CPU: two here and
    in CI), writes the DB a one-process analysis writes, and leaves no Ray process behind."""
    pytest.importorskip("ray", reason="the ray extra is installed by make test")
    lake = tmp_path / "lake"
    shutil.copytree(demo_workdir / "lake", lake)
    _write_hand(lake)
    _write_clear(lake)
    _analyze(lake, tmp_path / "one.duckdb")
    before = _ray_processes()
    done = subprocess.run([sys.executable, "-m", "kvlens.cli", "analyze", "--lake", str(lake), "--db",
                           str(tmp_path / "ray.duckdb"), "--full", "--ray", "--partitions", "5"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.findall(r"^(\S+): full .*ledger replayed in 5 block-hash partitions on Ray "
                      r"\(local cluster, (\d+) CPUs\)", done.stderr, re.MULTILINE)
    scenarios = {"agents", "agents4-pool", "cache8", "cache8-lf2", "conversation", "rr8", "hand", "clear"}
    assert {name for name, _ in said} == scenarios, done.stderr[-3000:]
    assert {int(cpus) for _, cpus in said} == {os.cpu_count() or 1}
    counts = assert_same_db(tmp_path / "ray.duckdb", tmp_path / "one.duckdb")
    assert counts["block_outcomes"] > 1_000_000
    deadline = time.monotonic() + 30
    while (left := _ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes outlived kvlens analyze: {sorted(left)}"
