"""Tests for kvlens/lake.py: segments, partitions, checkpoints, replace, views, compact."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import kvlens.compact as compact_module
from kvlens.compact import compact, drop_old_days, parse_keep_days
from kvlens.errors import ConfigError, SchemaVersionError
from kvlens.lake import SegmentWriter, latest_checkpoint, open_lake, segment_files
from kvlens.schema import LAKE_TABLES, TABLES

DAY = 86_400 * 10**9


def _views(lake: Path) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    open_lake(con, lake)
    return con


def test_empty_lake_has_typed_views_for_every_table(tmp_path: Path) -> None:
    SegmentWriter(tmp_path, "requests")  # creates the lake marker only
    con = _views(tmp_path)
    for table in LAKE_TABLES:
        described = con.execute(f"DESCRIBE {table.name}").fetchall()
        assert [r[0] for r in described] == list(table.names)
        assert con.execute(f"SELECT count(*) FROM {table.name}").fetchone() == (0,)
    kinds = dict((r[0], r[1]) for r in con.execute("DESCRIBE kv_events").fetchall())
    assert kinds["kind"].startswith("ENUM(") and kinds["block_hash"] == "UBIGINT"


def test_rows_columns_and_arrow_land_with_nulls_for_missing_columns(tmp_path: Path) -> None:
    with SegmentWriter(tmp_path, "kv_events", scenario="s1") as w:
        w.append_rows([{"ts_ns": 5, "kind": "stored", "block_hash": 2**64 - 1, "medium": "gpu"}])
        w.append_columns({"ts_ns": [6, 7], "kind": ["removed", "cleared"], "replica": ["a", "b"]})
        w.append_arrow(pa.table({"ts_ns": pa.array([8], pa.int64()), "kind": ["stored"]}))
    rows = _views(tmp_path).execute(
        "SELECT ts_ns, kind, block_hash, replica, scenario FROM kv_events ORDER BY ts_ns").fetchall()
    assert rows == [(5, "stored", 2**64 - 1, None, "s1"), (6, "removed", None, "a", "s1"),
                    (7, "cleared", None, "b", "s1"), (8, "stored", None, None, "s1")]


def test_a_segment_written_before_a_column_existed_reads_it_as_null(tmp_path: Path) -> None:
    """Segments of one schema are read by position (one footer per bind); a segment without a
    column (written before the schema had it) makes the view match columns by name, NULL there."""
    from kvlens.lake import _view_sql

    for n in (1, 2):
        with SegmentWriter(tmp_path, "kv_events", scenario="s1") as w:
            w.append_rows([{"ts_ns": n, "kind": "stored", "replica": f"r{n}", "extra_key": f"salt{n}"}])
    table = TABLES["kv_events"]
    con = _views(tmp_path)
    assert "union_by_name = false" in _view_sql(con, tmp_path, table)
    old = segment_files(tmp_path, "kv_events")[0]
    older = pq.read_table(old).drop_columns(["extra_key"])
    pq.write_table(older, old.with_name("w-older.parquet"))
    assert "union_by_name = true" in _view_sql(con, tmp_path, table)
    rows = _views(tmp_path).execute("SELECT ts_ns, replica, extra_key FROM kv_events ORDER BY ALL").fetchall()
    assert rows == [(1, "r1", "salt1"), (1, "r1", None), (2, "r2", "salt2")]  # NULLs sort last


def test_unknown_column_is_refused(tmp_path: Path) -> None:
    w = SegmentWriter(tmp_path, "requests")
    with pytest.raises(ValueError, match="no column"):
        w.append_columns({"request_id": ["a"], "prompt_tokenz": [1]})


def test_flush_by_row_count_bounds_the_buffer(tmp_path: Path) -> None:
    w = SegmentWriter(tmp_path, "requests", flush_rows=100)
    peak = 0
    for i in range(10):
        w.append_columns({"request_id": [f"r{i}-{j}" for j in range(30)], "arrival_ns": [0] * 30})
        peak = max(peak, w.buffered_rows)
    w.commit()
    assert peak < 100
    assert w.rows_written == 300
    assert len(segment_files(tmp_path, "requests")) == 3  # 120, 120 flushed at 100+; then 60


def test_flush_by_age_uses_the_injected_clock(tmp_path: Path) -> None:
    now = [0.0]
    w = SegmentWriter(tmp_path, "requests", flush_rows=10**6, flush_age_s=5.0, clock=lambda: now[0])
    w.append_rows([{"request_id": "a", "arrival_ns": 0}])
    assert w.segments_written == 0
    now[0] = 4.9
    assert not w.maybe_flush()
    now[0] = 5.0
    w.append_rows([{"request_id": "b", "arrival_ns": 0}])
    assert w.segments_written == 1 and w.buffered_rows == 0


def test_rows_are_partitioned_by_utc_date(tmp_path: Path) -> None:
    with SegmentWriter(tmp_path, "requests", scenario="x") as w:
        w.append_columns({"request_id": ["a", "b", "c"], "arrival_ns": [0, DAY + 1, DAY * 365]})
    dates = sorted(p.parent.name for p in segment_files(tmp_path, "requests"))
    assert dates == ["date=1970-01-01", "date=1970-01-02", "date=1971-01-01"]


def test_segments_carry_checkpoints_and_the_newest_wins(tmp_path: Path) -> None:
    w = SegmentWriter(tmp_path, "kv_events", scenario="live", writer_id="col-a")
    assert latest_checkpoint(tmp_path, "col-a") is None
    w.append_rows([{"ts_ns": 1, "kind": "stored"}])
    w.flush({"seq": {"pub1": 10}})
    w.append_rows([{"ts_ns": 2, "kind": "stored"}])
    w.flush({"seq": {"pub1": 11}})
    other = SegmentWriter(tmp_path, "requests", scenario="live", writer_id="col-b")
    other.flush({"mine": True})  # an empty segment still records a checkpoint
    assert latest_checkpoint(tmp_path, "col-a") == {"seq": {"pub1": 11}}
    assert latest_checkpoint(tmp_path, "col-b") == {"mine": True}
    # A restarted writer with the same id keeps naming segments after the old ones.
    again = SegmentWriter(tmp_path, "kv_events", scenario="live", writer_id="col-a")
    again.append_rows([{"ts_ns": 3, "kind": "stored"}])
    again.flush({"seq": {"pub1": 12}})
    assert latest_checkpoint(tmp_path, "col-a") == {"seq": {"pub1": 12}}


def test_replace_swaps_a_scenario_whole_and_abort_leaves_it(tmp_path: Path) -> None:
    def load(ids: list[str]) -> None:
        with SegmentWriter(tmp_path, "requests", scenario="imp", replace=True) as w:
            w.append_columns({"request_id": ids, "arrival_ns": [0] * len(ids)})

    load(["a", "b"])
    load(["c"])
    con = _views(tmp_path)
    assert con.execute("SELECT list(request_id) FROM requests").fetchone() == (["c"],)
    with pytest.raises(RuntimeError), SegmentWriter(tmp_path, "requests", scenario="imp", replace=True) as w:
        w.append_columns({"request_id": ["d"] * 5, "arrival_ns": [0] * 5})
        w.flush()  # staged, not committed
        raise RuntimeError("killed")
    con = _views(tmp_path)
    assert con.execute("SELECT list(request_id) FROM requests").fetchone() == (["c"],)
    assert not any((tmp_path / ".staging").glob("**/*.parquet"))


def test_appending_writers_do_not_touch_other_scenarios(tmp_path: Path) -> None:
    with SegmentWriter(tmp_path, "requests", scenario="a", replace=True) as w:
        w.append_rows([{"request_id": "x", "arrival_ns": 0}])
    with SegmentWriter(tmp_path, "requests", scenario="b") as w:
        w.append_rows([{"request_id": "y", "arrival_ns": 0}])
    rows = _views(tmp_path).execute("SELECT scenario, request_id FROM requests ORDER BY 1").fetchall()
    assert rows == [("a", "x"), ("b", "y")]


def test_segment_metadata_names_schema_version_and_writer(tmp_path: Path) -> None:
    with SegmentWriter(tmp_path, "requests", writer_id="w1") as w:
        w.append_rows([{"request_id": "x", "arrival_ns": 0}])
    meta = pq.read_schema(segment_files(tmp_path, "requests")[0]).metadata
    assert meta[b"kvlens.writer"] == b"w1" and meta[b"kvlens.schema_version"] == b"1"
    assert "scenario" not in pq.read_schema(segment_files(tmp_path, "requests")[0]).names


def test_lake_of_another_schema_version_is_refused(tmp_path: Path) -> None:
    SegmentWriter(tmp_path, "requests")
    (tmp_path / "_kvlens.json").write_text(json.dumps({"schema_version": 999}))
    with pytest.raises(SchemaVersionError, match="v999"):
        open_lake(duckdb.connect(), tmp_path)


def test_bad_names_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="scenario"):
        SegmentWriter(tmp_path, "requests", scenario="../escape")
    with pytest.raises(ConfigError, match="analysis table"):
        SegmentWriter(tmp_path, "miss_ledger")
    with pytest.raises(ConfigError, match="does not exist"):
        open_lake(duckdb.connect(), tmp_path / "nope")


def test_compact_merges_closed_days_keeps_rows_and_checkpoint(tmp_path: Path) -> None:
    w = SegmentWriter(tmp_path, "kv_events", scenario="live", writer_id="c")
    for i in range(4):
        w.append_rows([{"ts_ns": i, "kind": "stored", "block_hash": i}])
        w.flush({"seq": i})
    w.append_rows([{"ts_ns": 40 * DAY, "kind": "stored"}])  # today's partition stays as it is
    w.flush({"seq": 9})
    counts = compact(tmp_path, today="1970-02-10")
    assert counts == {"segments_written": 1, "segments_replaced": 4}
    files = segment_files(tmp_path, "kv_events")
    assert len(files) == 2
    con = _views(tmp_path)
    assert con.execute("SELECT sum(block_hash), count(*) FROM kv_events").fetchone() == (6, 5)
    assert latest_checkpoint(tmp_path, "c") == {"seq": 9}


def test_retention_drops_whole_old_days_keeps_checkpoints_and_today(tmp_path: Path) -> None:
    # days 0..40 of 1970 (1970-01-01 .. 1970-02-10) in two tables and two scenarios
    for scenario in ("live", "conv"):
        kv = SegmentWriter(tmp_path, "kv_events", scenario=scenario, writer_id="live-a")
        reqs = SegmentWriter(tmp_path, "requests", scenario=scenario, writer_id="imp")
        for day in (1, 5, 30, 31, 40):
            kv.append_rows([{"ts_ns": day * DAY + 7, "kind": "stored", "block_hash": day}])
            kv.flush({"seq": day})
            reqs.append_rows([{"request_id": f"{scenario}-{day}", "arrival_ns": day * DAY + 9}])
            reqs.flush()
        kv.flush({"seq": 99})  # an empty segment: the checkpoint only, dated 1970-01-01
    counts = drop_old_days(tmp_path, 10, scenarios=("live",), today="1970-02-10")
    # today is day 40; days before day 30 (1970-01-31) go: 2 days x 2 tables of scenario live
    assert counts == {"days_dropped": 2, "partitions_dropped": 4, "segments_dropped": 4}
    con = _views(tmp_path)
    got = con.execute("SELECT scenario, list(block_hash ORDER BY block_hash) FROM kv_events "
                      "GROUP BY 1 ORDER BY 1").fetchall()
    assert got == [("conv", [1, 5, 30, 31, 40]), ("live", [30, 31, 40])]
    assert con.execute("SELECT count(*) FROM requests WHERE scenario = 'live'").fetchone() == (3,)
    assert latest_checkpoint(tmp_path, "live-a") == {"seq": 99}  # the checkpoint segment stayed
    assert not (tmp_path / "requests" / "scenario=live" / "date=1970-01-06").exists()
    assert not list(tmp_path.glob(".staging/*")) and not list(tmp_path.glob(".trash/*"))
    assert drop_old_days(tmp_path, 10, scenarios=("live",), today="1970-02-10")["days_dropped"] == 0
    assert drop_old_days(tmp_path, 1, today="1970-02-10")["days_dropped"] == 4  # conv too; never today
    assert con.execute("SELECT list(DISTINCT block_hash) FROM kv_events").fetchone() == ([40],)


def test_retention_keeps_what_a_writer_adds_to_an_old_day_while_it_drops_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Retention lists a day's segments, then commits their removal. A writer adding a segment to
    # that day in between (a request that ended after midnight; a checkpoint: checkpoint-only
    # segments are dated 1970-01-01, a day every retention drops) keeps it: the commit removes the
    # segments listed, not the partition (before, the partition was swapped out whole).
    kv = SegmentWriter(tmp_path, "kv_events", scenario="live", writer_id="live-a")
    for day in (1, 2, 30):
        kv.append_rows([{"ts_ns": day * DAY + 7, "kind": "stored", "block_hash": day}])
        kv.flush({"seq": day})
    kv.flush({"seq": 50})  # a checkpoint-only segment, dated 1970-01-01
    real_swap = compact_module.swap_in

    def writer_meanwhile(root: Path, pairs: list[tuple[Path | None, Path]]) -> None:
        if not late_written:  # the first day's commit (1970-01-02): a segment lands in that day
            late = SegmentWriter(tmp_path, "kv_events", scenario="live", writer_id="live-a")
            late.append_rows([{"ts_ns": 1 * DAY + 9, "kind": "stored", "block_hash": 1000}])
            late.flush({"seq": 60})
            late.flush({"seq": 61})  # and a newer checkpoint-only segment
            late_written.append(True)
        real_swap(root, pairs)

    late_written: list[bool] = []

    monkeypatch.setattr(compact_module, "swap_in", writer_meanwhile)
    counts = drop_old_days(tmp_path, 10, today="1970-02-10")
    assert counts == {"days_dropped": 2, "partitions_dropped": 2, "segments_dropped": 2}
    con = _views(tmp_path)
    got = con.execute("SELECT list(block_hash ORDER BY block_hash) FROM kv_events").fetchone()
    assert got == ([30, 1000],)
    assert latest_checkpoint(tmp_path, "live-a") == {"seq": 61}
    assert not list(tmp_path.glob(".staging/*")) and not list(tmp_path.glob(".trash/*"))


def test_retention_drops_a_merged_segments_record_with_it(tmp_path: Path) -> None:
    # A merged segment of the current day carries a hidden record of the segments it replaced
    # (compact.sidecar); once its day is dropped, the record goes in the same commit.
    kv = SegmentWriter(tmp_path, "kv_events", scenario="live", writer_id="live-a")
    for i in range(3):
        kv.append_rows([{"ts_ns": 3 * DAY + i, "kind": "stored", "block_hash": i}])
        kv.flush({"seq": i})
    assert compact(tmp_path, today="1970-01-04", current=True)["segments_replaced"] == 3
    day = tmp_path / "kv_events" / "scenario=live" / "date=1970-01-04"
    assert len(list(day.glob(".*.sources"))) == 1
    assert drop_old_days(tmp_path, 1, today="1970-01-10")["segments_dropped"] == 1
    assert not day.exists()


@pytest.mark.parametrize("text", ["0d", "30", "1w", "-3d"])
def test_keep_takes_whole_days(text: str) -> None:
    with pytest.raises(ConfigError, match="whole days"):
        parse_keep_days(text)
    assert parse_keep_days("30d") == 30


def test_every_lake_table_round_trips_its_declared_types(tmp_path: Path) -> None:
    sample = {"BIGINT": 1, "UBIGINT": 2**63 + 5, "INTEGER": 7, "DOUBLE": 1.5, "BOOLEAN": True,
              "VARCHAR": "v", "MAP(VARCHAR, VARCHAR)": [("k", "v")], "INTEGER[]": [1, 2]}
    for table in LAKE_TABLES:
        row = {c.name: (c.enum and next(iter(c.enum)).value) or sample[c.type]
               for c in table.file_columns}
        with SegmentWriter(tmp_path, table.name, scenario="t") as w:
            w.append_rows([row])
    con = _views(tmp_path)
    for table in LAKE_TABLES:
        got = con.execute(f"SELECT * FROM {table.name}").fetchone()
        assert got is not None
        for col, value in zip(table.names, got, strict=True):
            c = TABLES[table.name].column(col)
            if col == "scenario":
                assert value == "t"
            elif c.type.startswith("MAP"):
                assert value == {"k": "v"}
            elif c.enum:
                assert value == next(iter(c.enum)).value
            else:
                assert value == sample[c.type], (table.name, col)


def test_recover_leaves_a_live_commit_alone_and_undoes_a_dead_one(tmp_path: Path) -> None:
    import json as _json
    import os

    from kvlens.commit import recover, staging_token

    with SegmentWriter(tmp_path, "requests", scenario="s", replace=True) as w:
        w.append_rows([{"request_id": "old", "arrival_ns": 0}])
    final = tmp_path / "requests" / "scenario=s"
    staged = tmp_path / ".staging" / "x" / "requests" / "scenario=s"
    staged.parent.mkdir(parents=True)
    trash = tmp_path / ".trash" / "t" / "0"
    trash.parent.mkdir(parents=True)
    os.replace(final, trash)  # a commit that died after moving the old rows aside
    entries = [{"staged": str(staged), "final": str(final), "trash": str(trash), "had_old": True}]
    journal_dir = tmp_path / ".journal"
    journal_dir.mkdir(exist_ok=True)
    live = journal_dir / f"{staging_token()}.json"  # this process: alive
    live.write_text(_json.dumps({"entries": entries}))
    assert recover(tmp_path) == 0 and live.exists() and not final.exists()
    dead = journal_dir / (live.stem.rsplit("-", 2)[0] + "-999999999-deadbeef.json")  # no such pid
    live.rename(dead)
    assert recover(tmp_path) == 1 and not dead.exists()
    con = duckdb.connect()
    open_lake(con, tmp_path)
    assert con.execute("SELECT list(request_id) FROM requests").fetchone() == (["old"],)


def test_a_writer_counts_the_bytes_of_the_segments_it_committed(tmp_path: Path) -> None:
    """What the live collector's written_bytes metric reads, instead of the writer's private paths."""
    with SegmentWriter(tmp_path / "lake", "kv_events", writer_id="w") as w:
        for seq in range(3):
            w.append_rows([{"ts_ns": 1_735_689_600 * 10**9, "recv_ns": 1, "replica": "r", "seq": seq,
                            "kind": "stored", "block_hash": seq + 1}])
            w.flush()
    files = segment_files(tmp_path / "lake", "kv_events")
    assert len(files) == w.segments_written == 3
    assert w.bytes_written == sum(Path(f).stat().st_size for f in files) > 0


# -- the current day's compaction (kvlens compact --today, kvlens analyze --compact) ----------


def _flushes(lake: Path, writer: str, n: int, *, start: int = 0, seq0: int = 0) -> None:
    """``n`` segments of one row each from ``writer``, as a live collector's flushes write them."""
    w = SegmentWriter(lake, "kv_events", scenario="live", writer_id=writer)
    for i in range(start, start + n):
        w.append_rows([{"ts_ns": 40 * DAY + i, "kind": "stored", "block_hash": i, "replica": writer}])
        w.flush({"seq": seq0 + i})


