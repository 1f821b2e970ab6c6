"""The spine's command line: thin click commands over the packages, imported lazily.

Every KvlensError, and every usage error (a missing or bad flag, an unknown command), becomes
one ``Error:`` line and exit status 1 (click's default for usage errors is 2, with the usage
text; a command stopped at its ``--memory-limit`` exits 3); bugs keep their tracebacks.
"""

from __future__ import annotations

import logging
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import click

from kvlens import cli_options as opts
from kvlens.cli_kit import (
    Group,
    LazyChoice,
    given_model,
    items_bar,
    model_name,
    parse_now,
    parse_token_ids,
    progress_bar,
)
from kvlens.cli_kit import stopped_by_signals as _stopped_by_signals

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


def _parse_t0(value: str | None) -> int | None:
    from kvlens.collector.fields import rfc3339_ns

    try:
        return None if value is None else rfc3339_ns(value)  # None: import_files' fixed anchor
    except ValueError as e:
        raise click.BadParameter(f"{e}: give an ISO time such as 2025-01-01T00:00:00Z") from None


@cli.command("import")
@click.argument("fmt", metavar="FORMAT", type=LazyChoice(_import_formats))
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@opts.import_options
def import_cmd(fmt: str, files: tuple[str, ...], lake: str, scenario: str, model: str | None,
               model_config: str | None, skip_bad_lines: bool, t0: str | None, allow_empty: bool) -> None:
    """Import trace FILES of FORMAT into the lake (requests, request_blocks).

    Example: kvlens import mooncake conversation_trace.jsonl --lake lake --scenario conv
    """
    from contextlib import nullcontext

    from kvlens.collector.imports import LINE_FORMATS, import_files

    lines = fmt in LINE_FORMATS  # read line by line: a progress bar and a --t0 anchor
    model = model_name(model, model_config)  # before the bar: a bad flag's error is the only output
    bar: Any
    with progress_bar(files, f"import {fmt}") if lines else nullcontext() as bar:
        r = import_files(fmt, files, lake, scenario=scenario, model=model,
                         skip_bad_lines=skip_bad_lines, t0_ns=_parse_t0(t0) if lines else None,
                         allow_empty=allow_empty, on_progress=bar.update if lines else None)
    click.echo(r.summary(lake))
    if r.bad_lines:
        click.echo(f"skipped {r.bad_lines:,} bad lines; first: {r.first_bad[0]}", err=True)
    if r.repeats:
        click.echo(f"skipped {r.repeats:,} repeated lookups of requests already imported", err=True)


@cli.command("sql")
@click.argument("query")
@opts.sql_options
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
@opts.compact_options
def compact_cmd(lake: str, keep: str | None, scenarios: tuple[str, ...], today: bool) -> None:
    """Merge each writer's segments of each closed day into one, atomically; with --keep, drop old
    days first; with --today, merge the current day's small segments per writer too.

    Example: kvlens compact --lake lake --keep 30d --scenario live
    """
    from kvlens.compact import compact, drop_old_days, parse_keep_days

    if keep is not None:
        dropped = drop_old_days(lake, parse_keep_days(keep), scenarios=scenarios)
        click.echo(f"dropped {dropped['days_dropped']} days older than {keep} "
                   f"({dropped['partitions_dropped']} partitions, {dropped['segments_dropped']} segments)")
    counts = compact(lake, current=today)
    click.echo(f"merged {counts['segments_replaced']:,} segments into {counts['segments_written']:,}")


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
@opts.analyze_options
def analyze_cmd(model: str | None, model_config: str | None, **flags: Any) -> None:
    """Replay the lake into the analysis DB: block outcomes, the miss ledger, and more.

    Example: kvlens analyze --lake lake --db kvlens.duckdb --scenario rr8
    """
    from kvlens.analyzers.analyze import analyze_lake
    from kvlens.analyzers.partitions import Partitions
    from kvlens.memory import MemoryGuard, format_bytes, peak_resident_bytes

    count, ray, out_of_core = flags.pop("partitions"), flags.pop("ray"), flags.pop("out_of_core")
    if flags.pop("compact"):
        from kvlens.compact import compact

        counts = compact(flags["lake"], current=True)
        click.echo(f"compacted the lake: {counts['segments_replaced']:,} segments merged into "
                   f"{counts['segments_written']:,}", err=True)
    limit = flags["memory_limit"]
    guard: AbstractContextManager[Any] = MemoryGuard(limit) if limit is not None else nullcontext()
    where: AbstractContextManager[Partitions | None]
    if out_of_core:
        from kvlens.analyzers.out_of_core import OutOfCore

        flags["out_of_core"] = OutOfCore(partitions=count)
        where = nullcontext(None)
    if ray is not None:
        from kvlens.analyzers.ray_runner import ray_partitions

        where = ray_partitions(ray or None, count)
    elif not out_of_core:
        where = nullcontext(Partitions(count) if count else None)
    with guard, where as partitions:
        result = analyze_lake(model=given_model(model, model_config), progress=items_bar("analyze"),
                              partitions=partitions, **flags)
    for scenario, mode, why in result.modes:
        click.echo(f"{scenario}: {mode} ({why})", err=True)
    peak = peak_resident_bytes()
    if peak is not None:  # what --memory-limit compares with (Ray's workers not counted)
        click.echo(f"peak resident memory: {format_bytes(peak)} (measured)", err=True)
    click.echo(f"analysis DB written: {result.db}")


