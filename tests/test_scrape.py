"""collect scrape: a real vLLM exposition served over loopback HTTP lands in metric_samples."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner
from metrics_endpoint import MetricsEndpoint

from kvlens.cli import cli
from kvlens.collector.scrape import Scraper, parse_exposition
from kvlens.lake import open_lake

CAPTURE = (Path(__file__).parent / "data" / "vllm-cpu-capture" / "metrics.txt").read_text()
QUERIES = 'vllm:prefix_cache_queries_total{engine="0",model_name="/tmp/tiny"}'
HITS = 'vllm:prefix_cache_hits_total{engine="0",model_name="/tmp/tiny"}'
# The same engine after a restart: its counters start again, lower than before.
RESTARTED = (CAPTURE.replace(f"{QUERIES} 104998.0", f"{QUERIES} 500.0")
             .replace(f"{HITS} 63744.0", f"{HITS} 300.0"))

@pytest.fixture
def server() -> Iterator[MetricsEndpoint]:
    s = MetricsEndpoint([(200, CAPTURE.encode(), 0.0)])
    yield s
    s.close()


def _rows(lake: Path, where: str = "TRUE") -> list[tuple[object, ...]]:
    con = duckdb.connect()
    open_lake(con, lake)
    return con.execute(f"SELECT ts_ns, replica, name, labels, value FROM metric_samples WHERE {where} "
                       "ORDER BY ts_ns, name, CAST(labels AS VARCHAR)").fetchall()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clock(start_ns: int = 1_796_070_000_000_000_000) -> Callable[[], int]:
    ticks = iter(range(start_ns, start_ns + 10**15, 15 * 10**9))
    return lambda: next(ticks)


def test_real_vllm_exposition_then_a_counter_reset_are_stored_raw(server: MetricsEndpoint,
                                                                  tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    server.replies = [(200, CAPTURE.encode(), 0.0), (200, RESTARTED.encode(), 0.0)]
    scraper = Scraper(url=server.url, replica="replica-a", lake=str(lake), clock_ns=_clock())
    first = scraper.scrape_once()
    second = scraper.scrape_once()
    scraper.writer.commit()
    assert first == second == len(parse_exposition(CAPTURE)) > 0
    assert (scraper.stats.ok, scraper.stats.failed) == (2, 0)

    t0 = 1_796_070_000_000_000_000
    labels = {"engine": "0", "model_name": "/tmp/tiny"}
    assert _rows(lake, "name = 'vllm:prefix_cache_queries_total'") == [
        (t0, "replica-a", "vllm:prefix_cache_queries_total", labels, 104998.0),
        (t0 + 15 * 10**9, "replica-a", "vllm:prefix_cache_queries_total", labels, 500.0)]
    assert [r[4] for r in _rows(lake, "name = 'vllm:prefix_cache_hits_total'")] == [63744.0, 300.0]
    names = {r[2] for r in _rows(lake, f"ts_ns = {t0}")}
    for kept in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total", "vllm:external_prefix_cache_hits_total",
                 "vllm:external_prefix_cache_queries_total", "vllm:prefix_cache_hits_created",
                 "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"):
        assert kept in names, kept
    assert not any(n.startswith(("python_", "http_", "process_")) for n in names)
    assert "vllm:e2e_request_latency_seconds_bucket" not in names  # not on the allow-list
    buckets = _rows(lake, f"ts_ns = {t0} AND name = 'vllm:time_to_first_token_seconds_bucket'")
    assert len(buckets) == 23  # 22 bounds and +Inf
    count = _rows(lake, f"ts_ns = {t0} AND name = 'vllm:time_to_first_token_seconds_count'")[0][4]
    assert {r[4] for r in buckets if r[3]["le"] == "+Inf"} == {count} == {300.0}


def test_failed_scrapes_are_counted_and_the_loop_keeps_going(server: MetricsEndpoint,
                                                             tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    good = CAPTURE.encode()
    server.replies = [(500, b"engine error", 0.0), (200, b"<html>not metrics</html>", 0.0),
                      (200, b"\xff\xfe binary", 0.0), (200, good, 0.5), (200, good, 0.0)]
    scraper = Scraper(url=server.url, replica="r", lake=str(lake), interval_s=0.02, timeout_s=0.2)
    stats = scraper.run(duration_s=1.5)
    assert stats.failed == 4, stats.errors  # 500, garbage, not UTF-8, too slow
    assert stats.ok >= 2
    assert "500" in stats.errors[0] and "does not parse" in stats.errors[1]
    assert "timed out" in stats.errors[3]
    stored = _rows(lake, "name = 'vllm:prefix_cache_hits_total'")
    assert len(stored) == stats.ok and {r[4] for r in stored} == {63744.0}


def test_connection_refused_is_counted_not_raised(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/metrics"
    stats = Scraper(url=url, replica="r", lake=str(tmp_path / "lake"), interval_s=0.01).run(duration_s=0.2)
    assert stats.ok == 0 and stats.failed >= 2
    assert "refused" in (stats.last_error or "").lower()


def test_cli_scrape_writes_the_live_scenario(server: MetricsEndpoint, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    result = CliRunner().invoke(cli, ["collect", "scrape", "--url", server.url, "--replica", "replica-a",
                                      "--lake", str(lake), "--interval", "0.05", "--duration", "0.3"])
    assert result.exit_code == 0, result.output
    assert "0 failed" in result.output
    con = duckdb.connect()
    open_lake(con, lake)
    ((scenario, scrapes),) = con.execute(
        "SELECT scenario, count(*) FROM metric_samples WHERE name = 'vllm:prefix_cache_queries_total' "
        "GROUP BY scenario").fetchall()
    assert scenario == "live" and scrapes >= 2


def test_non_finite_values_are_skipped_and_counted(tmp_path: Path) -> None:
    text = ("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\"} NaN\n"
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} +Inf\n"
            "vllm:num_requests_running{engine=\"1\"} 3\n")
    skipped: list[str] = []
    assert parse_exposition(text, skipped=skipped) == [("vllm:num_requests_running", [("engine", "1")], 3.0)]
    assert skipped == ["vllm:kv_cache_usage_perc", "vllm:num_requests_running"]
    scraper = Scraper(url="http://x", replica="r", lake=str(tmp_path / "lake"), fetch_text=lambda u, t: text)
    assert scraper.scrape_once() == 1
    scraper.writer.commit()
    assert scraper.stats.skipped_samples == 2


def test_cli_scrape_config_follows_every_replicas_metrics_url(tmp_path: Path) -> None:
    servers = [MetricsEndpoint([(200, CAPTURE.encode(), 0.0)]) for _ in range(2)]
    try:
        servers[1].replies = [(200, RESTARTED.encode(), 0.0)]
        config = tmp_path / "kvlens.toml"
        config.write_text("".join(
            f'[[fleet.replicas]]\nname = "r{i}"\nendpoint = "tcp://127.0.0.1:{5557 + i}"\n'
            f'metrics_url = "{s.url}"\n' for i, s in enumerate(servers))
            + '[[fleet.replicas]]\nname = "no-metrics"\nendpoint = "tcp://127.0.0.1:5600"\n')
        lake = tmp_path / "lake"
        result = CliRunner().invoke(cli, ["collect", "scrape", "--config", str(config), "--lake", str(lake),
                                          "--interval", "0.05", "--duration", "0.3"])
        assert result.exit_code == 0, result.output
        assert servers[0].hits >= 2 and servers[1].hits >= 2
    finally:
        for s in servers:
            s.close()
    con = duckdb.connect()
    open_lake(con, lake)
    values = dict(con.execute("SELECT replica, max(value) FROM metric_samples "
                              "WHERE name = 'vllm:prefix_cache_queries_total' GROUP BY 1").fetchall())
    assert values == {"r0": 104998.0, "r1": 500.0}


def test_cli_scrape_needs_url_or_config(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["collect", "scrape", "--lake", str(tmp_path / "lake")])
    assert result.exit_code == 1 and "--config kvlens.toml" in result.output
