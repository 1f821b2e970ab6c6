"""analyzers' front door for ``kvlens simulate``: a lake scenario replayed -> a what-if scenario in it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import duckdb

from kvlens.analyzers import step_time
from kvlens.analyzers.analyze import scenario_model
from kvlens.analyzers.costs import cost_model
from kvlens.analyzers.join import join_sources
from kvlens.analyzers.sim_config import Engine, SimConfig, SimResult
from kvlens.analyzers.simulate import simulate
from kvlens.errors import NoDataError
from kvlens.lake import write_scenario
from kvlens.models import ModelGeometry
from kvlens.query import connect

__all__ = ["WhatIfResult", "simulate_scenario"]

SOURCE_REQUESTS_SQL = "SELECT * FROM requests WHERE scenario = ?"
SOURCE_BLOCKS_SQL = "SELECT * FROM request_blocks WHERE scenario = ?"


@dataclass(frozen=True)
class WhatIfResult:
    """The what-if written: rows per lake table, the config it ran (its step model filled in), and
    the simulator's frames and stats (every time in them modelled)."""

    scenario: str
    counts: dict[str, int]
    config: SimConfig
    model: ModelGeometry
    sim: SimResult


def _step_model(con: duckdb.DuckDBPyConnection, source: str, config: SimConfig, geometry: ModelGeometry,
                calibrate: str | None) -> step_time.StepModel | None:
    """Fitted to ``calibrate``'s measured spans; else, for the vllm engine, the device's roofline with
    prefill from the lake's GPU probe runs when they calibrate it (analyzers/costs.py)."""
    if config.step_model is not None:
        return config.step_model
    if calibrate is not None:
        spans, _report = join_sources(requests=con.table("requests"), scenario=calibrate, sources=[source],
                                      matched_ids=True)
        return step_time.calibrated(spans, geometry, calibrate, config.device)
    if config.engine == Engine.VLLM:
        probe = cost_model(probe_runs=con.table("probe_runs"), model=geometry, device=config.device)
        return step_time.modelled(geometry, config.device, costs=probe)
    return None


def simulate_scenario(lake: str | Path, source: str, name: str, config: SimConfig,
                      model: ModelGeometry | None = None, *, calibrate: str | None = None,
                      writer_id: str = "simulate") -> WhatIfResult:
    """Replay scenario ``source``'s requests under ``config`` and write them as scenario ``name``
    (replaced whole). ``model``: the geometry, else ``source``'s own (``scenario_model``);
    ``calibrate``: a scenario whose measured spans the step time is fitted to."""
    con = connect(lake=lake)
    try:
        reqs = con.sql(SOURCE_REQUESTS_SQL, params=[source]).pl()
        if reqs.is_empty():
            raise NoDataError(f"scenario {source!r} has no requests in lake {lake}: import it first")
        blocks = con.sql(SOURCE_BLOCKS_SQL, params=[source]).pl()
        geometry, _ = scenario_model(con, source, model)
        config = dataclasses.replace(config, step_model=_step_model(con, source, config, geometry, calibrate))
    finally:
        con.close()
    result = simulate(requests=reqs, request_blocks=blocks, config=config, model=geometry)
    counts = write_scenario(lake, name, {k: v.to_arrow() for k, v in result.tables.items()},
                            writer_id=writer_id)
    return WhatIfResult(name, counts, config, geometry, result)
