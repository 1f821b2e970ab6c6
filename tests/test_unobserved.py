"""A scenario without KV events (a plain trace import): residency unknown, never called cold.

The shipped Mooncake conversation trace, imported as it is, has requests and blocks but no engine
events. Its blocks are ``unobserved`` (neither hit nor miss); what an unbounded cache could have
served is ``reusable_tokens``; the report and the dashboard say so and never call the misses cold.
The trace's 37.3% reusable share is the README's SQL (full blocks an earlier request needed).
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from kvlens.cli import cli
from kvlens.dashboards.charts import OUTCOME_COLORS
from kvlens.dashboards.queries import hit_ratios
from kvlens.dashboards.read import Window
from kvlens.dashboards.report import build_report
from kvlens.sample_data import MOONCAKE_CONVERSATION
from kvlens.schema import Outcome

REUSABLE_SQL = """
WITH ordered AS (
    SELECT block_tokens, block_size_tokens,
           row_number() OVER (PARTITION BY block_hash ORDER BY arrival_ns, request_id) AS nth
    FROM request_blocks WHERE scenario = 'conv')
SELECT sum(block_tokens) FILTER (WHERE nth > 1 AND block_tokens = block_size_tokens)
FROM ordered
"""


@pytest.fixture(scope="module")
def conv_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("unobserved")
    lake, db = tmp / "lake", tmp / "kvlens.duckdb"
    runner = CliRunner()
    for args in (["import", "mooncake", str(MOONCAKE_CONVERSATION), "--lake", str(lake),
                  "--scenario", "conv"],
                 ["analyze", "--lake", str(lake), "--db", str(db), "--model", "llama-3.1-70b"]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 0, result.output
    return db


def test_without_events_every_block_is_unobserved_and_the_potential_is_shown(conv_db: Path) -> None:
    con = duckdb.connect(str(conv_db), read_only=True)
    try:
        outcomes = con.execute("SELECT DISTINCT outcome FROM miss_ledger").fetchall()
        ((prompt, hits, unobserved, reusable, misses),) = con.execute(
            "SELECT sum(prompt_tokens), sum(hit_tokens), sum(unobserved_tokens), sum(reusable_tokens), "
            "sum(miss_tokens) FROM request_ledger").fetchall()
        ((expected,),) = con.execute(REUSABLE_SQL).fetchall()
    finally:
        con.close()
    assert outcomes == [("unobserved",)]  # not miss_cold: nobody knows what the caches held
    assert hits == misses == 0 and unobserved > 0
    assert reusable == expected
    assert round(reusable / prompt, 3) == 0.373  # README's unbounded-cache share of this trace


def test_the_report_and_the_dashboard_say_residency_is_unknown(conv_db: Path) -> None:
    text = build_report(conv_db).text
    assert "no cache could have served them" not in text
    assert "published no KV events (unobserved)" in text.replace("\n", " ")
    assert "An unbounded cache could have served 37.3%" in text and "modelled" in text
    con = duckdb.connect(str(conv_db), read_only=True)
    try:
        ratios = hit_ratios(con, "conv", Window(None, None))
    finally:
        con.close()
    assert ratios["token_hit_ratio"] is None and ratios["byte_hit_ratio"] is None  # n/a, not 0%
    assert ratios["unobserved_tokens"] > 0 and ratios["reusable_tokens"] > 0
    assert list(OUTCOME_COLORS) == list(Outcome)  # every outcome has its colour, in the table's order
    assert "\nunobserved " in text.split("\nLedger by outcome\n")[1].split("\nTrend\n")[0]
