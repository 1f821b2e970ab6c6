"""Tests for continuing the ledger from a saved state (analyzers/ledger_state.py, outcomes.ledger_outcomes).

The lake is cut at a time x: the *old* lake holds every row stamped before x (rows without a time
too), the *new* one every row. The ledger of the old lake, with a checkpoint at most x, continued
over the new lake must equal the new lake's ledger replayed from the start, row for row, in order;
where the state does not cover the new lake the continuation is refused, says why, and the rows
are still a full replay's. Four lakes: a simulated fleet with a pool (the time rule: it
continues), a real vLLM capture (requests anchored at their own stores), and two real hybrid
captures (two KV cache groups, anchored at the full-attention group's stores; one client, and six
at once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import duckdb
import numpy as np
import polars as pl
import pytest
from capture_lines import capture_lake
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from incremental_lake import source_lake
from polars.testing import assert_frame_equal
from test_ledger import BLOCK, _blocks, _ev, _request, _write, at

from kvlens.analyzers import admission
from kvlens.analyzers.ledger_state import LedgerState
from kvlens.analyzers.outcomes import Ledger, Prefetch, Resume, _with, in_order, ledger_outcomes, rows_of
from kvlens.analyzers.state_blob import pack_arrays, unpack_arrays
from kvlens.lake import open_lake
from kvlens.schema import TABLES

DATA = Path(__file__).parent / "data"
_TABLES = ("requests", "request_blocks", "kv_events", "transfers")


class Lake(NamedTuple):
    path: Path
    scenario: str
    first: int
    last: int


def _span(path: Path, scenario: str) -> Lake:
    con = duckdb.connect()
    try:
        open_lake(con, path)
        ((first, last),) = con.execute("SELECT min(arrival_ns), max(arrival_ns) FROM requests "
                                       "WHERE scenario = ?", [scenario]).fetchall()
    finally:
        con.close()
    return Lake(path, scenario, int(first), int(last))


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Lake:
    return _span(source_lake(tmp_path_factory.mktemp("resume-sim"), requests=200), "rr2")


def _captured(tmp: Path, capture: Path, model: str) -> Lake:
    return _span(capture_lake(capture, tmp, model), "capture")


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Lake:
    return _captured(tmp_path_factory.mktemp("resume-capture"), DATA / "vllm-cpu-capture", "tiny")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Lake:
    return _captured(tmp_path_factory.mktemp("resume-hybrid"), DATA / "vllm-cpu-hybrid-capture",
                     "tiny-gemma2")


# The real vLLM captures whose requests are admitted at their own stores, and the model each serves.
_ANCHORED = {"concurrent_hybrid": ("vllm-concurrent-hybrid-capture", "tiny-gemma2"),
             "preempting_hybrid": ("vllm-preempting-hybrid-capture", "tiny-gemma2"),
             "chunked": ("vllm-chunked-capture", "tiny"),
             "chunked_hybrid": ("vllm-chunked-hybrid-capture", "tiny-gemma2"),
             "chat_hybrid": ("vllm-chat-hybrid-capture", "tiny-gemma2")}


@pytest.fixture(scope="module")
def anchored(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Lake]:
    """Each of ``_ANCHORED``'s captures as a lake, imported once for the module."""
    lakes: dict[str, Lake] = {}

    def lake(name: str) -> Lake:
        if name not in lakes:
            directory, model = _ANCHORED[name]
            lakes[name] = _captured(tmp_path_factory.mktemp(f"resume-{name}"), DATA / directory, model)
        return lakes[name]
    return lake


@pytest.fixture
def con() -> Iterator[duckdb.DuckDBPyConnection]:
    c = duckdb.connect()
    yield c
    c.close()


def _relations(con: duckdb.DuckDBPyConnection, lake: Lake, before: int | None,
               extra: dict[str, str] | None = None) -> dict[str, duckdb.DuckDBPyRelation]:
    """The scenario's rows of each table, only those stamped before ``before`` when given, and the
    rows of the query ``extra[table]`` too."""
    open_lake(con, lake.path)
    out = {}
    for name in _TABLES:
        where = f"scenario = '{lake.scenario}'"
        t = TABLES[name].time_column
        if before is not None and t is not None:
            where += f" AND coalesce({t}, -1) < {before}"
        sql = f"SELECT * FROM {name} WHERE {where}"
        if extra and name in extra:
            sql += f" UNION ALL ({extra[name]})"
        out[name] = con.sql(sql)
    return out


