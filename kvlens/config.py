"""The spine's configuration: ``kvlens.toml`` (the fleet today; other sections kept as read).

```toml
[[fleet.replicas]]
name = "vllm-0"                               # optional: else from an llm-d topic kv@<pod>@<model>
endpoint = "tcp://10.0.0.5:5557"              # the engine's KV-event PUB endpoint
replay_endpoint = "tcp://10.0.0.5:5558"       # its ROUTER replay endpoint (optional)
model = "llama-3.1-8b"                        # optional
topic = ""                                    # subscription prefix (optional)
bind = false                                  # true: the collector binds, the engine connects
metrics_url = "http://10.0.0.5:8000/metrics"  # optional, for scrapers
url = "http://10.0.0.5:8000"                  # its OpenAI API, for kvlens gateway (optional)
block_size = 16                               # for kvlens gateway: the engine's --block-size
hash_algo = "sha256"                          # ... its --prefix-caching-hash-algo
hash_seed = "0"                               # ... its PYTHONHASHSEED (omit: vLLM's fixed default)
loras = { "my-adapter" = "/models/my-adapter" }  # ... its --lora-modules, name = path

[smtp]                                        # for kvlens report --config (the nightly email)
server = "smtp.example.com:587"
starttls = true
user = "kvlens"                               # optional; needs password_env
password_env = "KVLENS_SMTP_PASSWORD"         # the variable holding the password, never the password
from = "kvlens@example.com"
to = ["ops@example.com", "kv-team@example.com"]

[costs]                                       # for kvlens report (what avoidable recompute is worth)
gpu_hour_usd = 2.50                           # price of one GPU-hour, in USD
```

CLI flags override what the file says.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvlens.errors import ConfigError

__all__ = ["Config", "ReplicaConfig", "SmtpConfig", "check_http_url", "check_zmq_endpoint", "load_config",
           "merge_flags"]


def check_http_url(url: str, where: str) -> str:
    """``url`` if it is an http(s) URL with a host, else a ConfigError naming ``where``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where} {url!r} is not an http:// or https:// URL with a host: "
                          "e.g. http://10.0.0.5:8000/metrics")
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number in range)
    except ValueError:
        raise ConfigError(f"{where} {url!r} has a bad port: e.g. http://10.0.0.5:8000/metrics") from None
    return url

_ZMQ_SCHEMES = ("tcp", "ipc", "inproc")


def check_zmq_endpoint(address: str, where: str, *, bind: bool = False) -> str:
    """``address`` if ZMQ can use it (``tcp://HOST:PORT``, ``ipc://PATH``, ``inproc://NAME``; a bound
    tcp endpoint may use ``*`` for the interface), else a ConfigError naming ``where``.

    The forms are ZMQ's transports (zmq_tcp(7), zmq_ipc(7), zmq_inproc(7)).
    """
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in _ZMQ_SCHEMES or not rest:
        raise ConfigError(f"{where} {address!r} is not a ZMQ endpoint: use tcp://HOST:PORT "
                          "(e.g. tcp://127.0.0.1:5557), ipc://PATH or inproc://NAME")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        wild = bind and port in ("*", "!")
        if not colon or not host or not (wild or (port.isdigit() and 0 < int(port) < 65536)):
            raise ConfigError(f"{where} {address!r} needs a host and a port from 1 to 65535: "
                              "e.g. tcp://10.0.0.5:5557" + (" or tcp://*:5557" if bind else ""))
        if host == "*" and not bind:
            raise ConfigError(f"{where} {address!r}: '*' (every interface) is only for a bound endpoint: "
                              "connect to the publisher's host, or pass --bind")
    return address


