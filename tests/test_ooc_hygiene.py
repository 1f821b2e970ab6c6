"""``hygiene_out_of_core`` (analyzers/hygiene.py, issue 17): prompt hygiene computed with one
partition of rows in memory at a time gives the rows of the one-process analysis, on the lakes out
of core accepts, on a gateway trace with planted offenders and on a generated fleet, in one
partition and in many small ones (so that partial results are merged)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest
from ooc_harness import after_ledger, ledger_db, memory_db, same_rows
from scale_lake import ScaleFleet, write_scale_lake
from test_hygiene import _trace

from kvlens.analyzers.hygiene import hygiene, hygiene_out_of_core
from kvlens.collector.importer import import_files
from kvlens.lake import SegmentWriter, open_lake, write_scenario

Analyzed = dict[str, tuple[Path, Path, Path]]  # name -> (lake, one-process DB, out-of-core ledger's DB)


def _plant(lake: Path, scenario: str, *, alphabet: int = 3, head: bool = False, ties: int = 0,
           repeats: int = 0) -> None:
    """``scenario``'s request_blocks written again with token hashes where they have none, drawn
    from ``alphabet`` values (block_hash mod alphabet), so that runs of block contents repeat after
    early splits; every 11th block hash has none (gaps). ``head``: every request's block 0 has one
    content hash (all then split after it). ``ties``: arrival times rounded down to a multiple of
    it (request ids break the ties). ``repeats``: one request in ``repeats`` has its rows read again
    from a later segment with other token hashes (the first one read is the one kept)."""
    con = duckdb.connect()
    open_lake(con, lake)
    arrival = f"arrival_ns - arrival_ns % {ties}" if ties else "arrival_ns"
    rows = con.sql(f"""
        SELECT * EXCLUDE (scenario, arrival_ns, content_hash, token_hash), {arrival} AS arrival_ns,
               CASE WHEN {'position = 0' if head else 'false'} THEN 12345
                    ELSE coalesce(content_hash, block_hash) END AS content_hash,
               CASE WHEN block_hash % 11 = 0 AND position > 0 THEN NULL
                    ELSE coalesce(token_hash, block_hash % {alphabet} + 1) END AS token_hash
        FROM request_blocks WHERE scenario = ?""", params=[scenario]).arrow().read_all()
    con.close()
    write_scenario(lake, scenario, {"request_blocks": rows}, writer_id="planted")
    if repeats:
        con = duckdb.connect()
        open_lake(con, lake)
        again = con.sql(f"""
            SELECT * EXCLUDE (scenario, token_hash), token_hash + 1 AS token_hash FROM request_blocks
            WHERE scenario = ? AND token_hash IS NOT NULL AND hash(request_id) % {repeats} = 0""",
                        params=[scenario]).arrow().read_all()
        con.close()
        with SegmentWriter(lake, "request_blocks", scenario=scenario, writer_id="repeated") as writer:
            writer.append_arrow(again)


def _gateway(lake: Path) -> Path:
    """tests/test_hygiene.py's trace: a timestamp and a request id planted early in prompts."""
    lines = lake.parent / "gw.jsonl"
    lines.write_text("".join(json.dumps(line) + "\n" for line in _trace()))
    import_files("gateway", [lines], lake, scenario="gw")
    return lake


# name -> the scenario analyzed, whether it has offenders, and rows a partition that cut it small
SCENARIOS = {"simulated": ("conv", True, 400), "capture": ("capture", False, 400),
             "hybrid": ("capture", False, 400), "hand": ("clear", False, 2), "gateway": ("gw", True, 8),
             "fleet": ("scale", True, 5_000)}


