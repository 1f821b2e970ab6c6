"""Every bad invocation of the CLI: one ``Error:`` line, exit status 1, no traceback (README's promise).

The table enumerates commands × bad inputs: damaged lakes (a truncated or overwritten segment, a
garbage ``_kvlens.json``), files that are not what a flag needs (not DuckDB, a directory, a path
under a file), ports in use, bad addresses, bad flag values and usage errors (click's own exit
status for those is 2).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from kvlens.cli import cli
from kvlens.lake import SegmentWriter

T = "trace.jsonl"  # the three-line Mooncake trace (conftest's mooncake3)

# (id, argv with {placeholders}, what the Error line must mention)
CASES: list[tuple[str, str, str]] = [
    # usage
    ("bare", "", "needs a command"),
    ("unknown-command", "nope", "No such command"),
    ("bare-group", "collect", "needs a command"),
    ("unknown-option", "sql --nope x", "No such option"),
    ("sql-no-query", "sql --lake {lake}", "Missing argument"),
    ("sql-bad-format", "sql --lake {lake} --format xml x", "--format"),
    ("import-bad-format", "import nope {trace} --lake {lake}", "FORMAT"),
    ("import-bad-t0", "import mooncake {trace} --lake {tmp}/l2 --t0 yesterday", "ISO time"),
    ("analyze-no-lake", "analyze --lake {tmp}/nope --db {tmp}/k.duckdb", "does not exist"),
    ("analyze-cache-zero", "analyze --lake {lake} --db {tmp}/k.duckdb --cache-tokens 0", "--cache-tokens"),
    ("simulate-replicas-zero", "simulate --lake {lake} --from default --scenario x --replicas 0",
     "--replicas"),
    ("simulate-bad-routing", "simulate --lake {lake} --from default --scenario x --replicas 2 "
     "--routing bogus", "--routing"),
    ("metrics-port-range", "collect vllm --endpoint tcp://127.0.0.1:5 --lake {tmp}/l3 --metrics-port 70000",
     "--metrics-port"),
    ("scrape-interval-zero", "collect scrape --url http://127.0.0.1:1/m --replica r --lake {tmp}/l4 "
     "--interval 0", "--interval"),
    ("export-port-range", "export --db {duck} --port 70000", "--port"),
    ("hash-block-zero", "hash --block-size 0", "--block-size"),
    ("demo-workdir-file", "demo --workdir {file}", "--workdir"),
    # sql
    ("sql-nothing", "sql x", "--lake"),
    ("sql-missing-lake", "sql --lake {tmp}/nope x", "does not exist"),
    ("sql-lake-is-file", "sql --lake {file} x", "is a file"),
    ("sql-garbage-marker", "sql --lake {marker} 'select 1'", "_kvlens.json"),
    ("sql-truncated-segment", "sql --lake {trunc} 'select 1'", "move it out of the lake"),
    ("sql-garbage-segment", "sql --lake {garbage} 'select 1'", "move it out of the lake"),
    ("sql-db-not-duckdb", "sql --db {notdb} 'select 1'", "not a DuckDB file"),
    ("sql-db-missing", "sql --db {tmp}/none.duckdb 'select 1'", "does not exist"),
    ("sql-db-under-file", "sql --db {file}/k.duckdb 'select 1'", "does not exist"),
    ("sql-db-directory", "sql --db {tmp} 'select 1'", "--db"),
    ("sql-syntax", "sql --lake {lake} 'selec 1'", "parse"),
    ("sql-write", "sql --lake {lake} 'drop view requests'", "read-only"),
    ("sql-outside-file", "sql --lake {lake} \"select * from read_text('/etc/hostname')\"", "Permission"),
    # import
    ("import-missing-file", "import mooncake {tmp}/missing.jsonl --lake {lake}", "no such file"),
    ("import-empty-mooncake", "import mooncake {empty} --lake {lake}", "nothing was replaced"),
    ("import-empty-gateway", "import gateway {empty} --lake {lake}", "nothing was replaced"),
    ("import-empty-vllm-events", "import vllm-events {empty} --lake {lake}", "nothing was replaced"),
    ("import-empty-otlp-json", "import otlp-json {empty} --lake {lake}", "nothing was replaced"),
    ("import-bad-line", "import mooncake {bad} --lake {lake}", "line 1"),
    ("import-lake-under-file", "import mooncake {trace} --lake {file}/lake", "cannot create lake"),
    ("import-garbage-marker", "import mooncake {trace} --lake {marker}", "_kvlens.json"),
    ("import-bad-scenario", "import mooncake {trace} --lake {lake} --scenario ../x", "scenario name"),
    # analyze
    ("analyze-truncated-segment", "analyze --lake {trunc} --db {tmp}/k.duckdb", "move it out of the lake"),
    ("analyze-garbage-marker", "analyze --lake {marker} --db {tmp}/k.duckdb", "_kvlens.json"),
    ("analyze-db-not-duckdb", "analyze --lake {lake} --db {notdb}", "not a DuckDB file"),
    ("analyze-db-under-file", "analyze --lake {lake} --db {file}/k.duckdb", "--db"),
    ("analyze-db-directory", "analyze --lake {lake} --db {tmp}", "--db"),
    ("analyze-unknown-scenario", "analyze --lake {lake} --db {tmp}/k.duckdb --scenario nope", "nope"),
    ("analyze-unknown-model", "analyze --lake {lake} --db {tmp}/k.duckdb --model nope", "nope"),
    # simulate, compact
    ("simulate-truncated-segment", "simulate --lake {trunc} --from default --scenario x --replicas 2",
     "move it out of the lake"),
    ("simulate-unknown-source", "simulate --lake {lake} --from nope --scenario x --replicas 2", "nope"),
    ("compact-damaged-segment", "compact --lake {compactable}", "move it out of the lake"),
    ("compact-missing-lake", "compact --lake {tmp}/nope", "nope"),
    ("compact-keep-not-days", "compact --lake {lake} --keep 30", "whole days"),
    ("compact-keep-zero", "compact --lake {lake} --keep 0d", "whole days"),
    # collectors
    ("vllm-no-endpoint", "collect vllm --lake {tmp}/l5", "--endpoint"),
    ("vllm-bad-endpoint", "collect vllm --endpoint nonsense --lake {tmp}/l5", "ZMQ endpoint"),
    ("vllm-bad-endpoint-port", "collect vllm --endpoint tcp://127.0.0.1:notaport --lake {tmp}/l5", "port"),
    ("vllm-bad-replay", "collect vllm --endpoint tcp://127.0.0.1:5 --replay bogus --lake {tmp}/l5",
     "--replay"),
    ("vllm-star-without-bind", "collect vllm --endpoint tcp://*:5557 --lake {tmp}/l5", "--bind"),
    ("vllm-metrics-port-in-use", "collect vllm --endpoint tcp://127.0.0.1:5 --lake {tmp}/l5 "
     "--metrics-port {busy}", "in use"),
    ("vllm-missing-config", "collect vllm --config {tmp}/none.toml --lake {tmp}/l5", "none.toml"),
    ("otlp-bad-listen", "collect otlp --listen bogus --lake {tmp}/l6", "HOST:PORT"),
    ("otlp-listen-in-use", "collect otlp --listen 127.0.0.1:{busy} --lake {tmp}/l6 --duration 0.1",
     "listen"),
    ("scrape-bad-url", "collect scrape --url nonsense --replica r --lake {tmp}/l7 --duration 0.1", "--url"),
    ("scrape-url-and-config", "collect scrape --url http://h/m --replica r --config {tmp}/k.toml "
     "--lake {tmp}/l7", "--config"),
    ("scrape-config-without-metrics", "collect scrape --config {fleet} --lake {tmp}/l7", "metrics_url"),
    # serve
    ("serve-missing-config", "serve --config {tmp}/none.toml --lake {tmp}/l8 --db {tmp}/k.duckdb",
     "none.toml"),
    ("serve-bad-period", "serve --config {fleet} --lake {tmp}/l8 --db {tmp}/k.duckdb --analyze-every soon",
     "soon"),
    ("serve-otlp-in-use", "serve --config {fleet} --lake {tmp}/l8 --db {tmp}/k.duckdb "
     "--otlp-listen 127.0.0.1:{busy}", "--otlp-listen"),
    ("serve-export-in-use", "serve --config {fleet} --lake {tmp}/l8 --db {tmp}/k.duckdb --otlp-listen off "
     "--export-port {busy}", "--export-port"),
    ("gateway-missing-config", "gateway --config {tmp}/none.toml --lake {tmp}/l8", "none.toml"),
    ("gateway-bad-listen", "gateway --config {tmp}/none.toml --listen bogus --lake {tmp}/l8", "HOST:PORT"),
    # readers of the analysis DB
    ("report-db-not-duckdb", "report --db {notdb} --out {tmp}/r.html", "not a DuckDB file"),
    ("report-db-not-analysis", "report --db {duck} --out {tmp}/r.html", "request_ledger"),
    ("report-bad-since", "report --db {duck} --out {tmp}/r.html --since bogus", "bogus"),
    ("report-email-without-smtp", "report --db {duck} --out {tmp}/r.html --email-to a@example.com",
     "--smtp"),
    ("export-db-not-duckdb", "export --db {notdb} --port 0 --duration 0.1", "not a DuckDB file"),
    ("export-port-in-use", "export --db {duck} --port {busy} --duration 0.1", "in use"),
    ("dashboard-db-missing", "dashboard --db {tmp}/none.duckdb", "does not exist"),
    ("dashboard-db-not-duckdb", "dashboard --db {notdb}", "not a DuckDB file"),
    ("dashboard-port-in-use", "dashboard --db {duck} --port {busy}", "in use"),
    # others
    ("hash-garbage-stdin", "hash --block-size 4", "token ids"),
    ("probe-bad-prefix-tokens", "probe --prefix-tokens abc", "--prefix-tokens"),
]


@pytest.fixture
def places(tmp_path: Path, mooncake3: Path) -> Iterator[dict[str, str]]:
    """Every placeholder of the table, built once per test in tmp_path."""
    lake = tmp_path / "lake"
    assert CliRunner().invoke(cli, ["import", "mooncake", str(mooncake3), "--lake", str(lake)]).exit_code == 0
    p = {"tmp": tmp_path, "lake": lake, "trace": mooncake3}
    for name, damage in (("trunc", lambda b: b[: len(b) // 2]), ("garbage", lambda b: b"\x07" * len(b))):
        copy = tmp_path / name
        _copy_tree(lake, copy)
        seg = next((copy / "requests").rglob("*.parquet"))
        seg.write_bytes(damage(seg.read_bytes()))
        p[name] = copy
    p["marker"] = tmp_path / "marker"
    _copy_tree(lake, p["marker"])
    (p["marker"] / "_kvlens.json").write_text("{not json")
    p["compactable"] = _two_segments_one_damaged(tmp_path / "compactable")
    for name, content in (("file", "a file\n"), ("notdb", "not a database\n"), ("empty", ""),
                          ("bad", "{not json\n")):
        (tmp_path / name).write_text(content)
        p[name] = tmp_path / name
    p["fleet"] = tmp_path / "fleet.toml"
    p["fleet"].write_text('[[fleet.replicas]]\nname = "a"\nendpoint = "tcp://127.0.0.1:5557"\n')
    p["duck"] = tmp_path / "plain.duckdb"
    duckdb.connect(str(p["duck"])).close()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        p["busy"] = busy.getsockname()[1]
        yield {k: str(v) for k, v in p.items()}


def _copy_tree(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst)


def _two_segments_one_damaged(lake: Path) -> Path:
    with SegmentWriter(lake, "requests", scenario="s", writer_id="t") as w:
        for i in range(2):
            w.append_rows([{"request_id": f"r{i}", "arrival_ns": 0, "prompt_tokens": 1}])
            w.flush()
    seg = sorted((lake / "requests").rglob("*.parquet"))[-1]
    seg.write_bytes(seg.read_bytes()[:-20])
    return lake


def _argv(template: str, places: dict[str, str]) -> list[str]:
    import shlex

    return [a.format(**places) for a in shlex.split(template)]


@pytest.mark.parametrize(("argv", "mention"), [(a, m) for _, a, m in CASES], ids=[c[0] for c in CASES])
def test_bad_invocation_is_one_error_line_and_exit_1(argv: str, mention: str, places: dict[str, str]) -> None:
    result = CliRunner().invoke(cli, _argv(argv, places), input="not token ids\n")
    assert isinstance(result.exception, SystemExit), result.exception  # not an uncaught exception
    assert result.exit_code == 1, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and result.stderr.rstrip("\n").endswith(errors[0]), result.stderr
    assert mention in errors[0], errors[0]


def test_the_table_covers_every_command() -> None:
    commands = ({c for c in cli.commands if c != "collect"}
                | {f"collect {c}" for c in ("vllm", "otlp", "scrape")})
    covered = {" ".join(argv.split()[:2]) if argv.startswith("collect ") else argv.split()[0]
               for _, argv, _ in CASES if argv}
    assert commands - {"schema", "models"} <= covered
    assert len(CASES) >= 33
