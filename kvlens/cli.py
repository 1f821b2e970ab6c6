"""The spine's command line: thin click commands over the packages, imported lazily.

Every KvlensError, and every usage error (a missing or bad flag, an unknown command), becomes
one ``Error:`` line and exit status 1 (click's default for usage errors is 2, with the usage
text); bugs keep their tracebacks.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from kvlens.errors import KvlensError

__all__ = ["cli", "main"]



class _ImportFormats(click.Choice):
    """``kvlens import``'s FORMAT choices, read from the collector's registry (collector/imports.py)
    when click first needs them: the CLI imports the other packages only lazily."""

    def __init__(self) -> None:
        super().__init__((), case_sensitive=True)

    @property
    def choices(self) -> tuple[str, ...]:
        from kvlens.collector.imports import FORMATS

        return FORMATS

    @choices.setter
    def choices(self, _value: object) -> None:
        pass


def _routing_policies() -> list[Any]:
    from kvlens.schema import RoutingPolicy

    return list(RoutingPolicy)


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _usage_error(e: click.UsageError) -> click.ClickException:
    """A usage error as one ``Error:`` line that says where and points at --help (exit 1)."""
    where = e.ctx.command_path if e.ctx is not None else "kvlens"
    if isinstance(e, click.exceptions.NoArgsIsHelpError) and isinstance(e.ctx.command, click.Group):
        names = ", ".join(e.ctx.command.list_commands(e.ctx))
        return click.ClickException(f"{where} needs a command ({names}): see {where} --help")
    return click.ClickException(f"{_one_line(e.format_message())} (see {where} --help)")


class _Group(click.Group):
    """Turns a KvlensError or a usage error from any command into one ``Error:`` line and exit 1."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            raise _usage_error(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KvlensError as e:
            raise click.ClickException(_one_line(str(e))) from e
        except click.UsageError as e:
            raise _usage_error(e) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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


def _progress_bar(paths: tuple[str, ...], label: str) -> Any:
    total = sum(Path(p).stat().st_size for p in paths if Path(p).is_file())
    return click.progressbar(length=total, label=label, file=sys.stderr, show_eta=True,
                             show_percent=True, width=30)


@contextlib.contextmanager
def _stopped_by_signals(stop: Callable[[], object]) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT call ``stop`` (the loop then ends as after its --duration);
    the previous handlers come back on the way out. Every long-running command runs in one."""
    previous = {sig: signal.signal(sig, lambda *_: stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_MODEL_CONFIG_HELP = ("A Hugging Face config.json: the model's KV geometry (layers, KV heads, head size, "
                      "MLA latent, sliding windows) and name, for a model kvlens does not list "
                      "(kvlens models).")


def _model_config_option(f: Any) -> Any:
    return click.option("--model-config", "model_config", default=None, metavar="config.json",
                        type=click.Path(dir_okay=False), help=_MODEL_CONFIG_HELP)(f)


def _given_model(model: str | None, model_config: str | None) -> Any:
    """The geometry --model or --model-config names (None when neither); both at once is an error."""
    from kvlens.errors import ConfigError
    from kvlens.models import from_hf_config, get_model

    if model and model_config:
        raise ConfigError(f"--model {model} and --model-config {model_config} both name the model: give one")
    if model_config:
        return from_hf_config(model_config)
    return get_model(model) if model else None


def _model_name(model: str | None, model_config: str | None) -> str | None:
    """The model name to record on rows: --model as given (any name), or the name in --model-config's file."""
    if model_config:
        return str(_given_model(model, model_config).name)
    return model


@cli.command("import")
@click.argument("fmt", metavar="FORMAT", type=_ImportFormats())
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--lake", required=True, type=click.Path(file_okay=False), help="Lake directory.")
@click.option("--scenario", default="default", show_default=True,
              help="Scenario name; an existing scenario of that name is replaced whole.")