def _scan(lake: Path) -> list[tuple[object, ...]]:
    return _views(lake).execute("SELECT replica, block_hash FROM kv_events").fetchall()


def test_compact_today_merges_each_writers_run_keeping_order_rows_and_checkpoints(tmp_path: Path) -> None:
    from kvlens.compact import merged_segments, sidecar

    _flushes(tmp_path, "a", 5)
    _flushes(tmp_path, "b", 3, start=100)
    before = _scan(tmp_path)
    sizes = {f.name: f.stat().st_size for f in segment_files(tmp_path, "kv_events")}
    assert compact(tmp_path, today="1970-02-10") == {"segments_written": 0, "segments_replaced": 0}
    counts = compact(tmp_path, today="1970-02-10", current=True)
    assert counts == {"segments_written": 2, "segments_replaced": 8}
    files = segment_files(tmp_path, "kv_events")
    assert [f.name for f in files] == [sorted(n for n in sizes if n.startswith(w))[-1] for w in "ab"]
    assert _scan(tmp_path) == before  # the same rows, in the order a scan returned them
    assert latest_checkpoint(tmp_path, "a") == {"seq": 4} and latest_checkpoint(tmp_path, "b") == {"seq": 102}
    merged = merged_segments(tmp_path)
    assert set(merged) == {str(f.relative_to(tmp_path)) for f in files}
    for f in files:
        m = merged[str(f.relative_to(tmp_path))]
        writer = f.name.split("-")[0]
        assert [Path(s.path).name for s in m.sources] == sorted(n for n in sizes if n.startswith(writer))
        assert [s.size for s in m.sources] == [sizes[Path(s.path).name] for s in m.sources]
        assert all(s.oldest_ns == s.newest_ns for s in m.sources)  # one row each, timed
        assert sidecar(f).exists() and not sidecar(f).name.endswith(".parquet")
    # more flushes, as large together as the merged one: merged again; the sidecar lists the merged
    # one as itself, its own list nested in it, and the 5 new ones: 10 original segments
    first = merged[str(files[0].relative_to(tmp_path))]
    _flushes(tmp_path, "a", 5, start=5)
    assert compact(tmp_path, today="1970-02-10", current=True)["segments_replaced"] == 6
    (a,) = [f for f in segment_files(tmp_path, "kv_events") if f.name.startswith("a-")]
    again = merged_segments(tmp_path)[str(a.relative_to(tmp_path))]
    assert len(again.sources) == 6 and again.inner()[0] == first and again.sources[0].merged
    assert (again.sources[0].oldest_ns, again.sources[0].newest_ns) == (
        min(s.oldest_ns or 0 for s in first.sources), max(s.newest_ns or 0 for s in first.sources))
    assert len(again.originals()) == 10 and again.originals()[:5] == list(first.sources)
    assert len(list((tmp_path / "kv_events").rglob(".a-*.sources"))) == 1  # the old sidecar went too
    assert _scan(tmp_path) == before[:5] + [("a", i) for i in range(5, 10)] + before[5:]
    assert latest_checkpoint(tmp_path, "a") == {"seq": 9}


