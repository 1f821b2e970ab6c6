"""Tests for the partitioned ledger (analyzers/partitions.py, analyzers/ray_runner.py): the replay
split into block-hash partitions (phase 1) and a pass per request (phase 2) decides every block as
the one-process replay does, row for row, for any number of partitions: on random streams against
``replay_core``, on real captures and simulated fleets against ``ledger_outcomes``, and through
``kvlens analyze --ray`` on a local Ray cluster of 2 workers against a one-process analysis."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from incremental_lake import assert_same_db
from polars.testing import assert_frame_equal
from test_ledger import _write_clear, _write_hand, replay_inputs
from test_ledger_resume import Lake, _captured, _ledger, _relations, _span

from kvlens.analyzers.partitions import (
    ROWS_PER_PARTITION,
    Partitions,
    in_process,
    replay_partitioned,
    split_by_partition,
)
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


def test_the_partition_count_follows_the_workers_and_the_size() -> None:
    assert Partitions(7).for_rows(10**12) == 7  # given: kept
    assert Partitions(workers=3).for_rows(10) == 6  # two per worker
    assert Partitions(workers=3).for_rows(6 * ROWS_PER_PARTITION) == 6
    assert Partitions(workers=3).for_rows(6 * ROWS_PER_PARTITION + 1) == 7  # none over ROWS_PER_PARTITION


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


def _take_partitioned_curves(db: Path) -> pl.DataFrame:
    """Removes the ``partitioned`` mrc rows from ``db`` (the rows a one-process analysis does not
    write) and returns them beside the exact curve at the same capacity (``exact``)."""
    with duckdb.connect(str(db)) as con:
        rows = con.sql("SELECT p.scenario, p.capacity_blocks, p.hit_ratio_blocks AS partitioned, "
                       "e.hit_ratio_blocks AS exact FROM mrc p JOIN mrc e "
                       "USING (scenario, stream, capacity_blocks) "
                       "WHERE p.method = 'partitioned' AND e.method = 'exact'").pl()
        ((n,),) = con.execute("SELECT count(*) FROM mrc WHERE method = 'partitioned'").fetchall()
        con.execute("DELETE FROM mrc WHERE method = 'partitioned'")
    assert rows.height == n  # every partitioned point lies on the exact curve's grid
    return rows


def test_analyze_with_partitions_writes_the_same_db(lakes: dict[str, Lake], tmp_path: Path) -> None:
    lake = lakes["capture"].path
    _analyze(lake, tmp_path / "one.duckdb")
    said = _analyze(lake, tmp_path / "parts.duckdb", "--partitions", "4")
    assert "ledger replayed in 4 block-hash partitions in process" in said
    assert _take_partitioned_curves(tmp_path / "parts.duckdb").height > 0
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


def _analyze_on_ray(lake: Path, db: Path, address: str | None, *flags: str,
                    env: dict[str, str] | None = None) -> str:
    """``kvlens analyze --full --ray [address] FLAGS`` in a process of its own; its stderr."""
    done = subprocess.run([sys.executable, "-m", "kvlens.cli", "analyze", "--lake", str(lake), "--db",
                           str(db), "--full", "--ray", *([address] if address else []), *flags],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _no_ray_left(before: set[int]) -> None:
    deadline = time.monotonic() + 30
    while (left := _ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes left behind: {sorted(left)}"


def test_analyze_on_a_local_ray_cluster_it_starts(lakes: dict[str, Lake], tmp_path: Path) -> None:
    """``kvlens analyze --ray`` without an address starts a local Ray cluster (one worker per CPU),
    chooses two partitions per CPU (a small lake), writes the DB a one-process analysis writes, and
    shuts the cluster down: no Ray process outlives the command."""
    pytest.importorskip("ray", reason="the ray extra is installed by make test")
    lake = lakes["simulated"].path
    _analyze(lake, tmp_path / "one.duckdb")
    before = _ray_processes()
    said = _analyze_on_ray(lake, tmp_path / "ray.duckdb", None)
    assert _take_partitioned_curves(tmp_path / "ray.duckdb").height > 0
    cpus = os.cpu_count() or 1
    chosen = f"ledger replayed in {2 * cpus} block-hash partitions on Ray (local cluster, {cpus} CPUs)"
    assert chosen in said, said[-3000:]
    assert assert_same_db(tmp_path / "ray.duckdb", tmp_path / "one.duckdb")["block_outcomes"] > 1000
    _no_ray_left(before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_analyze_on_a_ray_cluster_of_two_workers(demo_workdir: Path, tmp_path: Path) -> None:
    """A Ray cluster of 2 workers started here (``ray start --head --num-cpus 2``, token
    authentication on, as Ray 2.59+ does by default); ``kvlens analyze --ray ADDRESS`` on the
    demo's six scenarios (the trace, three simulated fleets, the agents and their fleet with a
    pool) and the two hand-built ledger lakes' scenarios, in one lake, writes the DB a one-process
    analysis writes: every table, row for row."""
    pytest.importorskip("ray", reason="the ray extra is installed by make test")
    lake = tmp_path / "lake"
    shutil.copytree(demo_workdir / "lake", lake)
    _write_hand(lake)
    _write_clear(lake)
    _analyze(lake, tmp_path / "one.duckdb")
    ray_cli = str(Path(sys.executable).with_name("ray"))
    # Workers at the test's priority, not Ray's default niceness 15: on a busy machine those get a
    # sliver of a CPU (analyzers/ray_runner.py).
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_worker_niceness": "0"}
    before = _ray_processes()
    port = _free_port()
    started = subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2",
                              "--include-dashboard=false", "--disable-usage-stats"],
                             capture_output=True, text=True, timeout=300, env=env)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        said = _analyze_on_ray(lake, tmp_path / "ray.duckdb", f"127.0.0.1:{port}", "--partitions", "5",
                               env=env)
    finally:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=300, env=env)
    names = re.findall(rf"^(\S+): full .*ledger replayed in 5 block-hash partitions on Ray "
                       rf"\(127\.0\.0\.1:{port}, 2 CPUs\)", said, re.MULTILINE)
    scenarios = {"agents", "agents4-pool", "cache8", "cache8-lf2", "conversation", "rr8", "hand", "clear"}
    assert set(names) == scenarios, said[-3000:]
    # Curves: the partitioned one (5 partitions: each a 20% spatial sample) within a SHARDS
    # estimate's error of the exact one on the trace's 276,491 full-block accesses, where a sample
    # is meaningful; the rest of the DB equal, row for row.
    curves = _take_partitioned_curves(tmp_path / "ray.duckdb")
    assert set(curves["scenario"]) == scenarios
    big = curves.filter(pl.col("scenario").is_in(["conversation", "rr8", "cache8", "cache8-lf2"]))
    gap = (big["partitioned"] - big["exact"]).abs()
    assert gap.mean() < 0.003 and gap.max() < 0.02, (gap.mean(), gap.max())
    counts = assert_same_db(tmp_path / "ray.duckdb", tmp_path / "one.duckdb")
    assert counts["block_outcomes"] > 1_000_000
    _no_ray_left(before)


_FAILING_TASK = """
import os
import sys
from kvlens.analyzers.ray_runner import ray_partitions
from kvlens.errors import KvlensError

