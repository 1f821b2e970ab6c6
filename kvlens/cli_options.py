"""The spine's option stacks for cli.py: each command's long option list as one decorator, its
parameter names the keywords of the front door it calls.

Only the spine is imported here (the architecture test lets kvlens/cli.py alone reach the other
packages, lazily), so what needs a package's registry stays in cli.py; the group, the progress
bars and the parse helpers are in cli_kit.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

__all__ = ["SizeType", "analyze_options", "collect_otlp_options", "collect_scrape_options",
           "collect_vllm_options", "compact_options", "dashboard_options", "duration_option",
           "export_options", "gateway_options", "hash_key_options", "import_options", "mail_options",
           "model_config_option", "options", "probe_options", "report_options", "serve_options",
           "sim_options", "simulate_options", "sql_options"]


class SizeType(click.ParamType):
    """A size in bytes (kvlens/memory.py ``parse_size``: 4GiB, 512MiB, 2G)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        from kvlens.errors import ConfigError
        from kvlens.memory import parse_size

        flag = f"--{param.name.replace('_', '-')}" if param is not None and param.name else "SIZE"
        try:
            return parse_size(str(value), flag)
        except ConfigError as e:
            self.fail(str(e), param, ctx)


def options(*decorators: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """One decorator applying ``decorators`` as if stacked in this order (the --help order)."""
    def apply(f: Any) -> Any:
        for d in reversed(decorators):
            f = d(f)
        return f
    return apply


_MODEL_CONFIG_HELP = ("A Hugging Face config.json: the model's KV geometry (layers, KV heads, head size, "
                      "MLA latent, sliding windows) and name, for a model kvlens does not list "
                      "(kvlens models).")


def model_config_option(f: Any) -> Any:
    return click.option("--model-config", "model_config", default=None, metavar="config.json",
                        type=click.Path(dir_okay=False), help=_MODEL_CONFIG_HELP)(f)


def _routing_choices() -> list[str]:
    from kvlens.schema import RoutingPolicy

    return [p.value for p in RoutingPolicy]


duration_option = click.option("--duration", "duration_s", type=float, default=None,
                               help="Stop after this many seconds (default: never).")
_lake_option = click.option("--lake", required=True, type=click.Path(file_okay=False), help="Lake directory.")
_lake_read_option = click.option("--lake", required=True, type=click.Path(file_okay=False, exists=True),
                                 help="Lake directory.")
_db_option = click.option("--db", required=True, type=click.Path(dir_okay=False),
                          help="Analysis DB written by kvlens analyze.")

# kvlens simulate's engine and fleet knobs, named as SimConfig's fields (analyzers/sim_config.py).
sim_options = options(
    click.option("--replicas", type=click.IntRange(min=1), required=True, help="Number of replicas."),
    click.option("--engine", type=click.Choice(["vllm", "lru"]), default="vllm", show_default=True,
                 help="vllm: vLLM's block pool and continuous batching; lru: an LRU of prompt blocks and "
                      "max-seqs slots."),
    click.option("--gpu-blocks", type=click.IntRange(min=2), default=None,
                 help="KV blocks per replica, counted as vLLM's --num-gpu-blocks-override (its null block "
                      "included)."),
    click.option("--capacity-tokens", type=click.IntRange(min=1), default=None,
                 help="Shorthand for --gpu-blocks: cached tokens per replica (with neither: unbounded)."),
    click.option("--max-seqs", type=click.IntRange(min=1), default=None,
                 help="Running sequences per replica (vLLM's --max-num-seqs; default 1024, lru: 8)."),
    click.option("--max-batched-tokens", type=click.IntRange(min=1), default=None,
                 help="Tokens per step (vLLM's --max-num-batched-tokens; default 8192, H100's)."),
    click.option("--pool-tokens", type=click.IntRange(min=1), default=None,
                 help="Shared pool tier, in tokens."),
    click.option("--routing", type=click.Choice(_routing_choices()), default="round_robin",
                 show_default=True, help="recorded: each request stays on the replica it was recorded on."),
    click.option("--load-factor", type=float, default=None,
                 help="cache_aware: send to the least loaded replica when the chosen one has more than "
                      "K x the mean in-flight requests."),
    click.option("--calibrate", default=None, metavar="SCENARIO",
                 help="Fit the step time to this scenario's measured spans (prefill vs computed tokens, "
                      "TPOT)."),
    click.option("--rate-scale", type=float, default=1.0, show_default=True,
                 help="Replay the arrivals K times denser (inter-arrival times divided by K)."),
    click.option("--model", default=None, help="Model geometry (default: the requests' model)."),
    model_config_option,
    click.option("--seed", type=int, default=0, show_default=True),
)

# kvlens simulate's flags: the scenario replayed and the one written, then the knobs above.
simulate_options = options(
    _lake_read_option,
    click.option("--from", "source", required=True, help="Scenario whose requests are replayed."),
    click.option("--scenario", required=True, help="Name of the what-if scenario to write (replaced)."),
    sim_options,
)

# kvlens report's email flags, named as dashboards/commands.py's MAIL_FLAGS, and the toml under them.
mail_options = options(
    click.option("--email-to", default=None, metavar="ADDR[,ADDR]",
                 help="Also send it to these addresses."),
    click.option("--smtp", default=None, metavar="HOST:PORT", help="SMTP server for --email-to."),
    click.option("--starttls/--no-starttls", default=None, help="Upgrade the SMTP connection with STARTTLS."),
    click.option("--user", default=None, help="SMTP login user (needs --password-env)."),
    click.option("--password-env", default=None, metavar="VAR",
                 help="Environment variable holding the password."),
    click.option("--from", "sender", default=None, help="Sender address (default: kvlens@localhost)."),
    click.option("--subject", default=None, help="Subject (default: 'kvlens report, <window end>')."),
    click.option("--config", default=None, type=click.Path(dir_okay=False),
                 help="kvlens.toml whose [smtp] gives what the email flags do not ([costs]: the price)."),
)

# kvlens hash's cache-key flags, named as collector/hashing.py's vllm_block_hashes keywords.
hash_key_options = options(
    click.option("--algo", type=click.Choice(["sha256", "sha256_cbor"]), default="sha256",
                 show_default=True, help="vLLM's --prefix-caching-hash-algo."),
    click.option("--seed", default=None,
                 help="The engine's PYTHONHASHSEED (default: vLLM's fixed seed 'vllm-none-hash')."),
    click.option("--salt", "cache_salt", default=None,
                 help="The request's cache_salt (hashed into the first block)."),
    click.option("--lora", "lora_name", default=None, help="The request's LoRA adapter name."),
    click.option("--lora-path", default=None, help="The adapter's path (tagged extra keys include it)."),
    click.option("--extra-keys", "extra_keys_style", type=click.Choice(["tagged", "bare"]), default="tagged",
                 show_default=True,
                 help="tagged: ('lora', name, path) / ('cache_salt', s); bare: older vLLM."),
)

# kvlens collect vllm's flags, named as collector/collect.py's collect_vllm keywords.
collect_vllm_options = options(
    click.option("--endpoint", default=None,
                 help="KV-event PUB endpoint (vLLM / SGLang), e.g. tcp://HOST:5557."),
    click.option("--replay", default=None,
                 help="The publisher's ROUTER replay endpoint, e.g. tcp://HOST:5558."),
    click.option("--topic", default="", help="Subscription topic prefix (default: every topic)."),
    click.option("--replica", default=None, help="Replica name (default: from a kv@<pod>@<model> topic)."),
    click.option("--model", default=None, help="Model name recorded as the rows' namespace."),
    model_config_option,
    _lake_option,
    duration_option,
    click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
                 help="Serve the collector's own /metrics here."),
    click.option("--metrics-addr", default="127.0.0.1", show_default=True, help="Address for /metrics."),
    click.option("--bind", is_flag=True,
                 help="Bind the endpoint (publishers connect) instead of connecting."),
    click.option("--config", default=None, type=click.Path(dir_okay=False),
                 help="kvlens.toml whose [[fleet.replicas]] are followed (when no --endpoint)."),
    click.option("--keep-tokens", is_flag=True, help="Keep the blocks' token ids in kv_events.token_ids."),
    click.option("--record", default=None, type=click.Path(dir_okay=False),
                 help="Also append every frame received to FILE (kvlens import vllm-events reads it)."),
    click.option("--flush-seconds", "flush_s", type=float, default=5.0, show_default=True,
                 help="Commit a segment (with its checkpoint) at least this often."),
    click.option("--scenario", default="live", show_default=True,
                 help="Scenario the events are written to."),
)

