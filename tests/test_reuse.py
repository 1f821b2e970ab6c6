"""Exact reuse distance: hand-computed cases, the pure-Python oracle, and the `reuse` table."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.analyzers.reuse import ReuseState, _last_accesses, reuse, reuse_distances
from kvlens.schema import REUSE


def oracle(keys: list[int], sizes: list[int]) -> tuple[list[int], list[int]]:
    """Distinct keys (and bytes) in (prev, i], the key itself included, by direct enumeration.

    Every key counts at the size of its latest access before i (the key itself included).
    """
    blocks, byts = [], []
    last: dict[int, int] = {}
    for i, k in enumerate(keys):
        if k not in last:
            blocks.append(-1)
            byts.append(-1)
        else:
            latest: dict[int, int] = {}
            for j in range(last[k] + 1, i):
                latest[keys[j]] = sizes[j]
            latest[k] = sizes[last[k]]
            blocks.append(len(latest))
            byts.append(sum(latest.values()))
        last[k] = i
    return blocks, byts


# Six accesses; block 2 grows from 20 to 25 bytes at its second access.
SIX_KEYS = [1, 2, 1, 3, 2, 1]
SIX_SIZES = [10, 20, 10, 30, 25, 10]
SIX_BLOCKS = [-1, -1, 2, -1, 3, 3]  # (0,2]={2,1}; (1,4]={1,3,2}; (2,5]={3,2,1}
SIX_BYTES = [-1, -1, 30, -1, 60, 65]  # 20+10; 10+30+20 (2 as cached); 30+25 (its newest)+10


def test_six_accesses_by_hand() -> None:
    d = reuse_distances(np.array(SIX_KEYS), np.array(SIX_SIZES))
    assert d.blocks.tolist() == SIX_BLOCKS
    assert d.bytes.tolist() == SIX_BYTES
    assert d.prev.tolist() == [-1, -1, 0, -1, 1, 2]
    assert oracle(SIX_KEYS, SIX_SIZES) == (SIX_BLOCKS, SIX_BYTES)


def test_immediate_reaccess_has_distance_one_and_cached_size() -> None:
    d = reuse_distances(np.array([7, 7, 7], dtype=np.uint64), np.array([5, 6, 6]))
    assert d.blocks.tolist() == [-1, 1, 1]
    assert d.bytes.tolist() == [-1, 5, 6]


def test_keys_above_2_63_and_empty_stream() -> None:
    big = np.array([2**64 - 1, 2**63, 2**64 - 1], dtype=np.uint64)
    assert reuse_distances(big, 1).blocks.tolist() == [-1, -1, 2]
    assert reuse_distances(np.array([], dtype=np.uint64)).blocks.size == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 9)), min_size=1, max_size=400))
def test_matches_oracle_on_random_streams(stream: list[tuple[int, int]]) -> None:
    # Up to 400 accesses over 13 keys: the 64-slot tree is compacted many times.
    keys = [k for k, _ in stream]
    sizes = [s for _, s in stream]
    d = reuse_distances(np.array(keys, dtype=np.uint64), np.array(sizes))
    assert (d.blocks.tolist(), d.bytes.tolist()) == oracle(keys, sizes)


def test_matches_oracle_across_many_compactions() -> None:
    rng = np.random.default_rng(3)
    keys = (rng.zipf(1.3, 3000) % 200).tolist()
    sizes = rng.integers(1, 50, 3000).tolist()
    d = reuse_distances(np.array(keys, dtype=np.uint64), np.array(sizes))
    assert (d.blocks.tolist(), d.bytes.tolist()) == oracle(keys, sizes)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 80), st.lists(st.tuples(st.integers(0, 120), st.integers(1, 9)), max_size=300),
       st.booleans(), st.randoms(use_true_random=False))
def test_a_distinct_head_gives_the_distances_of_the_whole_stream(
        head: int, after: list[tuple[int, int]], uniform: bool, rnd: Any) -> None:
    # A replayed stack (distinct keys) before later accesses, as _resumed builds them: some of its
    # keys named again later, some not, the later accesses also naming keys it lacks.
    stack = rnd.sample(range(121), head)
    keys = stack + [k for k, _ in after]
    sizes = [rnd.randint(1, 9) for _ in stack] + [s for _, s in after]
    if uniform:
        sizes = [4] * len(keys)
    whole = reuse_distances(np.array(keys, dtype=np.uint64), np.array(sizes, dtype=np.int64))
    headed = reuse_distances(np.array(keys, dtype=np.uint64), np.array(sizes, dtype=np.int64),
                             distinct_head=head)
    assert headed.blocks.tolist() == whole.blocks.tolist()
    assert headed.bytes.tolist() == whole.bytes.tolist()
    assert headed.prev.tolist() == whole.prev.tolist()


def _relations(con: duckdb.DuckDBPyConnection) -> tuple[duckdb.DuckDBPyRelation, ...]:
    # Three requests: r1 on a (blocks 1,2), r2 on b (blocks 1,3), r3 on a (blocks 1,2, tail 4).
    rb = pl.DataFrame({
        "request_id": ["r1", "r1", "r2", "r2", "r3", "r3", "r3", "x"],
        "scenario": ["s"] * 7 + ["other"],
        "arrival_ns": [100, 100, 200, 200, 400, 400, 400, 0],
        "position": [0, 1, 0, 1, 0, 1, 2, 0],
        "block_hash": pl.Series([1, 2, 1, 3, 1, 2, 4, 1], dtype=pl.UInt64),
        "block_tokens": [16, 16, 16, 16, 16, 16, 5, 16],
        "block_size_tokens": [16] * 8,
    })
    req = pl.DataFrame({"request_id": ["r1", "r2", "r3"], "scenario": ["s"] * 3, "replica": ["a", "b", "a"]})
    ev = pl.DataFrame({
        "ts_ns": [10, 20, 30, 40], "scenario": ["s"] * 4, "replica": ["a", "a", "b", "a"],
        "seq": [1, 2, 3, 4], "kind": ["stored", "stored", "stored", "removed"],
        "block_hash": pl.Series([1, 2, 1, 1], dtype=pl.UInt64),
        "block_tokens": [16, None, 16, 16], "medium": ["gpu"] * 4, "position": [0, 1, 0, 0],
    })
    return con.from_arrow(rb.to_arrow()), con.from_arrow(req.to_arrow()), con.from_arrow(ev.to_arrow())


def test_reuse_table_streams() -> None:
    con = duckdb.connect()
    rb, req, ev = _relations(con)
    out = reuse(request_blocks=rb.filter("scenario = 's'"), kv_events=ev, bytes_per_token=2, scenario="s",
                requests=req)
    assert out.columns == list(REUSE.names)
    by = {s: f.sort("ts_ns", "block_hash") for (s,), f in out.group_by("stream")}
    # requests stream 1,2,1,3,1,2,4: re-accesses 1@200 (d=2), 1@400 (d=2: 3,1), 2@400 (d=3: 3,1,2)
    r = by["requests"]
    assert r["block_hash"].to_list() == [1, 1, 2]
    assert r["distance_blocks"].to_list() == [2, 2, 3]
    assert r["distance_bytes"].to_list() == [64, 64, 96]
    assert r["interval_ns"].to_list() == [100, 200, 300]
    assert by["group:1"]["distance_blocks"].to_list() == [2, 2]
    # replica a saw 1,2 then 1,2,4: both re-accesses at distance 2
    assert by["replica:a"]["distance_blocks"].to_list() == [2, 2]
    assert by["replica:b"].height == 0 if "replica:b" in by else True
    # kv_events stores: fleet 1,2,1 -> one re-store at distance 2; the NULL size takes the mode (16)
    assert by["fleet"]["distance_bytes"].to_list() == [64]
    assert "replica:a/gpu" not in by  # a stored 1 and 2 once each
    assert (out["scenario"] == "s").all()


def test_a_shared_access_stream_gives_the_same_tables(tmp_path: Path, mooncake3: Path) -> None:
    # kvlens analyze builds the requests stream and its distances once for reuse, mrc and TTL.
    from kvlens.analyzers.capacity import ttl_coverage
    from kvlens.analyzers.mrc import mrc
    from kvlens.analyzers.reuse import access_stream, reuse
    from kvlens.collector.importer import import_files
    from kvlens.lake import open_lake

    lake = tmp_path / "lake"
    import_files("mooncake", [mooncake3], lake, scenario="s")
    con = duckdb.connect()
    open_lake(con, lake)
    rb, reqs = con.table("request_blocks"), con.table("requests")
    shared = access_stream(rb, "s", 100, reqs)
    assert shared.distances.reaccess.sum() == 2  # blocks 10 and 11 come back in the third request
    kw = {"request_blocks": rb, "bytes_per_token": 100, "scenario": "s"}
    assert reuse(**kw, requests=reqs).equals(reuse(**kw, stream=shared))
    assert mrc(**kw, sample_rate=0.5).equals(mrc(**kw, sample_rate=0.5, stream=shared))
    assert ttl_coverage(**kw).equals(ttl_coverage(**kw, stream=shared))


def test_event_stream_order_does_not_depend_on_row_order() -> None:
    """One stored event carries a chain of blocks (same ts_ns, replica, seq): they are accessed in
    position order whatever order the lake's segments hold the rows in, so two analyses of the
    same lake give the same fleet distances (kvlens analyze's incremental mode relies on it)."""
    con = duckdb.connect()
    rb, req, _ = _relations(con)
    blocks = list(range(1, 9))
    rows = {"ts_ns": [100] * 8 + [200] * 8, "seq": [1] * 8 + [2] * 8, "replica": ["a"] * 16,
            "kind": ["stored"] * 16, "block_hash": blocks + blocks, "position": list(range(8)) * 2,
            "block_tokens": [16] * 16, "medium": ["gpu"] * 16, "scenario": ["s"] * 16}
    ordered = pl.DataFrame(rows)
    outs = []
    for frame in (ordered, ordered.reverse(), ordered.sample(fraction=1.0, shuffle=True, seed=3)):
        ev = con.from_arrow(frame.to_arrow())
        out = reuse(request_blocks=rb, kv_events=ev, bytes_per_token=2, scenario="s", requests=req)
        outs.append(out.filter(pl.col("stream") == "fleet").sort("ts_ns", "block_hash"))
    # Each block of the second event is re-stored with the 7 others of the chain in between: 8.
    assert outs[0]["distance_blocks"].to_list() == [8] * 8
    assert outs[1].equals(outs[0]) and outs[2].equals(outs[0])


# -- continuing from a saved state (kvlens analyze's incremental runs) ---------------------------------


def _grown(requests: list[tuple[int, str, list[int], bool]],
           events: list[tuple[int | None, str, str, int, int | None]]) -> tuple[pl.DataFrame, ...]:
    """request_blocks, requests and kv_events of scenario ``s``: requests (arrival, replica, chain
    of block hashes, a partial tail) and stored events (ts, replica, medium, block, tokens)."""
    rb, req = [], []
    for i, (arrival, replica, chain, tail) in enumerate(requests):
        req.append({"request_id": f"r{i}", "scenario": "s", "replica": replica})
        for pos, block in enumerate(chain):
            partial = tail and pos == len(chain) - 1
            rb.append({"request_id": f"r{i}", "scenario": "s", "arrival_ns": arrival, "position": pos,
                       "block_hash": block, "block_tokens": 5 if partial else 16, "block_size_tokens": 16})
    ev = [{"ts_ns": ts, "seq": n, "replica": rep, "kind": "stored", "block_hash": block,
           "block_tokens": tokens, "medium": medium, "position": 0, "scenario": "s"}
          for n, (ts, rep, medium, block, tokens) in enumerate(events)]
    return (pl.DataFrame(rb, schema_overrides={"block_hash": pl.UInt64}),
            pl.DataFrame(req),
            pl.DataFrame(ev, schema={"ts_ns": pl.Int64, "seq": pl.Int64, "replica": pl.String,
                                     "kind": pl.String, "block_hash": pl.UInt64, "block_tokens": pl.Int64,
                                     "medium": pl.String, "position": pl.Int32, "scenario": pl.String}))


def _runs(frames: tuple[pl.DataFrame, ...], lakes: list[int],
          lag: int) -> list[tuple[pl.DataFrame, pl.DataFrame]]:
    """For each lake end L (the lake holds what is stamped before it, the checkpoint is L - lag):
    the table kept by continuing (the rows before the previous checkpoint, then the new ones) and
    reuse of the whole lake then. No row stamped before a checkpoint arrives after it, as
    ``kvlens analyze`` guarantees (it rebuilds on a late segment)."""
    from kvlens.analyzers.reuse import ReuseState, access_stream, reuse_continued

    rb, req, ev = frames
    con = duckdb.connect()
    out, table, state = [], None, None
    for end in lakes:
        blocks = con.from_arrow(rb.filter(pl.col("arrival_ns") < end).to_arrow())
        if not blocks.filter("block_tokens = 16").aggregate("count(*)").fetchall()[0][0]:
            continue
        reqs = con.from_arrow(req.to_arrow())
        events = con.from_arrow(ev.filter(pl.col("ts_ns").is_null() | (pl.col("ts_ns") < end)).to_arrow())
        acc = access_stream(blocks, "s", 2, reqs)
        got = reuse_continued(kv_events=events, bytes_per_token=2, scenario="s", stream=acc, resume=state,
                              checkpoint_ns=end - lag)
        assert state is None or got.refused is None or "block_tokens" in got.refused, got.refused
        if got.since is not None:
            assert table is not None
            table = pl.concat([table.filter(pl.col("ts_ns") < got.since), got.frame])
        else:
            table = got.frame
        whole = reuse(request_blocks=blocks, kv_events=events, bytes_per_token=2, scenario="s",
                      requests=reqs)
        out.append((table, whole))
        assert got.state is not None
        state = ReuseState.from_bytes(got.state.to_bytes())  # as the analysis DB keeps it
        kept = table.filter(pl.col("ts_ns") < state.checkpoint_ns).height
        state = dataclasses.replace(state, kept_rows=kept)
    return out


_ORDER = list(REUSE.names)


@settings(max_examples=150, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 40), st.sampled_from("ab"),
                                   st.lists(st.integers(1, 9), min_size=1, max_size=4), st.booleans()),
                         min_size=1, max_size=25),
       events=st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 40)), st.sampled_from("ab"),
                                 st.sampled_from(["gpu", "cpu"]),
                                 st.integers(1, 9), st.sampled_from([None, 8, 16, 16])), max_size=25),
       ends=st.lists(st.integers(1, 41), min_size=1, max_size=4, unique=True), lag=st.integers(0, 6))
