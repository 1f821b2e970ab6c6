"""Tests for the kvlens command line (click's CliRunner over kvlens.cli.cli)."""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kvlens.cli import cli

REPO = Path(__file__).resolve().parents[1]


def run(*args: str | Path) -> Result:
    # click >= 8.2 keeps stdout and stderr apart (result.stdout / result.stderr).
    return CliRunner().invoke(cli, [str(a) for a in args])


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("Error:")]


def assert_one_error_line(result: Result) -> str:
    """Exit 1, nothing on stdout, and stderr is exactly one ``Error:`` line."""
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


@pytest.fixture
def lake(tmp_path: Path, mooncake3: Path) -> Path:
    path = tmp_path / "lake"
    result = run("import", "mooncake", mooncake3, "--lake", path)
    assert result.exit_code == 0, result.output
    assert "imported 3 requests and 8 blocks" in result.stdout
    return path


# -- sql --------------------------------------------------------------------------------------


def test_sql_csv_is_header_and_count(lake: Path) -> None:
    result = run("sql", "--lake", lake, "select count(*) from requests", "--format", "csv")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["count_star()", "3"]
    assert result.stderr == ""


def test_sql_json_parses(lake: Path) -> None:
    result = run("sql", "--lake", lake, "select count(*) AS n, min(prompt_tokens) AS p from requests",
                 "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"n": 3, "p": 1024}]


def test_sql_table_contains_count(lake: Path) -> None:
    result = run("sql", "--lake", lake, "select count(*) AS n from requests")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].strip() == "n"
    assert "3" in lines[2].split()
    assert lines[-1] == "(1 row)"


def test_sql_reads_scenario_and_blocks(lake: Path) -> None:
    result = run("sql", "--lake", lake, "select scenario, sum(block_tokens) from request_blocks group by 1",
                 "--format", "csv")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[1:] == [f"default,{1024 + 1300 + 1100}"]