# kvlens collect scrape's flags, named as collector/collect.py's collect_scrape keywords.
collect_scrape_options = options(
    click.option("--url", default=None,
                 help="The engine's metrics endpoint, e.g. http://HOST:8000/metrics."),
    click.option("--replica", default=None, help="Replica name recorded on the rows (with --url)."),
    click.option("--config", default=None, type=click.Path(dir_okay=False),
                 help="kvlens.toml: scrape every [[fleet.replicas]] metrics_url, one thread each "
                      "(instead of --url)."),
    _lake_option,
    click.option("--interval", "interval_s", type=click.FloatRange(min=0.01), default=15.0,
                 show_default=True, help="Seconds between scrapes."),
    duration_option,
    click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.01), default=5.0, show_default=True,
                 help="Seconds before a scrape is given up (and counted as failed)."),
    click.option("--scenario", default="live", show_default=True,
                 help="Scenario the samples are written to."),
    click.option("--flush-seconds", "flush_s", type=float, default=60.0, show_default=True,
                 help="Write a segment at least this often."),
    click.option("--family", "families", multiple=True,
                 help="Metric family name prefix to keep (repeat); default: the documented allow-list."),
)

# kvlens collect otlp's flags, named as collector/collect.py's collect_otlp keywords.
collect_otlp_options = options(
    click.option("--listen", default="127.0.0.1:4318", show_default=True,
                 help="HOST:PORT to serve OTLP/HTTP on (loopback unless told otherwise)."),
    _lake_option,
    duration_option,
    click.option("--max-body-bytes", type=click.IntRange(min=1), default=16 * 2**20, show_default=True,
                 help="Largest request body accepted, before and after gunzip (413 above)."),
    click.option("--replica", default=None,
                 help="Replica name for every row (default: from the resource)."),
    click.option("--model", default=None, help="Model name for spans that carry none."),
    model_config_option,
    click.option("--flush-seconds", "flush_s", type=float, default=5.0, show_default=True,
                 help="Commit a segment at least this often."),
    click.option("--scenario", default="live", show_default=True,
                 help="Scenario the requests are written to."),
)

