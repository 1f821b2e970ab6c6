"""``kvlens analyze --out-of-core`` (analyzers/out_of_core.py, issue 17): the ledger computed one
block-hash partition and one range of requests at a time equals the one-process ledger, row for row
and in the same order, on every lake it accepts (real engines' requests, admitted at their own stores
replica by replica, included); it refuses the others before writing anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from capture_lines import capture_lake
from click.testing import CliRunner
from ooc_harness import AFTER_LEDGER, DATA, same_tables
from scale_lake import ScaleFleet, write_scale_lake
from test_leftovers import _dead_pid, _tmp_of
from test_partitions import _no_ray_left, _ray_processes

from kvlens.analyzers.analyze import analyze_lake
from kvlens.analyzers.out_of_core import OutOfCore
from kvlens.cli import cli
from kvlens.errors import ConfigError
from kvlens.lake import open_lake, write_scenario

# The tables out of core writes; scenarios' analyzed_ns is the wall clock of each analysis.
LEDGER = {"block_outcomes": "*", "request_ledger": "*", "miss_ledger": "*",
          "scenarios": "* EXCLUDE (analyzed_ns)"}


def _ledger_rows(db: Path, tables: dict[str, str]) -> dict[str, list[tuple]]:
    with duckdb.connect(str(db), read_only=True) as con:
        rows = {t: con.execute(f"SELECT {c} FROM {t} ORDER BY ALL").fetchall() for t, c in tables.items()}
        # block_outcomes' own order, scenario by scenario (a DB may hold them in another order)
        order = con.execute("SELECT scenario, request_id, position FROM block_outcomes").fetchall()
        rows["order"] = sorted(order, key=lambda row: row[0])  # (a stable sort)
    return rows


def _same_ledger(got: Path, want: Path, tables: dict[str, str] = LEDGER) -> dict[str, int]:
    a, b = _ledger_rows(got, tables), _ledger_rows(want, tables)
    for table in a:
        assert len(a[table]) == len(b[table]), f"{table}: {len(a[table])} rows, in memory {len(b[table])}"
        for x, y in zip(a[table], b[table], strict=True):
            assert x == y, f"{table}: {x} != {y}"
    return {t: len(rows) for t, rows in a.items()}


@pytest.mark.parametrize(("name", "scenarios", "per_range"), [
    ("simulated", (), 97), ("capture", (), 97), ("hybrid", (), 97), ("hand", ("clear",), 2),
    ("anchored", (), 97)])
@pytest.mark.parametrize("partitions", [1, 3, 16])
def test_out_of_core_equals_the_one_process_ledger(ooc_lakes: dict[str, Path], tmp_path: Path, name: str,
                                                   scenarios: tuple[str, ...], per_range: int,
                                                   partitions: int) -> None:
    """Every partition count, with ranges of a few requests: the same rows as a full analysis, and
    block_outcomes in the same order (look-up order); ``anchored``'s requests are a real engine's,
    admitted at their own stores."""
    lake = ooc_lakes[name]
    analyze_lake(lake, tmp_path / "memory.duckdb", scenarios, full=True)
    result = analyze_lake(lake, tmp_path / "ooc.duckdb", scenarios,
                          out_of_core=OutOfCore(partitions=partitions, rows_per_range=per_range))
    counts = _same_ledger(tmp_path / "ooc.duckdb", tmp_path / "memory.duckdb")
    assert counts["block_outcomes"] > 0 and counts["request_ledger"] > 0
    for _, mode, why in result.modes:
        assert mode == "full" and f"in {partitions} block-hash partitions" in why
    # several ranges of requests were decided
    assert any(int(why.split(" ranges")[0].rsplit(" ", 1)[1]) > 1 for _, _, why in result.modes)
    assert not list(tmp_path.glob(".*.ooc")), "the spill directory is removed"


def test_out_of_core_on_the_demo_lake(demo_workdir: Path, tmp_path: Path) -> None:
    """The demo's what-ifs (the trace on 8 replicas under three routings, the agents on 4 with a
    pool), cut by the default plan: the ledger tables of ``make demo``'s own analysis (which was
    given the models the requests name: its scenarios rows say so), and every analysis after it."""
    with duckdb.connect(str(demo_workdir / "kvlens.duckdb"), read_only=True) as con:
        analyzed = [r[0] for r in con.execute("SELECT scenario FROM scenarios ORDER BY 1").fetchall()]
    result = analyze_lake(demo_workdir / "lake", tmp_path / "ooc.duckdb", analyzed, out_of_core=OutOfCore())
    counts = _same_ledger(tmp_path / "ooc.duckdb", demo_workdir / "kvlens.duckdb",
                          {**LEDGER, "scenarios": "* EXCLUDE (analyzed_ns, model_source)"})
    assert counts["block_outcomes"] > 1_000_000 and counts["scenarios"] == len(result.scenarios) == 4
    counts = same_tables(tmp_path / "ooc.duckdb", demo_workdir / "kvlens.duckdb")
    # every analysis the demo's scenarios have rows of (reconciliation: the engines' scrapes, none)
    assert all(counts[table] > 0 for table in AFTER_LEDGER if table != "reconciliation"), counts


def test_out_of_core_on_a_generated_fleet(tmp_path: Path) -> None:
    """The benchmark's generated fleet (tests/scale_lake.py), small and with small caches: evictions,
    routing misses and batches of events with one time and batch number, in 7 partitions."""
    lake = tmp_path / "lake"
    fleet = ScaleFleet(replicas=4, capacity=700, prefixes=400)
    write_scale_lake(lake, 40_000, fleet=fleet, chunk_requests=150)
    analyze_lake(lake, tmp_path / "memory.duckdb", full=True)
    analyze_lake(lake, tmp_path / "ooc.duckdb", out_of_core=OutOfCore(partitions=7, rows_per_range=5_000))
    counts = _same_ledger(tmp_path / "ooc.duckdb", tmp_path / "memory.duckdb")
    assert counts["block_outcomes"] >= 40_000
    with duckdb.connect(str(tmp_path / "ooc.duckdb"), read_only=True) as con:
        rows = con.execute("SELECT outcome FROM miss_ledger WHERE blocks > 100").fetchall()
    outcomes = {outcome for (outcome,) in rows}
    assert {"hit_local", "miss_evicted", "miss_routing", "miss_cold"} <= outcomes


@pytest.mark.parametrize(("name", "scenario", "said"), [
    ("hand", "hand", "namespaces"),
])
def test_out_of_core_refuses_what_it_cannot_compute(ooc_lakes: dict[str, Path], tmp_path: Path, name: str,
                                                    scenario: str, said: str) -> None:
    """Two namespaces (content maps): one error naming the scenario and the way out, and nothing left
    beside the DB."""
    with pytest.raises(ConfigError, match=f"scenario {scenario} cannot be analyzed out of core: .*{said}"
                                          ".*without --out-of-core"):
        analyze_lake(ooc_lakes[name], tmp_path / "ooc.duckdb", [scenario], out_of_core=OutOfCore())
    assert list(tmp_path.iterdir()) == []


def test_out_of_core_from_the_cli(ooc_lakes: dict[str, Path], tmp_path: Path) -> None:
    db = tmp_path / "ooc.duckdb"
    run = CliRunner().invoke(cli, ["analyze", "--lake", str(ooc_lakes["simulated"]), "--db", str(db),
                                   "--out-of-core", "--partitions", "2", "--memory-limit", "2GiB"])
    assert run.exit_code == 0, run.output
    assert "rr2: full (--out-of-core given; ledger out of core in 2 block-hash partitions" in run.output
    assert "peak resident memory:" in run.output
    # The next analysis saves nothing it could continue from: it analyzes in full, every table.
    again = CliRunner().invoke(cli, ["analyze", "--lake", str(ooc_lakes["simulated"]), "--db", str(db)])
    assert again.exit_code == 0, again.output
    assert "rr2: full" in again.output
    with duckdb.connect(str(db), read_only=True) as con:
        ((flows,),) = con.execute("SELECT count(*) FROM flows WHERE scenario = 'rr2'").fetchall()
    assert flows > 0


def test_a_killed_runs_spill_is_removed_by_the_next(ooc_lakes: dict[str, Path], tmp_path: Path) -> None:
    """A run killed mid-way leaves its spill directory (named as its temporary DB is, with its
    process id): the next build of the same DB removes it (kvlens.analysis_db.remove_dead_leftovers)."""
    db = tmp_path / "ooc.duckdb"
    dead = tmp_path / (_tmp_of(_dead_pid(), db.name) + ".ooc")
    (dead / "rows" / "part=0").mkdir(parents=True)
    (dead / "rows" / "part=0" / "data_0.parquet").write_bytes(b"half a spill")
    analyze_lake(ooc_lakes["simulated"], db, out_of_core=OutOfCore())
    assert not dead.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [db.name]


@pytest.mark.parametrize("flags", [["--join", "conv"]])
def test_out_of_core_refuses_flags_it_does_not_use(ooc_lakes: dict[str, Path], tmp_path: Path,
                                                   flags: list[str]) -> None:
    run = CliRunner().invoke(cli, ["analyze", "--lake", str(ooc_lakes["simulated"]), "--db",
                                   str(tmp_path / "x.duckdb"), "--out-of-core", *flags])
    assert run.exit_code != 0
    assert f"{flags[0]} cannot go with --out-of-core" in run.output
    assert not (tmp_path / "x.duckdb").exists()


def _two_replicas(lake: Path, out: Path, *, offset_ns: int, interleave: bool = False,
                  pool_every: int = 0) -> Path:
    """``lake``'s one-replica capture as a fleet of two, into ``out`` (a lake): ``replica-b`` replays
    ``replica-a``'s requests (ids suffixed ``-b``) and events ``offset_ns`` later. ``interleave``: each
    batch's rows alternate between the two replicas in one segment (with offset 0: two batches of one
    time and batch number, which admission reads one replica at a time); ``pool_every``: replica-b's
    batches whose number is a multiple of it are the shared pool's (pool-medium events)."""
    con = duckdb.connect()
    try:
        open_lake(con, lake)
        con.execute("SET preserve_insertion_order = true")
        tables = {}
        for name in ("requests", "request_blocks", "kv_events"):
            columns = [r[0] for r in con.execute(f"DESCRIBE {name}").fetchall() if r[0] != "scenario"]
            moved = {"request_id": "request_id || '-b'", "replica": "'replica-b'",
                     "arrival_ns": f"arrival_ns + {offset_ns}", "ts_ns": f"ts_ns + {offset_ns}",
                     "medium": f"CASE WHEN {pool_every} > 0 AND seq % {max(pool_every, 1)} = 0 THEN 'pool' "
                               "ELSE medium END"}
            a = ", ".join(columns)
            b = ", ".join(f"{moved[c]} AS {c}" if c in moved else c for c in columns)
            if name != "kv_events":
                both = f"SELECT {a} FROM {name} UNION ALL SELECT {b} FROM {name}"
                tables[name] = con.sql(both).arrow().read_all()
                continue
            rows = "(SELECT *, row_number() OVER () AS n FROM kv_events)"
            at = "row_number() OVER (PARTITION BY ts_ns, seq ORDER BY n) AS k"  # the row's place in its batch
            tables[name] = con.sql(f"""
                SELECT {a} FROM (SELECT {a}, {at}, 0 AS r FROM {rows}
                                 UNION ALL SELECT {b}, {at}, 1 AS r FROM {rows})
                ORDER BY ts_ns, seq, {"k, r" if interleave else "r, k"}""").arrow().read_all()
    finally:
        con.close()
    write_scenario(out, "capture", tables, writer_id="two-replicas")
    return out