@click.option("--model", default=None, help="Model name recorded on the rows (e.g. llama-3.1-70b).")
@_model_config_option
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
    model = _model_name(model, model_config)
    bar: Any
    with _progress_bar(files, f"import {fmt}") if lines else nullcontext() as bar:
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
def compact_cmd(lake: str) -> None:
    """Merge the segments of each closed day into one, atomically.

    Example: kvlens compact --lake lake
    """
    from kvlens.compact import compact

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

    with _progress_bar((str(SAMPLE_TRACE),), "import sample trace") as bar:
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
@_model_config_option
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
def analyze_cmd(lake: str, db: str, scenarios: tuple[str, ...], model: str | None, model_config: str | None,
                cache_tokens: int | None, join: tuple[str, ...], metrics_from: str | None) -> None:
    """Replay the lake into the analysis DB: block outcomes, the miss ledger, and more.

    Example: kvlens analyze --lake lake --db kvlens.duckdb --scenario rr8
    """
    from kvlens.analyzers.analyze import analyze_lake

    def bar(chosen: list[str]) -> Any:
        return click.progressbar(chosen, label="analyze", file=sys.stderr, width=30,
                                 item_show_func=lambda s: s or "")

    result = analyze_lake(lake, db, scenarios, _given_model(model, model_config), cache_tokens=cache_tokens,
                          join=join, metrics_from=metrics_from, progress=bar)
    click.echo(f"analysis DB written: {result.db}")


@cli.command("simulate")
@click.option("--lake", required=True, type=click.Path(file_okay=False, exists=True), help="Lake directory.")
@click.option("--from", "source", required=True, help="Scenario whose requests are replayed.")
@click.option("--scenario", required=True, help="Name of the what-if scenario to write (replaced).")
@click.option("--replicas", type=click.IntRange(min=1), required=True, help="Number of replicas.")
@click.option("--engine", type=click.Choice(["vllm", "lru"]), default="vllm", show_default=True,
              help="vllm: vLLM's block pool and continuous batching; lru: an LRU of prompt blocks and "
                   "max-seqs slots.")
@click.option("--gpu-blocks", type=click.IntRange(min=2), default=None,
              help="KV blocks per replica, counted as vLLM's --num-gpu-blocks-override (its null block "
                   "included).")
@click.option("--capacity-tokens", type=click.IntRange(min=1), default=None,
              help="Shorthand for --gpu-blocks: cached tokens per replica (with neither: unbounded).")
@click.option("--max-seqs", type=click.IntRange(min=1), default=None,
              help="Running sequences per replica (vLLM's --max-num-seqs; default 1024, lru: 8).")
@click.option("--max-batched-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per step (vLLM's --max-num-batched-tokens; default 8192, H100's).")
@click.option("--pool-tokens", type=click.IntRange(min=1), default=None, help="Shared pool tier, in tokens.")
@click.option("--routing", type=click.Choice([p.value for p in _routing_policies()]), default="round_robin",
              show_default=True, help="recorded: each request stays on the replica it was recorded on.")
@click.option("--load-factor", type=float, default=None,
              help="cache_aware: send to the least loaded replica when the chosen one has more than "
                   "K x the mean in-flight requests.")
@click.option("--calibrate", default=None, metavar="SCENARIO",
              help="Fit the step time to this scenario's measured spans (prefill vs computed tokens, TPOT).")
@click.option("--rate-scale", type=float, default=1.0, show_default=True,
              help="Replay the arrivals K times denser (inter-arrival times divided by K).")