def test_compact_today_leaves_a_large_merged_segment_until_the_newer_ones_catch_up(tmp_path: Path) -> None:
    """A merged segment larger than the newer segments together stays as it is (its rows are not
    rewritten every period); the newer ones are merged among themselves."""
    w = SegmentWriter(tmp_path, "kv_events", scenario="live", writer_id="a")
    w.append_rows([{"ts_ns": 40 * DAY + i, "kind": "stored", "block_hash": i} for i in range(20_000)])
    w.flush()
    _flushes(tmp_path, "a", 3, start=20_000)
    big = segment_files(tmp_path, "kv_events")[0]
    counts = compact(tmp_path, today="1970-02-10", current=True)
    assert counts == {"segments_written": 1, "segments_replaced": 3}
    files = segment_files(tmp_path, "kv_events")
    assert len(files) == 2 and files[0] == big
    assert [r[1] for r in _scan(tmp_path)] == list(range(20_003))


def test_compact_today_stops_a_run_at_the_target_size(tmp_path: Path) -> None:
    _flushes(tmp_path, "a", 6)
    one = max(f.stat().st_size for f in segment_files(tmp_path, "kv_events"))
    counts = compact(tmp_path, today="1970-02-10", current=True, target_bytes=3 * one)
    assert counts == {"segments_written": 1, "segments_replaced": 3}  # the newest three
    assert len(segment_files(tmp_path, "kv_events")) == 4
    assert [r[1] for r in _scan(tmp_path)] == list(range(6))


