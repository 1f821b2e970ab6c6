"""Analyzers: the vLLM engine's event and transfer buffers -> the lake's kv_events and transfers frames.

Location -1 is the shared pool (replica ``pool``, medium ``pool``); every other location is a
replica's GPU (medium ``gpu``). A stored block carries its request's chain (parent hash,
position, content hash when the source had one, namespace, session); a removed one only its
hash, as vLLM's ``BlockRemoved`` does. ``seq`` numbers each location's distinct event times,
as one published batch per scheduler step would be.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from kvlens.analyzers.step_time import StepModel
from kvlens.analyzers.vllm_cache import KIND_STORED

if TYPE_CHECKING:
    from kvlens.analyzers.sim_vllm import Prepared

__all__ = ["events_frame", "transfers_frame"]

_EVENT_SCHEMA = pl.Schema({"ts_ns": pl.Int64, "recv_ns": pl.Int64, "replica": pl.String, "dp_rank": pl.Int64,
                 "seq": pl.UInt64, "kind": pl.String, "block_hash": pl.UInt64, "parent_hash": pl.UInt64,
                 "position": pl.Int64, "block_tokens": pl.Int64, "medium": pl.String,
                 "content_hash": pl.UInt64, "namespace": pl.String, "session_id": pl.String})


def _names(loc: np.ndarray, names: list[str]) -> pl.Series:
    lookup = np.array([*names, "pool"], dtype=object)
    return pl.Series(lookup[np.where(loc < 0, len(names), loc)].tolist(), dtype=pl.String)


def events_frame(ev: np.ndarray, prep: Prepared, names: list[str]) -> pl.DataFrame:
    if len(ev) == 0:
        return pl.DataFrame(schema=_EVENT_SCHEMA)
    ts, loc, kind, h, req, pos = (ev[:, k] for k in range(6))
    stored = kind == KIND_STORED
    flat = np.where(stored, prep.off[np.maximum(req, 0)] + np.maximum(pos, 0), 0)
    has_parent = stored & (pos > 0)
    parent = prep.hashes[np.where(has_parent, flat - 1, 0)].view(np.uint64)
    content = prep.content[flat]
    namespace = prep.namespace.to_numpy()[np.maximum(req, 0)]
    session = prep.reqs["session_id"].to_numpy()[np.maximum(req, 0)]
    raw = pl.DataFrame({
        "ts_ns": ts, "recv_ns": ts, "replica": _names(loc, names), "dp_rank": np.zeros(len(ev), np.int64),
        "kind": np.where(stored, "stored", "removed"), "block_hash": h.view(np.uint64), "parent": parent,
        "pos": pos, "content": content, "ns": pl.Series(namespace, dtype=pl.String),
        "session": pl.Series(session, dtype=pl.String), "stored": stored, "has_parent": has_parent,
        "medium": np.where(loc < 0, "pool", "gpu")})
    frame = raw.with_columns(
        parent_hash=pl.when("has_parent").then("parent"), position=pl.when("stored").then("pos"),
        block_tokens=pl.when("stored").then(pl.lit(prep.block, pl.Int64)),
        content_hash=pl.when(pl.col("stored") & (pl.col("content") != 0)).then("content"),
        namespace=pl.when("stored").then("ns"), session_id=pl.when("stored").then("session"))
    seq = (pl.col("ts_ns").rank("dense").over("replica") - 1).cast(pl.UInt64)
    return frame.with_columns(seq=seq).select(list(_EVENT_SCHEMA)).cast(_EVENT_SCHEMA)


def transfers_frame(xf: np.ndarray, prep: Prepared, names: list[str], per_token: int, step: StepModel,
                    ext: np.ndarray) -> pl.DataFrame:
    """Pool loads (origin pool, a share of the request's modelled load time each) and pool writes."""
    schema = {"request_id": pl.String, "ts_ns": pl.Int64, "replica": pl.String, "origin": pl.String,
              "block_hash": pl.UInt64, "blocks": pl.Int64, "bytes": pl.Int64, "duration_ms": pl.Float64,
              "status": pl.String}
    if len(xf) == 0:
        return pl.DataFrame(schema=schema)
    req, ts, rep, origin, h, _pos = (xf[:, k] for k in range(6))
    nbytes = prep.block * per_token
    load = rep >= 0
    lookup_ms, ms_per_token = step.params[11], step.params[12]
    tokens = ext[req].astype(float)
    per_block = (lookup_ms + ms_per_token * tokens) * prep.block / np.maximum(tokens, 1)
    share = np.where(load & (tokens > 0), per_block, 0.0)
    return pl.DataFrame({
        "request_id": prep.reqs["request_id"].to_numpy()[req], "ts_ns": ts, "replica": _names(rep, names),
        "origin": _names(origin, names), "block_hash": h.view(np.uint64),
        "blocks": np.ones(len(xf), np.int64),
        "bytes": np.full(len(xf), nbytes, np.int64), "duration_ms": share, "status": "ok"}, schema=schema)
