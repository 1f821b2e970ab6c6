"""README's "Run kvlens in front of your fleet": the config and commands the live gateway test runs.

The integration test (tests/integration/test_live_gateway.py) reads the fleet config from the
README section itself and substitutes only its own ports and paths (``localise``); the unit test
(tests/test_gateway_readme.py) checks that the README holds exactly the commands below.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Run kvlens in front of your fleet"

# The README's own ports and paths, which a test replaces with free ones.
PLACES = {"api_a": "8101", "api_b": "8102", "replay_a": "5601", "replay_b": "5602", "gateway": "8100",
          "ipc_dir": "/run/kvlens"}

COLLECT = ["collect", "vllm", "--config", "kvlens.toml", "--lake", "lake"]
GATEWAY = ["gateway", "--config", "kvlens.toml", "--listen", "127.0.0.1:8100", "--lake", "lake"]
ROUTING = ["--routing", "cache_aware"]
ANALYZE = ["analyze", "--lake", "lake", "--db", "kvlens.duckdb", "--scenario", "live"]


def section() -> str:
    text = README.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:end if end > 0 else len(text)]


def fleet_toml() -> str:
    """The section's ``toml`` block, as written."""
    m = re.search(r"```toml\n(.*?)```", section(), re.S)
    assert m, "README's gateway section has no ```toml block"
    return m.group(1)


def engine_events(replica: str) -> str:
    """The --kv-events-config JSON the section gives the engine of ``replica`` (a or b)."""
    m = re.search(r"--kv-events-config '(\{[^']*kv@replica-" + replica + r"@tiny[^']*\})'", section())
    assert m, f"README's gateway section has no --kv-events-config for replica-{replica}"
    return m.group(1)


def localise(text: str, places: dict[str, str]) -> str:
    """``text`` with the README's ports and paths replaced by a test's (same keys as PLACES)."""
    for key, value in PLACES.items():  # in two steps: a new port may hold an old one's digits
        text = text.replace(value, f"<{key}>")
    for key in PLACES:
        text = text.replace(f"<{key}>", places[key])
    return text
