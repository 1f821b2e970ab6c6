"""kvlens/memory.py: an analysis given --memory-limit stops itself past it (kvlens serve's
--analyze-memory-limit), and leaves the previous analysis DB as it was."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import pytest

from kvlens.errors import MEMORY_EXIT, ConfigError, MemoryLimitError
from kvlens.memory import format_bytes, parse_size, resident_bytes

DEADLINE_S = 300


@pytest.mark.parametrize(("text", "size"), [
    ("4GiB", 4 << 30), ("4Gi", 4 << 30), ("512MiB", 512 << 20), ("512mib", 512 << 20), ("2G", 2 * 10**9),
    ("2GB", 2 * 10**9), ("1.5G", 1_500_000_000), ("64Ki", 65536), ("3000", 3000), ("3000B", 3000),
    (" 1 TiB ", 1 << 40), ("100k", 100_000),
])
def test_sizes_read_decimal_and_binary_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "four", "-1G", "0", "0.0001", "4 parsecs", "4GiBs", "1e9"])
def test_what_is_not_a_positive_size_is_refused_with_the_flag_named(text: str) -> None:
    with pytest.raises(ConfigError, match="--analyze-memory-limit"):
        parse_size(text, "--analyze-memory-limit")


def test_sizes_are_shown_in_binary_units() -> None:
    assert [format_bytes(n) for n in (512, 2048, 5 << 20, 512 << 20, int(4.5 * (1 << 30)))] == [
        "512 B", "2.0 KiB", "5.0 MiB", "512 MiB", "4.5 GiB"]


def test_the_resident_memory_is_this_processes() -> None:
    before = resident_bytes()
    held = bytearray(b"x" * (64 << 20))  # written, so resident
    assert resident_bytes() - before > 48 << 20
    del held


def _python(code: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter: the guard's signal and its end of the process are its own."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


# Grows the process 4 MiB at a time (written pages), up to 2 GiB over at least 5 s, pausing so that
# the watchdog runs even on a loaded machine. With ``CHECK``, each step is a safe point (``check``);
# with ``SWALLOW`` it keeps going after the stop, as code that catches the error would.
_GROW = """
import sys, time
import numpy as np
from kvlens import memory
from kvlens.errors import MemoryLimitError
from kvlens.memory import MemoryGuard, resident_bytes

held = []
guard = MemoryGuard(resident_bytes() + (96 << 20), grace_s={grace}, hard={hard})
try:
    with guard:
        while len(held) < 512:
            held.append(np.ones(1 << 19))
            time.sleep(0.01)
            try:
                if {check}:
                    memory.check()
            except MemoryLimitError:
                if not {swallow}:
                    raise
                print("swallowed", flush=True)
except MemoryLimitError as e:
    print("stopped after", len(held) * 4, "MiB:", e)
    print("peak over the limit by", (guard.peak - guard.limit) >> 20, "MiB")
    sys.exit(0)
