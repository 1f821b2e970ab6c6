"""kvlens.analysis_db.settings: DuckDB settings changed for a block and put back after it."""

from __future__ import annotations

from collections.abc import Iterator

import duckdb
import pytest

from kvlens.analysis_db import _shown_bytes, settings


def _now(con: duckdb.DuckDBPyConnection) -> tuple[object, ...]:
    row = con.execute("SELECT current_setting('threads'), current_setting('preserve_insertion_order'), "
                      "current_setting('memory_limit')").fetchone()
    assert row is not None
    return tuple(row)


@pytest.fixture
def con() -> Iterator[duckdb.DuckDBPyConnection]:
    c = duckdb.connect(config={"threads": 2, "preserve_insertion_order": True, "memory_limit": "512MiB"})
    yield c
    c.close()


def test_settings_hold_inside_the_block_and_are_put_back_after_it(con: duckdb.DuckDBPyConnection) -> None:
    before = _now(con)
    with settings(con, threads=1, preserve_insertion_order=False, memory_limit="256MiB") as previous:
        assert _now(con) == (1, False, "256.0 MiB")
        assert previous == {"threads": 2, "preserve_insertion_order": True, "memory_limit": "512.0 MiB"}
    assert _now(con) == before == (2, True, "512.0 MiB")


def test_settings_are_put_back_when_the_block_raises(con: duckdb.DuckDBPyConnection) -> None:
    before = _now(con)
    with pytest.raises(RuntimeError, match="in the block"), settings(con, threads=1,
                                                                      preserve_insertion_order=False):
        raise RuntimeError("in the block")
    assert _now(con) == before


def test_settings_are_put_back_when_a_generator_holding_them_is_closed(
        con: duckdb.DuckDBPyConnection) -> None:
    def rows() -> Iterator[int]:  # as reuse.requests_read holds them while it yields chunks
        with settings(con, threads=1):
            yield from range(3)

    before = _now(con)
    it = rows()
    assert next(it) == 0
    assert _now(con)[0] == 1
    it.close()
    assert _now(con) == before


def test_a_setting_duckdb_refuses_puts_back_those_already_changed(con: duckdb.DuckDBPyConnection) -> None:
    before = _now(con)
    with pytest.raises(duckdb.Error), settings(con, threads=1, memory_limit="not a size"):
        pytest.fail("the block must not run when a setting is refused")
    assert _now(con) == before


def test_no_settings_is_a_block_that_changes_nothing(con: duckdb.DuckDBPyConnection) -> None:
    before = _now(con)
    with settings(con) as previous:
        assert previous == {}
    assert _now(con) == before


_LIMITS = [1_900_000_000, 1_825_361_101, 1_825_570_816, 3 * 2**40 + 5, 2**30, 512 * 2**20, 1023 * 2**20 + 7]


@pytest.mark.parametrize("limit", _LIMITS)
def test_a_size_duckdb_shows_cut_is_put_back_unchanged_however_often_a_block_sets_it(limit: int) -> None:
    # DuckDB shows memory_limit cut to one decimal; put back as that text, "1.7 GiB" parses a little
    # under 1.7 GiB and shows as "1.6 GiB": a block per analysis step lowered the limit every time
    con = duckdb.connect(config={"memory_limit": f"{limit}B"})
    try:
        shown = _now(con)[2]
        for _ in range(4):
            with settings(con, memory_limit="256MiB", threads=1):
                assert _now(con)[2] == "256.0 MiB"
            assert _now(con)[2] == shown
    finally:
        con.close()


@pytest.mark.parametrize("limit", _LIMITS)
def test_the_bytes_put_back_are_the_fewest_duckdb_shows_as_it_showed(limit: int) -> None:
    con = duckdb.connect(config={"memory_limit": f"{limit}B"})
    try:
        shown = _now(con)[2]
        least = _shown_bytes(shown)
        assert least is not None and least <= limit
        con.execute(f"SET memory_limit = '{least}B'")
        assert _now(con)[2] == shown
        con.execute(f"SET memory_limit = '{least - 1}B'")
        assert _now(con)[2] != shown
    finally:
        con.close()


def test_a_setting_that_is_not_a_shown_size_is_put_back_as_its_text() -> None:
    assert _shown_bytes("90% of available disk space") is None
    assert _shown_bytes("134217728B") is None
    assert _shown_bytes("1.7 GB") is None  # (a decimal unit: not how DuckDB shows its limits)