@click.option("--model", default=None, help="Model geometry (default: the requests' model).")
@_model_config_option
@click.option("--seed", type=int, default=0, show_default=True)
def simulate_cmd(lake: str, source: str, scenario: str, replicas: int, engine: str, gpu_blocks: int | None,
                 capacity_tokens: int | None, max_seqs: int | None, max_batched_tokens: int | None,
                 pool_tokens: int | None, routing: str, load_factor: float | None, calibrate: str | None,
                 rate_scale: float, model: str | None, model_config: str | None, seed: int) -> None:
    """Replay a scenario's requests on N replicas under a routing policy; write a what-if scenario.

    Every time it writes is modelled; the step-time model it used is printed.

    Example: kvlens simulate --lake lake --from conv --scenario rr8 --replicas 8 --routing round_robin
    """
    from kvlens.analyzers import step_time
    from kvlens.analyzers.analyze import scenario_model
    from kvlens.analyzers.costs import cost_model
    from kvlens.analyzers.join import join_sources
    from kvlens.analyzers.sim_config import DEFAULT_MAX_BATCHED_TOKENS, Engine
    from kvlens.analyzers.simulate import SimConfig, simulate
    from kvlens.errors import NoDataError
    from kvlens.lake import write_scenario
    from kvlens.query import connect
    from kvlens.schema import RoutingPolicy

    con = connect(lake=lake)
    reqs = con.sql("SELECT * FROM requests WHERE scenario = ?", params=[source]).pl()
    if reqs.is_empty():
        raise NoDataError(f"scenario {source!r} has no requests in lake {lake}: import it first")
    blocks = con.sql("SELECT * FROM request_blocks WHERE scenario = ?", params=[source]).pl()
    geometry, _ = scenario_model(con, source, _given_model(model, model_config))
    step = None
    if calibrate is not None:
        spans, _report = join_sources(requests=con.table("requests"), scenario=calibrate, sources=[source],
                                      matched_ids=True)
        step = step_time.calibrated(spans, geometry, calibrate)
    elif engine == "vllm":
        probe = cost_model(probe_runs=con.table("probe_runs"), model=geometry)
        step = step_time.modelled(geometry, costs=probe)
    config = SimConfig(replicas=replicas, capacity_tokens=capacity_tokens, pool_tokens=pool_tokens,
                       routing=RoutingPolicy(routing), load_factor=load_factor, seed=seed, max_seqs=max_seqs,
                       engine=Engine(engine), gpu_blocks=gpu_blocks,
                       max_batched_tokens=max_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS, step_model=step,
                       rate_scale=rate_scale)
    result = simulate(requests=reqs, request_blocks=blocks, config=config, model=geometry)
    counts = write_scenario(lake, scenario, {k: v.to_arrow() for k, v in result.tables.items()},
                            writer_id="simulate")
    click.echo(f"scenario {scenario!r}: " + ", ".join(f"{n:,} {t}" for t, n in counts.items()))
    if engine == "vllm":
        st = result.stats
        click.echo(f"  {st['gpu_blocks']:,} blocks of {st['block_tokens']} tokens per replica, "
                   f"{st['steps']:,} steps, {st['preemptions']:,} preemptions; times are {st['step_model']}")
    else:
        click.echo("  times are modelled: prefill FLOPs at the device's efficiency, "
                   f"{config.device.decode_ms_per_token:g} ms per output token")


@cli.group("collect")
def collect_group() -> None:
    """Follow live sources and append their rows to the lake (scenario: live).

    Example: kvlens collect vllm --endpoint tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --lake lake
    """


@collect_group.command("vllm")
@click.option("--endpoint", default=None, help="KV-event PUB endpoint (vLLM / SGLang), e.g. tcp://HOST:5557.")
@click.option("--replay", default=None, help="The publisher's ROUTER replay endpoint, e.g. tcp://HOST:5558.")
@click.option("--topic", default="", help="Subscription topic prefix (default: every topic).")
@click.option("--replica", default=None, help="Replica name (default: from a kv@<pod>@<model> topic).")
@click.option("--model", default=None, help="Model name recorded as the rows' namespace.")
@_model_config_option
@click.option("--lake", required=True, type=click.Path(file_okay=False), help="Lake directory.")
@click.option("--duration", type=float, default=None, help="Stop after this many seconds (default: never).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve the collector's own /metrics here.")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True, help="Address for /metrics.")
@click.option("--bind", is_flag=True, help="Bind the endpoint (publishers connect) instead of connecting.")
@click.option("--config", default=None, type=click.Path(dir_okay=False),
              help="kvlens.toml whose [[fleet.replicas]] are followed (when no --endpoint).")
@click.option("--keep-tokens", is_flag=True, help="Keep the blocks' token ids in kv_events.token_ids.")
@click.option("--record", default=None, type=click.Path(dir_okay=False),
              help="Also append every frame received to FILE (kvlens import vllm-events reads it).")
@click.option("--flush-seconds", type=float, default=5.0, show_default=True,
              help="Commit a segment (with its checkpoint) at least this often.")
