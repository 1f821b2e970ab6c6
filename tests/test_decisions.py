"""The decision-first report: day-over-day attribution, worth in GPU-hours and money, the actions.

Numbers by hand from tests/two_day_db.py (a measured scenario over two days and a what-if of it).
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner
from two_day_db import DAY1_NS, DAY_NS, make_two_day_db

from kvlens.cli import cli
from kvlens.config import load_config
from kvlens.dashboards.attribution import TAIL, attribute, round_to_sum
from kvlens.dashboards.decisions import decide
from kvlens.dashboards.provenance import origins
from kvlens.dashboards.queries import headlines
from kvlens.dashboards.read import Window, open_db
from kvlens.dashboards.report import build_report
from kvlens.dashboards.worth import price_of
from kvlens.errors import ConfigError
from kvlens.models import get_model

DAY1 = Window(DAY1_NS, DAY1_NS + DAY_NS)


@pytest.fixture
def two_days(tmp_path: Path) -> Path:
    return make_two_day_db(tmp_path / "two_days.duckdb")


@pytest.fixture
def con(two_days: Path) -> duckdb.DuckDBPyConnection:
    c = open_db(two_days)
    yield c
    c.close()


def test_the_day_over_day_attribution_sums_to_the_change_exactly(con: duckdb.DuckDBPyConnection) -> None:
    a = attribute(con, "prod", DAY1)
    assert a is not None
    assert a.previous_ratio == pytest.approx(300 / 550) and a.current_ratio == pytest.approx(200 / 650)
    by = {(p.cause, p.replica): p.points for p in a.parts}
    assert by == pytest.approx({
        ("miss_evicted", "replica-1"): -(200 / 650 - 100 / 550) * 100,
        ("miss_routing", "replica-0"): -(100 / 650) * 100,
        ("miss_cold", "replica-0"): (100 / 550) * 100,
        ("miss_cold", "replica-1"): -(100 / 650) * 100,
        (TAIL, None): -(50 / 650 - 50 / 550) * 100,
    })
    assert a.points == pytest.approx((200 / 650 - 300 / 550) * 100)
    assert sum(p.points for p in a.parts) == pytest.approx(a.points, abs=1e-12)
    assert abs(a.residual_points) < 1e-12
    assert sum(p.tokens for p in a.parts) == pytest.approx(a.tokens, abs=1e-9)
    assert a.tokens == pytest.approx((200 / 650 - 300 / 550) * 650)  # -154.5 tokens at day 1's volume
    assert a.parts[0].cause == "miss_cold" and a.parts[0].replica == "replica-0"  # largest effect first


def test_rounded_parts_add_up_as_printed() -> None:
    values = [1 / 3, 1 / 3, 1 / 3]
    assert sum(round(v, 1) for v in values) != pytest.approx(1.0)  # plain rounding would not
    assert round_to_sum(values, 1.0) == [0.4, 0.3, 0.3]
    shown = round_to_sum([-12.587, -15.385, 18.182, -15.385, 1.399], -23.776)
    assert round(sum(shown), 1) == -23.8


def _hand_price_gpu_s(model: str, tokens: int) -> float:
    """The modelled prefill of ``tokens`` (analyzers/costs.py's formula), per token, on 8 GPUs."""
    g = get_model(model)
    layers = sum(x.num_layers for x in g.groups)
    flops = 2.0 * g.num_params * tokens + 2.0 * layers * g.hidden_size * tokens**2
    ms = flops / (989e12 * 8 * 0.4 / 1e3)  # 8x H100 SXM at 40% of its 989 TFLOPS
    return ms / tokens * 8 / 1000


def test_the_worth_of_a_cause_is_tokens_times_the_per_token_price(con: duckdb.DuckDBPyConnection) -> None:
    heads = headlines(con, ["prod", "prod-cache"], DAY1)
    d = decide(con, heads, origins(con, ["prod", "prod-cache"]), DAY1, usd_per_gpu_hour=2.5)
    assert d is not None and d.scenario == "prod" and d.stand_in is None
    per_token = _hand_price_gpu_s("llama-3.1-8b", 325)  # day 1's mean prompt: 650 / 2
    assert d.price.label == "modelled"
    assert d.price.gpu_s_per_token == pytest.approx(per_token, rel=1e-12)
    assert d.by_cause() == {"miss_evicted": 200, "miss_routing": 100}
    assert d.by_replica() == {"replica-1": 200, "replica-0": 100}
    assert d.price.gpu_hours(200) == pytest.approx(200 * per_token / 3600, rel=1e-12)
    assert d.price.usd(200) == pytest.approx(200 * per_token / 3600 * 2.5, rel=1e-12)
    assert d.avoidable_tokens == 300


def test_a_price_that_nothing_can_compute_says_so(con: duckdb.DuckDBPyConnection) -> None:
    p = price_of(con, "no-such-model", 100, 2.0)
    assert p.gpu_s_per_token is None and p.gpu_hours(10) is None
    assert "not in kvlens's registry" in p.assumptions


def test_the_actions_come_from_the_what_if_that_was_run(con: duckdb.DuckDBPyConnection) -> None:
    heads = headlines(con, ["prod", "prod-cache"], DAY1)
    d = decide(con, heads, origins(con, ["prod", "prod-cache"]), DAY1)
    assert d is not None
    (act,) = d.actions
    assert act.what_if == "prod-cache" and act.tokens == 300 and act.page == "whatif"
    assert act.effect.startswith("+46.2 pts of hit ratio, 300 fewer tokens recomputed")  # 300 of 650
    assert "TTFT P99 -" in act.effect
    assert act.basis == "modelled, what-if prod-cache, on the 2 requests both ran"


def test_the_report_leads_with_the_decision(two_days: Path) -> None:
    report = build_report(two_days, now_ns=DAY1_NS + DAY_NS, usd_per_gpu_hour=2.5)
    text = report.text
    lead = text.split("\nWhy it changed\n")[0]
    assert "prod (measured): token hit ratio 30.8%, byte hit ratio 30.8%, over 2 requests" in lead
    assert "token hit ratio 54.5% to 30.8%, -23.8 pts" in lead
    gpu_s = 300 * _hand_price_gpu_s("llama-3.1-8b", 325)  # 0.0122 GPU-s: 12 ms of the 8 GPUs' time
    assert (f"Avoidable: 300 recomputed tokens (46.2% of prompt tokens, every miss but miss_cold), worth "
            f"{gpu_s:.3g} GPU-s (<$0.01), modelled.") in lead
    assert "only 1 action with a gain found" in lead
    table = text.split("\nWhy it changed\n")[1].split("What the avoidable")[0]
    points = [float(m) for m in re.findall(r"\s([+-]\d+\.\d)\s+[+-][\d,]+$", table, re.M)]
    assert points[-1] == -23.8 and round(sum(points[:-1]), 1) == -23.8  # the rows add up as printed
    assert "miss_evicted (the block had been evicted)" in table


def test_gpu_hour_price_from_the_flag_or_the_config(two_days: Path, tmp_path: Path) -> None:
    toml = tmp_path / "kvlens.toml"
    toml.write_text("[costs]\ngpu_hour_usd = 4\n")
    assert load_config(toml).gpu_hour_usd == 4.0
    runner = CliRunner()
    out = tmp_path / "r.html"
    base = ["report", "--db", str(two_days), "--out", str(out), "--now", "2025-01-03T00:00:00Z"]
    result = runner.invoke(cli, [*base, "--config", str(toml)])
    assert result.exit_code == 0, result.output
    assert "$4.00 per GPU-hour" in out.read_text()
    result = runner.invoke(cli, [*base, "--config", str(toml), "--gpu-hour-price", "1.5"])
    assert result.exit_code == 0, result.output
    assert "$1.50 per GPU-hour" in out.read_text()
    toml.write_text("[costs]\ngpu_hour_usd = -1\n")
    with pytest.raises(ConfigError, match="gpu_hour_usd must be a number"):
        load_config(toml)


def test_production_can_be_chosen_and_a_wrong_one_is_an_error(two_days: Path) -> None:
    text = build_report(two_days, now_ns=DAY1_NS + DAY_NS, production="prod-cache").text
    assert "prod-cache (modelled): token hit ratio" in text
    with pytest.raises(ConfigError, match="--production"):
        build_report(two_days, now_ns=DAY1_NS + DAY_NS, production="nope")


def _overview(db: str) -> None:
    from kvlens.dashboards.app import run

    run(db, only="overview")


def test_the_dashboard_overview_leads_with_the_same_decision(two_days: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("streamlit", reason="the dashboard extra is not installed")
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("KVLENS_GPU_HOUR_USD", "2.5")
    at = AppTest.from_function(_overview, args=(str(two_days),), default_timeout=60).run()
    assert not at.exception, at.exception
    metrics = {m.label: (m.value, m.delta) for m in at.metric}
    assert metrics["Token hit ratio, this window (measured)"] == ("30.8%", "-23.8 pts")
    assert metrics["Avoidable recomputed tokens"][0] == "300"
    assert "<$0.01" in metrics["Their worth (modelled)"][0]
    text = [m.value for m in at.markdown]
    first = text.index(next(t for t in text if t.startswith("Change from the window before")))
    assert "-23.8 pts" in text[first]
    act = next(t for t in text if t.startswith("1. **"))
    assert "+46.2 pts of hit ratio" in act and act.endswith("[Evidence: What-if page](whatif)")
    # The order of the report: the decision first, then the selected range's own figures.
    heads = [s.value for s in at.subheader][:2]
    assert heads == ["What happened, and what to do first", "The selected range"]


def test_has_rows_leaves_no_result_open(con: duckdb.DuckDBPyConnection) -> None:
    # A fetchone() left the EXISTS result open: the next relation on the connection then failed
    # with "connection has an unfinished result" (the first screen reads through both APIs).
    from kvlens.dashboards.read import has_rows, table_columns

    assert has_rows(con, "block_outcomes") and not has_rows(con, "hygiene")
    assert "provenance" in table_columns(con, "scenarios")


def test_the_dashboards_price_reaches_its_child(two_days: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from kvlens.dashboards import commands

    seen: dict[str, object] = {}

    def child(cmd: list[str], *, env: dict[str, str] | None = None, **_kw: object) -> int:
        seen["env"] = env
        return 0

    monkeypatch.setattr(commands, "run_child", child)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    assert commands.run_dashboard(two_days, port=port, gpu_hour_price=3.25) == 0
    env = seen["env"]
    assert isinstance(env, dict) and env["KVLENS_GPU_HOUR_USD"] == "3.25"
    assert commands.run_dashboard(two_days, port=port) == 0 and seen["env"] is None