def test_a_compaction_killed_mid_commit_is_undone(tmp_path: Path) -> None:
    """A kill between the journal's renames: the next reader puts every segment back, without the
    merged one, and removes the dead compaction's staging."""
    import os
    import subprocess
    import sys

    _flushes(tmp_path, "a", 4)
    before = _scan(tmp_path)
    names = sorted(f.name for f in segment_files(tmp_path, "kv_events"))
    code = (
        "import os, sys\nimport kvlens.commit as c\nfrom kvlens.compact import compact\n"
        "real, done = c._swap_one, []\n"
        "def swap(entry):\n"
        "    if len(done) == 3: os._exit(9)\n"
        "    real(entry); done.append(entry)\n"
        "c._swap_one = swap\n"
        "compact(sys.argv[1], today='1970-02-10', current=True)\n")
    child = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=120)
    assert child.returncode == 9
    assert list((tmp_path / ".journal").glob("*.json"))
    assert _scan(tmp_path) == before  # open_lake recovered first
    assert sorted(f.name for f in segment_files(tmp_path, "kv_events")) == names
    assert not list((tmp_path / "kv_events").rglob(".*.sources"))
    assert not [p for p in (tmp_path / ".staging").glob("*")]
    assert os.listdir(tmp_path / ".journal") == []


