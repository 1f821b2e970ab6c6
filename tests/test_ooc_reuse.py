"""The reuse-distance family out of core (issue 17): tables `reuse`, `mrc` and `ttl_coverage` computed
from the `requests` stream read in order in chunks on one LRU stack (the other streams each continued
from their stacks, the TTL figures aggregated in DuckDB) equal the one-process analysis' rows exactly.

Every lake is read in small chunks, so that the stacks really carry each stream from one chunk to the
next."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import duckdb
import polars as pl
import pytest
from ooc_harness import after_ledger, ledger_db, memory_db, same_rows
from scale_lake import ScaleFleet, write_scale_lake

from kvlens.analyzers import SHARDS_RATE
from kvlens.analyzers.capacity import DEFAULT_TTLS_S, ttl_coverage_out_of_core
from kvlens.analyzers.mrc import mrc_out_of_core
from kvlens.analyzers.reuse import StreamChunk, reuse_out_of_core
from kvlens.analyzers.stream_summary import CurvesChain
from kvlens.errors import ConfigError
from kvlens.lake import open_lake, write_scenario
from kvlens.schema import REUSE

LAKES = {"simulated": (), "capture": (), "hybrid": (), "hand": ("clear",)}


def _scenarios(db: Path) -> list[str]:
    with duckdb.connect(str(db), read_only=True) as con:
        return [s for (s,) in con.execute("SELECT scenario FROM scenarios ORDER BY 1").fetchall()]


def _per_token(con: duckdb.DuckDBPyConnection, scenario: str) -> int:
    ((per_token,),) = con.execute("SELECT kv_bytes_per_token FROM scenarios WHERE scenario = ?",
                                  [scenario]).fetchall()
    return int(per_token)


def _family(con: duckdb.DuckDBPyConnection, scenario: str, work: Path, rows: int
            ) -> tuple[list[pl.DataFrame], pl.DataFrame, pl.DataFrame, int]:
    """The three tables from one read of the stream, as the pipeline calls them: reuse's pieces,
    mrc, ttl_coverage, and the count of chunks the `requests` stream was read in."""
    per_token = _per_token(con, scenario)
    chain = CurvesChain(rate=SHARDS_RATE, ttls_s=DEFAULT_TTLS_S)
    chunks = []

    def on_chunk(chunk: StreamChunk) -> None:
        chunks.append(chunk.frame.height)
        chain.add(chunk)

    pieces = list(reuse_out_of_core(con, scenario, work=work, partitions=3, bytes_per_token=per_token,
                                    on_chunk=on_chunk, rows=rows))
    curve = mrc_out_of_core(con, scenario, work=work, partitions=3, bytes_per_token=per_token,
                            sample_rate=SHARDS_RATE, chain=chain)
    ttl = ttl_coverage_out_of_core(con, scenario, work=work, partitions=3, bytes_per_token=per_token,
                                   chain=chain)
    return pieces, curve, ttl, len(chunks)


def _rows(pieces: list[pl.DataFrame]) -> pl.DataFrame:
    return pl.concat(pieces) if pieces else pl.DataFrame(schema=dict.fromkeys(REUSE.names, pl.Int64))


@pytest.fixture(scope="module")
def built(ooc_lakes: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Per lake: its one-process analysis DB and its out-of-core ledger DB (built once)."""
    out = {}
    for name, scenarios in LAKES.items():
        tmp = tmp_path_factory.mktemp(name)
        mem = memory_db(ooc_lakes[name], tmp / "memory.duckdb", scenarios)
        ooc = ledger_db(ooc_lakes[name], tmp / "ooc.duckdb", scenarios)
        out[name] = (mem, ooc, _scenarios(mem))
    yield out


@pytest.mark.parametrize("name", list(LAKES))
@pytest.mark.parametrize("rows", [12, 100])
def test_the_test_lakes(built: dict, ooc_lakes: dict[str, Path], tmp_path: Path, name: str,
                        rows: int) -> None:
    """Every scenario of the lakes out of core accepts, read in chunks of 12 and 100 accesses (or a
    quarter of the other streams' stacks): the same rows as the one-process analysis, in its order
    for `reuse`."""
    mem, ooc, scenarios = built[name]
    assert scenarios
    with after_ledger(ooc, ooc_lakes[name]) as con:
        for i, scenario in enumerate(scenarios):
            pieces, curve, ttl, _ = _family(con, scenario, tmp_path / f"work{i}", rows)
            got = _rows(pieces)
            assert same_rows(got, mem, "reuse", scenario) == got.height
            assert got.select("stream", "ts_ns", "block_hash").equals(
                got.select("stream", "ts_ns", "block_hash").sort("stream", "ts_ns", "block_hash",
                                                               nulls_last=False))
            assert same_rows(curve, mem, "mrc", scenario) > 0
            assert same_rows(ttl, mem, "ttl_coverage", scenario) == len(DEFAULT_TTLS_S)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The generated fleet (tests/scale_lake.py), small caches: its lake, one-process DB and
    out-of-core ledger DB."""
    tmp = tmp_path_factory.mktemp("fleet")
    lake = tmp / "lake"
    write_scale_lake(lake, 40_000, fleet=ScaleFleet(replicas=4, capacity=700, prefixes=400),
                     chunk_requests=150)
    return lake, memory_db(lake, tmp / "memory.duckdb"), ledger_db(lake, tmp / "ooc.duckdb", partitions=7,
                                                                   rows_per_range=5_000)


def test_a_generated_fleet(fleet: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """40k accesses and their events read in chunks of 3,000 (or more, see above): every
    stream's rows, the exact and SHARDS curves and the TTL rows are the one-process ones."""
    lake, mem, ooc = fleet
    with after_ledger(ooc, lake) as con:
        pieces, curve, ttl, chunks = _family(con, "scale", tmp_path / "work", 3_000)
        ((left,),) = con.execute("SELECT count(*) FROM duckdb_tables() WHERE temporary").fetchall()
    assert left == 0  # its temporary tables are dropped
    assert chunks >= 4
    got = _rows(pieces)
    assert same_rows(got, mem, "reuse", "scale") == got.height
    streams = set(got["stream"].str.replace(r":.*", "").unique())
    assert streams == {"requests", "group", "replica", "fleet"}
    assert same_rows(curve, mem, "mrc", "scale") > 0
    assert set(curve["method"]) == {"exact", "shards"}
    assert same_rows(ttl, mem, "ttl_coverage", "scale") == len(DEFAULT_TTLS_S)