@dataclass(frozen=True)
class ReplicaConfig:
    endpoint: str
    name: str | None = None
    replay_endpoint: str | None = None
    model: str | None = None
    topic: str = ""
    bind: bool = False
    metrics_url: str | None = None
    url: str | None = None  # the replica's OpenAI-compatible HTTP API (kvlens gateway forwards to it)
    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    loras: tuple[tuple[str, str], ...] = ()  # (adapter name, path) as served with --lora-modules
    tokenizer: str | None = None  # a Hugging Face tokenizer.json: the gateway's fallback when /tokenize fails


@dataclass(frozen=True)
class SmtpConfig:
    """Where ``kvlens report`` sends its email; every field may be overridden by a flag."""

    server: str | None = None  # HOST:PORT
    starttls: bool = False
    user: str | None = None
    password_env: str | None = None
    sender: str | None = None  # the file's ``from``
    to: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config:
    replicas: tuple[ReplicaConfig, ...] = ()
    smtp: SmtpConfig | None = None
    gpu_hour_usd: float | None = None  # [costs] gpu_hour_usd
    raw: dict[str, Any] = field(default_factory=dict)


_STR_KEYS = ("name", "replay_endpoint", "model", "topic", "metrics_url", "url", "hash_algo", "hash_seed",
             "tokenizer")
_HASH_ALGOS = ("sha256", "sha256_cbor")  # vLLM's --prefix-caching-hash-algo choices (collector/hashing.py)


def _gateway_keys(entry: dict[str, Any], where: str) -> dict[str, Any]:
    """The keys kvlens gateway reads (url, block_size, hash_algo, hash_seed, loras), checked."""
    out: dict[str, Any] = {"url": None}
    if entry.get("url") is not None:
        out["url"] = check_http_url(entry["url"], f"{where}: url").rstrip("/")
    block = entry.get("block_size", 16)
    if type(block) is not int or block < 1:
        raise ConfigError(f"{where}: block_size must be a positive integer (the engine's --block-size)")
    algo = entry.get("hash_algo", "sha256")
    if algo not in _HASH_ALGOS:
        raise ConfigError(f"{where}: hash_algo {algo!r} is not one of {', '.join(_HASH_ALGOS)}")
    loras = entry.get("loras", {})
    if not isinstance(loras, dict) or not all(isinstance(v, str) for v in loras.values()):
        raise ConfigError(f"{where}: loras must be a table of adapter name = \"path\"")
    out.update(block_size=block, hash_algo=algo, hash_seed=entry.get("hash_seed"),
               loras=tuple(sorted(loras.items())))
    return out


def _replica(entry: Any, where: str) -> ReplicaConfig:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a table with endpoint = \"tcp://HOST:PORT\"")
    unknown = set(entry) - {"endpoint", "bind", "block_size", "loras", *_STR_KEYS}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}: remove or rename them")
    endpoint = entry.get("endpoint")
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ConfigError(f"{where}: endpoint must be a ZMQ address such as tcp://HOST:5557")
    for key in _STR_KEYS:
        if key in entry and not isinstance(entry[key], str):
            raise ConfigError(f"{where}: {key} must be a string")
    if not isinstance(entry.get("bind", False), bool):
        raise ConfigError(f"{where}: bind must be true or false")
    check_zmq_endpoint(endpoint, f"{where}: endpoint", bind=entry.get("bind", False))
    if entry.get("replay_endpoint"):
        check_zmq_endpoint(entry["replay_endpoint"], f"{where}: replay_endpoint")
    gw = _gateway_keys(entry, where)
    return ReplicaConfig(endpoint=endpoint, bind=entry.get("bind", False), topic=entry.get("topic", ""),
                         name=entry.get("name"), replay_endpoint=entry.get("replay_endpoint"),
                         model=entry.get("model"), metrics_url=entry.get("metrics_url"), url=gw["url"],
                         block_size=gw["block_size"], hash_algo=gw["hash_algo"], hash_seed=gw["hash_seed"],
                         loras=gw["loras"], tokenizer=entry.get("tokenizer"))


_SMTP_STR_KEYS = ("server", "user", "password_env", "from")