@click.option("--scenario", default="live", show_default=True, help="Scenario the events are written to.")
def collect_vllm_cmd(endpoint: str | None, replay: str | None, topic: str, replica: str | None,
                     model: str | None, model_config: str | None, lake: str, duration: float | None,
                     metrics_port: int | None,
                     metrics_addr: str, bind: bool, config: str | None, keep_tokens: bool,
                     record: str | None, flush_seconds: float, scenario: str) -> None:
    """Collect vLLM / SGLang KV-cache events over ZMQ into kv_events, with replay and checkpoints.

    Example: kvlens collect vllm --endpoint tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --lake lake
    """
    from prometheus_client import start_http_server

    from kvlens.collector.live import CollectorOptions, LiveCollector, build_sources
    from kvlens.config import check_zmq_endpoint
    from kvlens.supervise import check_port_free

    model = _model_name(model, model_config)
    if endpoint:
        check_zmq_endpoint(endpoint, "--endpoint", bind=bind)
    if replay:
        check_zmq_endpoint(replay, "--replay")
    if metrics_port is not None:
        check_port_free(metrics_addr, metrics_port, "--metrics-port")
    sources = build_sources(endpoint=endpoint, replay=replay, topic=topic, replica=replica, model=model,
                            bind=bind, config=config)
    collector = LiveCollector(CollectorOptions(lake=lake, sources=sources, keep_tokens=keep_tokens,
                                               record=record, flush_age_s=flush_seconds, scenario=scenario))
    server = None
    if metrics_port is not None:
        server, _ = start_http_server(metrics_port, addr=metrics_addr, registry=collector.metrics.registry)
    click.echo(f"collecting {len(sources)} source(s) into {lake} as writer {collector.writer_id}", err=True)
    try:
        with _stopped_by_signals(collector.stop):
            collector.run(duration_s=duration)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    m = collector.metrics
    for r in sorted({p.replica for p in collector.pubs.values()}):
        click.echo(f"{r}: {m.value('kvlens_collector_received_batches_total', replica=r):,.0f} batches, "
                   f"{m.value('kvlens_collector_block_events_total', replica=r):,.0f} block events")


@cli.command("hash")
@click.option("--block-size", type=click.IntRange(min=1), required=True, help="Tokens per block.")
@click.option("--algo", type=click.Choice(["sha256", "sha256_cbor"]), default="sha256", show_default=True,
              help="vLLM's --prefix-caching-hash-algo.")
@click.option("--seed", default=None,
              help="The engine's PYTHONHASHSEED (default: vLLM's fixed seed 'vllm-none-hash').")
@click.option("--salt", default=None, help="The request's cache_salt (hashed into the first block).")
@click.option("--lora", default=None, help="The request's LoRA adapter name.")
@click.option("--lora-path", default=None, help="The adapter's path (tagged extra keys include it).")
@click.option("--extra-keys", "style", type=click.Choice(["tagged", "bare"]), default="tagged",
              show_default=True, help="tagged: ('lora', name, path) / ('cache_salt', s); bare: older vLLM.")
def hash_cmd(block_size: int, algo: str, seed: str | None, salt: str | None, lora: str | None,
             lora_path: str | None, style: str) -> None:
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
    for b in vllm_block_hashes(tokens, block_size, algo=algo, seed=seed, cache_salt=salt, lora_name=lora,
                               lora_path=lora_path, extra_keys_style=style):  # type: ignore[arg-type]
        click.echo(f"{b.position}\t{b.digest.hex()}\t{b.value}")


@cli.command("probe")
@click.option("--model", default=None, help="Model geometry to probe (default: the project default model).")
@_model_config_option
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
    from kvlens.gpu_probe.probe import (
        parse_prefix_tokens,
        plan_probe,
        render_table,
        run_probe,
        write_probe_rows,
    )
    from kvlens.gpu_probe.timing import cuda_available, import_torch
    from kvlens.models import resolve_model

    geometry = _given_model(model, model_config) or resolve_model(None)
    import_torch()
    tokens = parse_prefix_tokens(prefix_tokens)
    cuda = cuda_available()
    if not cuda:
        click.echo("CUDA is not available: running a tiny CPU version of each measurement "
                   "(rows marked source=cpu)")
    report = run_probe(plan_probe(geometry, tokens, quick=quick, cuda=cuda))
    click.echo(render_table(report))
    if lake:
        rows = write_probe_rows(report, lake)
        click.echo(f"wrote {rows} probe_runs rows (run {report.run_id}) to {lake}")
    if not report.byte_exact:
        raise click.ClickException("a transfer path was not byte-exact (or the delay-injection "
                                   "check failed); see the table above")


