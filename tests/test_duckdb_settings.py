"""kvlens.analysis_db.settings: DuckDB settings changed for a block and put back after it."""

from __future__ import annotations

from collections.abc import Iterator

import duckdb
import pytest

from kvlens.analysis_db import settings


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
