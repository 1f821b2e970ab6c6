"""The library front doors: one call per command, one small frozen result record."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvlens.cli import cli
from kvlens.collector import FORMATS, ImportResult, import_files
from kvlens.errors import ConfigError, EmptyReplaceError

DATA = Path(__file__).resolve().parent / "data"
CAPTURE = DATA / "vllm032_capture_head.frames.jsonl"
BODIES = sorted((DATA / "vllm-cpu-capture").glob("otlp_*.pb"))


def _mooncake(path: Path) -> Path:
    rows = [{"timestamp": 0, "input_length": 1200, "output_length": 4, "hash_ids": [1, 2, 3]},
            {"timestamp": 5, "input_length": 700, "output_length": 4, "hash_ids": [1, 2]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_import_command_offers_the_registry() -> None:
    (command,) = [p for p in cli.commands["import"].params if p.name == "fmt"]
    assert tuple(command.type.choices) == FORMATS  # type: ignore[attr-defined]
    assert len(FORMATS) == 7


def test_one_result_type_for_every_kind_of_file(tmp_path: Path) -> None:
    lines = import_files("mooncake", [_mooncake(tmp_path / "m.jsonl")], tmp_path / "lake", scenario="m")
    events = import_files("vllm-events", [CAPTURE], tmp_path / "lake", scenario="e")
    spans = import_files("otlp", BODIES, tmp_path / "lake", scenario="o", model="tiny")
    assert all(isinstance(r, ImportResult) for r in (lines, events, spans))
    assert (lines.requests, lines.blocks, lines.files) == (2, 5, (str(tmp_path / "m.jsonl"),))
    assert events.batches == len(CAPTURE.read_text().splitlines()) and events.kv_rows > 0
    assert (events.requests, events.blocks) == (0, 0)
    assert spans.requests == 300 and spans.blocks == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        lines.requests = 3  # type: ignore[misc]


def test_an_empty_import_keeps_the_scenario_unless_allowed(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    import_files("mooncake", [_mooncake(tmp_path / "m.jsonl")], lake, scenario="s")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(EmptyReplaceError, match="keeps its previous rows"):
        import_files("mooncake", [empty], lake, scenario="s")
    assert import_files("mooncake", [empty], lake, scenario="s", allow_empty=True).requests == 0


def test_an_unknown_format_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="choose one of mooncake"):
        import_files("csv", [tmp_path / "x"], tmp_path / "lake")


def test_analyze_lake_resolves_scenarios_and_models(tmp_path: Path) -> None:
    from kvlens.analyzers.analyze import AnalyzeResult, analyze_lake
    from kvlens.errors import NoDataError
    from kvlens.models import DEFAULT_MODEL, get_model

    lake = tmp_path / "lake"
    import_files("mooncake", [_mooncake(tmp_path / "m.jsonl")], lake, scenario="m")
    import_files("mooncake", [_mooncake(tmp_path / "k.jsonl")], lake, scenario="k", model="llama-3.1-8b")
    result = analyze_lake(lake, tmp_path / "a.duckdb")
    assert isinstance(result, AnalyzeResult) and result.db == (tmp_path / "a.duckdb").resolve()
    assert result.models == (("k", get_model("llama-3.1-8b").name, "requests"),
                             ("m", get_model(DEFAULT_MODEL).name, "default"))
    given = analyze_lake(lake, tmp_path / "b.duckdb", scenarios=["m"], model=get_model("llama-3.1-8b"))
    assert given.models == (("m", get_model("llama-3.1-8b").name, "given"),)
    with pytest.raises(NoDataError, match="scenario\\(s\\) nope have no requests"):
        analyze_lake(lake, tmp_path / "c.duckdb", scenarios=["nope"])


def test_a_signal_stops_the_command_and_the_handlers_come_back() -> None:
    import os
    import signal
    import threading

    from kvlens.cli import _stopped_by_signals

    before = signal.getsignal(signal.SIGTERM)
    stop = threading.Event()
    with _stopped_by_signals(stop.set):
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(10)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_flag_given_wins_then_the_toml_then_the_default() -> None:
    from kvlens.config import merge_flags

    flags = {"smtp": "flag:25", "sender": None, "subject": None, "starttls": False}
    file = {"smtp": "file:25", "sender": "file@example.com", "starttls": True}
    merged = merge_flags(flags, file, {"sender": "kvlens@localhost", "subject": "default"})
    assert merged == {"smtp": "flag:25", "sender": "file@example.com", "subject": "default",
                      "starttls": False}
    assert merge_flags({"sender": None}, {}, {"sender": "kvlens@localhost"}) == {"sender": "kvlens@localhost"}
    pair = (("user", "password_env"),)
    assert merge_flags({"user": "u", "password_env": None}, {"user": "f", "password_env": "VAR"},
                       together=pair) == {"user": "u", "password_env": None}
    assert merge_flags({"user": None, "password_env": None}, {"user": "f", "password_env": "VAR"},
                       together=pair) == {"user": "f", "password_env": "VAR"}


def test_simulate_scenario_writes_the_what_if_the_cli_writes(tmp_path: Path) -> None:
    from kvlens.analyzers.sim_config import SimConfig
    from kvlens.analyzers.what_if import WhatIfResult, simulate_scenario
    from kvlens.errors import NoDataError
    from kvlens.query import connect

    lake = tmp_path / "lake"
    import_files("mooncake", [_mooncake(tmp_path / "m.jsonl")], lake, scenario="m", model="llama-3.1-8b")
    result = simulate_scenario(lake, "m", "rr2", SimConfig(replicas=2))
    assert isinstance(result, WhatIfResult) and result.counts["requests"] == 2
    assert result.config.step_model is not None and result.model.name.lower().startswith("llama-3.1-8b")
    from click.testing import CliRunner

    out = CliRunner().invoke(cli, ["simulate", "--lake", str(lake), "--from", "m", "--scenario", "cli2",
                                   "--replicas", "2"])
    assert out.exit_code == 0, out.output
    assert f"scenario 'cli2': {result.counts['requests']:,} requests" in out.output
    con = connect(lake=lake)
    sql = "SELECT request_id, replica, ttft_ms FROM requests WHERE scenario = ? ORDER BY 1"
    assert con.execute(sql, ["rr2"]).fetchall() == con.execute(sql, ["cli2"]).fetchall()
    con.close()
    with pytest.raises(NoDataError, match="scenario 'nope' has no requests"):
        simulate_scenario(lake, "nope", "x", SimConfig(replicas=1))


def test_a_collect_front_door_runs_inside_the_stop_scope_it_is_given(tmp_path: Path) -> None:
    import contextlib
    from collections.abc import Callable, Iterator

    from kvlens.collector.collect import collect_scrape

    @contextlib.contextmanager
    def stopped_at_once(stop: Callable[[], object]) -> Iterator[None]:
        stop()
        yield

    lines: list[str] = []
    stats = collect_scrape(tmp_path / "lake", url="http://127.0.0.1:9/metrics", replica="r", interval_s=0.01,
                           duration_s=30.0, until=stopped_at_once, announce=lines.append)
    assert (stats.ok, stats.failed) == (0, 0)
    assert lines == [f"scraping http://127.0.0.1:9/metrics every 0.01 s into {tmp_path / 'lake'} "
                     "as writer scrape-r"]