@collect_group.command("scrape")
@click.option("--url", required=True, help="The engine's metrics endpoint, e.g. http://HOST:8000/metrics.")
@click.option("--replica", required=True, help="Replica name recorded on the rows.")
@click.option("--lake", required=True, type=click.Path(file_okay=False), help="Lake directory.")
@click.option("--interval", type=click.FloatRange(min=0.01), default=15.0, show_default=True,
              help="Seconds between scrapes.")
@click.option("--duration", type=float, default=None, help="Stop after this many seconds (default: never).")
@click.option("--timeout", type=click.FloatRange(min=0.01), default=5.0, show_default=True,
              help="Seconds before a scrape is given up (and counted as failed).")
@click.option("--scenario", default="live", show_default=True, help="Scenario the samples are written to.")
@click.option("--flush-seconds", type=float, default=60.0, show_default=True,
              help="Write a segment at least this often.")
@click.option("--family", "families", multiple=True,
              help="Metric family name prefix to keep (repeat); default: the documented allow-list.")
def collect_scrape_cmd(url: str, replica: str, lake: str, interval: float, duration: float | None,
                       timeout: float, scenario: str, flush_seconds: float,
                       families: tuple[str, ...]) -> None:
    """Scrape an engine's Prometheus /metrics (vLLM, SGLang, LMCache) into metric_samples.

    Example: kvlens collect scrape --url http://127.0.0.1:8000/metrics --replica replica-a --lake lake
    """
    from kvlens.collector.scrape import DEFAULT_FAMILY_PREFIXES, Scraper
    from kvlens.config import check_http_url

    check_http_url(url, "--url")
    scraper = Scraper(url=url, replica=replica, lake=lake, interval_s=interval, timeout_s=timeout,
                      scenario=scenario, flush_s=flush_seconds, prefixes=families or DEFAULT_FAMILY_PREFIXES)
    click.echo(f"scraping {url} every {interval:g} s into {lake} as writer scrape-{replica}", err=True)
    with _stopped_by_signals(scraper.stop):
        stats = scraper.run(duration_s=duration)
    click.echo(f"{replica}: {stats.ok:,} scrapes, {stats.failed:,} failed, {stats.samples:,} samples")
    if stats.last_error:
        click.echo(f"last failure: {stats.last_error}", err=True)


@collect_group.command("otlp")
@click.option("--listen", default="127.0.0.1:4318", show_default=True,
              help="HOST:PORT to serve OTLP/HTTP on (loopback unless told otherwise).")
@click.option("--lake", required=True, type=click.Path(file_okay=False), help="Lake directory.")
@click.option("--duration", type=float, default=None, help="Stop after this many seconds (default: never).")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=16 * 2**20, show_default=True,
              help="Largest request body accepted, before and after gunzip (413 above).")
@click.option("--replica", default=None, help="Replica name for every row (default: from the resource).")
@click.option("--model", default=None, help="Model name for spans that carry none.")
@_model_config_option
@click.option("--flush-seconds", type=float, default=5.0, show_default=True,
              help="Commit a segment at least this often.")
