"""Nothing silently lost, nothing left behind: an empty input never replaces a scenario, and what
killed processes leave (a half-written analysis DB, a segment being written) is removed next time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import polars as pl
import pytest
from click.testing import CliRunner

from kvlens.analysis_db import remove_dead_leftovers
from kvlens.cli import cli
from kvlens.commit import recover, tmp_name
from kvlens.errors import EmptyReplaceError
from kvlens.lake import SegmentWriter, empty_replace_allowed
from kvlens.query import query

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data" / "conversation_trace.jsonl.gz"
DEADLINE_S = 180.0  # bounds a failure only: the waits end when their condition holds


def _count(lake: Path) -> int:
    return int(query("SELECT count(*) FROM requests WHERE scenario = 's'", lake=lake)[1][0][0])


# -- an empty input replaces nothing ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mooncake", "gateway", "bailian", "vllm-events", "otlp-json"])
def test_an_empty_file_does_not_replace_a_scenario(tmp_path: Path, mooncake3: Path, fmt: str) -> None:
    lake = tmp_path / "lake"
    assert CliRunner().invoke(cli, ["import", "mooncake", str(mooncake3), "--lake", str(lake),
                                    "--scenario", "s"]).exit_code == 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = CliRunner().invoke(cli, ["import", fmt, str(empty), "--lake", str(lake), "--scenario", "s"])
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()[-1:]
    assert line.startswith("Error: ") and str(empty) in line and "nothing was replaced" in line
    assert _count(lake) == 3  # the scenario kept its rows


def test_only_bad_lines_skipped_is_no_rows_either(tmp_path: Path, mooncake3: Path) -> None:
    lake = tmp_path / "lake"
    CliRunner().invoke(cli, ["import", "mooncake", str(mooncake3), "--lake", str(lake), "--scenario", "s"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    result = CliRunner().invoke(cli, ["import", "mooncake", str(bad), "--lake", str(lake), "--scenario", "s",
                                      "--skip-bad-lines"])
    assert result.exit_code == 1 and "nothing was replaced" in result.stderr
    assert _count(lake) == 3


def test_allow_empty_empties_the_scenario_on_purpose(tmp_path: Path, mooncake3: Path) -> None:
    lake = tmp_path / "lake"
    CliRunner().invoke(cli, ["import", "mooncake", str(mooncake3), "--lake", str(lake), "--scenario", "s"])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = CliRunner().invoke(cli, ["import", "mooncake", str(empty), "--lake", str(lake),
                                      "--scenario", "s", "--allow-empty"])
    assert result.exit_code == 0, result.output
    assert _count(lake) == 0


def test_the_library_refuses_an_empty_replace_too(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    with SegmentWriter(lake, "requests", scenario="s", replace=True) as w:
        w.append_rows([{"request_id": "r", "arrival_ns": 0, "prompt_tokens": 1}])
    with pytest.raises(EmptyReplaceError), SegmentWriter(lake, "requests", scenario="s", replace=True):
        pass
    assert _count(lake) == 1
    assert not any((lake / ".staging").iterdir())  # the refused replace left no staging behind
    with empty_replace_allowed(), SegmentWriter(lake, "requests", scenario="s", replace=True):
        pass
    assert _count(lake) == 0


# -- what killed processes leave ------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # exited and reaped: no process has this id now (pids are not reused at once)


def _tmp_of(pid: int, name: str) -> str:
    ns, rest = tmp_name(name)[len(name) + 2:-len(".tmp")].split("-", 1)
    host, _, rand = rest.rsplit("-", 2)  # a host name may hold '-'
    return f".{name}.{ns}-{host}-{pid}-{rand}.tmp"


def test_recover_removes_the_temporary_files_of_dead_writers_only(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    with SegmentWriter(lake, "requests", scenario="s") as w:
        w.append_rows([{"request_id": "r", "arrival_ns": 0, "prompt_tokens": 1}])
    day = next((lake / "requests" / "scenario=s").glob("date=*"))
    dead = _dead_pid()
    left = [day / _tmp_of(dead, "live-r1-00000000000000000001.parquet"), lake / _tmp_of(dead, "_kvlens.json"),
            lake / ".journal" / _tmp_of(dead, "x.json")]
    live = day / _tmp_of(os.getpid(), "live-r1-00000000000000000002.parquet")
    for p in [*left, live]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"half a segment")
    recover(lake)
    assert [p for p in left if p.exists()] == []
    assert live.exists()  # a writer still alive keeps its file


def test_next_analyze_removes_what_a_killed_analyze_left(tmp_path: Path) -> None:
    lake, db = tmp_path / "lake", tmp_path / "out" / "kvlens.duckdb"
    assert CliRunner().invoke(cli, ["import", "mooncake", str(SAMPLE), "--lake", str(lake)]).exit_code == 0
    leftovers = lambda: sorted(db.parent.glob(f".{db.name}.*"))  # noqa: E731
    db.parent.mkdir()
    left_by = []
    for _ in range(2):  # the second run starts by removing what the first left, then is killed too
        before = set(leftovers())
        proc = subprocess.Popen([sys.executable, "-m", "kvlens.cli", "analyze", "--lake", str(lake),
                                 "--db", str(db)], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            deadline = time.monotonic() + DEADLINE_S
            while not any(p.stat().st_size > 0 for p in set(leftovers()) - before if p.is_file()):
                assert proc.poll() is None, "analyze finished before it could be killed"
                assert time.monotonic() < deadline, "analyze never started writing its DB"
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
        assert proc.returncode == -signal.SIGKILL
        left_by.append(set(leftovers()) - before)
        assert left_by[-1], "a killed analyze leaves its half-written DB"
    assert not db.exists()
    assert not left_by[0] & set(leftovers())  # the second run removed the first one's
    result = CliRunner().invoke(cli, ["analyze", "--lake", str(lake), "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert leftovers() == []
    assert db.is_file()


def test_a_running_builds_files_are_left_alone(tmp_path: Path) -> None:
    db = tmp_path / "kvlens.duckdb"
    mine = tmp_path / _tmp_of(os.getpid(), db.name)
    dead = tmp_path / _tmp_of(_dead_pid(), db.name)
    spill = tmp_path / (dead.name + ".tmp")  # DuckDB's spill directory beside the file
    wal = tmp_path / (dead.name + ".wal")
    for p in (mine, dead, wal):
        p.write_bytes(b"x")
    spill.mkdir()
    (spill / "duckdb_temp_storage-0.tmp").write_bytes(b"x")
    assert remove_dead_leftovers(db) == 3
    assert mine.exists() and not dead.exists() and not wal.exists() and not spill.exists()


def test_the_analysis_db_is_synced_before_it_is_renamed_into_place(tmp_path: Path, mooncake3: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """DuckDB does not sync the temporary file it builds (fsync_mode NONE): the build syncs the
    whole file once, then renames it over the old one, then syncs the directory."""
    from kvlens import analysis_db

    lake, db = tmp_path / "lake", tmp_path / "kvlens.duckdb"
    assert CliRunner().invoke(cli, ["import", "mooncake", str(mooncake3), "--lake", str(lake),
                                    "--scenario", "s"]).exit_code == 0
    steps: list[tuple[str, Path]] = []
    real_sync, real_replace = analysis_db.fsync_path, os.replace

    def sync(path: Path) -> None:
        steps.append(("sync", Path(path)))
        real_sync(path)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        steps.append(("replace", Path(src)))
        real_replace(src, dst)

    monkeypatch.setattr(analysis_db, "fsync_path", sync)
    monkeypatch.setattr(analysis_db.os, "replace", replace)
    analysis_db.build_analysis_db(db, lake, lambda con: iter(()))
    (synced, renamed, dir_synced) = steps
    assert synced[0] == "sync" and renamed == ("replace", synced[1]) and synced[1] != db
    assert dir_synced == ("sync", db.parent)
    assert analysis_db.check_duckdb_file(db) == db  # the renamed file is a whole DuckDB file


def test_a_builds_commits_write_their_rows_once_not_to_a_wal(tmp_path: Path, mooncake3: Path) -> None:
    """The DB being built is a temporary file: its commits need no write-ahead log, so each
    checkpoints at once (``CHECKPOINT_THRESHOLD``) and the rows are written to the file once, not
    to the WAL and again at the final CHECKPOINT. After a committed transaction of 50,000 rows no
    WAL lies beside the file, and the finished DB holds them."""
    from kvlens import analysis_db

    lake, db = tmp_path / "lake", tmp_path / "kvlens.duckdb"
    assert CliRunner().invoke(cli, ["import", "mooncake", str(mooncake3), "--lake", str(lake),
                                    "--scenario", "s"]).exit_code == 0
    wal_after_commit: list[int] = []  # the WAL's bytes, once the transaction committed
    n = 50_000
    rows = pl.DataFrame({"scenario": ["s"] * n, "replica": [f"r{i % 7}" for i in range(n)],
                         "outcome": ["hit_local"] * n, "blocks": list(range(n)), "tokens": [16] * n,
                         "bytes": [4096] * n, "events_incomplete": [False] * n})

    def compute(con: duckdb.DuckDBPyConnection) -> Iterator[tuple[str, pl.DataFrame]]:
        con.execute("BEGIN TRANSACTION")
        yield "miss_ledger", rows
        con.execute("COMMIT")
        wal_after_commit.append(sum(p.stat().st_size for p in tmp_path.glob(".*.wal")))

    analysis_db.build_analysis_db(db, lake, compute)
    assert len(wal_after_commit) == 1 and wal_after_commit[0] < 4096, wal_after_commit
    assert query("SELECT count(*), sum(blocks) FROM miss_ledger", db=db)[1][0] == (50_000, sum(range(50_000)))
