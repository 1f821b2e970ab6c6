"""analyzers/admission.py on a hand-made stream: where each request's look-up falls among the events."""

from __future__ import annotations

import numpy as np
import polars as pl

from kvlens.analyzers.admission import admission_cuts

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