@click.option("--scenario", default="live", show_default=True, help="Scenario the requests are written to.")
def collect_otlp_cmd(listen: str, lake: str, duration: float | None, max_body_bytes: int,
                     replica: str | None, model: str | None, model_config: str | None, flush_seconds: float,
                     scenario: str) -> None:
    """Receive OTLP/HTTP traces (vLLM llm_request spans) into requests; GET /metrics on the same port.

    Example: kvlens collect otlp --listen 127.0.0.1:4318 --lake lake --duration 600
    """
    import threading

    from kvlens.collector.otlp_server import OtlpReceiver, ReceiverOptions, parse_listen

    model = _model_name(model, model_config)
    host, port = parse_listen(listen)
    receiver = OtlpReceiver(ReceiverOptions(lake=lake, host=host, port=port, replica=replica, model=model,
                                            max_body_bytes=max_body_bytes, flush_age_s=flush_seconds,
                                            scenario=scenario))
    stop = threading.Event()
    click.echo(f"receiving OTLP traces on http://{listen}/v1/traces into {lake} "
               f"as writer {receiver.writer_id}", err=True)
    with _stopped_by_signals(stop.set):
        receiver.run(duration_s=duration, stop_event=stop)
    m = receiver.metrics
    click.echo(f"{m.value('kvlens_otlp_requests_total'):,.0f} requests from "
               f"{m.value('kvlens_otlp_spans_total', kind='llm_request'):,.0f} llm_request spans, "
               f"{m.value('kvlens_otlp_spans_total', kind='other'):,.0f} other spans; "
               f"{m.value('kvlens_otlp_written_rows_total'):,.0f} rows written")


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
@click.option("--flush-seconds", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Commit recorded requests at least this often (what a kill -9 can lose).")
@click.option("--flush-requests", type=click.IntRange(min=1), default=1024, show_default=True,
              help="... and at least every this many requests.")
@click.option("--scenario", default="live", show_default=True, help="Scenario the requests are written to.")
@click.option("--duration", type=float, default=None, help="Stop after this many seconds (default: never).")
def gateway_cmd(config: str, listen: str, lake: str, routing: str, load_factor: float | None,
                otlp_endpoint: str | None, keep_tokens: bool, flush_seconds: float, flush_requests: int,
                scenario: str, duration: float | None) -> None:
    """Serve an OpenAI-compatible proxy in front of the fleet that records every request's prompt blocks.

    Example: kvlens gateway --config kvlens.toml --listen 127.0.0.1:8000 --lake lake --routing cache_aware
    """
    import threading

    from kvlens.collector.gateway_server import Gateway, GatewayOptions
    from kvlens.collector.otlp_server import parse_listen
    from kvlens.config import check_http_url, load_config

    host, port = parse_listen(listen)
    if otlp_endpoint:
        check_http_url(otlp_endpoint, "--otlp-endpoint")
    options = GatewayOptions(replicas=load_config(config).replicas, lake=lake, routing=routing,
                             load_factor=load_factor, otlp_endpoint=otlp_endpoint, keep_tokens=keep_tokens,
                             scenario=scenario, flush_age_s=flush_seconds, flush_requests=flush_requests)
    gateway = Gateway(options, host, port).start()
    click.echo(f"gateway on http://{host}:{gateway.port} for {len(options.replicas)} replica(s), "
               f"routing {routing}, into {lake}", err=True)
    stop = threading.Event()
    try:
        with _stopped_by_signals(stop.set):
            stop.wait(duration)
    finally:
        gateway.stop()
    m = gateway.metrics
    click.echo(f"{m.value('kvlens_gateway_rows_written_total', table='requests'):,.0f} requests recorded, "
               f"{m.value('kvlens_gateway_rows_written_total', table='request_blocks'):,.0f} blocks")


def _parse_now(value: str | None) -> int | None:
    from datetime import UTC, datetime

    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give an ISO time such as 2025-01-02T00:00:00Z",
                                 param_hint="--now") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp()) * 10**9 + moment.microsecond * 1000


def _smtp_settings(smtp: str, starttls: bool, user: str | None, password_env: str | None) -> Any:
    import os

    from kvlens.dashboards.mail import SmtpSettings, parse_smtp
    from kvlens.errors import ConfigError

    if (user is None) != (password_env is None):
        raise ConfigError("--user and --password-env go together: the password is read from the "
                          "environment variable --password-env names, never from the command line")
    password = None
    if password_env is not None:
        password = os.environ.get(password_env)
        if password is None:
            raise ConfigError(f"environment variable {password_env} (from --password-env) is not set: "
                              "export it with the SMTP password")
    host, port = parse_smtp(smtp)
    return SmtpSettings(host=host, port=port, starttls=starttls, user=user, password=password)


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
@click.option("--email-to", default=None, metavar="ADDR[,ADDR]", help="Also send it to these addresses.")
@click.option("--smtp", default=None, metavar="HOST:PORT", help="SMTP server for --email-to.")
@click.option("--starttls/--no-starttls", default=None, help="Upgrade the SMTP connection with STARTTLS.")
@click.option("--user", default=None, help="SMTP login user (needs --password-env).")
@click.option("--password-env", default=None, metavar="VAR",
              help="Environment variable holding the password.")
@click.option("--from", "sender", default=None, help="Sender address (default: kvlens@localhost).")
@click.option("--subject", default=None, help="Subject (default: 'kvlens report, <window end>').")
@click.option("--config", default=None, type=click.Path(dir_okay=False),
              help="kvlens.toml whose [smtp] table gives what the email flags do not.")
