"""README's "Run kvlens in front of your fleet" holds what the live gateway test runs (gateway_readme.py)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import gateway_readme as readme

from kvlens.cli import cli
from kvlens.config import load_config


def test_the_fleet_config_is_a_valid_two_replica_gateway_config(tmp_path: Path) -> None:
    config = tmp_path / "kvlens.toml"
    config.write_text(readme.fleet_toml())
    replicas = load_config(config).replicas
    assert [r.name for r in replicas] == ["replica-a", "replica-b"]
    for r, ab in zip(replicas, "ab", strict=True):
        assert r.url == f"http://127.0.0.1:{readme.PLACES['api_' + ab]}"
        assert r.endpoint == f"ipc://{readme.PLACES['ipc_dir']}/kv-{ab}"
        assert (r.block_size, r.hash_algo, r.hash_seed, r.model) == (32, "sha256_cbor", "0", "tiny")
        events = json.loads(readme.engine_events(ab))
        # the engine publishes where the config subscribes, with the replica's name in its topic
        assert (events["endpoint"], events["replay_endpoint"]) == (r.endpoint, r.replay_endpoint)
        assert events["topic"] == f"kv@{r.name}@tiny"


def _commands() -> list[list[str]]:
    text = readme.section()
    block = text[text.index("```sh\n") + 6:]
    block = block[:block.index("```")].replace("\\\n", " ")
    return [shlex.split(line) for line in block.splitlines() if line.startswith("kvlens ")]


def test_the_commands_are_the_ones_the_live_test_runs() -> None:
    commands = [[a for a in c if a != "&"][1:] for c in _commands()]
    assert commands == [readme.COLLECT, readme.GATEWAY + readme.ROUTING, readme.ANALYZE]


def test_every_gateway_flag_the_readme_uses_exists() -> None:
    params = {opt for p in cli.commands["gateway"].params for opt in p.opts}  # type: ignore[attr-defined]
    assert {a for a in readme.GATEWAY + readme.ROUTING if a.startswith("--")} <= params


def test_the_engine_flags_match_the_live_engines() -> None:
    from integration.live_engine import ENGINE_FLAGS

    text = " ".join(readme.section().replace("\\\n", " ").split())
    assert text.count(" ".join(ENGINE_FLAGS)) == 2  # both engines