def test_mrc_and_ttl_alone(fleet: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """mrc and ttl_coverage each read the stream themselves when no chain is given."""
    lake, mem, ooc = fleet
    with after_ledger(ooc, lake) as con:
        per_token = _per_token(con, "scale")
        curve = mrc_out_of_core(con, "scale", work=tmp_path, partitions=7, bytes_per_token=per_token,
                                sample_rate=SHARDS_RATE, rows=5_000)
        ttl = ttl_coverage_out_of_core(con, "scale", work=tmp_path, partitions=7, bytes_per_token=per_token,
                                       rows=5_000)
    assert same_rows(curve, mem, "mrc", "scale") > 0
    assert same_rows(ttl, mem, "ttl_coverage", "scale") == len(DEFAULT_TTLS_S)


@pytest.mark.parametrize("limit", ["below the requests rows", "below all rows"])
def test_past_the_row_limit(fleet: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            limit: str) -> None:
    """Past MAX_REUSE_ROWS `reuse` keeps only the `requests` stream: out of core knows it before
    reading the other streams when the `requests` rows alone pass it, and drops them when all
    together do; either way the rows are the one-process analysis' under the same limit."""
    lake, _, ooc = fleet
    with duckdb.connect(str(fleet[1]), read_only=True) as con:
        ((requests, every),) = con.execute(
            "SELECT count(*) FILTER (WHERE stream = 'requests'), count(*) FROM reuse").fetchall()
    module = importlib.import_module("kvlens.analyzers.reuse")  # (the package's `reuse` is the function)
    monkeypatch.setattr(module, "MAX_REUSE_ROWS",
                        requests - 1 if limit.endswith("requests rows") else every - 1)
    mem = memory_db(lake, tmp_path / "memory.duckdb")
    with after_ledger(ooc, lake) as con:
        got = _rows(list(reuse_out_of_core(con, "scale", work=tmp_path / "work", partitions=7,
                                           bytes_per_token=_per_token(con, "scale"), rows=4_000)))
    assert set(got["stream"]) == {"requests"}
    assert same_rows(got, mem, "reuse", "scale") == got.height


def test_a_stream_of_several_sizes_is_refused(ooc_lakes: dict[str, Path], tmp_path: Path) -> None:
    """Full blocks of two sizes (no block size given, chain roots of half the tokens): the
    per-record curves need the whole stream, so all three say so rather than compute otherwise."""
    lake = tmp_path / "lake"
    con = duckdb.connect()
    try:
        open_lake(con, ooc_lakes["capture"])
        tables = {name: con.sql(f"SELECT * EXCLUDE (scenario) FROM {name} WHERE scenario = 'capture'").arrow()
                  .read_all() for name in ("requests", "kv_events")}
        tables["request_blocks"] = con.sql(
            "SELECT * EXCLUDE (scenario, block_tokens, block_size_tokens), CASE WHEN position = 0 "
            "THEN block_tokens // 2 ELSE block_tokens END AS block_tokens, "
            "CAST(NULL AS INTEGER) AS block_size_tokens FROM request_blocks WHERE scenario = 'capture'"
        ).arrow().read_all()
    finally:
        con.close()
    write_scenario(lake, "sizes", tables, writer_id="sizes")
    with after_ledger(tmp_path / "empty.duckdb", lake) as con:
        for call in (lambda: list(reuse_out_of_core(con, "sizes", work=tmp_path / "w", partitions=1,
                                                    bytes_per_token=64)),
                     lambda: mrc_out_of_core(con, "sizes", work=tmp_path, partitions=1, bytes_per_token=64,
                                             sample_rate=SHARDS_RATE),
                     lambda: ttl_coverage_out_of_core(con, "sizes", work=tmp_path, partitions=1,
                                                      bytes_per_token=64)):
            with pytest.raises(ConfigError, match=r"scenario sizes: .*one size"):
                call()
