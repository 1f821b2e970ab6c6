"""The container files: the Dockerfile's install and user, and the compose file's kvlens commands are
the README's and ones the CLI accepts (nothing is built here: no container runtime in CI)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvlens.cli import cli

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "deploy" / "compose.yaml"


def _instructions() -> list[tuple[str, str]]:
    lines = [ln for ln in (REPO / "Dockerfile").read_text().splitlines() if ln and not ln.startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    return [(ln.split(None, 1)[0], ln.split(None, 1)[1]) for ln in text.splitlines() if ln[0] != " "]


def kvlens_commands() -> dict[str, list[str]]:
    """Each kvlens service's command (the compose file writes them as one-line JSON arrays)."""
    out: dict[str, list[str]] = {}
    service = None
    for line in COMPOSE.read_text().splitlines():
        if m := re.match(r"^  ([a-z][\w-]*):\s*$", line):
            service = m.group(1)
        elif (m := re.match(r"^    command: (\[.*\])\s*$", line)) and (service or "").startswith("kvlens-"):
            out[str(service)] = json.loads(m.group(1))
    return out


def _readme_commands() -> set[str]:
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    return {" ".join(ln.split()) for ln in text.splitlines() if ln.startswith("kvlens ")}


def test_dockerfile_installs_the_project_on_a_slim_base_as_a_non_root_user() -> None:
    steps = _instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")
    assert ("RUN", "pip install .") in steps
    users = [arg for op, arg in steps if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert ("ENTRYPOINT", '["kvlens"]') in steps
    run_index = steps.index(("RUN", "pip install ."))
    copied = {arg.split()[0] for op, arg in steps[:run_index] if op == "COPY"}
    packages = re.search(r'packages = \[(.*?)\]', (REPO / "pyproject.toml").read_text())
    assert packages is not None
    assert {p.strip(' "') for p in packages.group(1).split(",")} <= copied  # every package is installed


def test_compose_commands_are_the_readmes_and_parse() -> None:
    commands = kvlens_commands()
    assert set(commands) == {"kvlens-events", "kvlens-spans", "kvlens-analyze", "kvlens-export"}
    readme = _readme_commands()
    runner = CliRunner()
    for service, args in commands.items():
        line = "kvlens " + shlex.join(args)
        assert line in readme, f"{service}: {line!r} is not in README.md"
        # --help is eager: it answers only when every subcommand and option before it exists
        result = runner.invoke(cli, [*args, "--help"])
        assert result.exit_code == 0, f"{service}: {line}: {result.output}"


def test_an_unknown_option_would_be_caught() -> None:
    result = CliRunner().invoke(cli, ["export", "--db", "x", "--prot", "9465", "--help"])
    assert result.exit_code != 0 and "No such option" in result.output


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="no promtool (Debian: apt-get install prometheus; make test installs it as root)")
def test_the_compose_prometheus_config_is_valid(tmp_path: Path) -> None:
    rules = REPO / "dashboards" / "grafana" / "kvlens-rules.yml"
    text = (REPO / "deploy" / "prometheus.yml").read_text()
    text = text.replace("/etc/prometheus/kvlens-rules.yml", str(rules))
    config = tmp_path / "prometheus.yml"
    config.write_text(text)
    done = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
