"""Tests for incremental `kvlens analyze` (analyzers/incremental.py): after every increment of a
growing lake, the incrementally kept analysis DB equals a full analysis of the lake at that moment."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from incremental_lake import assert_same_db, cut, source_lake, time_bounds

import kvlens.analyzers as analyzers
from kvlens.analyzers import incremental
from kvlens.analyzers.analyze import AnalyzeResult, analyze_lake
from kvlens.analyzers.incremental import LATE_LAG_NS, STATE_TABLE, Inputs, Segment, new_rows_from
from kvlens.cli import cli
from kvlens.lake import open_lake
from kvlens.models import get_model
from kvlens.schema import LAKE_TABLES


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 requests of the sample trace (``conv``), a 2-replica fleet with a pool serving them (``rr2``)."""
    return source_lake(tmp_path_factory.mktemp("incr-source"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return source_lake(tmp_path_factory.mktemp("incr-tiny"), requests=40)


def _modes(result: AnalyzeResult) -> dict[str, str]:
    return {scenario: mode for scenario, mode, _ in result.modes}


def test_five_increments_each_equal_a_full_analysis(source: Path, tmp_path: Path) -> None:
    """The lake grows by five time slices of rr2 (conv lands whole in the first): after each, the
    incremental DB equals a full one, every table and row; an unchanged scenario is carried."""
    lake, db, full = tmp_path / "lake", tmp_path / "incr.duckdb", tmp_path / "full.duckdb"
    bounds = time_bounds(source, 5)
    compared = []
    for k in range(5):
        lo = None if k == 0 else bounds[k]
        assert cut(source, lake, lo, bounds[k + 1], writer=f"inc{k}", scenarios=["rr2"]) > 0
        if k == 0:
            cut(source, lake, None, bounds[-1], writer="conv", scenarios=["conv"])
        result = analyze_lake(lake, db)
        analyze_lake(lake, full, full=True)
        counts = assert_same_db(db, full)
        compared.append(sum(counts.values()))
        want = {"conv": "full", "rr2": "full"} if k == 0 else {"conv": "carried", "rr2": "appended"}
        assert _modes(result) == want
        if k:  # the ledger went on from the previous checkpoint, not from the start
            (why,) = [reason for scenario, _, reason in result.modes if scenario == "rr2"]
            assert "ledger continued from its checkpoint" in why, why
            assert "reuse continued from its checkpoint" in why, why
            assert "lake aggregates continued from" in why, why
    assert compared == sorted(compared) and compared[0] < compared[-1]  # the lake, and the DB, grew
    assert _modes(analyze_lake(lake, db)) == {"conv": "carried", "rr2": "carried"}
    assert_same_db(db, full)


def test_full_flag_equals_the_default(tiny: Path, tmp_path: Path) -> None:
    lake, db, full = tmp_path / "lake", tmp_path / "incr.duckdb", tmp_path / "full.duckdb"
    bounds = time_bounds(tiny, 2)
    runner = CliRunner()
    for k in range(2):
        cut(tiny, lake, None if k == 0 else bounds[k], bounds[k + 1], writer=f"inc{k}")
        default = runner.invoke(cli, ["analyze", "--lake", str(lake), "--db", str(db)])
        assert default.exit_code == 0, default.output
        forced = runner.invoke(cli, ["analyze", "--lake", str(lake), "--db", str(full), "--full"])
        assert forced.exit_code == 0, forced.output
        assert_same_db(db, full)
    assert "rr2: appended (" in default.stderr
    assert "rr2: full (--full given)" in forced.stderr


def _live(lake: Path, source: Path, lo: int, hi: int, *, writer: str, written_ns: int,
          tables: tuple[str, ...]) -> None:
    """``cut`` as a live collector would have written it: every file it adds carries the write
    time ``written_ns`` (the lake's times are wall-clock times for a live collector)."""
    before = set(lake.rglob("*.parquet"))
    cut(source, lake, lo, hi, writer=writer, scenarios=["rr2"], tables=tables)
    for path in set(lake.rglob("*.parquet")) - before:
        os.utime(path, ns=(written_ns, written_ns))


_REQUEST_TABLES = ("requests", "request_blocks")
_OTHER_TABLES = tuple(t.name for t in LAKE_TABLES if t.name not in _REQUEST_TABLES)


def _grow_live(source: Path, lake: Path, flushes: range, held: dict[int, int] | None = None) -> None:
    """Flushes ``flushes`` of a live fleet over ``source``'s rr2: every collector flushes each 10 s
    of the lake's time, and the gateway holds some requests back as long ones: those arriving in
    the 2nd 10 s are written with the 11th flush (100 s late), those of the 5th with the 14th."""
    (lo, _) = time_bounds(source, 1)
    at = [lo + k * 10 * 10**9 for k in range(26)]
    held = {1: 10, 4: 13} if held is None else held  # slice -> the flush that writes its requests
    for k in flushes:
        written = at[k + 1] + 10**9
        bounds = [(None if j == 0 else at[j], at[j + 1] if j < 24 else 2**62) for j in range(25)]
        _live(lake, source, *bounds[k], writer=f"ev{k}", written_ns=written, tables=_OTHER_TABLES)
        for j in [*([] if k in held else [k]), *(j for j, by in held.items() if by == k)]:
            _live(lake, source, *bounds[j], writer=f"gw{j}", written_ns=written, tables=_REQUEST_TABLES)


def test_a_live_gateways_long_requests_are_appended_not_rebuilt(source: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway writes a request when it finishes, stamped with its arrival: a long request's
    row lands minutes after rows stamped later. The requests the second analysis finds held back
    precede the first one's watermark by more than LATE_LAG_NS, but the live segments the first
    one saw showed rows landing 100 s late: the lag it kept is longer, so the second continues (and
    equals a full analysis). Without that lag, the same lake is rebuilt in full."""
    (lo, _) = time_bounds(source, 1)
    for learned in (True, False):
        if not learned:  # no segment counts as live: the fixed lag only
            monkeypatch.setattr(incremental, "LIVE_WINDOW_NS", -1)
        root = tmp_path / str(learned)
        lake, db, full = root / "lake", root / "incr.duckdb", root / "full.duckdb"
        _grow_live(source, lake, range(12))
        assert _modes(analyze_lake(lake, db)) == {"rr2": "full"}
        _grow_live(source, lake, range(12, 25))
        with duckdb.connect(str(db), read_only=True) as con:
            ((mark,),) = con.execute(f"SELECT watermark_ns FROM {STATE_TABLE}").fetchall()
        assert lo + 40 * 10**9 < mark - LATE_LAG_NS  # the held-back requests are older than that
        ((_, mode, why),) = analyze_lake(lake, db).modes
        analyze_lake(lake, full, full=True)
        assert_same_db(db, full)
        if learned:
            assert mode == "appended" and " s late accepted from now on" in why, why
        else:
            assert mode == "full" and why.startswith("late segment ") and "/gw4-" in why, why


def test_a_lag_that_grows_never_moves_the_horizon_back(source: Path, tmp_path: Path) -> None:
    """The requests of the 8th 10 s are written with the last flush, 180 s late, after a first
    analysis that saw nothing later than 11 s: not late for it (they follow its horizon), but the
    lag they teach would put the new horizon before the states that analysis kept. The horizon
    stays at the previous one; the continuation equals a full analysis."""
    lake, db, full = tmp_path / "lake", tmp_path / "incr.duckdb", tmp_path / "full.duckdb"
    _grow_live(source, lake, range(12), held={7: 24})
    assert _modes(analyze_lake(lake, db)) == {"rr2": "full"}
    with duckdb.connect(str(db), read_only=True) as con:
        ((first,),) = con.execute(f"SELECT horizon_ns FROM {STATE_TABLE}").fetchall()
    _grow_live(source, lake, range(12, 25), held={7: 24})
    ((_, mode, why),) = analyze_lake(lake, db).modes
    assert mode == "appended" and " s late accepted from now on" in why, why
    with duckdb.connect(str(db), read_only=True) as con:
        ((second, mark),) = con.execute(f"SELECT horizon_ns, watermark_ns FROM {STATE_TABLE}").fetchall()
    assert second == first > mark - 180 * 10**9  # the lag learned would have moved it back
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)


def test_a_record_made_today_moves_no_watermark(source: Path, tmp_path: Path) -> None:
    """rr2's `simulations` row is stamped when the simulation ran (today), its traffic when the
    trace's requests ran: the watermark is the traffic's, so a later slice of it is appended, not
    late (with the record's time as the watermark, every slice would be older than the horizon)."""
    lake, db, full = tmp_path / "lake", tmp_path / "incr.duckdb", tmp_path / "full.duckdb"
    bounds = time_bounds(source, 2)
    cut(source, lake, None, 2**62, writer="sim", scenarios=["rr2"], tables=["simulations"])
    traffic = tuple(t for t in _OTHER_TABLES + _REQUEST_TABLES if t != "simulations")
    cut(source, lake, None, bounds[1], writer="a", scenarios=["rr2"], tables=traffic)
    assert _modes(analyze_lake(lake, db)) == {"rr2": "full"}
    with duckdb.connect(str(db), read_only=True) as con:
        ((mark,),) = con.execute(f"SELECT watermark_ns FROM {STATE_TABLE}").fetchall()
    assert mark < bounds[1]
    cut(source, lake, bounds[1], bounds[2], writer="b", scenarios=["rr2"], tables=traffic)
    ((_, mode, why),) = analyze_lake(lake, db).modes
    assert mode == "appended", why
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)


def test_the_lag_is_what_live_segments_show(tmp_path: Path) -> None:
    """``late_lag``: a live segment (its newest row stamped near its write time) shows how late its
    oldest row landed; the lag is a quarter more than the latest seen lately, never less than
    LATE_LAG_NS nor more than MAX_LATE_LAG_NS; an imported segment (rows stamped long before it
    was written) shows nothing."""
    s = 10**9
    now = 1_800_000_000 * s

    def seg(name: str, oldest: int, newest: int, written: int) -> Segment:
        return Segment(name, 1, written, oldest, newest)

    live = seg("gw", now - 200 * s, now - s, now)  # a request 200 s long, written on its flush
    imported = seg("trace", now - 10**6 * s, now - 9 * 10**5 * s, now)  # stamped days ago
    assert incremental.late_lag(Inputs("{}", (imported,))) == LATE_LAG_NS
    assert incremental.late_lag(Inputs("{}", (imported, live))) == 250 * s
    assert incremental.late_lag(Inputs("{}", (seg("ev", now - 2 * s, now - s, now),))) == LATE_LAG_NS
    week = seg("gw", now - 7 * 86400 * s, now - s, now)
    assert incremental.late_lag(Inputs("{}", (week,))) == incremental.MAX_LATE_LAG_NS
    # a live segment whose rows are all older than LATE_SEEN_NS before the watermark is not seen
    # any more (here the one 200 s late, 7 hours before a later flush's rows)
    later = seg("ev", now + 7 * 3600 * s - 2 * s, now + 7 * 3600 * s, now + 7 * 3600 * s + s)
    assert incremental.late_lag(Inputs("{}", (live, later))) == LATE_LAG_NS
    assert incremental.late_lag(Inputs("{}", (live, seg("ev", now - s, now + s, now + 2 * s)))) == 250 * s
    # the horizon, and decide's late rule, follow it
    inputs = Inputs("{}", (imported, live))
    assert incremental.horizon(inputs) == now - s - 250 * s
    # a continuation's horizon is never before the one it starts from
    assert incremental.horizon(inputs, Inputs("{}", (), now)) == now
    assert incremental.horizon(inputs, Inputs("{}", (), now - 10**6 * s)) == now - s - 250 * s
    new = seg("new", now - s - 240 * s, now + s, now + 2 * s)
    said = incremental.decide(Inputs("{}", (imported, live, new)), inputs, full=False, no_state=None)
    # (the new segment's oldest row landed 243 s late: a quarter more is the lag from now on, said)
    assert said.mode == "appended" and "rows up to 304 s late accepted" in said.reason, said
    older = seg("older", now - s - 260 * s, now + s, now + 2 * s)
    assert incremental.decide(Inputs("{}", (imported, live, older)), inputs, full=False,
                              no_state=None).mode == "full"


def test_a_late_segment_falls_back_to_a_full_rebuild(source: Path, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Rows older than the watermark (less the lag) arriving after it was analyzed: the scenario is
    rebuilt, and the log says which segment was late."""
    lake, db, full = tmp_path / "lake", tmp_path / "incr.duckdb", tmp_path / "full.duckdb"
    bounds = time_bounds(source, 3)
    cut(source, lake, None, bounds[1], writer="early", scenarios=["rr2"])
    cut(source, lake, bounds[2], bounds[3], writer="recent", scenarios=["rr2"])
    assert _modes(analyze_lake(lake, db)) == {"rr2": "full"}
    cut(source, lake, bounds[1], bounds[2], writer="late", scenarios=["rr2"])
    with caplog.at_level(logging.INFO, logger="kvlens.analyzers.analyze"):
        result = analyze_lake(lake, db)
    ((_, mode, why),) = result.modes
    assert mode == "full" and why.startswith("late segment ") and "/scenario=rr2/" in why
    assert any("rr2: full (late segment" in r.getMessage() for r in caplog.records)
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)


def test_a_compaction_between_analyses_continues_them(source: Path, tmp_path: Path) -> None:
    """A live collector's segments merged between two analyses (kvlens compact --today, which
    ``kvlens analyze --compact`` runs first): the next analysis reads a merged segment as the
    segments it replaced, so it carries or continues rather than rebuilds, and its DB equals a full
    analysis of the compacted lake. A merged segment without its list reads as a new one."""
    from kvlens.compact import compact

    lake, db, full = tmp_path / "lake", tmp_path / "incr.duckdb", tmp_path / "full.duckdb"
    bounds = time_bounds(source, 4)
    cut(source, lake, None, bounds[-1], writer="conv", scenarios=["conv"])
    for k in range(2):  # one writer, as a live collector: two segments per table
        cut(source, lake, None if k == 0 else bounds[k], bounds[k + 1], writer="live", scenarios=["rr2"])
    analyze_lake(lake, db)
    assert compact(lake, today="1970-01-02", current=True)["segments_replaced"] >= 2
    assert _modes(analyze_lake(lake, db)) == {"conv": "carried", "rr2": "carried"}
    cut(source, lake, bounds[2], bounds[3], writer="live", scenarios=["rr2"])
    compact(lake, today="1970-01-02", current=True)  # merged where it outweighs the merged one
    result = analyze_lake(lake, db)
    assert _modes(result) == {"conv": "carried", "rr2": "appended"}
    (why,) = [reason for scenario, _, reason in result.modes if scenario == "rr2"]
    assert "ledger continued from its checkpoint" in why, why
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)
    cut(source, lake, bounds[3], bounds[4], writer="live", scenarios=["rr2"])  # not compacted
    assert _modes(analyze_lake(lake, db)) == {"conv": "carried", "rr2": "appended"}
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)
    merged = sorted((lake / "kv_events" / "scenario=rr2").rglob(".*.sources"))
    assert merged
    merged[0].unlink()
    result = analyze_lake(lake, db)
    assert _modes(result)["rr2"] == "full" and "gone or rewritten" in dict(
        (s, why) for s, _, why in result.modes)["rr2"]


def _recorded(db: Path, scenario: str) -> list[dict[str, object]]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        ((segments,),) = con.execute(f"SELECT segments FROM {STATE_TABLE} WHERE scenario = ?",
                                     [scenario]).fetchall()
    finally:
        con.close()
    return list(json.loads(segments))


def test_a_closed_days_merged_segment_is_recorded_as_itself(source: Path, tmp_path: Path) -> None:
    """A closed day's merge (kvlens compact) is read once as the segments it replaced, then recorded
    as itself: a scenario's record of a closed day stays one segment per writer and table, not one
    per flush (a live collector's every few seconds: tens of thousands a day, kept as long as the
    lake keeps the day), and its sidecar is not read again. A late segment merged into the day
    later lists it so: the analyses carry or continue, and equal a full analysis."""
    from kvlens.compact import compact

    lake, db, full = tmp_path / "lake", tmp_path / "incr.duckdb", tmp_path / "full.duckdb"
    bounds = time_bounds(source, 4)
    for k in range(2):
        cut(source, lake, None if k == 0 else bounds[k], bounds[k + 1], writer="live", scenarios=["rr2"])
    analyze_lake(lake, db)
    originals = _recorded(db, "rr2")
    assert not any(r.get("merged") for r in originals)
    assert compact(lake, today="2099-01-01")["segments_replaced"] == len(originals)  # the day closed
    assert _modes(analyze_lake(lake, db)) == {"rr2": "carried"}
    units = _recorded(db, "rr2")
    files = sorted(str(f.relative_to(lake)) for f in lake.rglob("*.parquet") if "/scenario=rr2/" in str(f))
    assert sorted(str(r["path"]) for r in units) == files and all(r["merged"] for r in units)
    assert len(units) < len(originals)
    by_dir = {Path(str(r["path"])).parent: r for r in units}  # (one writer: one per partition)
    for r in originals:  # each record spans the times of the segments it replaced
        u = by_dir[Path(str(r["path"])).parent]
        if r["oldest_ns"] is not None:
            assert int(str(u["oldest_ns"])) <= int(str(r["oldest_ns"]))
            assert int(str(r["newest_ns"])) <= int(str(u["newest_ns"]))
    aside = {side: side.read_bytes() for side in lake.rglob(".*.sources")}
    for side in aside:  # read no more: an analysis carries without them
        side.unlink()
    assert _modes(analyze_lake(lake, db)) == {"rr2": "carried"}
    for side, text in aside.items():  # (a later merge of the day reads them)
        side.write_bytes(text)
    cut(source, lake, bounds[2], bounds[3], writer="live", scenarios=["rr2"])  # late into the closed day
    assert _modes(analyze_lake(lake, db)) == {"rr2": "appended"}
    assert compact(lake, today="2099-01-01")["segments_written"] >= 1  # the day's merge and the new one
    assert _modes(analyze_lake(lake, db)) == {"rr2": "carried"}
    assert all(r.get("merged") for r in _recorded(db, "rr2"))
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)


def test_settled_merged_segments_of_the_current_day_are_recorded_as_themselves(
        source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the current day, a merged segment whose newest row is older than the watermark less
    LATE_SEEN_NS (the window whose segments' write times late_lag reads) is recorded as itself; a
    later merge lists it so, its own list nested, and the next analysis continues from it. (Here
    the window is 1 ns: every merged segment but the newest is settled.)"""
    from kvlens.compact import compact, merged_segments

    monkeypatch.setattr(incremental, "LATE_SEEN_NS", 1)
    lake, db, full = tmp_path / "lake", tmp_path / "incr.duckdb", tmp_path / "full.duckdb"
    bounds = time_bounds(source, 6)
    for k in range(2):
        cut(source, lake, None if k == 0 else bounds[k], bounds[k + 1], writer="live", scenarios=["rr2"])
    analyze_lake(lake, db)
    flushes = len(_recorded(db, "rr2"))
    compact(lake, today="1970-01-02", current=True)
    assert _modes(analyze_lake(lake, db)) == {"rr2": "carried"}
    settled = [r for r in _recorded(db, "rr2") if r.get("merged")]
    assert settled and len(_recorded(db, "rr2")) < flushes
    for k in range(2, 6):  # as many new flushes as the merged ones held, and more: merged with them
        cut(source, lake, bounds[k], bounds[k + 1], writer="live", scenarios=["rr2"])
    compact(lake, today="1970-01-02", current=True)
    nested = [m for m in merged_segments(lake).values() if any(s.merged for s in m.sources)]
    assert nested and all(m.within for m in nested)
    result = analyze_lake(lake, db)
    assert _modes(result) == {"rr2": "appended"}
    assert "ledger continued from its checkpoint" in result.modes[0][2], result.modes
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)


def test_a_changed_model_or_gone_segment_rebuilds(tiny: Path, tmp_path: Path) -> None:
    lake, db = tmp_path / "lake", tmp_path / "incr.duckdb"
    shutil.copytree(tiny, lake)
    analyze_lake(lake, db)
    result = analyze_lake(lake, db, model=get_model("llama-3.1-8b"))
    assert {m for _, m, _ in result.modes} == {"full"}
    assert all("model" in why for _, _, why in result.modes)
    segment = next((lake / "transfers" / "scenario=rr2").rglob("*.parquet"))
    segment.unlink()  # as kvlens compact would
    result = analyze_lake(lake, db, model=get_model("llama-3.1-8b"))
    assert dict((s, why) for s, _, why in result.modes)["rr2"].endswith(str(segment.relative_to(lake)))
    assert _modes(result) == {"conv": "carried", "rr2": "full"}
    con = duckdb.connect(str(db))
    try:
        con.execute(f"DROP TABLE {STATE_TABLE}")  # as a DB written before incremental analysis
    finally:
        con.close()
    result = analyze_lake(lake, db, model=get_model("llama-3.1-8b"))
    assert set(result.modes) == {(s, "full", "previous analysis DB has no state") for s in ("conv", "rr2")}


def _analyzed_then_grown(tiny: Path, tmp_path: Path) -> tuple[Path, Path, Path, list[tuple[object, ...]]]:
    """The first half of ``tiny`` analyzed into ``incr.duckdb`` (its state returned), then the
    second half appended to the lake; with the path a full analysis goes to."""
    lake, db, full = tmp_path / "lake", tmp_path / "incr.duckdb", tmp_path / "full.duckdb"
    bounds = time_bounds(tiny, 2)
    cut(tiny, lake, None, bounds[1], writer="inc0")
    analyze_lake(lake, db)
    before = _state(db)
    cut(tiny, lake, bounds[1], bounds[2], writer="inc1")
    return lake, db, full, before


def test_a_failed_analysis_leaves_the_previous_db_and_state(tiny: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The state is written in the same file as the results: an analysis that dies half-way (here
    an error in the second scenario) leaves the previous DB, and the next run resumes from it."""
    lake, db, full, before = _analyzed_then_grown(tiny, tmp_path)
    real = analyzers.analyze_scenario
    seen: list[str] = []

    def dies_on_the_second(con: duckdb.DuckDBPyConnection, scenario: str, *a: object,
                           **kw: object) -> Iterator[object]:
        seen.append(scenario)
        if len(seen) == 2:
            raise KeyboardInterrupt
        yield from real(con, scenario, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(analyzers, "analyze_scenario", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        analyze_lake(lake, db)
    monkeypatch.undo()
    assert _state(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["incr.duckdb", "lake"]
    assert set(_modes(analyze_lake(lake, db)).values()) == {"appended"}
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)


def _state(db: Path) -> list[tuple[object, ...]]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(f"SELECT * FROM {STATE_TABLE} ORDER BY scenario").fetchall()
    finally:
        con.close()


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.floats(0.02, 0.98), min_size=1, max_size=3, unique=True),
       order=st.permutations(range(4)), conv_first=st.booleans())
def test_random_cuts_equal_a_full_analysis(tiny: Path, tmp_path_factory: pytest.TempPathFactory,
                                           cuts: list[float], order: list[int], conv_first: bool) -> None:
    """Any cut of the tiny lake into time slices, delivered in any order (out of order: late
    segments), analyzed after each: the incremental DB always equals a full analysis."""
    root = tmp_path_factory.mktemp("incr-random")
    lake, db, full = root / "lake", root / "incr.duckdb", root / "full.duckdb"
    first, last = _span(tiny)
    edges = [first] + [first + round((last - first) * c) for c in sorted(cuts)] + [2**62]
    slices = list(itertools.pairwise(edges))
    if conv_first:
        cut(tiny, lake, None, 2**62, writer="conv", scenarios=["conv"])
    for n, i in enumerate(i for i in order if i < len(slices)):
        lo, hi = slices[i]
        if cut(tiny, lake, None if i == 0 else lo, hi, writer=f"s{n}", scenarios=["rr2"]) == 0:
            continue
        if not conv_first and n == 0:
            cut(tiny, lake, None, 2**62, writer="conv", scenarios=["conv"])
        analyze_lake(lake, db)
        analyze_lake(lake, full, full=True)
        assert_same_db(db, full)
    shutil.rmtree(root)


def _span(lake: Path) -> tuple[int, int]:
    """The first and last request arrival of ``lake``."""
    first, _ = time_bounds(lake, 1)
    con = duckdb.connect()
    try:
        open_lake(con, lake)
        ((last,),) = con.execute("SELECT max(arrival_ns) FROM requests").fetchall()
    finally:
        con.close()
    return first, int(last)


# A child that analyzes the lake and, when its second scenario starts, says so on stdout and waits
# on stdin (for ever, unless killed): the parent kills it there with SIGKILL.
_STALLS = """
import sys
import kvlens.analyzers as analyzers
from kvlens.analyzers.analyze import analyze_lake
real, seen = analyzers.analyze_scenario, []
def stalls(con, scenario, *a, **kw):
    seen.append(scenario)
    if len(seen) == 2:
        print("analyzing", flush=True)
        sys.stdin.read()
    yield from real(con, scenario, *a, **kw)
analyzers.analyze_scenario = stalls
analyze_lake(sys.argv[1], sys.argv[2])
"""


def test_a_killed_analysis_leaves_the_previous_db_and_the_next_completes(tiny: Path, tmp_path: Path) -> None:
    lake, db, full, before = _analyzed_then_grown(tiny, tmp_path)
    with subprocess.Popen([sys.executable, "-c", _STALLS, str(lake), str(db)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "analyzing"
        assert any(p.name.startswith(".incr.duckdb.") for p in tmp_path.iterdir())  # mid-build
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stdin.close()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert _state(db) == before  # the previous DB, readable, with its own state
    assert set(_modes(analyze_lake(lake, db)).values()) == {"appended"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["incr.duckdb", "lake"]  # leftovers removed
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)


def test_an_incremental_analysis_writes_into_a_copy_of_the_previous_db(
        source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An appended analysis starts from a copy of the previous DB: the carried scenario's rows are
    the previous file's, the continued ledger writes only its new rows; a scenario not chosen any
    more is gone, as from a new build. Each DB equals a new full build of the same choice. (The
    lateness accepted is cut to 1 s so that the checkpoint settles most of this short slice.)"""
    import kvlens.analysis_db as analysis_db
    from kvlens.analyzers import analyze, incremental

    monkeypatch.setattr(incremental, "LATE_LAG_NS", 1_000_000_000)
    lake, db, full, _ = _analyzed_then_grown(source, tmp_path)
    bases: list[object] = []
    written: dict[str, int] = {}
    real_build, real_insert = analysis_db.build_analysis_db, analysis_db._insert

    def build(*a: object, base: object = None, **kw: object) -> Path:
        bases.append(base)
        return real_build(*a, base=base, **kw)  # type: ignore[arg-type]

    def insert(con: duckdb.DuckDBPyConnection, name: str, frame: object) -> None:
        written[name] = written.get(name, 0) + frame.height  # type: ignore[attr-defined]
        real_insert(con, name, frame)  # type: ignore[arg-type]

    monkeypatch.setattr(analyze, "build_analysis_db", build)
    monkeypatch.setattr(analysis_db, "_insert", insert)
    # The copy is attached with its row group size (a checkpoint rewrites each row group that
    # appends and deletes touched, so small ones keep that to what was appended).
    monkeypatch.setattr(analysis_db, "ROW_GROUP_ROWS", 2048)
    result = analyze_lake(lake, db)
    assert _modes(result) == {"conv": "appended", "rr2": "appended"}
    assert bases == [db.resolve()]
    con = duckdb.connect(str(db), read_only=True)
    try:
        ((rows,),) = con.execute("SELECT count(*) FROM block_outcomes").fetchall()
        ((largest,),) = con.execute("SELECT max(count) FROM pragma_storage_info('block_outcomes') "
                                    "WHERE row_group_id = (SELECT max(row_group_id) "
                                    "FROM pragma_storage_info('block_outcomes'))").fetchall()
    finally:
        con.close()
    assert 0 < written["block_outcomes"] < rows  # the continued ledgers wrote their new rows only
    assert rows > 2048 and largest <= 2048  # the appended rows are in row groups of 2048
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)

    written.clear()
    assert _modes(analyze_lake(lake, db)) == {"conv": "carried", "rr2": "carried"}
    assert bases[-1] == db.resolve() and written == {}  # carried rows stay where they are
    assert_same_db(db, full)
    assert _modes(analyze_lake(lake, db, scenarios=["rr2"])) == {"rr2": "carried"}
    assert bases[-1] == db.resolve() and "block_outcomes" not in written
    analyze_lake(lake, full, scenarios=["rr2"], full=True)
    assert_same_db(db, full)  # conv is gone from every table, as from a new build
    assert [row[0] for row in _state(db)] == ["rr2"]
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT DISTINCT scenario FROM kvlens_ledger").fetchall() == [("rr2",)]
    finally:
        con.close()


def test_a_new_file_when_the_previous_cannot_be_the_base(tiny: Path, tmp_path: Path) -> None:
    """The previous DB is not copied when it has a write-ahead log beside it, was written by other
    code, or has more free blocks than used ones (deleted rows' space is never returned)."""
    from kvlens.analyzers.incremental import base_file, base_fits, code_digest

    def base_of(path: Path, code: str) -> Path | None:  # what analyze_lake decides, read in place
        found = base_file(path)
        if found is None:
            return None
        con = duckdb.connect(str(found), read_only=True)
        try:
            return found if base_fits(con, code) else None
        finally:
            con.close()

    lake, db = tmp_path / "lake", tmp_path / "incr.duckdb"
    shutil.copytree(tiny, lake)
    analyze_lake(lake, db)
    code = code_digest()
    assert base_of(db, code) == db.resolve()
    assert base_of(db, "another-code") is None
    assert base_of(tmp_path / "absent.duckdb", code) is None
    wal = db.with_name(db.name + ".wal")
    wal.write_bytes(b"")
    assert base_of(db, code) is None
    wal.unlink()
    con = duckdb.connect(str(db))
    try:  # fill the file, then delete: the blocks stay, free
        con.execute("CREATE TABLE filler AS SELECT range AS x, md5(range::VARCHAR) AS y FROM range(3000000)")
        con.execute("CHECKPOINT")
        con.execute("CREATE TABLE after_it AS SELECT range AS x FROM range(1000)")  # the blocks at the end
        con.execute("CHECKPOINT")
        con.execute("DROP TABLE filler")
        con.execute("CHECKPOINT")
        ((used, free),) = con.execute("SELECT used_blocks, free_blocks "
                                      "FROM pragma_database_size()").fetchall()
    finally:
        con.close()
    assert free > used
    assert base_of(db, code) is None
    analyze_lake(lake, db)  # a new file: compact again
    con = duckdb.connect(str(db), read_only=True)
    try:
        ((free_after,),) = con.execute("SELECT free_blocks FROM pragma_database_size()").fetchall()
    finally:
        con.close()
    assert free_after < free


def _corrupt_states(db: Path, table: str) -> None:
    """Overwrite the state blob of both scenarios in ``table`` of ``db`` with bytes that do not read."""
    con = duckdb.connect(str(db))
    try:
        assert con.execute(f"SELECT count(*) FROM {table}").fetchall() == [(2,)]
        con.execute(f"UPDATE {table} SET state = '\\x00\\x01'::BLOB")
    finally:
        con.close()


def test_an_unreadable_ledger_state_replays_the_ledger_in_full(tiny: Path, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The ledger's state is parsed on a worker thread while the ledger reads the new requests; one
    that does not read is refused there (the ledger replays in full, saying why) and the DB still
    equals a full analysis."""
    lake, db, full, _ = _analyzed_then_grown(tiny, tmp_path)
    _corrupt_states(db, "kvlens_ledger")
    with caplog.at_level(logging.INFO, logger="kvlens.analyzers"):
        result = analyze_lake(lake, db)
    assert set(_modes(result).values()) == {"appended"}
    assert sum("saved ledger state is unreadable" in r.getMessage() for r in caplog.records) == 2
    assert all("ledger replayed in full: its saved state is unreadable" in why for _, _, why in result.modes)
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)


def test_an_unreadable_flows_state_computes_flows_in_full(tiny: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    lake, db, full, _ = _analyzed_then_grown(tiny, tmp_path)
    _corrupt_states(db, "kvlens_flows")
    with caplog.at_level(logging.WARNING, logger="kvlens.analyzers.incremental"):
        assert set(_modes(analyze_lake(lake, db)).values()) == {"appended"}
    assert sum("saved flows state is unreadable" in r.getMessage() for r in caplog.records) == 2
    analyze_lake(lake, full, full=True)
    assert_same_db(db, full)


def test_the_rows_gained_are_stamped_from_the_oldest_row_of_the_new_segments() -> None:
    """Per lake table of the scenario: the oldest row among its new segments (an appended run's
    counts before an earlier checkpoint then need no scan); unknown when a new segment's is."""
    def seg(path: str, oldest: int | None) -> Segment:
        return Segment(path, 1, 1, oldest, oldest)

    before = Inputs("{}", (seg("kv_events/scenario=s/date=d/a.parquet", 10),
                           seg("requests/scenario=s/date=d/a.parquet", 5)))
    now = Inputs("{}", (*before.segments,
                        seg("kv_events/scenario=s/date=d/b.parquet", 40),
                        seg("kv_events/scenario=s/date=d/c.parquet", 30),
                        seg("kv_events/scenario=other/date=d/x.parquet", 1),  # another scenario's
                        seg("transfers/scenario=s/date=d/b.parquet", None),  # no statistics
                        seg("request_blocks/scenario=s/date=d/b.parquet", 50)))
    got = new_rows_from(now, before, "s")
    assert (got["kv_events"], got["request_blocks"]) == (30, 50)
    assert "transfers" not in got
    assert got["requests"] == got["metric_samples"] == 2**63 - 1  # no new segment: nothing new
