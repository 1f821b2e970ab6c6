"""Dashboards: what each scenario's figures rest on, read from `scenarios`, in the words shown beside them.

``kvlens analyze`` records per scenario whether it was simulated or measured (from its requests'
sources, not its name), whether its TTFT is measured or modelled, what the model assumed, and
where the KV geometry came from. The report and the pages put those words next to the numbers.
An analysis DB written before these columns existed reads as unlabelled (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from kvlens.dashboards.read import rows, table_columns

__all__ = ["Origin", "bytes_sentence", "origins", "tagged"]

_COLUMNS = ("scenario", "model", "kv_bytes_per_token", "model_source", "provenance", "ttft_label",
            "assumptions")
_SOURCE_WORDS = {
    "given": "given to kvlens analyze",
    "requests": "named by the requests",
    "default": "assumed: no model was given (pass --model or --model-config to kvlens analyze)",
}


@dataclass(frozen=True)
class Origin:
    """One scenario's provenance; ``label`` is ``modelled`` or ``measured`` (None: not recorded)."""

    scenario: str
    model: str | None = None
    kv_bytes_per_token: int | None = None
    model_source: str | None = None
    provenance: str | None = None
    ttft_label: str | None = None
    assumptions: str | None = None

    @property
    def label(self) -> str | None:
        if self.provenance is None:
            return None
        return "modelled" if self.provenance == "simulated" else "measured"

    @property
    def assumed_bytes(self) -> bool:
        """The KV bytes rest on the default geometry: nothing named the model."""
        return self.model_source == "default"

    def ttft(self, text: str) -> str:
        """A TTFT figure with its label beside it."""
        return f"{text} ({self.ttft_label})" if self.ttft_label and text != "n/a" else text


# {columns}: _COLUMNS, NULL for those an older analysis DB lacks (schema names, never user input).
ORIGINS_SQL = "SELECT {columns} FROM scenarios ORDER BY scenario"


def origins(con: duckdb.DuckDBPyConnection, names: list[str] | None = None) -> dict[str, Origin]:
    """Per analyzed scenario (of ``names`` when given): its Origin."""
    have = set(table_columns(con, "scenarios"))
    cols = [c if c in have else f"NULL AS {c}" for c in _COLUMNS]
    found = {r[0]: Origin(*r) for r in rows(con, ORIGINS_SQL.format(columns=", ".join(cols)))}
    return found if names is None else {n: found.get(n, Origin(n)) for n in names}


def tagged(name: str, found: dict[str, Origin]) -> str:
    """``rr8 (modelled)`` / ``prod (measured)``: a scenario named with what its figures are."""
    origin = found.get(name)
    label = origin.label if origin else None
    return f"{name} ({label})" if label else name


def bytes_sentence(found: dict[str, Origin]) -> str | None:
    """One sentence naming the KV geometry behind every byte figure, and where it came from."""
    groups: dict[tuple[str, int, str], list[str]] = {}
    for o in found.values():
        if o.model and o.kv_bytes_per_token and o.model_source:
            groups.setdefault((o.model, o.kv_bytes_per_token, o.model_source), []).append(o.scenario)
    if not groups:
        return None
    said = []
    for (model, per_token, source), names in sorted(groups.items()):
        who = "" if len(groups) == 1 else f" for {', '.join(sorted(names))}"
        words = _SOURCE_WORDS.get(source, source)
        said.append(f"{model}'s KV geometry, {per_token:,} B per token{who} ({words})")
    return "Byte figures use " + "; ".join(said) + "."
