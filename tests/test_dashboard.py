"""Dashboard page logic on the demo's analysis DB (Streamlit AppTest), its queries and charts."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import altair as alt
import duckdb
import polars as pl
import pytest
from click.testing import CliRunner

pytest.importorskip("streamlit", reason="the dashboard extra is not installed")
from streamlit.testing.v1 import AppTest

from kvlens.cli import cli
from kvlens.dashboards import analyses, charts
from kvlens.dashboards.app import PAGES
from kvlens.dashboards.queries import hit_ratios, ledger_by_outcome, scenario_span_ns
from kvlens.dashboards.read import Window

# The table whose rows a page's chart is drawn from (the page says "no rows yet" without them).
PAGE_TABLES = {
    "overview": "miss_ledger",
    "misses": "block_outcomes",
    "prefixes": "prefix_ranking",
    "capacity": "mrc",
    "flows": "flows",
    "latency": "latency_tails",
    "whatif": "miss_ledger",
    "probe": "crossover",
    "audit": "isolation_findings",
    "hygiene": "hygiene",
}


# Metrics a page shows once its analysis has rows for the selected scenario.
PAGE_METRICS = {
    "overview": {"Requests", "Token hit ratio", "Byte hit ratio", "Worst TTFT P99/P50"},
    "capacity": {"C_physical", "C_eff", "Byte hit ratio at C_eff", "Gain from 2 x C_eff"},
    "flows": {"Read", "Written", "Never read again", "Worst 15-minute window"},
    "latency": {"TTFT P50", "TTFT P99", "P99/P50", "Queue P50"},
    "hygiene": {"Requests affected", "Tokens lost", "KV lost"},
}


def _script(db: str, page: str) -> None:
    from kvlens.dashboards.app import run

    run(db, only=page)


@pytest.fixture(scope="module")
def db(demo_workdir: Path) -> str:
    return str(demo_workdir / "kvlens.duckdb")


@pytest.fixture(scope="module")
def cur(db: str) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(db, read_only=True)
    yield con.cursor()
    con.close()


def _page(db: str, page: str) -> AppTest:
    return AppTest.from_function(_script, args=(db, page), default_timeout=60).run()


def _rows(cur: duckdb.DuckDBPyConnection, table: str, scenario: str) -> int:
    from kvlens.dashboards.read import table_rows

    return table_rows(cur, table, scenario) or 0


def _base(label: str) -> str:
    """A metric's label without what it says beside it: ``TTFT P50 (modelled)`` -> ``TTFT P50``."""
    return label.split(" (")[0]


def _metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if _base(m.label) == label)


def test_every_page_is_declared_with_a_table() -> None:
    assert [p.url_path for p in PAGES] == list(PAGE_TABLES)


@pytest.mark.parametrize("page", list(PAGE_TABLES))
def test_page_renders_its_chart_or_says_no_rows(db: str, cur: duckdb.DuckDBPyConnection, page: str) -> None:
    at = _page(db, page)
    assert not at.exception, [e.value for e in at.exception]
    scenario = at.sidebar.selectbox(key="scenario").value
    assert at.header, "every page has a header"
    if _rows(cur, PAGE_TABLES[page], scenario):
        assert at.get("vega_lite_chart"), f"{page}: {PAGE_TABLES[page]} has rows but no chart was drawn"
        assert PAGE_METRICS.get(page, set()) <= {_base(m.label) for m in at.metric}
    else:
        assert any("no rows yet" in i.value for i in at.info), f"{page}: an empty analysis must say so"


def test_overview_ratios_are_the_ledgers(db: str, cur: duckdb.DuckDBPyConnection) -> None:
    at = _page(db, "overview")
    scenario = at.sidebar.selectbox(key="scenario").value
    hit, prompt = cur.execute(
        "SELECT sum(hit_tokens), sum(prompt_tokens) FROM request_ledger WHERE scenario = ?", [scenario]
    ).fetchall()[0]
    assert _metric(at, "Token hit ratio") == f"{hit / prompt:.1%}"
    n = cur.execute("SELECT count(*) FROM request_ledger WHERE scenario = ?", [scenario]).fetchall()[0][0]
    assert _metric(at, "Requests") == f"{n:,}"


def test_scenario_selector_changes_the_numbers(db: str) -> None:
    at = _page(db, "overview")
    box = at.sidebar.selectbox(key="scenario")
    before = _metric(at, "Token hit ratio")
    other = next(o for o in box.options if o != box.value)
    box.set_value(other).run()
    assert not at.exception
    assert at.header[0].value.endswith(other)
    assert _metric(at, "Token hit ratio") != before