def _ledger(rel: dict[str, duckdb.DuckDBPyRelation], scenario: str, **kw: object) -> Ledger:
    return ledger_outcomes(requests=rel["requests"], request_blocks=rel["request_blocks"],
                           kv_events=rel["kv_events"], transfers=rel["transfers"], scenario=scenario,
                           bytes_per_token=1000, **kw)  # type: ignore[arg-type]


def _continued_and_full(con: duckdb.DuckDBPyConnection, lake: Lake, x: int,
                        extra: dict[str, str] | None = None,
                        both: dict[str, str] | None = None) -> tuple[Ledger, Ledger, Ledger]:
    """(the old lake's ledger, the new one's continued from it, the new one's full replay); ``extra``:
    rows of the new lake only, ``both``: of both."""
    old = _ledger(_relations(con, lake, x, both), lake.scenario, horizon_ns=x)
    assert old.state is not None and old.state.checkpoint_ns <= x
    con.register("old_frame", old.frame.to_arrow())
    con.execute("CREATE OR REPLACE TABLE previous AS SELECT * FROM old_frame")  # a table: ordered by rowid
    added: dict[str, list[str]] = {}
    for rows in (extra or {}, both or {}):
        for table, query in rows.items():
            added.setdefault(table, []).append(f"({query})")
    new = _relations(con, lake, None, {k: " UNION ALL ".join(v) for k, v in added.items()} or None)
    saved = LedgerState.from_bytes(old.state.to_bytes())  # as the analysis DB keeps it
    resumed = _ledger(new, lake.scenario, resume=Resume(saved, con.table("previous")))
    full = _ledger(new, lake.scenario)
    assert_frame_equal(resumed.frame, full.frame)
    assert full.frame.height > old.frame.height
    return old, resumed, full


_CUTS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("name", ["simulated", "hybrid"])
@_CUTS
@given(at=st.floats(0.05, 0.95))
def test_a_lake_continues_from_any_cut(name: str, request: pytest.FixtureRequest,
                                       con: duckdb.DuckDBPyConnection, at: float) -> None:
    """The simulated fleet (the time rule), and the hybrid capture (two KV cache groups, anchored at
    the full-attention group's stores; the state carries both groups): the settled requests are not
    replayed."""
    lake: Lake = request.getfixturevalue(name)
    x = lake.first + round((lake.last - lake.first) * at)
    _, resumed, full = _continued_and_full(con, lake, x)
    assert resumed.refused is None
    assert resumed.replayed < full.replayed