def test_continued_reuse_equals_reuse_of_the_whole_lake(
        requests: list[tuple[int, str, list[int], bool]],
        events: list[tuple[int | None, str, str, int, int | None]], ends: list[int], lag: int) -> None:
    """A lake grown by random time slices, reuse continued from the state the previous run saved:
    after every run the table (the rows before the checkpoint kept, the rest new) is the table of
    the whole lake, every stream (replicas, groups, fleet, replica/medium) row for row. Events
    stamped without a time are in the lake from the start and sort last."""
    for table, whole in _runs(_grown(requests, events), [*sorted(ends), 10**6], lag):
        assert table.sort(_ORDER).equals(whole.sort(_ORDER))


def test_a_block_that_becomes_a_chain_root_later_gets_its_earlier_group_rows() -> None:
    """Block 2 is re-accessed at t=200 (after the checkpoint of the first run it is settled), and
    only at t=300 starts a chain: its group stream then holds the re-access at 200 as well, which
    the continued run adds to the rows it kept."""
    frames = _grown([(100, "a", [1, 2], False), (200, "a", [1, 2], False), (300, "b", [2, 5], False)], [])
    (first, _), (table, whole) = _runs(frames, [260, 10**6], lag=10)
    assert "group:2" not in first["stream"].to_list()
    assert table.filter(pl.col("stream") == "group:2")["ts_ns"].to_list() == [200, 300]
    assert table.sort(_ORDER).equals(whole.sort(_ORDER))


