"""Analyzer: a scenario's requests -> where its figures come from (columns of table `scenarios`).

A scenario is ``simulated`` when every one of its requests rows was written by ``kvlens simulate``
(``requests.source = 'sim'``): its ledger, flows and timings are then the simulator's model, not
an engine's record. Otherwise it is ``measured``: rows recorded outside kvlens (an engine's KV
events and spans, a gateway log, an imported trace). The label is read from the data, never from
the scenario's name. Its TTFT figures are ``modelled`` (simulated), ``measured`` (a measured
scenario whose requests, after any ``--join``, carry ``ttft_ms``), or absent.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from kvlens.analyzers.costs import DEFAULT_DEVICE, DeviceModel

__all__ = ["MEASURED", "MODELLED", "SIMULATED", "Provenance", "scenario_provenance", "simulator_assumptions"]

SIMULATED, MEASURED, MODELLED = "simulated", "measured", "modelled"
_SIM_SOURCE = "sim"  # analyzers/simulate.py writes this source on every requests row

# Aggregates over one scenario's requests rows: the formats seen, rows not written by the
# simulator, rows with a TTFT (no user input reaches this text).
_AGGREGATE = (
    "coalesce(string_agg(DISTINCT coalesce(source, '(none)'), ',' ORDER BY coalesce(source, '(none)')), ''), "
    f"count(*) FILTER (WHERE source IS DISTINCT FROM '{_SIM_SOURCE}'), count(ttft_ms)"
)


@dataclass(frozen=True)
class Provenance:
    """The provenance columns of one `scenarios` row."""

    provenance: str
    sources: str
    ttft_label: str | None
    assumptions: str | None


def simulator_assumptions(device: DeviceModel = DEFAULT_DEVICE) -> str:
    """The simulator's service model in words (analyzers/costs.py), for every modelled figure."""
    return (f"cache, routing and queueing replayed by kvlens simulate; TTFT = queue + "
            f"pool load ({device.pool_gbps:g} GB/s, {device.pool_lookup_ms:g} ms lookup) + prefill at "
            f"{device.efficiency:.0%} of {device.name.removesuffix(' (modelled)')} bf16 peak; "
            f"{device.decode_ms_per_token:g} ms per output token")


def _recorded_assumptions(simulations: duckdb.DuckDBPyRelation | None) -> str | None:
    """What ``kvlens simulate`` recorded for the what-if (its newest row), if the lake has it."""
    if simulations is None:
        return None
    rows = simulations.order("created_ns DESC").limit(1).select("assumptions").fetchall()
    return str(rows[0][0]) if rows and rows[0][0] else None


def scenario_provenance(*, requests: duckdb.DuckDBPyRelation,
                        simulations: duckdb.DuckDBPyRelation | None = None) -> Provenance:
    """Where a scenario's figures come from, read from its ``requests`` rows (joined ones included).

    A simulated scenario's assumptions are those ``kvlens simulate`` recorded in its
    ``simulations`` rows; a what-if written before that table existed gets the LRU engine's
    service model, which was then the only one.
    """
    ((sources, not_simulated, with_ttft),) = requests.aggregate(_AGGREGATE).fetchall()
    if not_simulated == 0 and sources:
        assumed = _recorded_assumptions(simulations) or simulator_assumptions()
        return Provenance(SIMULATED, str(sources), MODELLED if with_ttft else None, assumed)
    return Provenance(MEASURED, str(sources), MEASURED if with_ttft else None, None)
