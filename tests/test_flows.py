"""Byte flows and fan-out: a hand-built lake where every byte's place is known, and the demo."""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.analyzers.fanout import fanout
from kvlens.analyzers.flows import FlowsState, _agrees, flows

PER_TOKEN = 10
BLOCK = 2  # tokens, so 20 bytes a block
A, B, C, D, E, F = 1, 2, 3, 4, 5, 6


def _ev(ts: int, replica: str, kind: str, block: int | None, medium: str | None) -> dict[str, object]:
    return {"scenario": "s", "ts_ns": ts, "seq": ts, "replica": replica, "kind": kind, "block_hash": block,
            "medium": medium, "block_tokens": None if block is None else BLOCK}


def _hit(rid: str, replica: str, arrival: int, block: int, outcome: str) -> dict[str, object]:
    return {"scenario": "s", "request_id": rid, "replica": replica, "arrival_ns": arrival, "position": 0,
            "block_hash": block, "outcome": outcome, "tokens": BLOCK, "bytes": BLOCK * PER_TOKEN}


@pytest.fixture
def lake() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    events = pl.DataFrame([
        _ev(0, "r0", "stored", A, "gpu"),
        _ev(0, "r0", "stored", B, "gpu"),
        _ev(0, "r0", "stored", F, "gpu"),     # never read, never removed: unread, resident
        _ev(0, "r0", "stored", D, "cpu"),
        _ev(5, "pool", "stored", A, "pool"),
        _ev(10, "r1", "stored", C, "gpu"),
        _ev(50, "r1", "cleared", None, None),  # clears C unread
        _ev(100, "r0", "removed", B, "gpu"),   # B evicted unread
    ], schema_overrides={"block_hash": pl.UInt64, "block_tokens": pl.Int32, "seq": pl.UInt64})
    transfers = pl.DataFrame([
        {"scenario": "s", "request_id": "q2", "ts_ns": 30, "replica": "r1", "origin": "pool", "block_hash": A,
         "blocks": 1, "bytes": 20, "duration_ms": 1.0, "status": "ok"},
    ], schema_overrides={"block_hash": pl.UInt64})
    con.register("kv_events", events)
    con.register("transfers", transfers)
    return con


def _outcomes() -> pl.DataFrame:
    return pl.DataFrame([
        _hit("q1", "r0", 10, A, "hit_local"),
        _hit("q1", "r0", 10, D, "hit_offload"),
        _hit("q2", "r1", 30, A, "hit_remote"),
        _hit("q3", "r1", 150, E, "hit_local"),     # no store of E anywhere in the lake
        _hit("q3", "r1", 150, C, "miss_evicted"),  # not a read
    ], schema_overrides={"block_hash": pl.UInt64})


def _ledger() -> pl.DataFrame:
    return pl.DataFrame({"request_id": ["q1", "q2", "q3"], "arrival_ns": [10, 30, 150],
                         "queue_ms": [0.0, 0.0, None]})