def test_time_window_narrows_the_requests(db: str, cur: duckdb.DuckDBPyConnection) -> None:
    at = _page(db, "overview")
    slider = at.sidebar.slider(key=f"window:{at.sidebar.selectbox(key='scenario').value}")
    lo, hi = slider.value
    mid = lo + (hi - lo) // 2
    mid = mid - dt.timedelta(seconds=mid.second, microseconds=mid.microsecond)
    slider.set_range(lo, mid).run()
    assert not at.exception
    start_ns = int((lo - dt.datetime(1970, 1, 1)).total_seconds()) * 10**9
    end_ns = int((mid - dt.datetime(1970, 1, 1)).total_seconds()) * 10**9 - 1
    scenario = at.sidebar.selectbox(key="scenario").value
    n = cur.execute(
        "SELECT count(*) FROM request_ledger WHERE scenario = ? AND arrival_ns BETWEEN ? AND ?",
        [scenario, start_ns, end_ns],
    ).fetchall()[0][0]
    assert 0 < n < hit_ratios(cur, scenario, Window())["requests"]
    assert _metric(at, "Requests") == f"{n:,}"


def test_misses_drill_down_to_blocks(db: str, cur: duckdb.DuckDBPyConnection) -> None:
    at = _page(db, "misses")
    assert not at.exception
    outcome = at.selectbox(key="miss_outcome")
    outcome.set_value("miss_routing" if "miss_routing" in outcome.options else outcome.options[0]).run()
    replica = at.selectbox(key="miss_replica").value
    request_id = at.selectbox(key="miss_request").value
    blocks = at.dataframe[-1].value
    scenario = at.sidebar.selectbox(key="scenario").value
    n = cur.execute(
        "SELECT count(*) FROM block_outcomes WHERE scenario = ? AND request_id = ?", [scenario, request_id]
    ).fetchall()[0][0]
    assert len(blocks) == n
    assert outcome.value in set(blocks["outcome"])
    served = cur.execute(
        "SELECT DISTINCT replica FROM block_outcomes WHERE scenario = ? AND request_id = ?",
        [scenario, request_id],
    ).fetchall()
    assert served == [(replica,)]


def test_whatif_shows_every_scenario(db: str, cur: duckdb.DuckDBPyConnection) -> None:
    at = _page(db, "whatif")
    names = [r[0] for r in cur.execute("SELECT scenario FROM scenarios ORDER BY 1").fetchall()]
    labels = [m.label for m in at.metric]
    # every scenario of the demo's DB is a simulated what-if (scenarios.provenance): modelled
    assert labels == [f"{n}: token hit ratio (modelled)" for n in names]
    # the caption names the engine the what-if was simulated with (table simulations), not the LRU's model
    assert any("Modelled, not measured" in c.value and "kvlens simulate --engine vllm:" in c.value
               and "step times" in c.value for c in at.caption)
    tails = at.dataframe[-1].value
    assert set(tails["ttft"]) == {"modelled"}


def test_modelled_figures_and_an_unsubtracted_c_eff_say_so(db: str) -> None:
    at = _page(db, "latency")
    assert {m.label for m in at.metric} >= {"TTFT P50 (modelled)", "TTFT P99 (modelled)"}
    assert any(c.value.startswith("Modelled, not measured") for c in at.caption)
    at = _page(db, "capacity")
    # the demo gives --cache-tokens and has no engine metrics: nothing is subtracted
    assert "C_eff (nothing subtracted)" in {m.label for m in at.metric}
    assert "Byte hit ratio at C_eff (modelled LRU)" in {m.label for m in at.metric}


def test_missing_db_is_an_error_on_the_page(tmp_path: Path) -> None:
    at = _page(str(tmp_path / "nope.duckdb"), "overview")
    assert "does not exist" in at.error[0].value


def test_filters_are_bound_not_formatted(cur: duckdb.DuckDBPyConnection) -> None:
    assert ledger_by_outcome(cur, "x' OR '1'='1", Window()).height == 0
    assert scenario_span_ns(cur, "x' OR '1'='1") is None


def test_chart_builders_give_valid_specs(cur: duckdb.DuckDBPyConnection) -> None:
    scenario = cur.execute("SELECT min(scenario) FROM scenarios").fetchall()[0][0]
    ledger = ledger_by_outcome(cur, scenario, Window())
    specs = [
        charts.ledger_chart(ledger),
        charts.ledger_share_chart(ledger),
        charts.mrc_chart(
            analyses.mrc_curve(cur, scenario, "requests"), analyses.capacity_marks(cur, scenario)
        ),
        charts.crossover_chart(
            pl.DataFrame(
                {
                    "prefix_tokens": [512, 1024],
                    "series": ["recompute"] * 2,
                    "ms": [3.0, 7.5],
                    "label": ["modelled"] * 2,
                }
            )
        ),
    ]
    for chart in specs:
        spec = chart.to_dict()  # validates against the Vega-Lite schema
        assert spec["$schema"].startswith("https://vega.github.io/schema/vega-lite/")
    assert isinstance(specs[2], alt.LayerChart)