# kvlens import's flags (after FORMAT and FILES), named as collector/imports.py's import_files keywords.
import_options = options(
    _lake_option,
    click.option("--scenario", default="default", show_default=True,
                 help="Scenario name; an existing scenario of that name is replaced whole."),
    click.option("--model", default=None, help="Model name recorded on the rows (e.g. llama-3.1-70b)."),
    model_config_option,
    click.option("--skip-bad-lines", is_flag=True, help="Count and skip lines that do not parse."),
    click.option("--t0", default=None, help="Anchor for traces with relative times (ISO time, UTC)."),
    click.option("--allow-empty", is_flag=True,
                 help="Replace the scenario even when the files hold no rows (default: refuse, keep it)."),
)

# kvlens analyze's flags, named as analyzers/analyze.py's analyze_lake keywords.
analyze_options = options(
    _lake_read_option,
    click.option("--db", required=True, type=click.Path(dir_okay=False), help="Analysis DB to (re)build."),
    click.option("--scenario", "scenarios", multiple=True,
                 help="Scenario to analyze (repeat); default: all."),
    click.option("--model", default=None, help="Model geometry for bytes (default: the requests' model)."),
    model_config_option,
    click.option("--cache-tokens", type=click.IntRange(min=1), default=None,
                 help="KV cache the requests are served from, in tokens (all replicas together): "
                      "places the effective capacity on the miss-ratio curve (table capacity)."),
    click.option("--join", "join", multiple=True, metavar="SCENARIO",
                 help="Fill each request's missing timings, replica and cached tokens from this scenario's "
                      "requests with the same id (e.g. spans from otlp-json); repeat for several. Writes "
                      "request_sources with the matches and the estimated clock offset."),
    click.option("--metrics-from", default=None, metavar="SCENARIO",
                 help="Scenario holding the engines' scraped metrics (e.g. live); default: each analyzed "
                      "scenario itself. Writes reconciliation: engine hit counters beside the ledger."),
    click.option("--full", is_flag=True,
                 help="Rebuild every scenario from the lake; by default a scenario whose lake segments "
                      "are unchanged is copied from the previous DB."),
    click.option("--compact", "compact", is_flag=True,
                 help="First merge the lake's small segments (kvlens compact --today): every query reads "
                      "every segment, and live collectors write one per flush. Keeps the incremental "
                      "state (kvlens serve's analyses pass it)."),
    click.option("--partitions", type=click.IntRange(min=1), default=None, metavar="K",
                 help="Replay each analyzed scenario's ledger in K block-hash partitions (docs/scale.md): "
                      "the same outcomes, and the same state saved for the next analysis to continue from."),
    click.option("--ray", "ray", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
                 help="Run the ledger's partitions as Ray tasks: on the cluster at ADDRESS (e.g. auto, "
                      "ray://head:10001), or on a local cluster started for this run (pip install "
                      "'kvlens[ray]'); without --partitions, two per CPU of the cluster, more for a "
                      "scenario over 4M needed blocks per partition."),
    click.option("--memory-limit", "memory_limit", type=SizeType(), default=None, metavar="SIZE",
                 help="Stop (exit status 3, the previous analysis DB unchanged) once this process's "
                      "resident memory passes SIZE (4GiB, 512MiB, 2G = 2*10^9 bytes); DuckDB gets half of it "
                      "and spills past that. Ray's workers are not counted."),
    click.option("--out-of-core", "out_of_core", is_flag=True,
                 help="For a lake larger than memory: every analysis, with one partition (of block "
                      "hashes, requests or keys), one range of requests or one replica's events in memory "
                      "at a time, spilling to a directory beside --db (docs/scale.md). The same tables as "
                      "a full analysis; refuses a scenario of two namespaces, and --join. --partitions K "
                      "sets the ledger's partitions (default: one per 2M needed blocks); with --ray they "
                      "run as Ray tasks that read and write the spill directory (a path every worker "
                      "sees)."),
)

