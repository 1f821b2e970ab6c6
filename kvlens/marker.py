"""The spine's lake marker: ``LAKE/_kvlens.json`` says a directory is a lake, and of which schema."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvlens.commit import fsync_path, tmp_name
from kvlens.errors import ConfigError, InputError, SchemaVersionError
from kvlens.schema import SCHEMA_VERSION

__all__ = ["MARKER", "lake_info", "read_marker"]

MARKER = "_kvlens.json"


def lake_info(lake: str | Path, *, create: bool = False) -> dict[str, Any]:
    """The lake's marker (schema version); creates the lake when asked; checks the version."""
    root = Path(lake)
    marker = root / MARKER
    if root.exists() and not root.is_dir():
        raise ConfigError(f"lake {root} is a file, not a directory: pass the lake's directory")
    if marker.exists():
        info = read_marker(marker)
        if info.get("schema_version") != SCHEMA_VERSION:
            raise SchemaVersionError(
                f"lake {root} has schema v{info.get('schema_version')}, kvlens expects "
                f"v{SCHEMA_VERSION}: re-import its sources into a new lake"
            )
        return info
    info = {"schema_version": SCHEMA_VERSION}
    if create:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create lake {root} ({e.strerror}): "
                              "choose a directory path that can be created and written") from None
        _atomic_write_bytes(marker, json.dumps(info).encode())
    return info


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(tmp_name(path.name))
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def read_marker(marker: Path) -> dict[str, Any]:
    """The lake marker's JSON object, or an InputError saying how to repair it."""
    try:
        info = json.loads(marker.read_bytes())
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not JSON"
        raise InputError(f"lake marker {marker} cannot be read ({reason}): {_RESTORE}") from None
    if not isinstance(info, dict):
        raise InputError(f"lake marker {marker} is not a JSON object: {_RESTORE}")
    return info


_RESTORE = (f"restore it (kvlens writes {{\"schema_version\": {SCHEMA_VERSION}}}) "
            "or pass the lake's own directory")