def test_the_cli_compacts_today_and_analyze_compact_says_so(tmp_path: Path) -> None:
    import time

    from click.testing import CliRunner

    from kvlens.cli import cli

    w = SegmentWriter(tmp_path, "kv_events", scenario="live", writer_id="a")
    for i in range(3):  # today's rows (the partition of the current UTC day)
        w.append_rows([{"ts_ns": time.time_ns(), "kind": "stored", "block_hash": i}])
        w.flush({"seq": i})
    runner = CliRunner()
    plain = runner.invoke(cli, ["compact", "--lake", str(tmp_path)])
    assert plain.exit_code == 0 and "merged 0 segments" in plain.output  # today's: only with --today
    today = runner.invoke(cli, ["compact", "--lake", str(tmp_path), "--today"])
    assert today.exit_code == 0, today.output
    assert "merged 3 segments into 1" in today.output
    assert len(segment_files(tmp_path, "kv_events")) == 1


def test_compact_merges_a_closed_day_per_writer_keeping_every_writers_checkpoint(tmp_path: Path) -> None:
    """The checkpoint-only segments of every collector share the partition of 1970-01-01, a closed
    day: each writer's are merged into its newest, so each writer's checkpoint still resolves."""
    for writer in ("a", "b"):
        w = SegmentWriter(tmp_path, "kv_events", scenario="live", writer_id=writer)
        for i in range(3):
            w.flush({"seq": i, "writer": writer})  # empty: the checkpoint only, dated 1970-01-01
    counts = compact(tmp_path, today="1970-02-10")
    assert counts == {"segments_written": 2, "segments_replaced": 6}
    assert latest_checkpoint(tmp_path, "a") == {"seq": 2, "writer": "a"}
    assert latest_checkpoint(tmp_path, "b") == {"seq": 2, "writer": "b"}
    assert len(segment_files(tmp_path, "kv_events")) == 2