def _smtp(entry: Any, where: str) -> SmtpConfig:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: [smtp] must be a table (server = \"HOST:PORT\", to = [...])")
    unknown = set(entry) - {"starttls", "to", "password", *_SMTP_STR_KEYS}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}: remove or rename them")
    if "password" in entry:
        raise ConfigError(f"{where}: a password is never read from the file: put it in an environment "
                          "variable and name that variable in password_env")
    for key in _SMTP_STR_KEYS:
        if key in entry and not isinstance(entry[key], str):
            raise ConfigError(f"{where}: {key} must be a string")
    if not isinstance(entry.get("starttls", False), bool):
        raise ConfigError(f"{where}: starttls must be true or false")
    to = entry.get("to", [])
    if isinstance(to, str):
        to = [to]
    if not isinstance(to, list) or not all(isinstance(a, str) and "@" in a for a in to):
        raise ConfigError(f"{where}: to must be a list of addresses such as [\"ops@example.com\"]")
    if ("user" in entry) != ("password_env" in entry):
        raise ConfigError(f"{where}: user and password_env go together")
    return SmtpConfig(server=entry.get("server"), starttls=entry.get("starttls", False),
                      user=entry.get("user"), password_env=entry.get("password_env"),
                      sender=entry.get("from"), to=tuple(to))


def _gpu_hour_usd(entry: Any, where: str) -> float | None:
    if not isinstance(entry, dict) or set(entry) - {"gpu_hour_usd"}:
        raise ConfigError(f"{where}: [costs] takes one key, gpu_hour_usd = 2.50 (USD per GPU-hour)")
    price = entry.get("gpu_hour_usd")
    if price is not None and (isinstance(price, bool) or not isinstance(price, int | float) or price < 0):
        raise ConfigError(f"{where}: gpu_hour_usd must be a number of USD, 0 or more, such as 2.50")
    return None if price is None else float(price)


def load_config(path: str | Path) -> Config:
    """Read ``kvlens.toml``; a missing file or a bad entry is a ConfigError naming it."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist: check --config") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p} is not valid TOML: {e}") from None
    fleet = raw.get("fleet", {})
    entries = fleet.get("replicas", []) if isinstance(fleet, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"{p}: [fleet] must hold [[fleet.replicas]] tables")
    replicas = tuple(_replica(e, f"{p} fleet.replicas[{i}]") for i, e in enumerate(entries))
    names = [r.name for r in replicas if r.name]
    if len(names) != len(set(names)):
        raise ConfigError(f"{p}: replica names repeat: {sorted(names)}; give each its own name")
    smtp = _smtp(raw["smtp"], f"{p} [smtp]") if "smtp" in raw else None
    price = _gpu_hour_usd(raw["costs"], f"{p} [costs]") if "costs" in raw else None
    return Config(replicas=replicas, smtp=smtp, gpu_hour_usd=price, raw=raw)


def merge_flags(flags: Mapping[str, Any], file: Mapping[str, Any], defaults: Mapping[str, Any] | None = None,
                *, together: Iterable[tuple[str, ...]] = ()) -> dict[str, Any]:
    """Flags over ``kvlens.toml``: each setting is its flag's value when the flag was given (not None),
    else the file's (when not None), else ``defaults``' (else None).

    The names of a ``together`` group come from one place: from the flags when any of them was
    given, else all from the file (a --user never pairs with the file's password_env).
    """
    defaults = defaults or {}
    merged = {name: flags.get(name) for name in {*flags, *file, *defaults}}
    grouped = {name for group in together for name in group}
    for group in together:
        if all(flags.get(name) is None for name in group):
            merged.update({name: file.get(name) for name in group})
    for name, value in merged.items():
        if value is None and name not in grouped:
            merged[name] = file.get(name)
        if merged[name] is None:
            merged[name] = defaults.get(name)
    return merged