def _flows(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    return flows(block_outcomes=_outcomes(), request_ledger=_ledger(), kv_events=con.table("kv_events"),
                 transfers=con.table("transfers"), scenario="s", bytes_per_token=PER_TOKEN, window_ns=100)


def test_every_byte_lands_in_its_row(lake: duckdb.DuckDBPyConnection) -> None:
    out = _flows(lake)
    got = {(r["replica"], r["window_start_ns"], r["tier"]): (
        r["read_bytes"], r["write_bytes"], r["replica_bytes"], r["never_read_bytes"],
        r["read_unwritten_bytes"], r["unread_resident_bytes"]) for r in out.iter_rows(named=True)}
    #        read write copy never unwritten resident
    assert got == {
        ("pool", 0, "pool"): (20, 20, 0, 0, 0, 0),
        ("r0", 0, "gpu"): (20, 60, 0, 20, 0, 20),
        ("r0", 0, "cpu"): (20, 20, 0, 0, 0, 0),
        ("r1", 0, "gpu"): (0, 20, 20, 20, 0, 0),
        ("r1", 100, "gpu"): (20, 0, 0, 0, 20, 0),
    }
    assert out["scenario"].unique().to_list() == ["s"]


def test_flows_conserve_bytes(lake: duckdb.DuckDBPyConnection) -> None:
    out = _flows(lake)
    hits = _outcomes().filter(pl.col("outcome").str.starts_with("hit_"))
    assert out["read_bytes"].sum() == hits["bytes"].sum() == 80
    # What is read was written, except the one read the lake never saw stored, which is named.
    assert out["read_unwritten_bytes"].sum() == 20
    assert (out["never_read_bytes"] + out["unread_resident_bytes"] <= out["write_bytes"]).all()
    # The pool's one remote read is the one copy into r1.
    assert out["replica_bytes"].sum() == out.filter(pl.col("tier") == "pool")["read_bytes"].sum()


def test_a_read_before_the_store_matches_the_later_store(lake: duckdb.DuckDBPyConnection) -> None:
    # The simulator's shared pool can be written by a request that starts after the reader.
    early = _outcomes().with_columns(
        arrival_ns=pl.when(pl.col("request_id") == "q2").then(2).otherwise(pl.col("arrival_ns")))
    ledger = _ledger().with_columns(arrival_ns=pl.Series([10, 2, 150]))
    out = flows(block_outcomes=early, request_ledger=ledger, kv_events=lake.table("kv_events"),
                transfers=lake.table("transfers"), scenario="s", bytes_per_token=PER_TOKEN, window_ns=100)
    pool = out.filter(pl.col("replica") == "pool").row(0, named=True)
    assert (pool["read_bytes"], pool["read_unwritten_bytes"], pool["unread_resident_bytes"]) == (20, 0, 0)


def test_fanout_counts_replicas_per_block_and_window() -> None:
    rows = [_hit(f"q{i}", rep, t, blk, out) for i, (rep, t, blk, out) in enumerate([
        ("r0", 0, A, "hit_local"), ("r1", 10, A, "hit_remote"), ("r2", 20, A, "hit_remote"),
        ("r0", 30, B, "miss_cold"), ("r0", 40, B, "hit_local"), ("r1", 150, A, "hit_local")])]
    out = fanout(block_outcomes=pl.DataFrame(rows, schema_overrides={"block_hash": pl.UInt64}), window_ns=100)
    first, second = out.row(0, named=True), out.row(1, named=True)
    assert (first["window_start_ns"], first["needed_blocks"], first["shared_blocks"]) == (0, 2, 1)
    assert (first["fanout_max_replicas"], first["fanout_mean_replicas"]) == (3, 2.0)
    assert first["duplicate_bytes"] == 2 * 20
    assert (first["pulled_bytes"], first["pulled_max_replicas"], first["top_block_hash"]) == (40, 2, A)
    assert (second["window_start_ns"], second["fanout_max_replicas"], second["pulled_bytes"]) == (100, 1, 0)


@pytest.mark.parametrize("seed", range(4))
def test_fanout_windows_stand_alone(seed: int) -> None:
    """What a continued analysis relies on (analyzers/fanout.py ``fanout_since``): the rows of the
    windows from the earliest new arrival on are fanout of the rows that arrived from that window
    on; the earlier windows' rows are those a previous analysis wrote."""
    import numpy as np

    from kvlens.analyzers.fanout import fanout_since

    rng = np.random.default_rng(seed)
    n = 300
    outcomes = pl.DataFrame({
        "scenario": "s", "request_id": [f"q{i}" for i in rng.integers(0, 60, n)],
        "replica": [f"r{i}" for i in rng.integers(0, 3, n)],
        "arrival_ns": np.sort(rng.integers(0, 1000, n)), "position": rng.integers(0, 5, n).astype(np.int32),
        "block_hash": rng.integers(1, 40, n).astype(np.uint64),
        "outcome": rng.choice(["hit_local", "hit_remote", "miss_cold", "miss_evicted"], n),
        "bytes": rng.integers(1, 100, n)})
    whole = fanout(block_outcomes=outcomes, window_ns=100)
    arrivals = outcomes["arrival_ns"]
    for cut in (int(arrivals[0]), int(arrivals[37]), int(arrivals[150]), int(arrivals[-1])):
        appended = outcomes.filter(pl.col("arrival_ns") >= cut)
        since = fanout_since(appended, window_ns=100)
        assert since is not None and since <= cut
        kept = whole.filter(pl.col("window_start_ns") < since)
        redone = fanout(block_outcomes=outcomes.filter(pl.col("arrival_ns") >= since), window_ns=100)
        assert pl.concat([kept, redone]).equals(whole)
    assert fanout_since(outcomes.clear(), window_ns=100) is None


def test_demo_flows_read_what_the_ledger_hit(demo_workdir: Path) -> None:
    con = duckdb.connect(str(demo_workdir / "kvlens.duckdb"), read_only=True)
    hit = dict(con.execute("SELECT scenario, sum(bytes) FROM block_outcomes WHERE outcome IN "
                           "('hit_local', 'hit_offload', 'hit_remote') GROUP BY 1").fetchall())
    read = dict(con.execute("SELECT scenario, sum(read_bytes) FROM flows GROUP BY 1").fetchall())
    assert hit and read == hit
    ((unwritten, over, never, written),) = con.execute(
        "SELECT sum(read_unwritten_bytes), count(*) FILTER (WHERE never_read_bytes > write_bytes), "
        "sum(never_read_bytes), sum(write_bytes) FROM flows").fetchall()
    assert (unwritten, over) == (0, 0)
    assert 0 < never < written
    # Fan-out: the shared system prompt reaches every replica in every window.
    ((most,),) = con.execute("SELECT min(fanout_max_replicas) FROM fanout WHERE scenario = 'rr8'").fetchall()
    ((replicas,),) = con.execute("SELECT count(DISTINCT replica) FROM request_ledger "
                                 "WHERE scenario = 'rr8'").fetchall()
    assert most == replicas > 1


_OPS = st.lists(st.tuples(st.sampled_from(["r0", "r1"]), st.integers(1, 3), st.booleans()), max_size=30)


@settings(max_examples=40, deadline=None)
@given(ops=_OPS)
def test_flows_match_a_residency_oracle(ops: list[tuple[str, int, bool]]) -> None:
    """Stores and removals toggle residency; a look-up (odd times) of a resident block is a hit."""
    resident: dict[tuple[str, int], int] = {}  # -> index of the open store
    reads_per_store: list[int] = []
    ended: list[bool] = []
    events, hits = [], []
    for i, (rep, block, lookup) in enumerate(ops):
        t = 2 * i
        if lookup:
            if (rep, block) in resident:
                reads_per_store[resident[(rep, block)]] += 1
                hits.append(_hit(f"q{i}", rep, t + 1, block, "hit_local"))
        elif (rep, block) in resident:
            ended[resident.pop((rep, block))] = True
            events.append(_ev(t, rep, "removed", block, "gpu"))
        else:
            resident[(rep, block)] = len(reads_per_store)
            reads_per_store.append(0)
            ended.append(False)
            events.append(_ev(t, rep, "stored", block, "gpu"))
    con = duckdb.connect()
    con.register("kv_events", pl.DataFrame(events or [_ev(0, "r0", "cleared", None, None)], schema_overrides={
        "block_hash": pl.UInt64, "block_tokens": pl.Int32, "seq": pl.UInt64, "medium": pl.Utf8}))
    no_transfers = {"scenario": pl.Utf8, "ts_ns": pl.Int64, "request_id": pl.Utf8, "replica": pl.Utf8,
                    "origin": pl.Utf8, "block_hash": pl.UInt64, "bytes": pl.Int64, "status": pl.Utf8}
    con.register("transfers", pl.DataFrame(schema=no_transfers))
    outcomes = pl.DataFrame(hits, schema=_outcomes().schema)
    ledger = outcomes.select("request_id", "arrival_ns", queue_ms=pl.lit(0.0))
    out = flows(block_outcomes=outcomes, request_ledger=ledger, kv_events=con.table("kv_events"),
                transfers=con.table("transfers"), scenario="s", bytes_per_token=PER_TOKEN, window_ns=7)
    per_block = BLOCK * PER_TOKEN
    assert out["read_bytes"].sum() == len(hits) * per_block
    assert out["read_unwritten_bytes"].sum() == 0
    assert out["write_bytes"].sum() == len(reads_per_store) * per_block
    never = sum(1 for n, e in zip(reads_per_store, ended, strict=True) if n == 0 and e)
    still = sum(1 for n, e in zip(reads_per_store, ended, strict=True) if n == 0 and not e)
    assert out["never_read_bytes"].sum() == never * per_block
    assert out["unread_resident_bytes"].sum() == still * per_block
    assert (out["never_read_bytes"] + out["unread_resident_bytes"] <= out["write_bytes"]).all()


_LOCS = ["r0", "r1", "pool"]
_MEDIA = ["gpu", "cpu", "pool", None]
_KINDS = ["stored", "stored", "stored", "removed", "removed", "cleared"]


def _random_lake(data: st.DataObject) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """Events, transfers and the ledger's hits of a few blocks over a few locations and tiers,
    with clears (of one tier or all), removals, re-stores, events without block_tokens, local,
    offloaded and remote reads; times in [0, 100), a request's load stamped at its look-up."""
    events = []
    for i in range(data.draw(st.integers(0, 40))):
        kind = data.draw(st.sampled_from(_KINDS))
        loc = data.draw(st.sampled_from(_LOCS))
        medium = data.draw(st.sampled_from(_MEDIA))
        block = None if kind == "cleared" else data.draw(st.integers(1, 3))
        tokens = None if block is None or data.draw(st.integers(0, 9)) == 0 else BLOCK
        events.append({"scenario": "s", "ts_ns": data.draw(st.integers(0, 99)), "seq": i, "replica": loc,
                       "kind": kind, "block_hash": block, "medium": medium, "block_tokens": tokens})
    hits, loads = [], []
    for i in range(data.draw(st.integers(0, 15))):
        t = data.draw(st.integers(0, 99))
        outcome = data.draw(st.sampled_from(["hit_local", "hit_offload", "hit_remote", "miss_evicted"]))
        block = data.draw(st.integers(1, 3))
        hits.append(_hit(f"q{i}", data.draw(st.sampled_from(["r0", "r1"])), t, block, outcome) | {
            "tokens": data.draw(st.sampled_from([BLOCK, BLOCK, 1]))})
        if outcome == "hit_remote" and data.draw(st.booleans()):
            origin = data.draw(st.sampled_from(["pool", "r0", "r1", "cpu"]))
            loads.append({"scenario": "s", "request_id": f"q{i}", "ts_ns": t, "replica": hits[-1]["replica"],
                          "origin": origin, "block_hash": block,
                          "blocks": 1, "bytes": 20, "duration_ms": 1.0,
                          "status": data.draw(st.sampled_from(["ok", "ok", "failed"]))})
    ev_schema = {"scenario": pl.Utf8, "ts_ns": pl.Int64, "seq": pl.UInt64, "replica": pl.Utf8,
                 "kind": pl.Utf8, "block_hash": pl.UInt64, "medium": pl.Utf8, "block_tokens": pl.Int32}
    tr_schema = {"scenario": pl.Utf8, "request_id": pl.Utf8, "ts_ns": pl.Int64, "replica": pl.Utf8,
                 "origin": pl.Utf8, "block_hash": pl.UInt64, "blocks": pl.Int64, "bytes": pl.Int64,
                 "duration_ms": pl.Float64, "status": pl.Utf8}
    out_schema = dict(_outcomes().schema) | {"tokens": pl.Int64}
    return (pl.DataFrame(events, schema=ev_schema), pl.DataFrame(loads, schema=tr_schema),
            pl.DataFrame(hits, schema=out_schema))


def _grown(events: pl.DataFrame, loads: pl.DataFrame, hits: pl.DataFrame, ends: list[int],
           checkpoints: list[int]) -> FlowsState | None:
    """Flows of a lake seen growing (rows stamped before each of ``ends``), each run continuing from
    the state the previous one saved at its checkpoint, equal flows of what that run sees; the
    last state."""
    from kvlens.analyzers.flows import flows_continued

    state: FlowsState | None = None
    con = duckdb.connect()
    for end, at in zip(ends, checkpoints, strict=True):
        ev, tr = events.filter(pl.col("ts_ns") < end), loads.filter(pl.col("ts_ns") < end)
        seen = hits.filter(pl.col("arrival_ns") < end)
        ledger = seen.select("request_id", "arrival_ns", queue_ms=pl.lit(0.0)).unique("request_id")
        con.register("kv_events", ev)
        con.register("transfers", tr)
        con.register("requests", ledger)
        args = {"block_outcomes": seen, "request_ledger": ledger, "kv_events": con.table("kv_events"),
                "transfers": con.table("transfers"), "scenario": "s", "bytes_per_token": PER_TOKEN,
                "window_ns": 7}
        # with the requests, a continued run reads only the loads of the requests it reads again
        got, state = flows_continued(**args, resume=state, checkpoint_ns=at,  # type: ignore[arg-type]
                                     requests=con.table("requests"))
        state = FlowsState.from_bytes(state.to_bytes()) if state is not None else None
        want = flows(**args)  # type: ignore[arg-type]
        assert got.to_dicts() == want.to_dicts()
    return state


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_continued_flows_equal_flows_of_the_whole_lake(data: st.DataObject) -> None:
    """Random lakes, seen growing; each checkpoint at most its run's end, never back."""
    events, loads, hits = _random_lake(data)
    ends = [*sorted(data.draw(st.lists(st.integers(1, 100), min_size=1, max_size=4))), 100]
    checkpoints: list[int] = []
    for end in ends:
        checkpoints.append(data.draw(st.integers(checkpoints[-1] if checkpoints else 0, end)))
    _grown(events, loads, hits, ends, checkpoints)


def test_a_later_read_of_an_evicted_latest_store_is_matched_to_it() -> None:
    """A store evicted before the checkpoint, with no later store of its block there, stays open:
    a read after the checkpoint (a hit the events did not explain) is still matched to it, as in
    flows of the whole lake, so the store is read, not never read, in that run and the next."""
    schema = {"block_hash": pl.UInt64, "block_tokens": pl.Int32, "seq": pl.UInt64}
    events = pl.DataFrame([_ev(1, "r0", "stored", A, "gpu"), _ev(2, "r0", "removed", A, "gpu"),
                           _ev(3, "r0", "stored", B, "gpu"), _ev(4, "r0", "stored", B, "gpu")],
                          schema_overrides=schema)
    hits = pl.DataFrame([_hit("q", "r0", 10, A, "hit_local")], schema_overrides={"block_hash": pl.UInt64})
    no_loads = pl.DataFrame(schema={"scenario": pl.Utf8, "request_id": pl.Utf8, "ts_ns": pl.Int64,
                                    "replica": pl.Utf8, "origin": pl.Utf8, "block_hash": pl.UInt64,
                                    "bytes": pl.Int64, "status": pl.Utf8})
    _grown(events, no_loads, hits, [5, 20], [5, 20])
    # A run after the one that read it: the sums its state carries no longer count it never read.
    _grown(events, no_loads, hits, [5, 20, 30], [5, 20, 30])


def test_a_kept_evicted_store_stored_again_leaves_the_state() -> None:
    """A store kept evicted at one checkpoint (the latest of its block there) whose block is stored
    again before the next one is settled then: the next state keeps only the newer store."""
    schema = {"block_hash": pl.UInt64, "block_tokens": pl.Int32, "seq": pl.UInt64}
    events = pl.DataFrame([_ev(1, "r0", "stored", A, "gpu"), _ev(2, "r0", "removed", A, "gpu"),
                           _ev(10, "r0", "stored", A, "gpu"), _ev(11, "r0", "removed", A, "gpu")],
                          schema_overrides=schema)
    unseen = pl.DataFrame([_hit("q", "r0", 30, B, "hit_local")],  # after both runs' ends
                          schema_overrides={"block_hash": pl.UInt64})
    no_loads = pl.DataFrame(schema={"scenario": pl.Utf8, "request_id": pl.Utf8, "ts_ns": pl.Int64,
                                    "replica": pl.Utf8, "origin": pl.Utf8, "block_hash": pl.UInt64,
                                    "bytes": pl.Int64, "status": pl.Utf8})
    state = _grown(events, no_loads, unseen, [5, 20], [5, 20])
    assert state is not None
    assert state.stores.select("ts_ns", "ended").to_dicts() == [{"ts_ns": 10, "ended": "removed"}]


class _Unread:
    """A relation that must not be read."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the lake was read ({name})")


def test_a_state_before_the_rows_gained_agrees_without_a_count() -> None:
    """A run that knows the events it gained are stamped from a time on (an appended run's new
    segments) does not count the events before a checkpoint before that time again; one that
    does not know counts them, and a state of another window never agrees."""
    empty = pl.DataFrame()
    st = FlowsState(100, 3, 60, 2, 16, False, empty, empty, empty)
    assert _agrees(st, _Unread(), 60, 2, 16, unchanged_before=100)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="the lake was read"):
        _agrees(st, _Unread(), 60, 2, 16, unchanged_before=99)  # type: ignore[arg-type]
    assert not _agrees(st, _Unread(), 30, 2, 16, unchanged_before=100)  # type: ignore[arg-type]
    con = duckdb.connect()
    events = con.sql("SELECT * FROM (VALUES (10), (20), (30), (150)) t(ts_ns)")
    assert _agrees(st, events, 60, 2, 16)
    assert not _agrees(st, con.sql("SELECT * FROM (VALUES (10), (150)) t(ts_ns)"), 60, 2, 16)