@pytest.mark.parametrize("name", ["captured", *_ANCHORED])
@_CUTS
@given(at=st.floats(0.05, 0.95))
def test_a_capture_anchored_at_its_stores_continues(name: str, request: pytest.FixtureRequest,
                                                     anchored: Callable[[str], Lake],
                                                     con: duckdb.DuckDBPyConnection,
                                                     at: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real vLLM captures (one group; a hybrid model's, two, with six clients at once; the
    hybrid with sixteen, whose KV cache makes requests queue and preempts them; and both models
    prefilling in chunks under that pressure, the hybrid's in multi-turn chats too): their requests are
    admitted at their own stores (analyzers/admission.py); the state carries the runs settled
    requests claimed, and the rest are admitted over the whole stream: equal to a full replay. The
    captures last seconds, so admission's window (10 minutes in production, the longest a
    request's run may follow its look-up) is cut to 0.5 s here: requests that found no run of their
    own then settle too, and later cuts replay fewer requests."""
    captured: Lake = request.getfixturevalue(name) if name == "captured" else anchored(name)
    monkeypatch.setattr(admission, "ADMISSION_WINDOW_NS", 500_000_000)
    x = captured.first + round((captured.last - captured.first) * at)
    _, resumed, full = _continued_and_full(con, captured, x)
    assert resumed.refused is None and resumed.replayed <= full.replayed


def test_a_capture_continues_past_the_window(captured: Lake, con: duckdb.DuckDBPyConnection,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """At 90% of the capture with a 0.5 s window, most requests are settled: 37 of 300 replayed."""
    monkeypatch.setattr(admission, "ADMISSION_WINDOW_NS", 500_000_000)
    x = captured.first + round((captured.last - captured.first) * 0.9)
    _, resumed, full = _continued_and_full(con, captured, x)
    assert resumed.refused is None and full.replayed == 300
    assert resumed.replayed < full.replayed // 4, resumed.replayed


def test_a_replica_that_starts_publishing_is_replayed_in_full(simulated: Lake,
                                                              con: duckdb.DuckDBPyConnection) -> None:
    """A new location changes the layout of the saved state (and who could hold a block)."""
    x = (simulated.first + simulated.last) // 2
    late = (f"SELECT * REPLACE ('replica-9' AS replica, {simulated.last} AS ts_ns) FROM kv_events "
            f"WHERE scenario = '{simulated.scenario}' AND kind = 'stored' LIMIT 1")
    _, resumed, _ = _continued_and_full(con, simulated, x, {"kv_events": late})
    assert resumed.refused == "a location started publishing KV events"


def test_a_new_group_is_replayed_in_full(simulated: Lake, con: duckdb.DuckDBPyConnection) -> None:
    x = (simulated.first + simulated.last) // 2
    late = (f"SELECT * REPLACE (1 AS group_idx, {simulated.last} AS ts_ns) FROM kv_events "
            f"WHERE scenario = '{simulated.scenario}' AND kind = 'stored' LIMIT 1")
    _, resumed, _ = _continued_and_full(con, simulated, x, {"kv_events": late})
    assert resumed.refused == "KV cache group(s) [1] appeared"


def test_a_second_namespace_is_replayed_in_full(simulated: Lake, con: duckdb.DuckDBPyConnection) -> None:
    """A state saved with one namespace keeps no content maps (outcomes._content): a request under a
    second one, needing content stored before the checkpoint under the first, is
    ``miss_incompatible`` only in a full replay, which the continuation defers to."""
    x = (simulated.first + simulated.last) // 2
    sc, late = simulated.scenario, simulated.last + 1
    open_lake(con, simulated.path)
    ((rid, content),) = con.sql(
        f"SELECT b.request_id, b.content_hash FROM request_blocks b JOIN kv_events e "
        f"ON e.block_hash = b.block_hash AND e.scenario = b.scenario AND e.kind = 'stored' "
        f"AND e.content_hash = b.content_hash WHERE b.scenario = '{sc}' AND b.content_hash <> 0 "
        f"AND e.ts_ns < {simulated.first + (x - simulated.first) // 2} LIMIT 1").fetchall()
    request = (f"SELECT * REPLACE ('tenant-b' AS request_id, {late} AS arrival_ns) FROM requests "
               f"WHERE scenario = '{sc}' AND request_id = '{rid}'")
    block = (f"SELECT * REPLACE ('tenant-b' AS request_id, {late} AS arrival_ns, 'tenant-b' AS namespace, "
             f"xor(block_hash, 12345::UBIGINT) AS block_hash) FROM request_blocks "
             f"WHERE scenario = '{sc}' AND request_id = '{rid}' AND content_hash = {content}")
    _, resumed, full = _continued_and_full(con, simulated, x, {"requests": request, "request_blocks": block})
    assert resumed.refused == ("a second namespace appeared: the saved state holds no content maps "
                               "(_content)")
    got = full.frame.filter(pl.col("request_id") == "tenant-b")
    assert got["outcome"].to_list() == ["miss_incompatible"], got


def test_a_late_load_of_a_settled_request_is_replayed_in_full(simulated: Lake,
                                                             con: duckdb.DuckDBPyConnection) -> None:
    """A load is part of a request's outcome: one stamped after the checkpoint for a request
    settled before it means the settled rows may be wrong."""
    x = (simulated.first + simulated.last) // 2
    late = (f"SELECT t.* REPLACE ({simulated.last} AS ts_ns) FROM transfers t JOIN requests r "
            f"ON t.request_id = r.request_id AND t.replica = r.replica AND t.scenario = r.scenario "
            f"WHERE t.scenario = '{simulated.scenario}' AND r.arrival_ns < {simulated.first + 1} LIMIT 1")
    open_lake(con, simulated.path)
    assert con.sql(f"SELECT count(*) FROM ({late})").fetchall() == [(1,)]
    _, resumed, _ = _continued_and_full(con, simulated, x, {"transfers": late})
    assert resumed.refused == "a request settled at the checkpoint has a load stamped after it"


def test_a_repeated_request_id_is_replayed_in_full(simulated: Lake, con: duckdb.DuckDBPyConnection) -> None:
    """A request row after the checkpoint that repeats the id of a settled request: the settled rows
    of that id may change, so the continuation defers to a full replay and says why."""
    x = (simulated.first + simulated.last) // 2
    sc = simulated.scenario
    again = (f"SELECT * REPLACE ({simulated.last + 1} AS arrival_ns) FROM requests "
             f"WHERE scenario = '{sc}' AND arrival_ns < {simulated.first + 1} LIMIT 1")
    open_lake(con, simulated.path)
    assert con.sql(f"SELECT count(*) FROM ({again})").fetchall() == [(1,)]
    _, resumed, _ = _continued_and_full(con, simulated, x, {"requests": again})
    assert resumed.refused == "1 request row(s) repeat the id of a request after the checkpoint"


def test_a_request_without_an_arrival_is_replayed_in_full(simulated: Lake,
                                                          con: duckdb.DuckDBPyConnection) -> None:
    """A request row with no arrival time cannot be placed before or after the checkpoint."""
    x = (simulated.first + simulated.last) // 2
    unplaced = (f"SELECT * REPLACE ('no-arrival' AS request_id, NULL::BIGINT AS arrival_ns) FROM requests "
                f"WHERE scenario = '{simulated.scenario}' LIMIT 1")
    _, resumed, _ = _continued_and_full(con, simulated, x, {"requests": unplaced})
    assert resumed.refused == "1 request(s) have no arrival time"


def _failed_load(lake: Lake, where: str, at: int) -> str:
    """A failed load stamped at ``at`` of the last full block that its replica received no transfer of
    (seldom a hit: the load then changes its outcome) of the first request that matches ``where`` (on
    requests ``r``), as a row of table transfers."""
    return (f"SELECT b.request_id, b.scenario, {at} AS ts_ns, r.replica, 'pool' AS origin, b.block_hash, "
            "1 AS blocks, 0 AS bytes, 1.0 AS duration_ms, 'error' AS status "
            "FROM request_blocks b JOIN requests r "
            "ON b.request_id = r.request_id AND b.scenario = r.scenario "
            f"WHERE b.scenario = '{lake.scenario}' AND {where} AND b.block_tokens >= b.block_size_tokens "
            "AND NOT EXISTS (SELECT 1 FROM transfers t WHERE t.request_id = b.request_id "
            "AND t.block_hash = b.block_hash AND (t.replica IS NULL OR t.replica = r.replica)) "
            "ORDER BY r.arrival_ns, r.request_id, b.position DESC LIMIT 1")


@pytest.mark.parametrize("whose", ["queued", "unnamed"])
def test_a_continuation_finds_its_requests_transfers_stamped_long_before(
        whose: str, simulated: Lake, con: duckdb.DuckDBPyConnection) -> None:
    """A failed load stamped at the lake's first instant, long before the checkpoint (in the old lake
    and the new): of a request the old lake holds that looks up after the checkpoint (``queued``: its
    transfers are the state's to find), or of a request whose row only the new lake holds
    (``unnamed``: no row named it when the state was saved). The continuation reads the transfers from
    there on, not from its checkpoint, and its outcomes are the full replay's."""
    x = (simulated.first + simulated.last) // 2
    where = {"queued": f"r.arrival_ns < {x} AND r.arrival_ns + r.queue_ms * 1e6 >= {x}",
             "unnamed": f"r.arrival_ns >= {x}"}[whose]
    early = _failed_load(simulated, where, simulated.first)
    open_lake(con, simulated.path)
    assert con.sql(f"SELECT count(*) FROM ({early})").fetchall() == [(1,)]
    old, resumed, full = _continued_and_full(con, simulated, x, both={"transfers": early})
    assert old.state is not None and old.state.loads_from == simulated.first
    assert resumed.loads_from == simulated.first
    # the load changes an outcome: without it, the full replay differs
    without = _ledger(_relations(con, simulated, None), simulated.scenario)
    assert not full.frame.equals(without.frame)


def test_the_runs_settled_requests_claimed_stay_theirs(tmp_path: Path,
                                                       con: duckdb.DuckDBPyConnection) -> None:
    """X (arrives at 1 s) and Y (arrives at 1.5 s, queues 3 s) need the same block A on replica r0.
    X's run stores A at 2 s, it is evicted at 3 s, r1 stores A at 4.7 s and Y's run stores it
    again at 5 s. Admission gives X the run at 2 s and Y the one at 5 s, so Y looks up after r1's
    store (miss_routing). Cut at 4 s: X is settled with its run; continuing, Y must not take X's run
    (it arrived before it): the state carries the claim, and the ledger equals a full replay. (r1
    publishes from 0.5 s: a location that starts publishing after the checkpoint refuses it.)"""
    a, b = 301, 302
    tail = BLOCK + 4
    requests = [_request("X", 1.0, "r0", tail), _request("Y", 1.5, "r0", tail, queue_ms=3000.0),
                _request("Z", 6.0, "r0", tail)]
    blocks = [*_blocks("X", 1.0, [a], (901, 4)), *_blocks("Y", 1.5, [a], (902, 4)),
              *_blocks("Z", 6.0, [b], (903, 4))]
    events = [_ev(0.5, "r1", 1, "stored", 303), _ev(2.0, "r0", 1, "stored", a),
              _ev(3.0, "r0", 2, "removed", a), _ev(4.7, "r1", 2, "stored", a), _ev(5.0, "r0", 3, "stored", a),
              _ev(6.5, "r0", 4, "stored", b)]
    for table, rows in (("requests", requests), ("request_blocks", blocks), ("kv_events", events)):
        _write(tmp_path, "claims", table, rows)
    lake = _span(tmp_path, "claims")
    old, resumed, full = _continued_and_full(con, lake, at(4.0))
    assert old.state is not None and old.state.claimed.tolist() == [1]  # X's run: the stream's second row
    assert resumed.refused is None and resumed.replayed == 2  # Y and Z
    y = full.frame.filter(pl.col("request_id") == "Y").row(0, named=True)
    assert (y["outcome"], y["holder"]) == ("miss_routing", "r1")


@given(known=st.sets(st.integers(-2**63, 2**63 - 1), max_size=30),
       more=st.sets(st.integers(-2**63, 2**63 - 1), max_size=30), shared=st.integers(0, 10))
def test_the_needed_hashes_grow_as_a_union(known: set[int], more: set[int], shared: int) -> None:
    """A state's needed hashes (sorted, unique, as large as the history) take the next ones by
    insertion, not by a sort of both: the result is np.union1d's, at the ends, with repeats, empty."""
    more |= set(sorted(known)[:shared])
    a, b = np.array(sorted(known), np.int64), np.array(sorted(more), np.int64)
    got = _with(a, b)
    assert got.dtype == np.int64 and np.array_equal(got, np.union1d(a, b))


@given(rows=st.lists(st.tuples(st.integers(-3, 3), st.sampled_from([0, 1, 2, 2**63, 2**64 - 1])),
                     max_size=12), presort=st.booleans())
def test_events_in_stream_order_are_told_apart(rows: list[tuple[int, int]], presort: bool) -> None:
    """The ledger and flows skip their sort of the events when a stable sort by (time, sequence)
    would not move them: exactly then, unsigned sequences past 2**63 too."""
    if presort:
        rows = sorted(rows)
    ts = np.array([r[0] for r in rows], np.int64)
    seq = np.array([r[1] for r in rows], np.uint64)
    assert in_order(ts, seq) == bool((np.lexsort((seq, ts)) == np.arange(len(rows))).all())


def test_a_prefetch_reads_its_scenarios_rows_in_order_and_raises_on_the_callers_thread(
        tmp_path: Path) -> None:
    # A continuation reads the previous rows on a thread of its own (outcomes.Prefetch): the rows
    # of its scenario in the order they were written, and an error there is the caller's.
    con = duckdb.connect(str(tmp_path / "prev.duckdb"))
    con.execute("CREATE TABLE t AS SELECT CASE WHEN i % 3 = 0 THEN 'other' ELSE 's' END AS scenario, "
                "(1000 - i) AS v FROM range(3000) r(i)")
    started = Prefetch(con, "t", "s")
    started.start()
    unstarted = Prefetch(con, "t", "s")
    want = [v for (v,) in con.execute("SELECT v FROM t WHERE scenario = 's'").fetchall()]  # scan order
    assert rows_of(started)["v"].to_list() == want == rows_of(unstarted)["v"].to_list()
    # taken once: the prefetch holds them no longer (the analyses after the ledger reuse the memory)
    with pytest.raises(RuntimeError, match="taken already"):
        rows_of(started)
    missing = Prefetch(con, "no_such_table", "s")
    missing.start()
    with pytest.raises(duckdb.CatalogException, match="no_such_table"):
        rows_of(missing)
    con.close()


def test_a_prefetch_drops_the_replayed_requests_rows_on_its_thread_keeping_the_order(tmp_path: Path) -> None:
    # A continuation replaces the rows of the requests it replays: the prefetch started with their
    # ids drops them as it reads (off the caller's thread); taken with other ids, those go too; a
    # relation (no prefetch) is filtered alike. The rest stay in the order they were written.
    con = duckdb.connect(str(tmp_path / "prev.duckdb"))
    con.execute("CREATE TABLE t AS SELECT 's' AS scenario, 'r' || (i % 7) AS request_id, (1000 - i) AS v "
                "FROM range(700) r(i)")
    ids = pl.Series("request_id", ["r2", "r5"])
    want = [v for (v, r) in con.execute("SELECT v, request_id FROM t").fetchall() if r not in ("r2", "r5")]
    started = Prefetch(con, "t", "s")
    started.start(excluding=ids)
    assert rows_of(started, ids)["v"].to_list() == want
    other = Prefetch(con, "t", "s")
    other.start(excluding=pl.Series("request_id", ["r2"]))
    assert rows_of(other, ids)["v"].to_list() == want  # the ids given to take win
    unstarted = Prefetch(con, "t", "s")
    assert rows_of(unstarted, ids)["v"].to_list() == want
    assert rows_of(con.table("t"), ids)["v"].to_list() == want
    assert len(rows_of(con.table("t"))) == 700
    con.close()


def test_a_state_blob_keeps_every_array_exactly_and_refuses_a_damaged_one() -> None:
    """The ledger state's arrays (state_blob.pack_arrays) come back with their values, dtypes and
    shapes, writable (the replay writes into a restored state's copies), empty and 2-D ones too; a
    blob cut short or with a damaged payload is refused with a ValueError (incremental reads that
    as an unreadable state and replays in full), not read as other numbers."""
    rng = np.random.default_rng(7)
    arrays = {"hashes": rng.integers(-2**63, 2**63 - 1, 5_000, dtype=np.int64),
              "words": rng.integers(0, 8, (300, 3), dtype=np.int64),
              "loc_grp": rng.random((4, 2)) < 0.5, "codes": np.arange(-5, 5, dtype=np.int8),
              "empty": np.zeros(0, np.int64), "empty_rows": np.zeros((0, 2), np.int64)}
    blob = pack_arrays({"checkpoint_ns": 12, "specs": "[[0, 1]]"}, arrays)
    head, back = unpack_arrays(blob)
    assert head == {"checkpoint_ns": 12, "specs": "[[0, 1]]"} and back.keys() == arrays.keys()
    for name, a in arrays.items():
        b = back[name]
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b), name
        assert b.flags.writeable, name
    with pytest.raises(ValueError, match="cut short"):
        unpack_arrays(blob[:-10])
    hurt = bytearray(blob)
    hurt[len(blob) // 2:len(blob) // 2 + 64] = bytes(64)  # inside the hashes' compressed bytes
    with pytest.raises(ValueError):
        unpack_arrays(bytes(hurt))
