"""Warm-up and the isolation audit out of core (issue 17): ``warmup_out_of_core`` and
``isolation_findings_out_of_core`` on the analysis DB the out-of-core ledger wrote give the rows a
one-process ``kvlens analyze --full`` writes, on the test lakes and on a generated fleet with
tenants, salts and keys planted so that every finding of the audit is made, in several partitions.
Every column exactly, but warm-up's ``saved_ms``: within 1e-12 relative (``warmup_out_of_core`` says
why)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pytest
from ooc_harness import after_ledger, ledger_db, memory_db, same_rows
from scale_lake import ScaleFleet, write_scale_lake

from kvlens.analyzers.isolation import (
    _incompatible,
    _incompatible_out_of_core,
    isolation_findings_out_of_core,
)
from kvlens.analyzers.warmup import warmup_out_of_core
from kvlens.lake import open_lake, write_scenario

# Per table of the generated lake: its rows written again with planted columns. Tenants by request
# number (so tenants share prefixes: hits and keys across them); TTFT and queue times that sum to
# fractions; a partial block in a second namespace for a quarter of the requests, its content
# hash the content of full blocks keyed otherwise; content hashes that map several block hashes to
# one content; salts per replica on a fifth of the keys (one key, several salts).
_PLANTED = {
    "requests": """SELECT * EXCLUDE (scenario, ttft_ms, queue_ms, tenant),
                          prompt_tokens * 0.0137
                          + (CAST(right(request_id, 5) AS BIGINT) % 11) * 0.73 AS ttft_ms,
                          CASE WHEN CAST(right(request_id, 5) AS BIGINT) % 3 = 0 THEN NULL
                               ELSE (CAST(right(request_id, 5) AS BIGINT) % 7) * 0.11 END AS queue_ms,
                          'tenant-' || (CAST(right(request_id, 5) AS BIGINT) % 3) AS tenant
                   FROM requests WHERE scenario = 'scale'""",
    "request_blocks": """SELECT * EXCLUDE (scenario, content_hash, namespace),
                                block_hash % 4093 AS content_hash, 'ns-a' AS namespace
                         FROM request_blocks WHERE scenario = 'scale'
                         UNION ALL BY NAME
                         SELECT * EXCLUDE (scenario, content_hash, namespace, block_hash, position,
                                           block_tokens),
                                max(position) + 1 AS position, 5 AS block_tokens,
                                CAST(hash(request_id) AS UBIGINT) AS block_hash,
                                min(block_hash) % 4093 AS content_hash, 'ns-b' AS namespace
                         FROM request_blocks WHERE scenario = 'scale'
                           AND CAST(right(request_id, 5) AS BIGINT) % 4 = 0
                         GROUP BY ALL""",
    "kv_events": """SELECT * EXCLUDE (scenario, content_hash, extra_key),
                           block_hash % 4093 AS content_hash,
                           CASE WHEN block_hash % 5 = 0 THEN 'salt-' || replica END AS extra_key
                    FROM kv_events WHERE scenario = 'scale'""",
}


def _planted(lake: Path) -> Path:
    """A generated fleet (tests/scale_lake.py: small caches, so evictions and routing misses) with
    the planted columns of ``_PLANTED``."""
    write_scale_lake(lake, 30_000, fleet=ScaleFleet(replicas=4, capacity=700, prefixes=400),
                     chunk_requests=150)
    con = duckdb.connect()
    try:
        open_lake(con, lake)
        tables = {name: con.sql(sql).arrow().read_all() for name, sql in _PLANTED.items()}
    finally:
        con.close()
    write_scenario(lake, "scale", tables, writer_id="planted")
    return lake


@pytest.fixture(scope="module")
def analyzed(ooc_lakes: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, tuple[Path, Path, Path]]:
    """Per lake: (lake, its one-process analysis, its out-of-core ledger)."""
    tmp = tmp_path_factory.mktemp("ooc-warmup")
    lakes = {**{n: ooc_lakes[n] for n in ("simulated", "capture", "hybrid", "hand")},
             "planted": _planted(tmp / "planted")}
    out = {}
    for name, lake in lakes.items():
        scenarios = ("clear",) if name == "hand" else ()
        mem = memory_db(lake, tmp / f"{name}.memory.duckdb", scenarios)
        ooc = ledger_db(lake, tmp / f"{name}.ooc.duckdb", scenarios,
                        **({"partitions": 5, "rows_per_range": 5_000} if name == "planted" else {}))
        out[name] = (lake, mem, ooc)
    return out


def _scenarios(db: Path) -> list[tuple[str, int]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return [(s, int(b)) for s, b in
                con.execute("SELECT scenario, kv_bytes_per_token FROM scenarios ORDER BY 1").fetchall()]


def _both(lake: Path, mem: Path, ooc: Path, work: Path, partitions: int) -> dict[str, pl.DataFrame]:
    """Both tables of every scenario, each compared with the one-process rows; by table, all rows."""
    got: dict[str, list[pl.DataFrame]] = {"warmup": [], "isolation_findings": []}
    for scenario, per_token in _scenarios(mem):
        with after_ledger(ooc, lake) as con:
            (work / scenario / "w").mkdir(parents=True)
            (work / scenario / "i").mkdir(parents=True)
            warm = warmup_out_of_core(con, scenario, work=work / scenario / "w", partitions=partitions)
            found = isolation_findings_out_of_core(con, scenario, work=work / scenario / "i",
                                                   partitions=partitions, bytes_per_token=per_token)
        same_rows(warm, mem, "warmup", scenario, rel=1e-12)  # saved_ms: see warmup_out_of_core
        same_rows(found, mem, "isolation_findings", scenario)
        got["warmup"].append(warm)
        got["isolation_findings"].append(found)
    return {t: pl.concat(frames) for t, frames in got.items()}


@pytest.mark.parametrize("name", ["simulated", "capture", "hybrid", "hand"])
@pytest.mark.parametrize("partitions", [1, 3])
def test_the_one_process_rows_on_the_test_lakes(analyzed: dict[str, tuple[Path, Path, Path]], tmp_path: Path,
                                                name: str, partitions: int) -> None:
    got = _both(*analyzed[name], tmp_path, partitions)
    assert got["warmup"].height > 0
    if name == "hand":  # its clears are starts
        assert "cleared" in got["warmup"]["start_kind"].to_list()


def test_the_one_process_rows_of_a_planted_fleet(analyzed: dict[str, tuple[Path, Path, Path]],
                                                 tmp_path: Path) -> None:
    """Every finding but the incompatible keys (out of core refuses a second namespace of full
    blocks), warm-ups that reach the steady level and save tokens, each merged from partitions."""
    got = _both(*analyzed["planted"], tmp_path, 5)
    found = got["isolation_findings"]
    assert {"cross_tenant_reuse", "cross_tenant_keys", "cross_salt_keys", "same_content_different_keys"} \
        <= set(found["finding"])
    assert {"ns-a vs ns-b", "replica-0 vs replica-1"} <= set(found["subject"])
    warm = got["warmup"]
    assert warm.height == 4 and warm["steady_after_ns"].null_count() < 4
    assert (warm["saved_tokens"] > 0).any() and (warm["saved_ms"] > 0).any()
    for spill in ("w/warm_blocks", "i/replica_keys", "i/namespace_keys"):
        assert len(list((tmp_path / "scale" / spill).glob("p=*"))) > 1, spill


def test_incompatible_keys_in_sql() -> None:
    """The one finding no lake out of core accepts can make (it needs two namespaces of full
    blocks): its SQL form against ``_incompatible`` on planted outcomes, a block of no namespace
    and one not among the request's blocks."""
    con = duckdb.connect()
    con.execute("""CREATE TABLE block_outcomes AS SELECT * FROM (VALUES
        ('sc', 'x', 0, 'miss_incompatible', 16, 'ns|sha256'),
        ('sc', 'x', 1, 'miss_incompatible', 16, 'ns|sha256'),
        ('sc', 'y', 0, 'miss_incompatible', 7, 'ns|sha256'),
        ('sc', 'y', 1, 'miss_incompatible', 16, 'ns|md5'),
        ('sc', 'y', 2, 'miss_incompatible', 16, 'ns|md5'), ('sc', 'z', 0, 'miss_incompatible', 16, NULL),
        ('sc', 'z', 1, 'miss_cold', 16, 'ns|md5'), ('other', 'x', 0, 'miss_incompatible', 16, 'ns|sha256'))
        t(scenario, request_id, position, outcome, tokens, key_diff)""")
    con.execute("""CREATE TABLE request_blocks AS SELECT * FROM (VALUES
        ('sc', 'x', 0, 'ns|sha256_cbor'), ('sc', 'x', 1, 'ns|sha256_cbor'), ('sc', 'y', 0, NULL),
        ('sc', 'y', 1, 'ns|sha256_cbor'), ('other', 'y', 2, 'ns|other'))
        t(scenario, request_id, position, namespace)""")
    outcomes = con.sql("SELECT * FROM block_outcomes WHERE scenario = 'sc'").pl()
    want = _incompatible(outcomes, con.sql("SELECT * FROM request_blocks WHERE scenario = 'sc'"), 100)
    got = _incompatible_out_of_core(con, "'sc'", 100)
    assert len(want) == 4 and got == want