def test_a_continued_table_past_the_row_cap_is_computed_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlens.analyzers.reuse import access_stream, reuse_continued

    module = importlib.import_module("kvlens.analyzers.reuse")  # the package's `reuse` is the function

    rb, req, _ = _grown([(100, "a", [1, 2], False), (200, "a", [1, 2], False), (300, "a", [1, 2], False)], [])
    con = duckdb.connect()
    acc = access_stream(con.from_arrow(rb.filter(pl.col("arrival_ns") < 250).to_arrow()), "s", 2,
                        con.from_arrow(req.to_arrow()))
    state = reuse_continued(kv_events=None, bytes_per_token=2, scenario="s", stream=acc,
                            checkpoint_ns=240).state
    assert state is not None and state.accesses == 4
    monkeypatch.setattr(module, "MAX_REUSE_ROWS", 5)
    acc = access_stream(con.from_arrow(rb.to_arrow()), "s", 2, con.from_arrow(req.to_arrow()))
    got = reuse_continued(kv_events=None, bytes_per_token=2, scenario="s", stream=acc,
                          resume=dataclasses.replace(state, kept_rows=4), checkpoint_ns=290)
    assert got.since is None and got.refused is not None and "would pass 5" in got.refused
    assert got.frame.filter(pl.col("stream") == "requests").height == 4  # capped: the requests stream only


