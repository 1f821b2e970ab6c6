"""kvlens sql is read-only for real: no statement writes, and nothing outside the lake and the DB is read.

Both layers are tested on their own: the statement check (kvlens/readonly.py, through the CLI) and
the locked connection (kvlens.query.connect, with statements sent to DuckDB directly).
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner, Result

from kvlens.cli import cli
from kvlens.query import connect, query

SECRET = "kvlens-test-secret-7f3a"


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def sql(*args: str | Path, statement: str) -> Result:
    # "--" ends the options: a statement may start with a "-- comment".
    return run("sql", *args, "--", statement)


def assert_error(result: Result) -> str:
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert SECRET not in result.output
    return lines[0]


@pytest.fixture
def lake(tmp_path: Path, mooncake3: Path) -> Path:
    path = tmp_path / "lake"
    result = run("import", "mooncake", mooncake3, "--lake", path)
    assert result.exit_code == 0, result.output
    return path


def _segment_dir(lake: Path) -> Path:
    (day,) = (lake / "requests" / "scenario=default").glob("date=*")
    return day


def _writes(lake: Path, out: Path) -> list[str]:
    seg = _segment_dir(lake) / "evil.parquet"
    return [
        f"EXPLAIN ANALYSE COPY (SELECT 42 AS x) TO '{out}'",
        f"explain analyze copy (select 42 as x) to '{out}'",
        f"ExPlAiN AnAlYsE COPY (SELECT 42 AS x) TO '{out}'",
        f"EXPLAIN (ANALYZE) COPY (SELECT 42 AS x) TO '{out}'",
        f"EXPLAIN (ANALYZE true, FORMAT json) COPY (SELECT 42 AS x) TO '{out}'",
        f"/* c */ COPY (SELECT 42 AS x) TO '{out}'",
        f"/* c */ EXPLAIN ANALYZE COPY (SELECT 42 AS x) TO '{out}'",
        f"-- c\nEXPLAIN /* d */ ANALYZE -- e\n COPY (SELECT 42 AS x) TO '{out}'",
        f"EXPLAIN COPY (SELECT 42 AS x) TO '{out}'",
        # 1,000 fake requests into the lake itself, where the views would read them
        f"EXPLAIN ANALYSE COPY (SELECT 'fake' || range AS request_id FROM range(1000)) TO '{seg}'",
        f"COPY (SELECT 'fake' AS request_id) TO '{seg}'",
        f"EXPORT DATABASE '{out}'",
        "CHECKPOINT",
        "CREATE TABLE t AS SELECT 1",
        "CREATE MACRO m() AS 1",
        "PRAGMA version",
        "CALL pragma_version()",
        f"IMPORT DATABASE '{out}'",
        "SET enable_external_access = true",
        "SET lock_configuration = false",
        "RESET enable_external_access",
        f"ATTACH '{out}' AS o",
        "INSTALL httpfs",
        "LOAD httpfs",
        "UPDATE EXTENSIONS",
        "EXPLAIN ANALYZE ANALYZE",
        "PIVOT requests ON replica USING count(*)",
        "SELECT 1; /* c */ COPY (SELECT 42) TO 'x.csv'",
    ]


def test_every_write_is_refused_and_nothing_is_written(lake: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.csv"
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for statement in _writes(lake, out):
        line = assert_error(sql("--lake", lake, statement=statement))
        assert "read-only" in line or "exactly one statement" in line, (statement, line)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    result = run("sql", "--lake", lake, "select count(*) from requests", "--format", "csv")
    assert result.stdout.splitlines() == ["count_star()", "3"]


@pytest.mark.parametrize("statement", [
    "SELECT * FROM read_text('/proc/self/environ')",
    "SELECT * FROM read_blob('/proc/self/environ')",
    "SELECT * FROM read_csv('/proc/self/environ', header = false, sep = '|')",
    "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM read_blob('/etc/hostname')",
    "SELECT * FROM glob('/*')",
    "SELECT * FROM glob('/etc/*')",
    "SELECT * FROM sniff_csv('/etc/passwd')",
    "/* c */ SELECT * FROM read_text('/proc/self/environ')",
    "EXPLAIN ANALYZE SELECT * FROM read_text('/proc/self/environ')",
    "SELECT * FROM read_text('{lake}/../outside.txt')",
    "SELECT * FROM read_text('{lake}/_kvlens.json')",
    "SELECT * FROM read_parquet('{outside}')",
    "SELECT * FROM duckdb_secrets()",
])
def test_reads_outside_the_lake_are_refused(lake: Path, tmp_path: Path, statement: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLENS_TEST_SECRET", SECRET)
    (tmp_path / "outside.txt").write_text(SECRET)
    outside = tmp_path / "outside.parquet"
    duckdb.sql(f"COPY (SELECT '{SECRET}' AS s) TO '{outside}'")
    line = assert_error(sql("--lake", lake, statement=statement.format(lake=lake, outside=outside)))
    assert "Permission" in line or "read" in line


def test_the_lakes_own_segments_still_read(lake: Path) -> None:
    seg = next(_segment_dir(lake).glob("*.parquet"))
    result = run("sql", "--lake", lake, f"select count(*) from read_parquet('{seg}')", "--format", "csv")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["count_star()", "3"]


@pytest.mark.parametrize("statement", [
    "select count(*) from requests",
    "/* c */ select count(*) from requests",
    "EXPLAIN ANALYSE select count(*) from requests",
    "explain (analyze) select count(*) from requests",
    "explain (select 1)",
    "describe requests",
    "show tables",
    "summarize requests",
    "from requests select count(*)",
    "values (1), (2)",
    "with x as (select 1 as a) select * from x",
])
def test_reading_statements_run(lake: Path, statement: str) -> None:
    result = sql("--lake", lake, statement=statement)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""


def test_the_connection_itself_is_locked(lake: Path, tmp_path: Path) -> None:
    # The second layer: statements sent to DuckDB directly, past the statement check.
    con = connect(lake=lake)
    try:
        out = tmp_path / "x.csv"
        for statement in (f"COPY (SELECT 1) TO '{out}'", f"ATTACH '{tmp_path / 'o.db'}' AS o",
                          "SELECT * FROM read_text('/proc/self/environ')", "LOAD httpfs",
                          "SET enable_external_access = true", "SET lock_configuration = false",
                          "SET allowed_directories = ['/']", "SET autoload_known_extensions = true",
                          "SET python_enable_replacements = true"):
            with pytest.raises(duckdb.Error):
                con.execute(statement)
        assert not out.exists() and not (tmp_path / "o.db").exists()
        settings = dict(con.execute(
            "SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access', "
            "'lock_configuration', 'autoload_known_extensions', 'autoinstall_known_extensions')").fetchall())
        assert settings == {"enable_external_access": "false", "lock_configuration": "true",
                            "autoload_known_extensions": "false", "autoinstall_known_extensions": "false"}
        assert con.execute("SELECT count(*) FROM requests").fetchone() == (3,)
    finally:
        con.close()


def test_the_analysis_dbs_lake_views_read_and_nothing_else(demo_workdir: Path, tmp_path: Path) -> None:
    db = demo_workdir / "kvlens.duckdb"
    # requests is the DB's own view over the lake (by absolute path): the lake's files stay readable.
    _, rows = query("SELECT count(*) FROM requests", db=db)
    assert rows[0][0] > 0
    _, rows = query("SELECT count(*) FROM miss_ledger", db=db)
    assert rows[0][0] > 0
    outside = tmp_path / "o.parquet"
    duckdb.sql(f"COPY (SELECT 1 AS a) TO '{outside}'")
    for statement in (f"SELECT * FROM read_parquet('{outside}')", "SELECT * FROM read_text('/etc/passwd')"):
        line = assert_error(sql("--db", db, statement=statement))
        assert "Permission" in line


def test_the_dashboard_connection_is_locked(demo_workdir: Path) -> None:
    from kvlens.dashboards.read import open_db

    con = open_db(demo_workdir / "kvlens.duckdb")
    try:
        with pytest.raises(duckdb.Error):
            con.execute("SELECT * FROM read_text('/proc/self/environ')")
        with pytest.raises(duckdb.Error):
            con.execute("SET enable_external_access = true")
        cur = con.cursor()  # a cursor is a new session: the lock holds there too
        try:
            with pytest.raises(duckdb.Error):
                cur.execute("SELECT * FROM read_text('/proc/self/environ')")
            assert cur.execute("SELECT current_setting('python_enable_replacements')").fetchone() == (False,)
        finally:
            cur.close()
    finally:
        con.close()
