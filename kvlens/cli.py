"""The spine's command line: thin click commands over the packages, imported lazily.

Every KvlensError, and every usage error (a missing or bad flag, an unknown command), becomes
one ``Error:`` line and exit status 1 (click's default for usage errors is 2, with the usage
text); bugs keep their tracebacks.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from kvlens.cli_options import (
    Group,
    LazyChoice,
    collect_otlp_options,
    collect_scrape_options,
    collect_vllm_options,
    given_model,
    hash_key_options,
    mail_options,
    model_config_option,
    model_name,
    parse_now,
    progress_bar,
    sim_options,
)
from kvlens.cli_options import stopped_by_signals as _stopped_by_signals

__all__ = ["cli", "main"]


def _import_formats() -> tuple[str, ...]:
    from kvlens.collector.imports import FORMATS  # kvlens import's FORMAT choices: the registry

    return FORMATS


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug).")
@click.version_option(package_name="kvlens")
def cli(verbose: int) -> None:
    """kvlens: why each prompt token was recomputed instead of reused.

    Collectors write a Parquet lake; analyzers turn it into a DuckDB analysis DB;
    operators read it through SQL, reports and the dashboard.
    """
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _parse_t0(value: str | None) -> int:
    from kvlens.collector.importer import DEFAULT_T0_NS, rfc3339_ns

    if value is None:
        return DEFAULT_T0_NS
    try:
        return rfc3339_ns(value)
    except ValueError as e:
        raise click.BadParameter(f"{e}: give an ISO time such as 2025-01-01T00:00:00Z") from None


@cli.command("import")
@click.argument("fmt", metavar="FORMAT", type=LazyChoice(_import_formats))
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--lake", required=True, type=click.Path(file_okay=False), help="Lake directory.")
@click.option("--scenario", default="default", show_default=True,
              help="Scenario name; an existing scenario of that name is replaced whole.")
@click.option("--model", default=None, help="Model name recorded on the rows (e.g. llama-3.1-70b).")
@model_config_option
@click.option("--skip-bad-lines", is_flag=True, help="Count and skip lines that do not parse.")
@click.option("--t0", default=None, help="Anchor for traces with relative times (ISO time, UTC).")
@click.option("--allow-empty", is_flag=True,
              help="Replace the scenario even when the files hold no rows (default: refuse, keep it).")
def import_cmd(fmt: str, files: tuple[str, ...], lake: str, scenario: str, model: str | None,
               model_config: str | None, skip_bad_lines: bool, t0: str | None, allow_empty: bool) -> None:
    """Import trace FILES of FORMAT into the lake (requests, request_blocks).

    Example: kvlens import mooncake conversation_trace.jsonl --lake lake --scenario conv
    """
    from contextlib import nullcontext

    from kvlens.collector.imports import LINE_FORMATS, import_files

    lines = fmt in LINE_FORMATS  # read line by line: a progress bar and a --t0 anchor
    model = model_name(model, model_config)
    bar: Any
    with progress_bar(files, f"import {fmt}") if lines else nullcontext() as bar:
        r = import_files(fmt, files, lake, scenario=scenario, model=model, skip_bad_lines=skip_bad_lines,
                         t0_ns=_parse_t0(t0) if lines else None, allow_empty=allow_empty,
                         on_progress=bar.update if lines else None)
    where = f"scenario {scenario!r} of {lake}"
    if fmt == "vllm-events":
        click.echo(f"imported {r.batches:,} batches and {r.kv_rows:,} kv_events rows into {where} "
                   f"({r.bad_frames:,} bad frames, {r.bad_events:,} bad events, {r.duplicates:,} duplicates "
                   f"skipped; {r.unannounced_parents:,} stores whose parent was never announced)")
    elif fmt in ("otlp-json", "otlp"):
        click.echo(f"imported {r.requests:,} requests from llm_request spans into {where} "
                   f"({r.other_spans:,} other spans, {r.bad_spans:,} without a request id)")
    else:
        click.echo(f"imported {r.requests:,} requests and {r.blocks:,} blocks into {where}")
    if r.bad_lines:
        click.echo(f"skipped {r.bad_lines:,} bad lines; first: {r.first_bad[0]}", err=True)
    if r.repeats:
        click.echo(f"skipped {r.repeats:,} repeated lookups of requests already imported", err=True)


@cli.command("sql")
@click.argument("query")
@click.option("--lake", type=click.Path(file_okay=False), help="Lake directory (views over its tables).")
@click.option("--db", type=click.Path(dir_okay=False), help="Analysis DB written by kvlens analyze.")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True)
def sql_cmd(query: str, lake: str | None, db: str | None, fmt: str) -> None:
    """Run one read-only QUERY over the lake views and the analysis DB.

    Example: kvlens sql --lake lake "select scenario, count(*) from requests group by 1"
    """
    from kvlens.query import query as run_query
    from kvlens.query import render

    click.echo(render(*run_query(query, lake=lake, db=db), fmt), nl=False)


@cli.command("schema")
@click.option("--markdown", is_flag=True, help="Print the generated docs page (docs/schema.md).")
def schema_cmd(markdown: bool) -> None:
    """Print the lake and analysis tables (the contract).

    Example: kvlens schema --markdown > docs/schema.md
    """
    from kvlens.schema import TABLES, render_markdown

    if markdown:
        click.echo(render_markdown(), nl=False)
        return
    for table in TABLES.values():
        click.echo(f"{table.name} ({table.kind}): " + ", ".join(table.names))


@cli.command("models")
def models_cmd() -> None:
    """List the model geometries kvlens knows, with KV bytes per token.

    Example: kvlens models
    """
    from kvlens.models import MODELS

    for key, geo in MODELS.items():
        click.echo(f"{key:<18} {geo.kv_bytes_per_token():>9,} B/token ({geo.kv_dtype})  {geo.name}")


@cli.command("compact")
@click.option("--lake", required=True, type=click.Path(file_okay=False))
@click.option("--keep", default=None, metavar="Nd",
              help="Retention: first drop the raw days older than this (e.g. 30d), whole days, atomically; "
                   "the analysis DB is not touched.")
@click.option("--scenario", "scenarios", multiple=True,
              help="Scenario --keep applies to (repeat); default: all.")
def compact_cmd(lake: str, keep: str | None, scenarios: tuple[str, ...]) -> None:
    """Merge the segments of each closed day into one, atomically; with --keep, drop old days first.

    Example: kvlens compact --lake lake --keep 30d --scenario live
    """
    from kvlens.compact import compact, drop_old_days, parse_keep_days

    if keep is not None:
        dropped = drop_old_days(lake, parse_keep_days(keep), scenarios=scenarios)
        click.echo(f"dropped {dropped['days_dropped']} days older than {keep} "
                   f"({dropped['partitions_dropped']} partitions, {dropped['segments_dropped']} segments)")
    counts = compact(lake)
    click.echo(f"merged {counts['partitions_merged']} partitions "
               f"({counts['segments_replaced']} segments replaced)")


@cli.command("demo")
@click.option("--workdir", default="kvlens-demo", show_default=True, type=click.Path(file_okay=False),
              help="Where the demo's lake and outputs go (replaced on each run).")
def demo_cmd(workdir: str) -> None:
    """Run the whole pipeline on the shipped sample data and print a summary.

    Example: kvlens demo --workdir /tmp/kvlens-demo
    """
    from kvlens.dashboards.report import write_report
    from kvlens.sample_data.demo import SAMPLE_TRACE, run_demo

    with progress_bar((str(SAMPLE_TRACE),), "import sample trace") as bar:
        summary = run_demo(Path(workdir), on_progress=bar.update)
    click.echo(summary)
    db = Path(workdir) / "kvlens.duckdb"
    report = write_report(db, Path(workdir) / "report.html")
    click.echo(f"\nreport:      {report.resolve()}")
    # The same executable the user ran (make demo runs .venv/bin/kvlens, not on PATH).
    exe = sys.argv[0] if Path(sys.argv[0]).name == "kvlens" else "kvlens"
    click.echo(f"dashboard:   {exe} dashboard --db {db}   (then open http://localhost:8501)")


@cli.command("analyze")
@click.option("--lake", required=True, type=click.Path(file_okay=False, exists=True), help="Lake directory.")
@click.option("--db", required=True, type=click.Path(dir_okay=False), help="Analysis DB to (re)build.")
@click.option("--scenario", "scenarios", multiple=True, help="Scenario to analyze (repeat); default: all.")
@click.option("--model", default=None, help="Model geometry for bytes (default: the requests' model).")
@model_config_option
@click.option("--cache-tokens", type=click.IntRange(min=1), default=None,
              help="KV cache the requests are served from, in tokens (all replicas together): "
                   "places the effective capacity on the miss-ratio curve (table capacity).")
@click.option("--join", "join", multiple=True, metavar="SCENARIO",
              help="Fill each request's missing timings, replica and cached tokens from this scenario's "
                   "requests with the same id (e.g. spans from otlp-json); repeat for several. Writes "
                   "request_sources with the matches and the estimated clock offset.")
@click.option("--metrics-from", default=None, metavar="SCENARIO",
              help="Scenario holding the engines' scraped metrics (e.g. live); default: each analyzed "
                   "scenario itself. Writes reconciliation: engine hit counters beside the ledger.")
@click.option("--full", is_flag=True,
              help="Rebuild every scenario from the lake; by default a scenario whose lake segments "
                   "are unchanged is copied from the previous DB.")
def analyze_cmd(lake: str, db: str, scenarios: tuple[str, ...], model: str | None, model_config: str | None,
                cache_tokens: int | None, join: tuple[str, ...], metrics_from: str | None,
                full: bool) -> None:
    """Replay the lake into the analysis DB: block outcomes, the miss ledger, and more.

    Example: kvlens analyze --lake lake --db kvlens.duckdb --scenario rr8
    """
    from kvlens.analyzers.analyze import analyze_lake

    def bar(chosen: list[str]) -> Any:
        return click.progressbar(chosen, label="analyze", file=sys.stderr, width=30,
                                 item_show_func=lambda s: s or "")

    result = analyze_lake(lake, db, scenarios, given_model(model, model_config), cache_tokens=cache_tokens,
                          join=join, metrics_from=metrics_from, progress=bar, full=full)
    for scenario, mode, why in result.modes:
        click.echo(f"{scenario}: {mode} ({why})", err=True)
    click.echo(f"analysis DB written: {result.db}")


@cli.command("simulate")
@click.option("--lake", required=True, type=click.Path(file_okay=False, exists=True), help="Lake directory.")
@click.option("--from", "source", required=True, help="Scenario whose requests are replayed.")
@click.option("--scenario", required=True, help="Name of the what-if scenario to write (replaced).")
@sim_options
def simulate_cmd(lake: str, source: str, scenario: str, calibrate: str | None, model: str | None,
                 model_config: str | None, **knobs: Any) -> None:
    """Replay a scenario's requests on N replicas under a routing policy; write a what-if scenario.

    Every time it writes is modelled; the step-time model it used is printed.

    Example: kvlens simulate --lake lake --from conv --scenario rr8 --replicas 8 --routing round_robin
    """
    from kvlens.analyzers.sim_config import DEFAULT_MAX_BATCHED_TOKENS, Engine, SimConfig
    from kvlens.analyzers.what_if import simulate_scenario
    from kvlens.schema import RoutingPolicy

    engine = knobs["engine"]
    config = SimConfig(**{**knobs, "routing": RoutingPolicy(knobs["routing"]), "engine": Engine(engine),
                          "max_batched_tokens": knobs["max_batched_tokens"] or DEFAULT_MAX_BATCHED_TOKENS})
    r = simulate_scenario(lake, source, scenario, config, given_model(model, model_config),
                          calibrate=calibrate)
    click.echo(f"scenario {scenario!r}: " + ", ".join(f"{n:,} {t}" for t, n in r.counts.items()))
    if engine == "vllm":
        st = r.sim.stats
        click.echo(f"  {st['gpu_blocks']:,} blocks of {st['block_tokens']} tokens per replica, "
                   f"{st['steps']:,} steps, {st['preemptions']:,} preemptions; times are {st['step_model']}")
    else:
        click.echo("  times are modelled: prefill FLOPs at the device's efficiency, "
                   f"{config.device.decode_ms_per_token:g} ms per output token")


def _announce(line: str) -> None:
    click.echo(line, err=True)


@cli.group("collect")
def collect_group() -> None:
    """Follow live sources and append their rows to the lake (scenario: live).

    Example: kvlens collect vllm --endpoint tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --lake lake
    """


@collect_group.command("vllm")
@collect_vllm_options
def collect_vllm_cmd(model: str | None, model_config: str | None, **flags: Any) -> None:
    """Collect vLLM / SGLang KV-cache events over ZMQ into kv_events, with replay and checkpoints.

    Example: kvlens collect vllm --endpoint tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --lake lake
    """
    from kvlens.collector.collect import collect_vllm

    got = collect_vllm(model=model_name(model, model_config), until=_stopped_by_signals, announce=_announce,
                       **flags)
    for r in got:
        click.echo(f"{r.replica}: {r.batches:,} batches, {r.block_events:,} block events")


@cli.command("hash")
@click.option("--block-size", type=click.IntRange(min=1), required=True, help="Tokens per block.")
@hash_key_options
def hash_cmd(block_size: int, **keys: Any) -> None:
    """Print vLLM's block hashes for token ids read from stdin: position, hex digest, event uint64.

    Token ids are separated by spaces, commas or newlines (a JSON array works too); only full
    blocks are hashed.

    Example: seq 1 64 | kvlens hash --block-size 16 --algo sha256_cbor --seed 0
    """
    import re

    from kvlens.collector.hashing import vllm_block_hashes
    from kvlens.errors import InputError

    text = sys.stdin.read()
    try:
        tokens = [int(t) for t in re.split(r"[\s,\[\]]+", text) if t]
    except ValueError as e:
        raise InputError(f"stdin holds something other than token ids: {e}") from None
    for b in vllm_block_hashes(tokens, block_size, **keys):
        click.echo(f"{b.position}\t{b.digest.hex()}\t{b.value}")


@cli.command("probe")
@click.option("--model", default=None, help="Model geometry to probe (default: the project default model).")
@model_config_option
@click.option("--prefix-tokens", default=None,
              help="Comma-separated prefix lengths [GPU default: 4096,16384,32768,65536].")
@click.option("--lake", type=click.Path(file_okay=False), default=None,
              help="Append the rows to probe_runs in this lake (scenario probe).")
@click.option("--quick", is_flag=True, help="Fewer prefix lengths and runs.")
def probe_cmd(model: str | None, model_config: str | None, prefix_tokens: str | None, lake: str | None,
              quick: bool) -> None:
    """Measure KV transfer paths and prefill on this machine's GPU (a tiny CPU run without one).

    Example: kvlens probe --model llama-3.1-8b --prefix-tokens 4096,16384 --lake lake
    """
    from kvlens.gpu_probe.run import probe_machine

    r = probe_machine(given_model(model, model_config), prefix_tokens, quick=quick, lake=lake,
                      announce=click.echo)
    click.echo(r.table)
    if lake:
        click.echo(f"wrote {r.rows} probe_runs rows (run {r.report.run_id}) to {lake}")
    if not r.report.byte_exact:
        raise click.ClickException("a transfer path was not byte-exact (or the delay-injection "
                                   "check failed); see the table above")


@collect_group.command("scrape")
@collect_scrape_options
def collect_scrape_cmd(url: str | None, replica: str | None, config: str | None, **flags: Any) -> None:
    """Scrape engines' Prometheus /metrics (vLLM, SGLang, LMCache) into metric_samples.

    Example: kvlens collect scrape --url http://127.0.0.1:8000/metrics --replica replica-a --lake lake
    """
    from kvlens.collector.collect import collect_scrape, collect_scrape_fleet
    from kvlens.errors import ConfigError

    if (url is None) == (config is None) or (url is None) != (replica is None):
        raise ConfigError("give --url with --replica (one engine), or --config kvlens.toml (every replica's "
                          "metrics_url)")
    if config is not None:
        each = collect_scrape_fleet(config=config, until=_stopped_by_signals, announce=_announce, **flags)
    else:
        each = [(str(replica), collect_scrape(url=str(url), replica=str(replica), until=_stopped_by_signals,
                                              announce=_announce, **flags))]
    for name, stats in each:
        click.echo(f"{name}: {stats.ok:,} scrapes, {stats.failed:,} failed, {stats.samples:,} samples")
        if stats.last_error:
            click.echo(f"{name}: last failure: {stats.last_error}", err=True)


@collect_group.command("otlp")
@collect_otlp_options
def collect_otlp_cmd(model: str | None, model_config: str | None, **flags: Any) -> None:
    """Receive OTLP/HTTP traces (vLLM llm_request spans) into requests; GET /metrics on the same port.

    Example: kvlens collect otlp --listen 127.0.0.1:4318 --lake lake --duration 600
    """
    from kvlens.collector.collect import collect_otlp

    r = collect_otlp(model=model_name(model, model_config), until=_stopped_by_signals, announce=_announce,
                     **flags)
    click.echo(f"{r.requests:,} requests from {r.llm_request_spans:,} llm_request spans, "
               f"{r.other_spans:,} other spans; {r.written_rows:,} rows written")


@cli.command("gateway")
@click.option("--config", required=True, type=click.Path(dir_okay=False),
              help="kvlens.toml: the [[fleet.replicas]] to front (each with its url).")
@click.option("--listen", default="127.0.0.1:8000", show_default=True,
              help="HOST:PORT the OpenAI-compatible API is served on (loopback unless told otherwise).")
@click.option("--lake", required=True, type=click.Path(file_okay=False), help="Lake directory.")
@click.option("--routing", type=click.Choice(["round_robin", "random", "session_affinity", "prefix_hash",
                                              "cache_aware"]), default="round_robin", show_default=True,
              help="How a request picks its replica (the simulator's policies).")
@click.option("--load-factor", type=float, default=None,
              help="cache_aware's load fallback: above K x the mean in-flight count, the least loaded.")
@click.option("--otlp-endpoint", default=None,
              help="OTLP/HTTP collector for the gateway's own spans, e.g. http://127.0.0.1:4318.")
@click.option("--keep-tokens", is_flag=True, help="Keep the blocks' token ids in request_blocks.token_ids.")
@click.option("--flush-seconds", "flush_s", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Commit recorded requests at least this often (what a kill -9 can lose).")
@click.option("--flush-requests", type=click.IntRange(min=1), default=1024, show_default=True,
              help="... and at least every this many requests.")
@click.option("--scenario", default="live", show_default=True, help="Scenario the requests are written to.")
@click.option("--duration", "duration_s", type=float, default=None,
              help="Stop after this many seconds (default: never).")
def gateway_cmd(**flags: Any) -> None:
    """Serve an OpenAI-compatible proxy in front of the fleet that records every request's prompt blocks.

    Example: kvlens gateway --config kvlens.toml --listen 127.0.0.1:8000 --lake lake --routing cache_aware
    """
    from kvlens.collector.gateway_server import serve_gateway

    got = serve_gateway(until=_stopped_by_signals, announce=_announce, **flags)
    click.echo(f"{got.requests:,} requests recorded, {got.blocks:,} blocks")


@cli.command("report")
@click.option("--db", required=True, type=click.Path(dir_okay=False),
              help="Analysis DB written by kvlens analyze.")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="Write the self-contained HTML page (inline CSS, images as data: URIs) here.")
@click.option("--since", default="24h", show_default=True,
              help="Window length (30m, 24h, 7d, 1h30m): requests arriving in [now - since, now), "
                   "compared with the window before it.")
@click.option("--now", default=None,
              help="End of the window (ISO time, UTC), for every scenario. Default: just after each "
                   "scenario's own latest arrival (replayed traces keep their own epochs).")
@click.option("--scenario", "scenarios", multiple=True, help="Scenario to report (repeat); default: all.")
@mail_options
@click.option("--gpu-hour-price", type=click.FloatRange(min=0), default=None, metavar="USD",
              help="Price of one GPU-hour, for avoidable recompute in money (else --config's [costs]).")
@click.option("--production", default=None, metavar="SCENARIO",
              help="Scenario the first screen is about (default: the measured one with the most tokens).")
def report_cmd(db: str, out: str, since: str, now: str | None, scenarios: tuple[str, ...], config: str | None,
               gpu_hour_price: float | None, production: str | None, **mail: Any) -> None:
    """Write the report (what happened, why, what to do, its worth; then the evidence) as HTML; or email it.

    Example: kvlens report --db kvlens.duckdb --out report.html --email-to ops@example.com --smtp mail:25
    """
    from kvlens.dashboards.commands import run_report

    r = run_report(db, out, since=since, now_ns=parse_now(now), scenarios=scenarios, mail=mail, config=config,
                   gpu_hour_price=gpu_hour_price, production=production)
    click.echo(f"report written: {r.path} ({r.size_bytes / 1024:,.0f} KiB, {r.charts} charts)")
    if r.recipients:
        click.echo(f"report sent to {', '.join(r.recipients)} through {r.smtp}")


@cli.command("export")
@click.option("--db", required=True, type=click.Path(dir_okay=False),
              help="Analysis DB written by kvlens analyze.")
@click.option("--port", required=True, type=click.IntRange(0, 65535),
              help="Port for /metrics (0: any free one).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 for all).")
@click.option("--duration", type=float, default=None, help="Stop after this many seconds (default: never).")
@click.option("--top-prefixes", type=click.IntRange(0, 100), default=10, show_default=True,
              help="Prefixes served in kvlens_prefix_lost_tokens per scenario (bounds its cardinality).")
def export_cmd(db: str, port: int, host: str, duration: float | None, top_prefixes: int) -> None:
    """Serve the latest ledger as Prometheus gauges (tokens, bytes, hit ratios), reread when the DB changes.

    Example: kvlens export --db kvlens.duckdb --port 9465 --host 0.0.0.0
    """
    from kvlens.dashboards.commands import run_export

    run_export(db, port=port, host=host, top_prefixes=top_prefixes, duration_s=duration,
               until=_stopped_by_signals, announce=_announce)


@cli.command("serve")
@click.option("--config", required=True, type=click.Path(dir_okay=False, exists=True),
              help="kvlens.toml: the fleet whose replicas are collected and scraped.")
@click.option("--lake", required=True, type=click.Path(file_okay=False), help="Lake directory.")
@click.option("--db", required=True, type=click.Path(dir_okay=False), help="Analysis DB kept up to date.")
@click.option("--analyze-every", default="5m", show_default=True, metavar="DURATION",
              help="Run kvlens analyze this often (30s, 5m, 1h).")
@click.option("--dashboard", is_flag=True, help="Also serve the Streamlit dashboard (--dashboard-port).")
@click.option("--dashboard-port", type=click.IntRange(1, 65535), default=8501, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve serve's own /metrics here (restarts by child, analyses run, their duration).")
@click.option("--export-port", type=click.IntRange(1, 65535), default=9465, show_default=True,
              help="Port of the Prometheus export of the analysis DB (kvlens export).")
@click.option("--no-export", is_flag=True, help="Do not run the Prometheus export.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address /metrics, the export and the dashboard bind (0.0.0.0 for all).")
@click.option("--otlp-listen", default="127.0.0.1:4318", show_default=True,
              help="HOST:PORT of the OTLP/HTTP receiver; 'off' runs none.")
@click.option("--gateway-listen", default="127.0.0.1:8000", show_default=True,
              help="HOST:PORT of kvlens gateway, run when the config routes through it; 'off' runs none.")
@click.option("--flush-seconds", type=click.FloatRange(min=0.05), default=5.0, show_default=True,
              help="The collectors commit a segment at least this often.")
@click.option("--scrape-interval", type=click.FloatRange(min=0.05), default=15.0, show_default=True,
              help="Seconds between scrapes of each replica's metrics_url.")
@click.option("--backoff-cap", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Longest wait, in seconds, before a crashed child is restarted (the wait doubles "
                   "from 1 s).")
def serve_cmd(config: str, lake: str, db: str, analyze_every: str, dashboard: bool, dashboard_port: int,
              metrics_port: int | None, export_port: int, no_export: bool, host: str, otlp_listen: str,
              gateway_listen: str, flush_seconds: float, scrape_interval: float, backoff_cap: float) -> None:
    """Run the fleet from one config: collectors, scrapes, OTLP receiver, export, periodic analysis.

    Every part is a supervised child (restarted with back-off); SIGTERM stops them all.

    Example: kvlens serve --config kvlens.toml --lake lake --db kvlens.duckdb --analyze-every 5m --dashboard
    """
    from kvlens.collector.otlp_server import parse_listen
    from kvlens.dashboards.report import parse_duration_ns
    from kvlens.serve import ServeOptions, run_serve

    listen = None if otlp_listen == "off" else otlp_listen
    options = ServeOptions(config=config, lake=lake, db=db,
                           analyze_every_s=parse_duration_ns(analyze_every) / 1e9, dashboard=dashboard,
                           dashboard_port=dashboard_port, metrics_port=metrics_port, host=host,
                           export_port=None if no_export else export_port, otlp_listen=listen,
                           gateway_listen=None if gateway_listen == "off" else gateway_listen,
                           flush_s=flush_seconds, scrape_interval_s=scrape_interval,
                           backoff_cap_s=backoff_cap)
    statuses = run_serve(options, otlp_address=parse_listen(listen) if listen else None,
                         until=_stopped_by_signals, announce=_announce)
    click.echo("stopped: " + ", ".join(f"{n} exited {s}" for n, s in statuses.items()), err=True)


@cli.command("dashboard")
@click.option("--db", required=True, type=click.Path(dir_okay=False),
              help="Analysis DB written by kvlens analyze.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8501, show_default=True,
              help="Port the dashboard serves on.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (0.0.0.0 serves every interface).")
@click.option("--gpu-hour-price", type=click.FloatRange(min=0), default=None, metavar="USD",
              help="Price of one GPU-hour: the overview puts avoidable recompute in money.")
def dashboard_cmd(db: str, port: int, host: str, gpu_hour_price: float | None) -> None:
    """Serve the read-only Streamlit dashboard over an analysis DB.

    Example: kvlens dashboard --db kvlens-demo/kvlens.duckdb --port 8501
    """
    from kvlens.dashboards.commands import run_dashboard

    rc = run_dashboard(db, port=port, host=host, announce=_announce, gpu_hour_price=gpu_hour_price)
    if rc:
        raise click.ClickException(f"the dashboard's Streamlit server exited with status {rc}: "
                                   "see its messages above")


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    cli.main(args=argv, prog_name="kvlens")


if __name__ == "__main__":
    main()