@pytest.fixture(scope="module")
def real_lakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real vLLM captures, whose requests admission anchors at their own stores: chunked prefill under
    memory pressure, a hybrid model (a sliding window group) preempting, and one serving clients
    concurrently; and fleets of two replicas made of them (``_two_replicas``): the concurrent hybrid
    capture's batches interleaved with a copy's, and the concurrent capture beside a copy 1 ms later
    that publishes some batches to the shared pool."""
    tmp = tmp_path_factory.mktemp("real")
    lakes = {name: capture_lake(DATA / capture, tmp_path_factory.mktemp(name), model)
             for name, capture, model in (
        ("chunked", "vllm-chunked-capture", "tiny"),
        ("preempting-hybrid", "vllm-preempting-hybrid-capture", "tiny-gemma2"),
        ("concurrent-hybrid", "vllm-concurrent-hybrid-capture", "tiny-gemma2"),
        ("concurrent", "vllm-concurrent-capture", "tiny"))}
    lakes["two-interleaved"] = _two_replicas(lakes["concurrent-hybrid"], tmp / "two-interleaved",
                                             offset_ns=0, interleave=True)
    lakes["two-with-pool"] = _two_replicas(lakes.pop("concurrent"), tmp / "two-with-pool",
                                           offset_ns=1_000_003, pool_every=4)
    return lakes


@pytest.mark.parametrize(("name", "partitions"), [
    ("chunked", 3), ("preempting-hybrid", 16), ("concurrent-hybrid", 1), ("two-interleaved", 3),
    ("two-with-pool", 3)])
def test_out_of_core_admits_a_real_engines_requests(real_lakes: dict[str, Path], tmp_path: Path, name: str,
                                                    partitions: int) -> None:
    """Admission at the requests' own stores, computed one replica at a time, gives the one-process
    ledger's rows: where its rules matter (the time rule differs on each of these lakes), on two
    replicas whose batches interleave in the stream (barrier rows keep their rows apart), and with a
    shared pool's events between a request's time and its run (its cut falls back to its time)."""
    lake = real_lakes[name]
    analyze_lake(lake, tmp_path / "memory.duckdb", full=True)
    result = analyze_lake(lake, tmp_path / "ooc.duckdb",
                          out_of_core=OutOfCore(partitions=partitions, rows_per_range=1_500))
    counts = _same_ledger(tmp_path / "ooc.duckdb", tmp_path / "memory.duckdb")
    assert counts["request_ledger"] >= 360
    for _, mode, why in result.modes:
        assert mode == "full" and f"in {partitions} block-hash partitions" in why
    assert not list(tmp_path.glob(".*.ooc")), "the spill directory is removed"


def test_out_of_core_on_ray(ooc_lakes: dict[str, Path], tmp_path: Path) -> None:
    """``kvlens analyze --out-of-core --ray``: phase 1's partitions run as Ray tasks on a local
    cluster the command starts, each reading its rows from the spill directory and writing its
    states there (a worker reads them, not the driver): every table equals the one-process
    analysis', and no Ray process outlives the command."""
    pytest.importorskip("ray", reason="the ray extra is installed by make test")
    lake = ooc_lakes["anchored"]
    analyze_lake(lake, tmp_path / "memory.duckdb", full=True)
    before = _ray_processes()
    done = subprocess.run([sys.executable, "-m", "kvlens.cli", "analyze", "--lake", str(lake), "--db",
                           str(tmp_path / "ooc.duckdb"), "--out-of-core", "--ray", "--partitions", "3"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    cpus = os.cpu_count() or 1
    said = f"in 3 block-hash partitions on Ray (local cluster, {cpus} CPUs)"
    assert said in done.stderr, done.stderr[-3000:]
    counts = _same_ledger(tmp_path / "ooc.duckdb", tmp_path / "memory.duckdb")
    assert counts["block_outcomes"] > 0
    assert same_tables(tmp_path / "ooc.duckdb", tmp_path / "memory.duckdb")["reuse"] > 0
    assert not list(tmp_path.glob(".*.ooc")), "the spill directory is removed"
    _no_ray_left(before)
