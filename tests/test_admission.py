"""analyzers/admission.py on a hand-made stream: where each request's look-up falls among the events."""

from __future__ import annotations

import numpy as np
import polars as pl

from kvlens.analyzers.admission import ADMISSION_WINDOW_NS, admission_cuts

A, B, C, D = 11, 12, 13, 14


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
    cuts, _ = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert cuts.tolist() == [0, 2]  # x before its own run; y once A and B are held


def test_a_request_with_a_block_never_stored_keeps_its_time() -> None:
    # y needs C, which nobody stored (and B is evicted again): y cannot have found every block
    # cached, so its look-up keeps its time (and the replay calls what it finds then).
    ev = _stream([(100, 0, A, 0), (100, 0, B, A), (100, 1, B, 0), (200, 0, D, 0)])
    req, full = _requests({"x": (10, [A, B]), "y": (20, [A, B, C])})
    cuts, _ = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert cuts.tolist() == [0, 0]


def test_a_run_past_the_admission_window_is_not_the_request_s() -> None:
    # x needs A; the only run of A is stamped more than ADMISSION_WINDOW_NS after x looked up: a
    # later request's, never x's (vLLM publishes a step's stores when the step ends), so x keeps
    # its time; a run inside the window is x's.
    late, inside = 10 + ADMISSION_WINDOW_NS + 1, 10 + ADMISSION_WINDOW_NS
    req, full = _requests({"x": (10, [A])})
    for stamp, own in ((late, -1), (inside, 1)):  # 1: the run is the stream's second row
        ev = _stream([(5, 0, B, 0), (stamp, 0, A, 0)])
        cuts, owns = admission_cuts(ev, req, full, np.zeros(1, np.int64))
        assert owns.tolist() == [own], stamp
        assert cuts.tolist() == [1], stamp  # its time (after B), or just before its own run


def test_runs_claimed_before_are_not_taken_again() -> None:
    # x and y need A; runs of A at 100 and 300. Admitted together, x takes the first and y the
    # second; y admitted alone with x's run claimed gets the same run.
    ev = _stream([(100, 0, A, 0), (200, 1, A, 0), (300, 0, A, 0)])
    req, full = _requests({"x": (10, [A]), "y": (20, [A])})
    _, both = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert both.tolist() == [0, 2]
    y_req, y_full = _requests({"y": (20, [A])})
    _, alone = admission_cuts(ev, y_req, y_full, np.zeros(1, np.int64), claimed=[0])
    _, unaware = admission_cuts(ev, y_req, y_full, np.zeros(1, np.int64))
    assert alone.tolist() == [2] and unaware.tolist() == [0]


def test_a_request_that_stored_nothing_finds_a_run_claimed_after_it_in_arrival_order() -> None:
    # y (A B, a partial tail) reaches the gateway just before x (A B C), but the engine admits x
    # first (the API server hands requests to the engine core in the order it finishes them, not
    # in the gateway's): x stores A B C, y finds A and B cached and stores nothing. The run is x's
    # although x comes after y in look-up order; y's look-up is after it (the engine's 64 hit
    # tokens: CI saw this ledger give 0 where the engine had 160).
    ev = _stream([(100, 0, A, 0), (100, 0, B, A), (100, 0, C, B)])
    req, full = _requests({"y": (10, [A, B]), "x": (11, [A, B, C])})
    cuts, owns = admission_cuts(ev, req, full, np.zeros(2, np.int64))
    assert owns.tolist() == [-1, 0]
    assert cuts.tolist() == [2, 0]  # y once A and B are held; x before its own run


def test_a_run_nobody_claims_is_still_not_a_hit() -> None:
    # A B were stored by a run that goes on with D: the run of a request the lake does not hold
    # (y needs no block after B). No request claims it, so y, which matched no run of its own,
    # keeps its time (a miss), not a hit (measured live: such a place gave 704 hit tokens to a
    # request the engine served with 0).
    ev = _stream([(100, 0, A, 0), (100, 0, B, A), (100, 0, D, B)])
    req, full = _requests({"y": (10, [A, B])})
    cuts, owns = admission_cuts(ev, req, full, np.zeros(1, np.int64))
    assert owns.tolist() == [-1] and cuts.tolist() == [0]