def test_an_event_without_a_time_sorts_last_with_no_interval() -> None:
    """A stored event the engine did not stamp (ts_ns NULL) used to stop the whole analysis (a
    float column among integer ones); it is the last access of its streams, and its re-access row
    has no time and no interval."""
    rb, req, ev = _grown([(100, "a", [1, 2], False)], [(10, "a", "gpu", 1, 16), (None, "a", "gpu", 1, 16),
                                                        (30, "a", "gpu", 1, 16)])
    con = duckdb.connect()
    out = reuse(request_blocks=con.from_arrow(rb.to_arrow()), kv_events=con.from_arrow(ev.to_arrow()),
                bytes_per_token=2, scenario="s", requests=con.from_arrow(req.to_arrow()))
    fleet = out.filter(pl.col("stream") == "fleet").sort("ts_ns", nulls_last=True)
    assert fleet.select("ts_ns", "distance_blocks", "interval_ns").rows() == [(30, 1, 20), (None, 1, None)]


@given(lengths=st.lists(st.integers(0, 5), max_size=4))
def test_a_states_stacks_read_back_per_stream(lengths: list[int]) -> None:
    """Each stream's stack, in order, after the state is written and read back; a state whose
    streams do not add up to its stacks' rows, or name a stream twice, does not read."""
    names = [f"replica:r{i}" for i in range(len(lengths))]
    stacks = pl.DataFrame({"block_hash": list(range(sum(lengths))), "size": [16] * sum(lengths),
                           "ts_ns": [10 * i for i in range(sum(lengths))]},
                          schema={"block_hash": pl.UInt64, "size": pl.Int64, "ts_ns": pl.Int64})
    tokens = pl.DataFrame(schema={"block_tokens": pl.Int64, "count": pl.Int64})
    roots = pl.DataFrame(schema={"block_hash": pl.UInt64})
    state = ReuseState(5, 2, 0, 0, 0, 16, tokens, stacks, roots, tuple(zip(names, lengths, strict=True)))
    got = ReuseState.from_bytes(state.to_bytes()).by_stream()
    assert list(got) == names
    start = 0
    for name, n in zip(names, lengths, strict=True):
        assert got[name].to_dicts() == stacks.slice(start, n).to_dicts()
        start += n
    with pytest.raises(ValueError, match="not those of streams"):
        ReuseState(5, 2, 0, 0, 0, 16, tokens, stacks, roots, (("fleet", sum(lengths) + 1),))
    if lengths:
        with pytest.raises(ValueError, match="not those of streams"):
            ReuseState(5, 2, 0, 0, 0, 16, tokens, stacks, roots, (("fleet", sum(lengths)), ("fleet", 0)))


@settings(deadline=None)  # (the first example loads the distance kernels)
@given(keys=st.lists(st.integers(0, 6), max_size=40), cut=st.integers(0, 40))
def test_a_stacks_last_accesses_are_each_keys_latest_before_the_cut(keys: list[int], cut: int) -> None:
    """A saved stack: each key of the first ``cut`` accesses once, at its last access among them
    (its size and time there), in the order of those accesses."""
    n = min(cut, len(keys))
    arr = np.array(keys, np.uint64)
    sizes = np.arange(len(keys), dtype=np.int64) * 10 + 1  # a size and a time per access
    ts = pl.Series(np.arange(len(keys), dtype=np.int64) * 100)
    got = _last_accesses(arr, sizes, ts, reuse_distances(arr, sizes).prev, n)
    last = {k: i for i, k in enumerate(keys[:n])}  # each key's latest index before the cut
    order = sorted(last.values())
    assert got.columns == ["block_hash", "size", "ts_ns"]
    assert got.rows() == [(keys[i], int(sizes[i]), i * 100) for i in order]
