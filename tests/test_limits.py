"""Tests for kvlens.limits: what each schema type can hold."""

from __future__ import annotations

import math

import pytest

from kvlens.limits import fits, row_problem
from kvlens.schema import KV_EVENTS, METRIC_SAMPLES, REQUESTS


@pytest.mark.parametrize(("table", "column", "good", "bad"), [
    (REQUESTS, "arrival_ns", [0, -(2**63), 2**63 - 1, None], [2**63, 1.5, True, "1"]),
    (KV_EVENTS, "seq", [0, 2**64 - 1], [-1, 2**64]),
    (KV_EVENTS, "dp_rank", [2**31 - 1, -(2**31)], [2**31, -(2**31) - 1]),
    (REQUESTS, "ttft_ms", [0.5, 3, -1.0], [math.nan, math.inf, -math.inf, "1", False]),
    (KV_EVENTS, "kind", ["stored", "cleared"], ["STORED", "evicted", 1]),
    (REQUESTS, "request_id", ["r", "é", ""], ["\ud800", b"r", 1]),
    (METRIC_SAMPLES, "labels", [[("a", "b")], {"a": "b"}, []], [[("a",)], [("a", 1)], "ab"]),
    (KV_EVENTS, "token_ids", [[1, 2], []], [[2**31], [1.0], "12"]),
])
def test_values_fit_their_column_type(table, column, good, bad) -> None:  # type: ignore[no-untyped-def]
    col = table.column(column)
    assert all(fits(col, v) for v in good)
    assert not any(fits(col, v) for v in bad)


def test_row_problem_names_the_column() -> None:
    assert row_problem(REQUESTS, {"request_id": "r", "arrival_ns": 5}) is None
    assert "first_token_ns" in (row_problem(REQUESTS, {"first_token_ns": 2**64 - 1}) or "")
    assert "no column" in (row_problem(REQUESTS, {"nope": 1}) or "")
