"""analyzers/admission.py on a hand-made stream: where each request's look-up falls among the events."""

from __future__ import annotations

import numpy as np
import polars as pl

from kvlens.analyzers.admission import ADMISSION_WINDOW_NS, admission_cuts, anchor_groups

A, B, C, D, E = 11, 12, 13, 14, 15


def _stream(rows: list[tuple[int, int, int, int]]) -> dict[str, np.ndarray]:
    """(ts, kind, hash, parent) rows of one replica (location 0, one KV cache group), one batch each ts."""
    ts, kind, h, parent = (np.array(col, np.int64) for col in zip(*rows, strict=True))
    return {"ev_ts": ts, "ev_kind": kind.astype(np.int8), "ev_loc": np.zeros(len(rows), np.int32),
            "ev_grp": np.zeros(len(rows), np.int32), "ev_h": h, "ev_seq": ts // 100, "ev_parent": parent}


def _requests(chains: dict[str, tuple[int, list[int]]]) -> tuple[pl.DataFrame, pl.DataFrame]:
    req = pl.DataFrame({"request_id": list(chains), "arrival_ns": [t for t, _ in chains.values()],
                        "lookup_ns": [t for t, _ in chains.values()]})
    full = pl.DataFrame([{"request_id": r, "position": p, "block_hash_i64": h}
                         for r, (_, chain) in chains.items() for p, h in enumerate(chain)])
    return req, full


def test_a_request_that_stored_nothing_looks_up_after_the_blocks_it_found() -> None:
    # x (blocks A B C) and then y (A B, a partial tail) arrive before the step that admits both:
    # x stores A B C; y, admitted after it in the same step, finds A and B cached and stores
    # nothing; the step's batch is stamped after both arrived.
    ev = _stream([(100, 0, A, 0), (100, 0, B, A), (100, 0, C, B)])
    req, full = _requests({"x": (10, [A, B, C]), "y": (20, [A, B])})
    cuts, _, _ = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert cuts.tolist() == [0, 2]  # x before its own run; y once A and B are held


def test_a_request_with_a_block_never_stored_keeps_its_time() -> None:
    # y needs C, which nobody stored (and B is evicted again): y cannot have found every block
    # cached, so its look-up keeps its time (and the replay calls what it finds then).
    ev = _stream([(100, 0, A, 0), (100, 0, B, A), (100, 1, B, 0), (200, 0, D, 0)])
    req, full = _requests({"x": (10, [A, B]), "y": (20, [A, B, C])})
    cuts, _, _ = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert cuts.tolist() == [0, 0]


def test_a_run_past_the_admission_window_is_not_the_request_s() -> None:
    # x needs A; the only run of A is stamped more than ADMISSION_WINDOW_NS after x looked up: a
    # later request's, never x's (vLLM publishes a step's stores when the step ends), so x keeps
    # its time; a run inside the window is x's.
    late, inside = 10 + ADMISSION_WINDOW_NS + 1, 10 + ADMISSION_WINDOW_NS
    req, full = _requests({"x": (10, [A])})
    for stamp, own in ((late, -1), (inside, 1)):  # 1: the run is the stream's second row
        ev = _stream([(5, 0, B, 0), (stamp, 0, A, 0)])
        cuts, owns, _ = admission_cuts(ev, req, full, np.zeros(1, np.int64))
        assert owns.tolist() == [own], stamp
        assert cuts.tolist() == [1], stamp  # its time (after B), or just before its own run


def test_runs_claimed_before_are_not_taken_again() -> None:
    # x and y need A; runs of A at 100 and 300. Admitted together, x takes the first and y the
    # second; y admitted alone with x's run claimed gets the same run.
    ev = _stream([(100, 0, A, 0), (200, 1, A, 0), (300, 0, A, 0)])
    req, full = _requests({"x": (10, [A]), "y": (20, [A])})
    _, both, _ = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert both.tolist() == [0, 2]
    y_req, y_full = _requests({"y": (20, [A])})
    _, alone, _ = admission_cuts(ev, y_req, y_full, np.zeros(1, np.int64), claimed=[0])
    _, unaware, _ = admission_cuts(ev, y_req, y_full, np.zeros(1, np.int64))
    assert alone.tolist() == [2] and unaware.tolist() == [0]


def test_a_request_that_stored_nothing_finds_a_run_claimed_after_it_in_arrival_order() -> None:
    # y (A B, a partial tail) reaches the gateway just before x (A B C), but the engine admits x
    # first (the API server hands requests to the engine core in the order it finishes them, not
    # in the gateway's): x stores A B C, y finds A and B cached and stores nothing. The run is x's
    # although x comes after y in look-up order; y's look-up is after it (the engine's 64 hit
    # tokens: CI saw this ledger give 0 where the engine had 160).
    ev = _stream([(100, 0, A, 0), (100, 0, B, A), (100, 0, C, B)])
    req, full = _requests({"y": (10, [A, B]), "x": (11, [A, B, C])})
    cuts, owns, _ = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert owns.tolist() == [-1, 0]
    assert cuts.tolist() == [2, 0]  # y once A and B are held; x before its own run


def test_a_run_nobody_claims_is_still_not_a_hit() -> None:
    # A B were stored by a run that goes on with D: the run of a request the lake does not hold
    # (y needs no block after B). No request claims it, so y, which matched no run of its own,
    # keeps its time (a miss), not a hit (measured live: such a place gave 704 hit tokens to a
    # request the engine served with 0).
    ev = _stream([(100, 0, A, 0), (100, 0, B, A), (100, 0, D, B)])
    req, full = _requests({"y": (10, [A, B])})
    cuts, owns, _ = admission_cuts(ev, req, full, np.zeros(1, np.int64))
    assert owns.tolist() == [-1] and cuts.tolist() == [0]


def test_a_prefix_run_is_a_request_s_only_when_its_next_chunk_follows() -> None:
    # y (A B C D) found every block cached and stored nothing; later, after an eviction, x (A B, a
    # shorter prompt of the same system prompt) stores A B. That run ends inside y's blocks, and
    # nothing continues it with C after B: it is x's, not a first chunk of y's (which y, earlier in
    # look-up order, took before). With a run of C D from B following, A B is y's first chunk.
    held = [(5, 0, A, 0), (5, 0, B, A), (5, 0, C, B), (5, 0, D, C)]
    ev = _stream([*held, (100, 1, A, 0), (100, 1, B, 0), (200, 0, A, 0), (200, 0, B, A)])
    req, full = _requests({"y": (10, [A, B, C, D]), "x": (150, [A, B])})
    cuts, owns, _ = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert owns.tolist() == [-1, 6] and cuts.tolist() == [4, 6]  # y at its time (all held), x its run
    chunked = _stream([(100, 0, A, 0), (100, 0, B, A), (200, 0, C, B), (200, 0, D, C)])
    req, full = _requests({"y": (10, [A, B, C, D])})
    _, owns, _ = admission_cuts(chunked, req, full, np.zeros(1, np.int64))
    assert owns.tolist() == [0]


def test_a_block_with_a_second_copy_stays_held_after_one_removal() -> None:
    # A stored twice (vLLM computed it again: a second physical block), one copy evicted: y, which
    # stored nothing, still found A cached at its time, not only after w's later store of A D.
    ev = _stream([(5, 0, A, 0), (6, 0, A, 0), (7, 1, A, 0), (300, 0, A, 0), (300, 0, D, A)])
    req, full = _requests({"x": (1, [A]), "z": (4, [A]), "y": (10, [A]), "w": (250, [A, D])})
    cuts, owns, _ = admission_cuts(ev, req, full, np.zeros(4, np.int64))
    assert owns.tolist() == [0, 1, -1, 3]  # x, z and w took the three stores, y none
    assert cuts.tolist()[2] == 3  # y at its time: A still held (one copy left), not after w's run


def _hybrid(rows: list[tuple[int, int, int, int, int]]) -> dict[str, np.ndarray]:
    """(ts, kind, group, hash, parent) rows of one replica with two KV cache groups."""
    ts, kind, grp, h, parent = (np.array(col, np.int64) for col in zip(*rows, strict=True))
    return {"ev_ts": ts, "ev_kind": kind.astype(np.int8), "ev_loc": np.zeros(len(rows), np.int32),
            "ev_grp": grp.astype(np.int32), "ev_h": h, "ev_seq": ts // 100, "ev_parent": parent}


def test_a_hybrid_request_is_anchored_at_its_full_attention_run_and_looks_up_before_its_window_s() -> None:
    # Group 0 a sliding window, group 1 full attention. x (A B C) and y (A B, a partial tail) arrive
    # before the step that admits both, x first: x caches C in the window group (its other blocks
    # can never serve a hit there: no parent named) and A B C in the full group; y finds A and B
    # cached and stores nothing. x looks up before its window-group row; y after x's rows.
    loc_grp, windows = np.array([[True, True]]), np.array([[128, 0]])
    anchors = anchor_groups(loc_grp, windows)
    assert anchors.tolist() == [1]
    ev = _hybrid([(100, 0, 0, C, 0), (100, 0, 1, A, 0), (100, 0, 1, B, A), (100, 0, 1, C, B)])
    req, full = _requests({"x": (10, [A, B, C]), "y": (20, [A, B])})
    cuts, owns, _ = admission_cuts(ev, req, full, np.zeros(2, np.int64), anchors=anchors)
    assert owns.tolist() == [1, -1] and cuts.tolist() == [0, 3]
    # without windows (one location, two groups), every request keeps its time
    cuts, owns, _ = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert owns.tolist() == [-2, -2] and cuts.tolist() == [0, 0]
    # a window group's removal of B does not evict the full group's copy
    ev = _hybrid([(5, 0, 0, A, 0), (5, 0, 1, A, 0), (5, 0, 0, B, A), (5, 0, 1, B, A), (7, 1, 0, B, 0),
                  (100, 0, 1, E, 0)])
    req, full = _requests({"y": (20, [A, B])})
    cuts, owns, _ = admission_cuts(ev, req, full, np.zeros(1, np.int64), anchors=anchors)
    assert owns.tolist() == [-1] and cuts.tolist() == [5]


def test_anchor_groups() -> None:
    loc_grp = np.array([[True, False, False], [True, True, True], [False, True, True], [False, False, False]])
    windows = np.array([[128, 0, 0], [128, 0, 0], [64, 128, 0], [0, 0, 0]])
    # one group: that one, even a window's; several: the first without a window; none: -1
    assert anchor_groups(loc_grp, windows).tolist() == [0, 1, 2, -1]
    assert anchor_groups(np.array([[True, True]]), np.array([[64, 128]])).tolist() == [-1]


def test_a_hybrid_request_that_stored_nothing_waits_for_its_window_groups_tail() -> None:
    # Group 0 a sliding window of 128 tokens (blocks of 32: a hit needs the last 4 blocks, all of a
    # shorter chain), group 1 full attention. x stores A B C in both groups; the window group's B and
    # C are evicted before y (A B C, a partial tail) arrives, while the full group still holds all
    # three. w (A B C D) then finds only A in the window group (its hit: 1 block) and stores B C D
    # in both groups. y stored nothing, so the engine admitted it where both groups held what its
    # whole hit needs: after w's window rows store B and C again (measured on a real vLLM 0.32: a
    # request queued 117 ms read 32 hit tokens at its arrival where the engine had 96).
    loc_grp, windows = np.array([[True, True]]), np.array([[128, 0]])
    ev = _hybrid([(5, 0, 0, A, 0), (5, 0, 0, B, A), (5, 0, 0, C, B), (5, 0, 1, A, 0), (5, 0, 1, B, A),
                  (5, 0, 1, C, B), (9, 1, 0, B, 0), (9, 1, 0, C, 0), (300, 0, 0, B, A), (300, 0, 0, C, B),
                  (300, 0, 0, D, C), (300, 0, 1, B, A), (300, 0, 1, C, B), (300, 0, 1, D, C)])
    req, full = _requests({"x": (1, [A, B, C]), "y": (20, [A, B, C]), "w": (30, [A, B, C, D])})
    req = req.with_columns(block_size=pl.lit(32))
    tails = np.where(loc_grp, windows, 0)
    cuts, owns, _ = admission_cuts(ev, req, full, np.zeros(3, np.int64),
                                   anchors=anchor_groups(loc_grp, windows), windows=tails)
    assert owns.tolist() == [3, -1, 11] and cuts.tolist()[2] == 8  # w before its window rows
    assert cuts.tolist()[1] == 10  # after the window group's B and C of w's batch, not at y's time (8)
    # without the windows, the full group's blocks alone place y at its time
    cuts, _, _ = admission_cuts(ev, req, full, np.zeros(3, np.int64),
                                anchors=anchor_groups(loc_grp, windows))
    assert cuts.tolist()[1] == 8


def _batches(rows: list[tuple[int, int, int, int, int]]) -> dict[str, np.ndarray]:
    """(ts, batch, kind, hash, parent) rows of one replica with one KV cache group."""
    ts, seq, kind, h, parent = (np.array(col, np.int64) for col in zip(*rows, strict=True))
    return {"ev_ts": ts, "ev_kind": kind.astype(np.int8), "ev_loc": np.zeros(len(rows), np.int32),
            "ev_grp": np.zeros(len(rows), np.int32), "ev_h": h, "ev_seq": seq, "ev_parent": parent}


def test_a_chunk_after_an_eviction_of_its_parent_is_the_requests_next_chunk() -> None:
    # x (A B C D) prefills in two chunks; the second chunk's allocation evicts another copy of B,
    # B's removal just before C (parent B) in the same batch: C still starts the next chunk.
    ev = _batches([(100, 1, 0, A, 0), (100, 1, 0, B, A), (200, 2, 1, B, 0), (200, 2, 0, C, B),
                   (200, 2, 0, D, C)])
    req, full = _requests({"x": (10, [A, B, C, D])})
    _, owns, chunks = admission_cuts(ev, req, full, np.zeros(1, np.int64))
    assert owns.tolist() == [0] and chunks == [[3]]


def test_a_later_chunk_is_claimed_with_its_run() -> None:
    # x (A B C D) prefills in two chunks (A B, then C D at the next step); y (A B C D E), admitted
    # after them, found A..D cached and stores E: its run is E's, not x's second chunk.
    ev = _batches([(100, 1, 0, A, 0), (100, 1, 0, B, A), (200, 2, 0, C, B), (200, 2, 0, D, C),
                   (300, 3, 0, E, D)])
    req, full = _requests({"x": (10, [A, B, C, D]), "y": (20, [A, B, C, D, E])})
    cuts, owns, chunks = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert owns.tolist() == [0, 4] and chunks == [[2], []] and cuts.tolist() == [0, 4]


def test_a_preempted_request_is_looked_up_at_its_first_admission() -> None:
    # x (A B C D) stores A B (its first chunk) and is preempted; B is evicted; admitted again, x
    # finds A and stores B C D. vLLM counts its first admission's hit (none): x looks up before A.
    ev = _batches([(100, 1, 0, A, 0), (100, 1, 0, B, A), (200, 2, 1, B, 0), (300, 3, 0, B, A),
                   (300, 3, 0, C, B), (300, 3, 0, D, C)])
    req, full = _requests({"x": (10, [A, B, C, D])})
    cuts, owns, chunks = admission_cuts(ev, req, full, np.zeros(1, np.int64))
    assert owns.tolist() == [0] and chunks == [[3]] and cuts.tolist() == [0]
    # a prompt of A B that may still come (arrived before that run) may own it: x keeps its later run
    req, full = _requests({"x": (10, [A, B, C, D]), "y": (20, [A, B])})
    _, owns, _ = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert owns.tolist() == [3, 0]
    # one that came after it may not
    req, full = _requests({"x": (10, [A, B, C, D]), "y": (250, [A, B])})
    _, owns, _ = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert owns.tolist()[0] == 0


def test_a_request_admitted_before_later_arrivals_took_no_run_after_theirs() -> None:
    ms = 1_000_000
    # w stores A B; x (A B) arrives and finds them cached (stores nothing); they are evicted; v,
    # arriving 290 ms after x, stores E; z (A B C D) arrives later and prefills A B, then C D. x's
    # blocks match z's first chunk, but the engine admits in arrival order: x was admitted before
    # v, so that chunk is z's.
    ev = _batches([(5 * ms, 1, 0, A, 0), (5 * ms, 1, 0, B, A), (300 * ms, 2, 1, A, 0), (300 * ms, 2, 1, B, 0),
                   (400 * ms, 3, 0, E, 0), (700 * ms, 4, 0, A, 0), (700 * ms, 4, 0, B, A),
                   (710 * ms, 5, 0, C, B), (710 * ms, 5, 0, D, C)])
    req, full = _requests({"w": (1 * ms, [A, B]), "x": (10 * ms, [A, B]), "v": (300 * ms, [E]),
                           "z": (600 * ms, [A, B, C, D])})
    cuts, owns, _ = admission_cuts(ev, req, full, np.zeros(4, np.int64))
    assert owns.tolist() == [0, -1, 4, 5] and cuts.tolist()[1] == 2  # x where w's A B are held