def boom(p):
    if p == 1:
        raise RuntimeError("partition one is broken")
    return (p,)

def niceness(p):
    import os
    return os.nice(0)

with ray_partitions(None, 3) as parts:
    print("niceness", os.nice(0), sorted(set(parts.run(niceness, [(0,), (1,), (2,)]))))
    try:
        list(parts.run(boom, [(0,), (1,), (2,)]))
    except KvlensError as e:
        print(e)
        sys.exit(3)
"""


def test_a_failed_ray_task_is_one_clear_error(tmp_path: Path) -> None:
    """A partition whose task raises (or whose worker dies) ends the run with one error naming the
    partition and what to do, and the local cluster is still shut down. Its workers run at the
    command's priority (not Ray's default niceness 15, which starves them on a busy machine)."""
    pytest.importorskip("ray", reason="the ray extra is installed by make test")
    before = _ray_processes()
    done = subprocess.run([sys.executable, "-c", _FAILING_TASK], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 3, done.stderr[-3000:]
    own = os.nice(0)
    assert f"niceness {own} [{own}]" in done.stdout, done.stdout[-3000:]
    assert "partition 2 failed on Ray (local cluster" in done.stdout
    assert "partition one is broken" in done.stdout and "without --ray" in done.stdout
    _no_ray_left(before)


@pytest.mark.parametrize("partitions", [1, 3, 8, 9, 64, 300])
def test_split_by_partition_keeps_stream_order(partitions: int) -> None:
    # Both ways of splitting (a pass per partition up to 8, a radix sort past it) give each
    # partition its rows in stream order, every row exactly once.
    part = np.random.default_rng(partitions).integers(0, partitions, 20_000)
    got = split_by_partition(part, partitions)
    assert len(got) == partitions
    for k, rows in enumerate(got):
        assert np.array_equal(rows, np.flatnonzero(part == k))


def test_analyze_shows_each_partition_on_the_progress_bar(lakes: dict[str, Lake], tmp_path: Path) -> None:
    # Issue 17's "shows progress": the bar beside each scenario says which partition was gathered.
    from contextlib import contextmanager

    from kvlens.analyzers.analyze import analyze_lake

    shown: list[str] = []

    class Bar(list):  # type: ignore[type-arg]
        current_item = ""

        def render_progress(self) -> None:
            shown.append(self.current_item)

    @contextmanager
    def progress(items: list[str]) -> Iterator[Bar]:
        yield Bar(items)

    analyze_lake(lakes["capture"].path, tmp_path / "db.duckdb", progress=progress, partitions=Partitions(3))
    scenario = "capture"
    assert [s for s in shown if "ledger" in s] == [f"{scenario}: ledger partition {k}/3" for k in (1, 2, 3)]
    assert [s for s in shown if "curve" in s] == [f"{scenario}: curve partition {k}/3" for k in (1, 2, 3)]


def _state_by_hash(state: tuple[np.ndarray, ...], n_slots: int) -> tuple[dict[Any, Any], ...]:
    """A replay state keyed by block hash, not by row number (rows only index the arrays)."""
    row_hash, masks, extra, removed, remover, ck, cv, fk, fv, ok, ov = state
    rows = {int(h): (masks[i].tolist(), extra[i].tolist(), int(removed[i]), int(remover[i]))
            for i, h in enumerate(row_hash)}
    copies = {(int(row_hash[k // n_slots]), int(k % n_slots)): int(v) for k, v in zip(ck, cv, strict=True)}
    return rows, copies, dict(zip(fk.tolist(), fv.tolist(), strict=True)), dict(zip(ok.tolist(), ov.tolist(),
                                                                                   strict=True))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replay_inputs(), st.integers(1, 5), st.integers(0, 45))
def test_partitioned_state_at_a_checkpoint_equals_the_one_process_snapshot(args: tuple[Any, ...],
                                                                          partitions: int, snap: int) -> None:
    # What a partitioned full replay saves at its checkpoint is the state the one-process replay
    # saves there (issue 16 with 17): the next analysis continues from it in one process.
    from kvlens.analyzers.partitions import replay_partitioned_state
    from kvlens.analyzers.replay import TIERS, replay_resume

    ev_ts, ev_kind, ev_loc, _, ev_grp = args[:5]
    n_locs, _, windows = args[-3:]
    n_groups = windows.shape[1]
    loc_grp = loc_groups(ev_kind, ev_loc, ev_grp, n_locs, n_groups)
    n_words = (TIERS * n_locs * n_groups + 62) // 63
    no = np.zeros(0, np.int64)
    words = np.zeros((0, n_words), np.int64)
    empty = (no, words, words.copy(), no, no, no, no, no, no, no, no)
    want_out, want = replay_resume(ev_ts, *args, loc_grp, empty, snap)
    got_out, got = replay_partitioned_state(ev_ts, *args, loc_grp, partitions=partitions, snap=snap)
    assert [np.asarray(x).tolist() for x in got_out] == [np.asarray(x).tolist() for x in want_out]
    assert got is not None
    n_slots = TIERS * n_locs * n_groups
    assert _state_by_hash(got, n_slots) == _state_by_hash(want, n_slots)


def test_a_partitioned_analysis_saves_the_state_the_next_one_continues(tmp_path: Path) -> None:
    # A full replay in partitions saves the state at its checkpoint; the next analysis of the
    # grown lake continues from it (in this process) and the tables equal a one-process --full.
    from incremental_lake import cut, row_bounds, source_lake

    from kvlens.analyzers.analyze import analyze_lake

    source = source_lake(tmp_path / "src", requests=300)
    bounds = row_bounds(source, 3)
    lake, db = tmp_path / "lake", tmp_path / "incr.duckdb"
    said = []
    for k in range(3):
        cut(source, lake, None if k == 0 else bounds[k], bounds[k + 1], writer=f"inc{k}", scenarios=["rr2"])
        said.append(dict((s, (m, why)) for s, m, why in
                         analyze_lake(lake, db, partitions=Partitions(3)).modes)["rr2"])
    assert said[0][0] == "full" and "ledger replayed in 3 block-hash partitions in process" in said[0][1]
    for mode, why in said[1:]:
        assert mode == "appended" and "ledger continued from its checkpoint" in why, why
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM kvlens_ledger WHERE scenario = 'rr2'").fetchall() == [(1,)]
    analyze_lake(lake, tmp_path / "full.duckdb", full=True)
    _take_partitioned_curves(db)
    assert assert_same_db(db, tmp_path / "full.duckdb")["block_outcomes"] > 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replay_inputs(), st.integers(0, 45), st.integers(0, 55))
def test_a_replay_continued_from_its_state_equals_the_whole_replay(args: tuple[Any, ...], cut: int,
                                                                   later: int) -> None:
    # A replay continued from the state saved at a cut (what an incremental analysis does): the
    # outcomes of the requests after the cut, and the state at a later place, array for array (row
    # numbers, the content map's order), are those of one replay of everything.
    from kvlens.analyzers.replay import TIERS, replay_resume

    ev, req, blk = args[:9], args[9:14], args[14:18]
    n_locs, pool_loc, windows = args[18:]
    ev_ts, n_groups = ev[0], windows.shape[1]
    loc_grp = loc_groups(ev[1], ev[2], ev[4], n_locs, n_groups)
    no = np.zeros(0, np.int64)
    words = np.zeros((0, (TIERS * n_locs * n_groups + 62) // 63), np.int64)
    empty = (no, words, words.copy(), no, no, no, no, no, no, no, no)
    later = max(later, cut)
    whole, at_cut = replay_resume(ev_ts, *args, loc_grp, empty, cut)
    _, want = replay_resume(ev_ts, *args, loc_grp, empty, later)
    k = int(np.searchsorted(ev_ts, cut))  # the events in the state
    # the look-ups after the snapshot: those ordered after every event in the state
    i = int(np.searchsorted(req[0], ev_ts[k - 1], side="right")) if k else 0
    off = req[4]
    b = int(off[i])
    got, state = replay_resume(ev_ts[k:], ev_ts[k:], *(a[k:] for a in ev[1:]), *(a[i:] for a in req[:4]),
                               off[i:] - b, *(a[b:] for a in blk), n_locs, pool_loc, windows, loc_grp, at_cut,
                               later)
    for name, g, w in zip(_NAMES, got, whole, strict=True):
        assert np.asarray(g).tolist() == np.asarray(w)[b:].tolist(), name
    for g, w in zip(state, want, strict=True):
        assert g.dtype == w.dtype and np.asarray(g).tolist() == np.asarray(w).tolist()