print("never stopped", len(held) * 4, "MiB")
sys.exit(1)
"""


def test_past_the_limit_the_next_safe_point_stops_with_what_it_reached() -> None:
    got = _python(_GROW.format(grace=60, hard=100, check=True, swallow=False))
    assert got.returncode == 0, got.stdout + got.stderr
    grown = int(got.stdout.split("stopped after ")[1].split()[0])
    assert 96 <= grown < 2048  # stopped once past the limit, long before the loop's end
    assert "over --memory-limit" in got.stdout and "the previous analysis DB is unchanged" in got.stdout
    # soon after: the watchdog reads every 20 ms, the loop grows 4 MiB per 10 ms and checks each time
    assert int(got.stdout.split("by ")[1].split()[0]) < 1024


@pytest.mark.parametrize(("grace", "hard", "check", "why"), [
    (60, 1.5, True, "it reached"),  # safe points that swallow the stop: ended at 1.5 limits
    (1, 100, False, "no safe point came within 1 s"),  # no safe point at all: ended 1 s after the stop
])
def test_code_that_does_not_stop_is_ended_with_the_memory_status(grace: float, hard: float, check: bool,
                                                                  why: str) -> None:
    got = _python(_GROW.format(grace=grace, hard=hard, check=check, swallow=True))
    assert got.returncode == MEMORY_EXIT, got.stdout + got.stderr
    assert "never stopped" not in got.stdout and ("swallowed" in got.stdout) == check
    assert got.stderr.startswith("Error: resident memory reached") and f"; ended: {why}" in got.stderr


def test_under_the_limit_nothing_is_stopped_and_the_peak_is_measured() -> None:
    got = _python("""
        import numpy as np
        from kvlens import memory
        from kvlens.memory import MemoryGuard, resident_bytes
        with MemoryGuard(resident_bytes() + (1 << 30)) as guard:
            held = [np.ones(1 << 20) for _ in range(8)]  # 64 MiB
            import time; time.sleep(0.2)
            memory.check()
        print(guard.peak, guard.stopped_at)
    """)
    assert got.returncode == 0, got.stderr
    peak, stopped = got.stdout.split()
    assert int(peak) > 64 << 20 and stopped == "None"


def test_a_safe_point_outside_a_guard_stops_nothing() -> None:
    from kvlens import memory
    from kvlens.memory import MemoryGuard

    with MemoryGuard(1, hard=1 << 40) as guard:  # passed at its first reading
        deadline = time.monotonic() + DEADLINE_S
        while guard.stopped_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(MemoryLimitError):
            memory.check()
    memory.check()  # the guard is gone: nothing to stop


def test_an_analysis_past_its_limit_stops_between_tables_and_keeps_the_previous_db(
        tmp_path: Path, mooncake3: Path) -> None:
    from kvlens.analyzers.analyze import analyze_lake
    from kvlens.collector.imports import import_files
    from kvlens.memory import MemoryGuard

    lake, db = tmp_path / "lake", tmp_path / "kvlens.duckdb"
    import_files("mooncake", [mooncake3], lake, scenario="conv")
    analyze_lake(lake, db)
    before = _digest(db)
    # already past at the first reading; never ended (the test's process is not the command's)
    with pytest.raises(MemoryLimitError, match="over --memory-limit"), \
            MemoryGuard(resident_bytes() - 1, hard=1 << 20, grace_s=DEADLINE_S) as guard:
        analyze_lake(lake, db, full=True, memory_limit=resident_bytes())
    assert guard.stopped_at is not None
    assert _digest(db) == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".kvlens.duckdb.")], "leftovers"


def test_duckdb_gets_half_the_limit(tmp_path: Path) -> None:
    from kvlens.analysis_db import _connect

    con = _connect(tmp_path / "a.duckdb", 4 << 30)
    try:
        assert con.execute("SELECT current_setting('memory_limit')").fetchall() == [("2.0 GiB",)]
    finally:
        con.close()


def _kvlens(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlens.cli", *args], capture_output=True, text=True,
                          timeout=DEADLINE_S)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_command_past_its_limit_exits_3_and_the_next_build_clears_what_it_left(
        tmp_path: Path, mooncake3: Path) -> None:
    from kvlens.collector.imports import import_files

    lake, db = tmp_path / "lake", tmp_path / "kvlens.duckdb"
    import_files("mooncake", [mooncake3], lake, scenario="conv")
    first = _kvlens("analyze", "--lake", str(lake), "--db", str(db), "--full")
    assert first.returncode == 0, first.stderr
    before = _digest(db)
    # below what the interpreter and its imports hold, and past 1.5 times it: ended at once
    stopped = _kvlens("analyze", "--lake", str(lake), "--db", str(db), "--full", "--memory-limit", "64MiB")
    assert stopped.returncode == MEMORY_EXIT, stopped.stderr
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: resident memory reached") and "over --memory-limit 64 MiB" in last
    assert _digest(db) == before
    with duckdb.connect(str(db), read_only=True) as con:  # whole and readable
        assert con.execute("SELECT count(*) FROM block_outcomes").fetchall()[0][0] > 0
    # a limit it stays under: the same analysis as without one, and the ended build's file is gone
    roomy = _kvlens("analyze", "--lake", str(lake), "--db", str(db), "--full", "--memory-limit", "16GiB")
    assert roomy.returncode == 0, roomy.stderr
    # what it held at most, to choose a limit by: more than the interpreter with its imports
    peak = roomy.stderr.split("peak resident memory: ")[1].split(" (measured)")[0]
    assert peak.endswith("MiB") or peak.endswith("GiB")
    assert float(peak.split()[0]) * (1 if peak.endswith("MiB") else 1024) > 64
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".kvlens.duckdb.")], "leftovers"
    assert _digest(db) != before
    other = tmp_path / "plain.duckdb"
    assert _kvlens("analyze", "--lake", str(lake), "--db", str(other), "--full").returncode == 0
    with duckdb.connect(str(db), read_only=True) as a, duckdb.connect(str(other), read_only=True) as b:
        query = "SELECT * FROM block_outcomes ORDER BY ALL"
        assert a.execute(query).fetchall() == b.execute(query).fetchall()


def test_a_size_flag_that_is_not_a_size_is_one_error_line(tmp_path: Path) -> None:
    got = _kvlens("analyze", "--lake", str(tmp_path), "--db", str(tmp_path / "x.duckdb"),
                  "--memory-limit", "lots")
    assert got.returncode == 1
    assert got.stderr.startswith("Error:") and "--memory-limit 'lots' is not a size" in got.stderr


def test_serve_gives_each_analysis_the_limit_and_counts_its_stops(tmp_path: Path) -> None:
    from kvlens.serve import ANALYZE, ServeOptions, Serving, analyze_args

    opts = ServeOptions(config=str(tmp_path / "kvlens.toml"), lake=str(tmp_path / "lake"),
                        db=str(tmp_path / "db.duckdb"), analyze_memory_limit=3 << 30, export_port=None,
                        otlp_listen=None)
    args = analyze_args(opts)
    assert args[args.index("--memory-limit") + 1] == str(3 << 30)
    assert "--memory-limit" not in analyze_args(ServeOptions(config="c", lake="l", db="d"))
    (tmp_path / "kvlens.toml").write_text("")
    serving = Serving(opts, specs=())
    for status in (0, MEMORY_EXIT, 1):
        serving._analysis_done(status, 0.0)
    m = serving.metrics
    assert [m.value("kvlens_serve_analyses_total", result=r) for r in ("ok", "over_memory_limit", "failed")] \
        == [1, 1, 1]
    assert m.value("kvlens_serve_child_last_exit_status", child=ANALYZE) == 1