def report_cmd(db: str, out: str, since: str, now: str | None, scenarios: tuple[str, ...],
               email_to: str | None, smtp: str | None, starttls: bool | None, user: str | None,
               password_env: str | None, sender: str | None, subject: str | None, config: str | None) -> None:
    """Write the report (headline ratios, ledger chart, findings, change) as HTML; optionally email it.

    Example: kvlens report --db kvlens.duckdb --out report.html --email-to ops@example.com --smtp mail:25
    """
    from kvlens.config import load_config
    from kvlens.dashboards.report import build_report, parse_duration_ns, save_html
    from kvlens.errors import ConfigError

    file = load_config(config).smtp if config else None
    if file is not None:  # flags override the file, field by field
        smtp = smtp or file.server
        email_to = email_to or (",".join(file.to) if file.to else None)
        starttls = file.starttls if starttls is None else starttls
        if user is None and password_env is None:
            user, password_env = file.user, file.password_env
        sender = sender or file.sender
    sender = sender or "kvlens@localhost"
    if (email_to is None) != (smtp is None):
        raise ConfigError("--email-to and --smtp go together (or to and server in the --config file's "
                          "[smtp]): give both to send the report, or neither")
    settings = _smtp_settings(smtp, bool(starttls), user, password_env) if smtp else None
    report = build_report(db, since_ns=parse_duration_ns(since), now_ns=_parse_now(now),
                          scenarios=list(scenarios) or None)
    path = save_html(report, out)
    click.echo(f"report written: {path} ({path.stat().st_size / 1024:,.0f} KiB, {len(report.charts)} charts)")
    if settings is not None and email_to is not None:
        from kvlens.dashboards.mail import build_message, send_message

        recipients = [a.strip() for a in email_to.split(",") if a.strip()]
        send_message(build_message(report, sender=sender, recipients=recipients, subject=subject), settings)
        click.echo(f"report sent to {', '.join(recipients)} through {smtp}")


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
    import threading

    from kvlens.analysis_db import check_duckdb_file
    from kvlens.dashboards.export import serve
    from kvlens.supervise import check_port_free

    check_duckdb_file(db)
    check_port_free(host, port, "--port")
    server, _, bound = serve(db, port=port, host=host, top_prefixes=top_prefixes)
    stop = threading.Event()
    click.echo(f"serving {db} on http://{host}:{bound}/metrics", err=True)
    try:
        with _stopped_by_signals(stop.set):
            stop.wait(duration)
    finally:
        server.shutdown()
        server.server_close()


@cli.command("dashboard")
@click.option("--db", required=True, type=click.Path(dir_okay=False),
              help="Analysis DB written by kvlens analyze.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8501, show_default=True,
              help="Port the dashboard serves on.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (0.0.0.0 serves every interface).")
def dashboard_cmd(db: str, port: int, host: str) -> None:
    """Serve the read-only Streamlit dashboard over an analysis DB.

    Example: kvlens dashboard --db kvlens-demo/kvlens.duckdb --port 8501
    """
    import importlib.util

    from kvlens.analysis_db import check_duckdb_file
    from kvlens.errors import ConfigError
    from kvlens.supervise import check_port_free, run_child

    if importlib.util.find_spec("streamlit") is None:
        raise ConfigError("the dashboard needs streamlit: pip install 'kvlens[dashboard]'")
    path = check_duckdb_file(db)
    check_port_free(host, port, "--port")
    import kvlens.dashboards as dashboards

    app = Path(dashboards.__file__).resolve().parent / "app.py"
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), "--server.headless=true",
           "--browser.gatherUsageStats=false", "--server.fileWatcherType=none", "--server.runOnSave=false",
           f"--server.port={port}", f"--server.address={host}", "--", "--db", str(path.resolve())]
    click.echo(f"kvlens dashboard on http://{host}:{port}/ (Ctrl-C stops it)", err=True)
    # Streamlit runs as a child that dies with this process: a SIGTERM, SIGINT or SIGHUP here is
    # passed on and waited for, and a SIGKILL here ends it too (kvlens/supervise.py).
    rc = run_child(cmd)
    if rc:
        raise click.ClickException(f"the dashboard's Streamlit server exited with status {rc}: "
                                   "see its messages above")


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    cli.main(args=argv, prog_name="kvlens")


if __name__ == "__main__":
    main()
