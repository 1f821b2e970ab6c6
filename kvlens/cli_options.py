"""The spine's command-line kit: the one-line-error group, option stacks and parse helpers of cli.py.

Only the spine is imported here (the architecture test lets kvlens/cli.py alone reach the other
packages, lazily), so what needs a package's registry stays in cli.py.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from kvlens.errors import ConfigError, KvlensError

__all__ = ["Group", "LazyChoice", "collect_otlp_options", "collect_scrape_options", "collect_vllm_options",
           "duration_option", "given_model", "hash_key_options", "mail_options", "model_config_option",
           "model_name", "options", "parse_now", "progress_bar", "sim_options", "stopped_by_signals"]


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _usage_error(e: click.UsageError) -> click.ClickException:
    """A usage error as one ``Error:`` line that says where and points at --help (exit 1)."""
    where = e.ctx.command_path if e.ctx is not None else "kvlens"
    if isinstance(e, click.exceptions.NoArgsIsHelpError) and isinstance(e.ctx.command, click.Group):
        names = ", ".join(e.ctx.command.list_commands(e.ctx))
        return click.ClickException(f"{where} needs a command ({names}): see {where} --help")
    return click.ClickException(f"{_one_line(e.format_message())} (see {where} --help)")


class Group(click.Group):
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


class LazyChoice(click.Choice):
    """Choices read from ``load`` when click first needs them (the CLI imports packages lazily)."""

    def __init__(self, load: Callable[[], Sequence[str]]) -> None:
        self._load = load
        super().__init__((), case_sensitive=True)

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self._load())

    @choices.setter
    def choices(self, _value: object) -> None:
        pass


def options(*decorators: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """One decorator applying ``decorators`` as if stacked in this order (the --help order)."""
    def apply(f: Any) -> Any:
        for d in reversed(decorators):
            f = d(f)
        return f
    return apply


def progress_bar(paths: tuple[str, ...], label: str) -> Any:
    """A progress bar on stderr over the bytes of ``paths``."""
    total = sum(Path(p).stat().st_size for p in paths if Path(p).is_file())
    return click.progressbar(length=total, label=label, file=sys.stderr, show_eta=True,
                             show_percent=True, width=30)


@contextlib.contextmanager
def stopped_by_signals(stop: Callable[[], object]) -> Iterator[None]:
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


def model_config_option(f: Any) -> Any:
    return click.option("--model-config", "model_config", default=None, metavar="config.json",
                        type=click.Path(dir_okay=False), help=_MODEL_CONFIG_HELP)(f)


def given_model(model: str | None, model_config: str | None) -> Any:
    """The geometry --model or --model-config names (None when neither); both at once is an error."""
    from kvlens.models import from_hf_config, get_model

    if model and model_config:
        raise ConfigError(f"--model {model} and --model-config {model_config} both name the model: give one")
    if model_config:
        return from_hf_config(model_config)
    return get_model(model) if model else None


def model_name(model: str | None, model_config: str | None) -> str | None:
    """The model name to record on rows: --model as given (any name), or the name in --model-config's file."""
    if model_config:
        return str(given_model(model, model_config).name)
    return model


def parse_now(value: str | None) -> int | None:
    """--now as nanoseconds since the epoch (a time without a zone is UTC); None stays None."""
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


def _routing_choices() -> list[str]:
    from kvlens.schema import RoutingPolicy

    return [p.value for p in RoutingPolicy]


duration_option = click.option("--duration", "duration_s", type=float, default=None,
                               help="Stop after this many seconds (default: never).")

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
    click.option("--lake", required=True, type=click.Path(file_okay=False), help="Lake directory."),
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
    click.option("--url", required=True,
                 help="The engine's metrics endpoint, e.g. http://HOST:8000/metrics."),
    click.option("--replica", required=True, help="Replica name recorded on the rows."),
    click.option("--lake", required=True, type=click.Path(file_okay=False), help="Lake directory."),
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
    click.option("--lake", required=True, type=click.Path(file_okay=False), help="Lake directory."),
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