# kvlens probe's flags, named as gpu_probe/run.py's probe_machine arguments.
probe_options = options(
    click.option("--model", default=None,
                 help="Model geometry to probe (default: the project default model)."),
    model_config_option,
    click.option("--prefix-tokens", default=None,
                 help="Comma-separated prefix lengths [GPU default: 4096,16384,32768,65536]."),
    click.option("--lake", type=click.Path(file_okay=False), default=None,
                 help="Append the rows to probe_runs in this lake (scenario probe)."),
    click.option("--quick", is_flag=True, help="Fewer prefix lengths and runs."),
)


def _live_routing_choices() -> list[str]:
    # A live request has no recorded replica to stay on: every policy but the what-if baseline.
    return [p for p in _routing_choices() if p != "recorded"]


# kvlens gateway's flags, named as collector/gateway_server.py's serve_gateway keywords.
gateway_options = options(
    click.option("--config", required=True, type=click.Path(dir_okay=False),
                 help="kvlens.toml: the [[fleet.replicas]] to front (each with its url)."),
    click.option("--listen", default="127.0.0.1:8000", show_default=True,
                 help="HOST:PORT the OpenAI-compatible API is served on (loopback unless told otherwise)."),
    _lake_option,
    click.option("--routing", type=click.Choice(_live_routing_choices()), default="round_robin",
                 show_default=True, help="How a request picks its replica (the simulator's policies)."),
    click.option("--load-factor", type=float, default=None,
                 help="cache_aware's load fallback: above K x the mean in-flight count, the least loaded."),
    click.option("--otlp-endpoint", default=None,
                 help="OTLP/HTTP collector for the gateway's own spans, e.g. http://127.0.0.1:4318."),
    click.option("--keep-tokens", is_flag=True,
                 help="Keep the blocks' token ids in request_blocks.token_ids."),
    click.option("--flush-seconds", "flush_s", type=click.FloatRange(min=0.01), default=1.0,
                 show_default=True,
                 help="Commit recorded requests at least this often (what a kill -9 can lose)."),
    click.option("--flush-requests", type=click.IntRange(min=1), default=1024, show_default=True,
                 help="... and at least every this many requests."),
    click.option("--scenario", default="live", show_default=True,
                 help="Scenario the requests are written to."),
    duration_option,
)

# kvlens report's flags, named as dashboards/commands.py's run_report keywords (the email ones: mail).
report_options = options(
    _db_option,
    click.option("--out", required=True, type=click.Path(dir_okay=False),
                 help="Write the self-contained HTML page (inline CSS, images as data: URIs) here."),
    click.option("--since", default="24h", show_default=True,
                 help="Window length (30m, 24h, 7d, 1h30m): requests arriving in [now - since, now), "
                      "compared with the window before it."),
    click.option("--now", default=None,
                 help="End of the window (ISO time, UTC), for every scenario. Default: just after each "
                      "scenario's own latest arrival (replayed traces keep their own epochs)."),
    click.option("--scenario", "scenarios", multiple=True, help="Scenario to report (repeat); default: all."),
    mail_options,
    click.option("--gpu-hour-price", type=click.FloatRange(min=0), default=None, metavar="USD",
                 help="Price of one GPU-hour, for avoidable recompute in money (else --config's [costs])."),
    click.option("--production", default=None, metavar="SCENARIO",
                 help="Scenario the first screen is about (default: the measured one with the most tokens)."),
)