@cli.command("simulate")
@opts.simulate_options
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
@opts.collect_vllm_options
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
@opts.hash_key_options
def hash_cmd(block_size: int, **keys: Any) -> None:
    """Print vLLM's block hashes for token ids read from stdin: position, hex digest, event uint64.

    Token ids are separated by spaces, commas or newlines (a JSON array works too); only full
    blocks are hashed.

    Example: seq 1 64 | kvlens hash --block-size 16 --algo sha256_cbor --seed 0
    """
    from kvlens.collector.hashing import vllm_block_hashes

    for b in vllm_block_hashes(parse_token_ids(sys.stdin.read()), block_size, **keys):
        click.echo(f"{b.position}\t{b.digest.hex()}\t{b.value}")


@cli.command("probe")
@opts.probe_options
def probe_cmd(model: str | None, model_config: str | None, lake: str | None, **flags: Any) -> None:
    """Measure KV transfer paths and prefill on this machine's GPU (a tiny CPU run without one).

    Example: kvlens probe --model llama-3.1-8b --prefix-tokens 4096,16384 --lake lake
    """
    from kvlens.gpu_probe.run import probe_machine

    r = probe_machine(given_model(model, model_config), lake=lake, announce=click.echo, **flags)
    click.echo(r.table)
    if lake:
        click.echo(f"wrote {r.rows} probe_runs rows (run {r.report.run_id}) to {lake}")
    if not r.report.byte_exact:
        raise click.ClickException("a transfer path was not byte-exact (or the delay-injection "
                                   "check failed); see the table above")


@collect_group.command("scrape")
@opts.collect_scrape_options
def collect_scrape_cmd(**flags: Any) -> None:
    """Scrape engines' Prometheus /metrics (vLLM, SGLang, LMCache) into metric_samples.

    Example: kvlens collect scrape --url http://127.0.0.1:8000/metrics --replica replica-a --lake lake
    """
    from kvlens.collector.collect import collect_scrapes

    for name, stats in collect_scrapes(until=_stopped_by_signals, announce=_announce, **flags):
        click.echo(f"{name}: {stats.ok:,} scrapes, {stats.failed:,} failed, {stats.samples:,} samples")
        if stats.last_error:
            click.echo(f"{name}: last failure: {stats.last_error}", err=True)


@collect_group.command("otlp")
@opts.collect_otlp_options
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
@opts.gateway_options
def gateway_cmd(**flags: Any) -> None:
    """Serve an OpenAI-compatible proxy in front of the fleet that records every request's prompt blocks.

    Example: kvlens gateway --config kvlens.toml --listen 127.0.0.1:8000 --lake lake --routing cache_aware
    """
    from kvlens.collector.gateway_server import serve_gateway

    got = serve_gateway(until=_stopped_by_signals, announce=_announce, **flags)
    click.echo(f"{got.requests:,} requests recorded, {got.blocks:,} blocks")


@cli.command("report")
@opts.report_options
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
@opts.export_options
def export_cmd(**flags: Any) -> None:
    """Serve the latest ledger as Prometheus gauges (tokens, bytes, hit ratios), reread when the DB changes.

    Example: kvlens export --db kvlens.duckdb --port 9465 --host 0.0.0.0
    """
    from kvlens.dashboards.commands import run_export

    run_export(until=_stopped_by_signals, announce=_announce, **flags)


@cli.command("serve")
@opts.serve_options
def serve_cmd(analyze_every: str, **flags: Any) -> None:
    """Run the fleet from one config: collectors, scrapes, OTLP receiver, export, periodic analysis.

    Every part is a supervised child (restarted with back-off); SIGTERM stops them all.

    Example: kvlens serve --config kvlens.toml --lake lake --db kvlens.duckdb --analyze-every 5m --dashboard
    """
    from kvlens.dashboards.report import parse_duration_ns
    from kvlens.serve import serve_fleet

    statuses = serve_fleet(analyze_every_s=parse_duration_ns(analyze_every) / 1e9, until=_stopped_by_signals,
                           announce=_announce, **flags)
    click.echo("stopped: " + ", ".join(f"{n} exited {s}" for n, s in statuses.items()), err=True)


@cli.command("dashboard")
@opts.dashboard_options
def dashboard_cmd(**flags: Any) -> None:
    """Serve the read-only Streamlit dashboard over an analysis DB.

    Example: kvlens dashboard --db kvlens-demo/kvlens.duckdb --port 8501
    """
    from kvlens.dashboards.commands import run_dashboard

    rc = run_dashboard(announce=_announce, **flags)
    if rc:
        raise click.ClickException(f"the dashboard's Streamlit server exited with status {rc}: "
                                   "see its messages above")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: the command owns this process (a stop that hangs may end it)."""
    from kvlens.cli_kit import own_the_process

    own_the_process()
    cli.main(args=argv, prog_name="kvlens")


if __name__ == "__main__":
    main()