def test_crossover_series_long_form() -> None:
    frame = pl.DataFrame(
        {
            "prefix_tokens": [512, 512, 1024],
            "path": ["h2d", "disk", "h2d"],
            "recompute_ms": [4.0, 4.0, 9.0],
            "load_ms": [1.0, 6.0, 2.0],
            "label": ["measured"] * 3,
        }
    )
    out = analyses.crossover_series(frame)
    assert out is not None
    assert out.filter(pl.col("series") == "recompute")["ms"].to_list() == [4.0, 9.0]
    assert sorted(out["series"].unique().to_list()) == ["load disk", "load h2d", "recompute"]
    assert analyses.crossover_series(frame.drop("load_ms")) is None


def test_cli_refuses_a_missing_db(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["dashboard", "--db", str(tmp_path / "none.duckdb")])
    assert result.exit_code == 1
    assert "does not exist" in result.output


def test_cli_says_how_to_install_streamlit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "streamlit" else real(name, *a)
    )
    db = tmp_path / "x.duckdb"
    db.touch()
    result = CliRunner().invoke(cli, ["dashboard", "--db", str(db)])
    assert result.exit_code == 1
    assert "pip install 'kvlens[dashboard]'" in result.output


@pytest.fixture(scope="module")
def planted_db(db: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A copy of the demo DB with hygiene and isolation rows planted (the demo trace has neither)."""
    import shutil

    path = tmp_path_factory.mktemp("planted") / "kvlens.duckdb"
    shutil.copy(db, path)
    con = duckdb.connect(str(path))
    try:
        con.execute("DELETE FROM hygiene; DELETE FROM isolation_findings")  # only the planted rows count
        con.execute("""
            INSERT INTO hygiene (scenario, request_id, split_position, lost_tokens, lost_bytes, offender_rank,
                                 first_request_id)
            SELECT scenario, request_id, 1 + (row_number() OVER (ORDER BY arrival_ns, request_id)) % 3,
                   1024, 1024 * 327680, 1, 'first-of-group'
            FROM request_ledger WHERE scenario = (SELECT min(scenario) FROM scenarios)
            ORDER BY arrival_ns, request_id LIMIT 6
        """)
        con.execute("""
            INSERT INTO isolation_findings (scenario, finding, subject, blocks, detail)
            SELECT min(scenario), 'cross_tenant_reuse', 'tenant-a, tenant-b', 7,
                   '7 blocks stored by tenant-a were reused by tenant-b' FROM scenarios
        """)
        # Two replicas' scraped counters: one engine counted 24 external hits the ledger lacks.
        con.execute("""
            INSERT INTO reconciliation (scenario, replica, engine_queries_tokens, engine_hit_tokens,
                                        engine_external_hit_tokens, counter_resets, ledger_hit_tokens,
                                        reported_cached_tokens, difference_tokens, difference_ratio)
            SELECT (SELECT min(scenario) FROM scenarios), v.* FROM (VALUES
                ('replica-0', 4000, 1000, 24, 0, 1000, 1000, 24, 24 / 1024),
                ('replica-1', 2000, 500, 0, 1, 520, NULL, -20, -20 / 500)) v
        """)
    finally:
        con.close()
    return str(path)


def test_hygiene_page_on_planted_rows(planted_db: str) -> None:
    at = _page(planted_db, "hygiene")
    assert not at.exception
    assert at.get("vega_lite_chart")
    assert _metric(at, "Requests affected") == "6"
    assert _metric(at, "Tokens lost") == "6,144"
    assert len(at.dataframe[-1].value) == 6
    groups = at.dataframe[0].value
    assert list(groups["requests"]) == [6] and list(groups["first_request_id"]) == ["first-of-group"]


def test_overview_sets_engine_counters_beside_the_ledger(db: str, planted_db: str) -> None:
    plain = _page(db, "overview")
    assert not any(h.value == "Engine counters against the ledger" for h in plain.subheader)
    at = _page(planted_db, "overview")
    assert not at.exception
    assert any(h.value == "Engine counters against the ledger" for h in at.subheader)
    table = at.dataframe[-1].value
    assert list(table["replica"]) == ["replica-0", "replica-1"]
    assert list(table["engine_hit_tokens"]) == [1024, 500]  # local + external
    assert list(table["difference_ratio"]) == pytest.approx([24 / 1024, -20 / 500])


def test_audit_page_on_planted_rows(planted_db: str) -> None:
    at = _page(planted_db, "audit")
    assert not at.exception
    assert at.get("vega_lite_chart")
    assert _metric(at, "cross_tenant_reuse") == "1"
    assert any("reused by tenant-b" in m.value for m in at.markdown)


def test_a_db_renamed_into_place_is_reopened(db: str, planted_db: str, tmp_path: Path) -> None:
    import os
    import shutil

    live = tmp_path / "kvlens.duckdb"
    shutil.copy(db, live)
    with duckdb.connect(str(live)) as con:
        con.execute("DELETE FROM hygiene")
    at = _page(str(live), "hygiene")
    assert any("no rows yet" in i.value for i in at.info)
    staged = tmp_path / ".kvlens.duckdb.tmp"  # what kvlens analyze does: write aside, rename over
    shutil.copy(planted_db, staged)
    os.replace(staged, live)
    at.run()
    assert not at.exception
    assert _metric(at, "Requests affected") == "6"