@pytest.mark.parametrize("query", [
    "drop view requests",
    "create table t as select 1",
    "copy (select 1) to 'x.csv'",
    "insert into requests (request_id) values ('x')",
    "attach 'other.db' as o",
    "select 1; drop view requests",
])
def test_sql_refuses_writes(lake: Path, tmp_path: Path, query: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_one_error_line(run("sql", "--lake", lake, query))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no x.csv, no other.db
    # The views are still there afterwards.
    result = run("sql", "--lake", lake, "select count(*) from requests", "--format", "csv")
    assert result.stdout.splitlines() == ["count_star()", "3"]


def test_sql_explain_analyze_does_not_write(lake: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # EXPLAIN ANALYZE executes the statement it explains: it must not be a way around read-only.
    monkeypatch.chdir(tmp_path)
    result = run("sql", "--lake", lake, "explain analyze copy (select 42 AS x) to 'x.csv'")
    assert not (tmp_path / "x.csv").exists()
    assert_one_error_line(result)


def test_sql_syntax_error_is_one_line(lake: Path) -> None:
    line = assert_one_error_line(run("sql", "--lake", lake, "selec count(*) from requests"))
    assert "selec" in line


def test_sql_unknown_table_is_one_line(lake: Path) -> None:
    line = assert_one_error_line(run("sql", "--lake", lake, "select * from no_such_table"))
    assert "no_such_table" in line


def test_sql_needs_lake_or_db() -> None:
    line = assert_one_error_line(run("sql", "select 1"))
    assert "--lake" in line and "--db" in line


def test_sql_missing_lake(tmp_path: Path) -> None:
    line = assert_one_error_line(run("sql", "--lake", tmp_path / "nope", "select 1"))
    assert "nope" in line


# -- import -----------------------------------------------------------------------------------


def test_import_unknown_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    result = run("import", "mooncake", missing, "--lake", tmp_path / "lake")
    assert result.exit_code != 0
    errors = error_lines(result)
    assert len(errors) == 1 and str(missing) in errors[0] and "no such file" in errors[0]
    assert "Traceback" not in result.output


def test_import_bad_line_names_file_and_line(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    good = {"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [1]}
    bad = write_jsonl("bad.jsonl", [good, {**good, "input_length": "512"}, good])
    result = run("import", "mooncake", bad, "--lake", tmp_path / "lake")
    assert result.exit_code == 1
    assert result.stdout == ""
    errors = error_lines(result)
    assert len(errors) == 1, result.stderr
    assert str(bad) in errors[0] and "line 2" in errors[0] and "input_length" in errors[0]


def test_import_skip_bad_lines(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    good = {"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [1]}
    path = write_jsonl("mixed.jsonl", [good, "{oops", good, {**good, "hash_ids": []}, good])
    lake = tmp_path / "lake"
    result = run("import", "mooncake", path, "--lake", lake, "--skip-bad-lines", "--scenario", "m")
    assert result.exit_code == 0, result.output
    assert "imported 3 requests" in result.stdout
    assert "skipped 2 bad lines" in result.stderr
    assert "skipped" not in result.stdout
    counts = run("sql", "--lake", lake, "select scenario, count(*) from requests group by 1",
                 "--format", "csv")
    assert counts.stdout.splitlines()[1:] == ["m,3"]


def test_import_bad_scenario_name(tmp_path: Path, mooncake3: Path) -> None:
    result = run("import", "mooncake", mooncake3, "--lake", tmp_path / "lake", "--scenario", "../x")
    assert result.exit_code == 1
    assert len(error_lines(result)) == 1 and "scenario" in error_lines(result)[0]


def test_import_t0_option(tmp_path: Path, mooncake3: Path) -> None:
    lake = tmp_path / "lake"
    result = run("import", "mooncake", mooncake3, "--lake", lake, "--t0", "2024-06-01T00:00:00Z")
    assert result.exit_code == 0, result.output
    out = run("sql", "--lake", lake, "select min(arrival_ns) from requests", "--format", "csv")
    assert out.stdout.splitlines()[1] == str(1_717_200_000 * 10**9)
    naive = run("import", "mooncake", mooncake3, "--lake", lake, "--t0", "2024-06-01T00:00:00")
    assert naive.exit_code == 1 and "zone" in naive.stderr


def test_import_truncated_gzip_names_the_file(tmp_path: Path, mooncake3: Path) -> None:
    data = mooncake3.read_bytes() * 50
    path = tmp_path / "cut.jsonl.gz"
    compressed = gzip.compress(data)
    path.write_bytes(compressed[: len(compressed) // 2])
    result = run("import", "mooncake", path, "--lake", tmp_path / "lake")
    assert result.exit_code == 1
    errors = error_lines(result)
    assert len(errors) == 1 and str(path) in errors[0], result.output


# -- demo -------------------------------------------------------------------------------------


def test_demo(tmp_path: Path) -> None:
    result = run("demo", "--workdir", tmp_path / "demo")
    assert result.exit_code == 0, result.output
    assert re.search(r"requests\s+12,031\b", result.stdout), result.stdout
    m = re.search(r"= (\d+(?:\.\d+)?)% of prompt tokens", result.stdout)
    assert m, result.stdout
    assert 30.0 <= float(m.group(1)) <= 45.0
    assert (tmp_path / "demo" / "lake").is_dir()


# -- help, README, schema page ----------------------------------------------------------------


def _commands() -> dict[str, object]:
    return dict(cli.commands)


def test_every_command_has_help_and_example() -> None:
    assert {"import", "sql", "schema", "demo"} <= set(_commands())
    for name, cmd in _commands().items():
        help_text = (getattr(cmd, "help", None) or "").strip()
        assert help_text, f"kvlens {name} has no help text"
        examples = [ln.strip() for ln in help_text.splitlines() if ln.strip().startswith("Example:")]
        assert examples, f"kvlens {name}: its docstring has no 'Example:' line"
        assert f"kvlens {name}" in examples[0], f"kvlens {name}: the example does not run kvlens {name}"
        result = run(name, "--help")
        assert result.exit_code == 0 and "Example:" in result.stdout, name


def test_readme_mentions_every_command() -> None:
    readme = (REPO / "README.md").read_text()
    missing = [name for name in _commands() if f"kvlens {name}" not in readme]
    assert not missing, f"README.md does not show: {', '.join(f'kvlens {n}' for n in missing)}"


def test_schema_markdown_matches_committed_page() -> None:
    result = run("schema", "--markdown")
    assert result.exit_code == 0, result.output
    page = REPO / "docs" / "schema.md"
    assert page.is_file(), "docs/schema.md is missing: run kvlens schema --markdown > docs/schema.md"
    assert result.stdout == page.read_text(), "docs/schema.md is stale: regenerate it"


def test_schema_plain_lists_tables() -> None:
    result = run("schema")
    assert result.exit_code == 0
    assert any(line.startswith("requests (lake): request_id, scenario, arrival_ns")
               for line in result.stdout.splitlines())