@pytest.fixture(scope="module")
def analyzed(ooc_lakes: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Analyzed:
    """name -> (lake, the one-process analysis DB, the out-of-core ledger's DB)."""
    tmp = tmp_path_factory.mktemp("ooc-hygiene")
    lakes = {"capture": ooc_lakes["capture"], "hybrid": ooc_lakes["hybrid"]}  # real token hashes
    for name in ("simulated", "hand"):
        lakes[name] = Path(shutil.copytree(ooc_lakes[name], tmp / name))
    _plant(lakes["simulated"], "conv", head=True)
    _plant(lakes["hand"], "clear", alphabet=2)
    lakes["gateway"] = _gateway(tmp / "gateway")
    lakes["fleet"] = tmp / "fleet"
    write_scale_lake(lakes["fleet"], 40_000, fleet=ScaleFleet(replicas=4, capacity=700, prefixes=400),
                     chunk_requests=150)
    _plant(lakes["fleet"], "scale", ties=1_500_000, repeats=7)
    return {name: (lake, memory_db(lake, tmp / f"{name}-memory.duckdb", [SCENARIOS[name][0]]),
                   ledger_db(lake, tmp / f"{name}-ooc.duckdb", [SCENARIOS[name][0]],
                             rows_per_range=5_000 if name == "fleet" else 97))
            for name, lake in lakes.items()}


def _per_token(db: Path, scenario: str) -> int:
    """The KV bytes per token the one-process analysis of ``scenario`` used (its model's)."""
    with duckdb.connect(str(db), read_only=True) as con:
        ((per_token,),) = con.execute("SELECT kv_bytes_per_token FROM scenarios WHERE scenario = ?",
                                      [scenario]).fetchall()
    return int(per_token)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize(("partitions", "small"), [(1, False), (4, False), (3, True)])
def test_out_of_core_hygiene_equals_the_one_process_rows(analyzed: Analyzed,
                                                         tmp_path: Path, name: str, partitions: int,
                                                         small: bool) -> None:
    """The rows of ``kvlens analyze --full``, in ``hygiene``'s order; in one partition, in four, and
    cut small: each lake in several request, content and key partitions of a few rows."""
    lake, memory, ooc = analyzed[name]
    scenario, offenders, few = SCENARIOS[name]
    rows = few if small else 2_000_000
    per_token = _per_token(memory, scenario)
    with after_ledger(ooc, lake) as con:
        got = hygiene_out_of_core(con, scenario, work=tmp_path, partitions=partitions,
                                  bytes_per_token=per_token, rows=rows)
        blocks = con.table("request_blocks").filter(duckdb.ColumnExpression("scenario") == scenario)
        want = hygiene(request_blocks=blocks, scenario=scenario, bytes_per_token=per_token)
    assert (same_rows(got, memory, "hygiene", scenario) > 0) == offenders
    assert got.equals(want)
    if offenders:
        assert got["offender_rank"].n_unique() > 1  # several groups ranked


def test_one_partition_of_rows_at_a_time(analyzed: Analyzed, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The generated fleet (37,657 rows that take part, 43,034 read with the repeats) cut at 3,000
    rows: every frame read back from the spill files (a partition by request, content hash or run
    key, a request partition's numbers or cases) holds far fewer than 6,000 rows, the rows are the
    one-process ones, and the spill files are removed as they are read."""
    lake, memory, ooc = analyzed["fleet"]
    heights: list[int] = []
    read = pl.read_parquet

    def counted(*args: Any, **kwargs: Any) -> pl.DataFrame:
        frame = read(*args, **kwargs)
        heights.append(frame.height)
        return frame

    monkeypatch.setattr(pl, "read_parquet", counted)
    with after_ledger(ooc, lake) as con:
        got = hygiene_out_of_core(con, "scale", work=tmp_path, partitions=2,
                                  bytes_per_token=_per_token(memory, "scale"), rows=3_000)
    monkeypatch.undo()
    assert same_rows(got, memory, "hygiene", "scale") > 500
    assert len(heights) > 60 and max(heights) < 6_000, (len(heights), max(heights))
    spills = ("raw", "kept", "content", "runs", "cases", "keys")
    assert all((tmp_path / spill).is_dir() and not list((tmp_path / spill).iterdir()) for spill in spills)


def test_the_first_of_repeated_rows_decides(analyzed: Analyzed, tmp_path: Path) -> None:
    """The fleet's repeated rows matter: had the last one read been kept, the rows would differ
    (so comparing with the one-process rows tells the two apart)."""
    lake, _, ooc = analyzed["fleet"]
    segments = str(lake / "request_blocks" / "scenario=scale" / "*" / "*.parquet")
    with after_ledger(ooc, lake) as con:
        got = hygiene_out_of_core(con, "scale", work=tmp_path, partitions=3, bytes_per_token=1, rows=5_000)
        last = con.sql(f"SELECT * EXCLUDE (filename) FROM read_parquet('{segments}', filename = true) "
                       "QUALIFY row_number() OVER (PARTITION BY request_id, position "
                       "ORDER BY filename DESC) = 1")
        other = hygiene(request_blocks=last, scenario="scale", bytes_per_token=1)
    assert other.height > 0 and not got.equals(other)
