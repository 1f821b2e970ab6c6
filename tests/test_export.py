"""kvlens export: a real HTTP scrape of the gauges, parsed with prometheus_client, equals SQL sums."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from tiny_analysis_db import make_tiny_db, mark_unobserved

from kvlens.cli import cli
from kvlens.dashboards.export import serve
from kvlens.errors import ConfigError
from kvlens.query import query

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        body = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def scrape_once(db: Path) -> Samples:
    """Serve ``db`` on a free port, scrape it once, stop."""
    server, _, port = serve(db, port=0)
    try:
        return scrape(port)
    finally:
        server.shutdown()
        server.server_close()


def test_scrape_equals_sql_sums(demo_workdir: Path) -> None:
    db = demo_workdir / "kvlens.duckdb"
    got = scrape_once(db)
    _, ledger = query("SELECT scenario, replica, outcome::VARCHAR, sum(tokens), sum(bytes) FROM miss_ledger "
                      "GROUP BY ALL", db=db)
    assert len(ledger) >= 24
    for scenario, replica, outcome, tokens, nbytes in ledger:
        labels = (("outcome", outcome), ("replica", replica), ("scenario", scenario))
        assert got[("kvlens_prompt_tokens", labels)] == tokens
        assert got[("kvlens_prompt_bytes", labels)] == nbytes
    assert sum(1 for name, _ in got if name == "kvlens_prompt_tokens") == len(ledger)
    _, ratios = query("""
        SELECT r.scenario, r.replica,
               coalesce(sum(l.tokens) FILTER (WHERE l.outcome LIKE 'hit_%'), 0) / any_value(r.prompt),
               coalesce(sum(l.bytes) FILTER (WHERE l.outcome LIKE 'hit_%'), 0)
                   / (any_value(r.prompt) * any_value(s.kv_bytes_per_token))
        FROM (SELECT scenario, replica, sum(prompt_tokens) AS prompt FROM request_ledger GROUP BY ALL) r
        JOIN miss_ledger l USING (scenario, replica) JOIN scenarios s USING (scenario) GROUP BY ALL""", db=db)
    for scenario, replica, by_tokens, by_bytes in ratios:
        for unit, want in (("tokens", by_tokens), ("bytes", by_bytes)):
            key = ("kvlens_hit_ratio", (("replica", replica), ("scenario", scenario), ("unit", unit)))
            assert got[key] == pytest.approx(want, rel=1e-12)
    assert got[("kvlens_export_up", ())] == 1.0


def test_a_replica_without_kv_events_has_no_hit_ratio(tmp_path: Path) -> None:
    """Scenario a's replica-1 published no KV events (r2's tokens unobserved): its ratio is unknown,
    so no kvlens_hit_ratio series; it exported 0.0 before, a replica that seemed to miss everything.
    replica-0 keeps its ratio, 0 of 100 tokens."""
    db = make_tiny_db(tmp_path / "kvlens.duckdb")
    mark_unobserved(db, "a", "r2", 200)
    got = scrape_once(db)
    for unit in ("tokens", "bytes"):
        assert ("kvlens_hit_ratio", (("replica", "replica-1"), ("scenario", "a"), ("unit", unit))) not in got
        assert got[("kvlens_hit_ratio", (("replica", "replica-0"), ("scenario", "a"), ("unit", unit)))] == 0.0
    assert got[("kvlens_tail_partial_tokens", (("replica", "replica-1"), ("scenario", "a")))] == 50


def test_a_new_db_file_is_served_at_the_next_scrape(tmp_path: Path) -> None:
    db = make_tiny_db(tmp_path / "kvlens.duckdb")
    server, _, port = serve(db, port=0)
    key = ("kvlens_hit_ratio", (("replica", "replica-0"), ("scenario", "b"), ("unit", "tokens")))
    try:
        assert scrape(port)[key] == pytest.approx(100 / 350)
        newer = make_tiny_db(tmp_path / "next.duckdb")
        con = duckdb.connect(str(newer))
        con.execute("UPDATE request_ledger SET prompt_tokens = prompt_tokens * 2 WHERE scenario = 'b'")
        con.close()
        os.replace(newer, db)  # as kvlens analyze does
        assert scrape(port)[key] == pytest.approx(100 / 700)
        db.write_text("not a database any more")
        after = scrape(port)  # the last good snapshot, flagged
        assert after[key] == pytest.approx(100 / 700) and after[("kvlens_export_up", ())] == 0.0
    finally:
        server.shutdown()
        server.server_close()


def test_bad_db_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        serve(tmp_path / "nope.duckdb", port=0)
    result = CliRunner().invoke(cli, ["export", "--db", str(tmp_path / "nope.duckdb"), "--port", "0"])
    assert result.exit_code == 1 and result.output.startswith("Error: ") and result.output.count("\n") == 1


def test_cli_serves_for_a_duration(tmp_path: Path) -> None:
    db = make_tiny_db(tmp_path / "kvlens.duckdb")
    result = CliRunner().invoke(cli, ["export", "--db", str(db), "--port", "0", "--duration", "0.2"])
    assert result.exit_code == 0, result.output
    assert "/metrics" in result.output
