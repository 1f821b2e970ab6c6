"""Mergeable lake aggregates continued across runs (analyzers/scans.py): after every run of a
growing lake, each aggregate equals the same aggregate of the whole lake."""

from __future__ import annotations

import duckdb
import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.analyzers.scans import Scans, ScanState

_VALUES = {"n": ("CAST(count(*) AS BIGINT)", "sum"), "tokens": ("CAST(sum(tok) AS BIGINT)", "sum"),
           "first": ("min(ts_ns)", "min"), "last": ("max(ts_ns)", "max")}


def _aggregates(scans: Scans, rel: duckdb.DuckDBPyRelation) -> dict[str, pl.DataFrame]:
    return {
        "counts": scans.aggregate("counts", "ev", rel, ["rep", "CAST(kind AS VARCHAR) AS kind"], _VALUES),
        "pairs": scans.aggregate("pairs", "ev", rel.filter("tok IS NOT NULL"), ["rep", "tok"]),
        # one key: a prior larger than its new part merges only the groups the part names
        "by_tok": scans.aggregate("by_tok", "ev", rel.filter("tok IS NOT NULL"), ["tok"], _VALUES),
        "toks": scans.aggregate("toks", "ev", rel.filter("tok IS NOT NULL"), ["tok"]),
        "by_rep": scans.aggregate("by_rep", "ev", rel, ["rep"], _VALUES),  # a NULL key: merged whole
    }


def _same(a: pl.DataFrame, b: pl.DataFrame) -> bool:
    return a.sort(a.columns, nulls_last=True).equals(b.sort(b.columns, nulls_last=True))


@settings(max_examples=120, deadline=None)
@given(rows=st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 50)), st.sampled_from(["a", "b", None]),
                               st.sampled_from(["stored", "removed"]),
                               st.one_of(st.none(), st.integers(1, 12))), max_size=40),
       ends=st.lists(st.integers(1, 51), min_size=1, max_size=4, unique=True), lag=st.integers(0, 8),
       known=st.lists(st.booleans(), min_size=5, max_size=5))
def test_continued_aggregates_equal_those_of_the_whole_lake(
        rows: list[tuple[int | None, str | None, str, int | None]], ends: list[int], lag: int,
        known: list[bool]) -> None:
    """The lake holds the rows stamped before each end (unstamped rows from the start); the
    checkpoint is the end less ``lag``, so no row before it arrives later, as ``kvlens analyze``
    guarantees. Counts, sums, minima, maxima and distinct keys all merge. ``known``, per run:
    whether it is told that the rows it gained are stamped from the previous end on
    (``unchanged_before``, as an appended run knows from its new segments), so that it counts only
    those; the next run that is not told checks the count it saved."""
    frame = pl.DataFrame(rows, schema={"ts_ns": pl.Int64, "rep": pl.Utf8, "kind": pl.Utf8, "tok": pl.Int64},
                         orient="row")
    con = duckdb.connect()
    state = None
    continued = 0
    previous = None
    for run, end in enumerate([*sorted(ends), 10**6]):
        rel = con.from_arrow(frame.filter(pl.col("ts_ns").is_null() | (pl.col("ts_ns") < end)).to_arrow())
        since = {"ev": previous} if known[run] and previous is not None else {}
        scans = Scans({"ev": (rel, "ts_ns")}, state, end - lag, unchanged_before=since)
        previous = end
        assert scans.refused is None, scans.refused
        continued += scans.resume is not None
        got = _aggregates(scans, rel)
        want = _aggregates(Scans({"ev": (rel, "ts_ns")}), rel)
        for name in want:
            assert _same(got[name], want[name]), name
        saved = scans.state()
        assert saved is not None
        state = ScanState.from_bytes(saved.to_bytes())  # as the analysis DB keeps it
    assert continued == len(ends)


def test_a_row_that_arrives_before_the_checkpoint_makes_a_full_scan() -> None:
    con = duckdb.connect()
    first = pl.DataFrame({"ts_ns": [1, 5, 9], "rep": ["a", "a", "b"], "kind": ["stored"] * 3,
                          "tok": [1, 1, 2]})
    rel = con.from_arrow(first.to_arrow())
    scans = Scans({"ev": (rel, "ts_ns")}, None, 8)
    _aggregates(scans, rel)
    state = scans.state()
    assert state is not None and state.rows == {"ev": 2}
    late = pl.concat([first, pl.DataFrame({"ts_ns": [3], "rep": ["b"], "kind": ["stored"], "tok": [7]})])
    rel = con.from_arrow(late.to_arrow())
    scans = Scans({"ev": (rel, "ts_ns")}, state, 20)
    assert scans.resume is None and scans.refused is not None
    assert "3 ev rows before the checkpoint" in scans.refused
    got = _aggregates(scans, rel)["counts"]
    assert got.filter(pl.col("rep") == "b")["n"].to_list() == [2]  # the late row counted: a full scan