# kvlens export's flags, named as dashboards/commands.py's run_export keywords.
export_options = options(
    _db_option,
    click.option("--port", required=True, type=click.IntRange(0, 65535),
                 help="Port for /metrics (0: any free one)."),
    click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 for all)."),
    duration_option,
    click.option("--top-prefixes", type=click.IntRange(0, 100), default=10, show_default=True,
                 help="Prefixes served in kvlens_prefix_lost_tokens per scenario (bounds its cardinality)."),
)

# kvlens dashboard's flags, named as dashboards/commands.py's run_dashboard keywords.
dashboard_options = options(
    _db_option,
    click.option("--port", type=click.IntRange(min=0, max=65535), default=8501, show_default=True,
                 help="Port the dashboard serves on."),
    click.option("--host", default="127.0.0.1", show_default=True,
                 help="Address to bind (0.0.0.0 serves every interface)."),
    click.option("--gpu-hour-price", type=click.FloatRange(min=0), default=None, metavar="USD",
                 help="Price of one GPU-hour: the overview puts avoidable recompute in money."),
)

# kvlens serve's flags, named as kvlens/serve.py's serve_fleet keywords (--analyze-every parsed first).
serve_options = options(
    click.option("--config", required=True, type=click.Path(dir_okay=False, exists=True),
                 help="kvlens.toml: the fleet whose replicas are collected and scraped."),
    _lake_option,
    click.option("--db", required=True, type=click.Path(dir_okay=False), help="Analysis DB kept up to date."),
    click.option("--analyze-every", default="5m", show_default=True, metavar="DURATION",
                 help="Run kvlens analyze this often (30s, 5m, 1h)."),
    click.option("--analyze-memory-limit", "analyze_memory_limit", type=SizeType(), default=None,
                 metavar="SIZE", help="Give each periodic kvlens analyze this --memory-limit (4GiB): past it "
                 "the analysis stops and the previous DB stays, before the kernel's OOM killer picks a "
                 "collector. Counted as analyses{result=\"over_memory_limit\"}."),
    click.option("--dashboard", is_flag=True, help="Also serve the Streamlit dashboard (--dashboard-port)."),
    click.option("--dashboard-port", type=click.IntRange(1, 65535), default=8501, show_default=True),
    click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
                 help="Serve serve's own /metrics here (restarts by child, analyses run, their duration)."),
    click.option("--export-port", type=click.IntRange(1, 65535), default=9465, show_default=True,
                 help="Port of the Prometheus export of the analysis DB (kvlens export)."),
    click.option("--no-export", is_flag=True, help="Do not run the Prometheus export."),
    click.option("--host", default="127.0.0.1", show_default=True,
                 help="Address /metrics, the export and the dashboard bind (0.0.0.0 for all)."),
    click.option("--otlp-listen", default="127.0.0.1:4318", show_default=True,
                 help="HOST:PORT of the OTLP/HTTP receiver; 'off' runs none."),
    click.option("--gateway-listen", default="127.0.0.1:8000", show_default=True,
                 help="HOST:PORT of kvlens gateway, run when the config routes through it; 'off' runs none."),
    click.option("--flush-seconds", "flush_s", type=click.FloatRange(min=0.05), default=5.0,
                 show_default=True, help="The collectors commit a segment at least this often."),
    click.option("--scrape-interval", "scrape_interval_s", type=click.FloatRange(min=0.05), default=15.0,
                 show_default=True, help="Seconds between scrapes of each replica's metrics_url."),
    click.option("--backoff-cap", "backoff_cap_s", type=click.FloatRange(min=0.1), default=60.0,
                 show_default=True,
                 help="Longest wait, in seconds, before a crashed child is restarted (the wait doubles "
                      "from 1 s)."),
)

# kvlens sql's flags: kvlens/query.py's query keywords, then render's format.
sql_options = options(
    click.option("--lake", type=click.Path(file_okay=False), help="Lake directory (views over its tables)."),
    click.option("--db", type=click.Path(dir_okay=False), help="Analysis DB written by kvlens analyze."),
    click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
                 show_default=True),
)

# kvlens compact's flags: the lake, and the retention applied before the merge.
compact_options = options(
    click.option("--lake", required=True, type=click.Path(file_okay=False)),
    click.option("--keep", default=None, metavar="Nd",
                 help="Retention: first drop the raw days older than this (e.g. 30d), whole days, "
                      "atomically; the analysis DB is not touched."),
    click.option("--scenario", "scenarios", multiple=True,
                 help="Scenario --keep applies to (repeat); default: all."),
    click.option("--today", is_flag=True,
                 help="Also merge the current day's segments, per writer, up to 64 MiB a file (a live "
                      "collector writes one per flush); the next kvlens analyze continues, not rebuilds."),
)
