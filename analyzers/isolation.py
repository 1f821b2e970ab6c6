"""Analyzers: isolation and compatibility audit: cache keys shared where they must not be, and
keys that cannot match where they should.

Findings, each a row with a severity and a sentence for the operator:

- ``cross_tenant_reuse`` (high): a cache hit of one tenant on a block first needed by another
  tenant (``requests.tenant``, ``block_outcomes``): the tenants' prompts map to the same keys,
  so one tenant's KV serves another;
- ``cross_tenant_keys`` (medium): block keys needed by several tenants without such a hit yet;
- ``cross_salt_keys`` (high): one engine block key published with different extra keys (cache
  salts): the salt does not separate the keys;
- ``incompatible_keys`` (medium): ``miss_incompatible`` blocks: the same token content was
  stored under another namespace, so it was recomputed (with the parts of the two namespace
  names that differ);
- ``same_content_different_keys`` (medium): two replicas (engine events) or two namespaces
  (router / gateway blocks) keyed identical token content differently: hash algorithm, seed,
  model revision or salt differ although the content matches;
- ``block_size_mismatch`` (high): a replica stores blocks of another size than the router
  keys prompts in; ``engine_block_size_mismatch`` (medium): replicas disagree among themselves.
"""

from __future__ import annotations

import re

import duckdb
import polars as pl

from kvlens.analyzers.scans import Scans
from kvlens.schema import HIT_OUTCOMES, Outcome, Severity

__all__ = ["isolation_findings"]

_SEVERITY_ORDER = {Severity.HIGH.value: 0, Severity.MEDIUM.value: 1, Severity.LOW.value: 2}
_SCHEMA: dict[str, type[pl.DataType]] = {
    "scenario": pl.Utf8, "finding": pl.Utf8, "subject": pl.Utf8, "blocks": pl.Int64, "detail": pl.Utf8,
    "severity": pl.Utf8, "tokens": pl.Int64, "bytes": pl.Int64, "requests": pl.Int64,
}
_SALT_ADVICE = "give each tenant its own cache_salt (vLLM) or namespace"


def _rows(rows: list[dict[str, object]]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema=_SCHEMA) if rows else pl.DataFrame(schema=_SCHEMA)


def _tenant_blocks(requests: duckdb.DuckDBPyRelation,
                   request_blocks: duckdb.DuckDBPyRelation) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(request_id -> tenant, full blocks with tenant and arrival) of the scenario."""
    tenants = (requests.filter("tenant IS NOT NULL").select("request_id", "tenant").pl()
               .unique("request_id", keep="first"))
    if tenants.is_empty():  # most fleets: no block of the lake need be read
        return tenants, pl.DataFrame(schema={"request_id": pl.Utf8, "arrival_ns": pl.Int64,
                                             "block_hash": pl.UInt64, "block_tokens": pl.Int32,
                                             "block_size_tokens": pl.Int32, "tenant": pl.Utf8})
    blocks = (request_blocks.filter("block_tokens >= block_size_tokens")
              .select("request_id", "arrival_ns", "block_hash", "block_tokens", "block_size_tokens").pl()
              .join(tenants, on="request_id"))
    return tenants, blocks


def _cross_tenant(tenants: pl.DataFrame, blocks: pl.DataFrame, outcomes: pl.DataFrame,
                  bytes_per_token: int) -> list[dict[str, object]]:
    if blocks.is_empty():
        return []
    first = (blocks.sort("arrival_ns", "request_id").group_by("block_hash", maintain_order=True)
             .agg(owner=pl.col("tenant").first()))
    hits = (outcomes.filter(pl.col("outcome").cast(pl.Utf8).is_in(HIT_OUTCOMES))
            .join(tenants, on="request_id").join(first, on="block_hash")
            .filter(pl.col("owner") != pl.col("tenant")))
    out: list[dict[str, object]] = []
    for r in (hits.group_by("owner", "tenant").agg(blocks=pl.len(),
                                                    tokens=pl.col("tokens").cast(pl.Int64).sum(),
                                                    requests=pl.col("request_id").n_unique())
              .sort("owner", "tenant").iter_rows(named=True)):
        out.append({
            "finding": "cross_tenant_reuse", "severity": Severity.HIGH.value,
            "subject": f"{r['owner']} -> {r['tenant']}", "blocks": r["blocks"], "tokens": r["tokens"],
            "bytes": r["tokens"] * bytes_per_token, "requests": r["requests"],
            "detail": f"{r['blocks']:,} cache hits ({r['tokens']:,} tokens) in {r['requests']:,} requests of "
                      f"tenant {r['tenant']} were served from blocks first computed for tenant {r['owner']}: "
                      f"the tenants share cache keys; {_SALT_ADVICE}."})
    crossed = set(hits["block_hash"].to_list())
    shared = (blocks.filter(~pl.col("block_hash").is_in(list(crossed)))
              .group_by("block_hash").agg(tenants=pl.col("tenant").unique().sort(),
                                          tokens=pl.col("block_tokens").first().cast(pl.Int64),
                                          requests=pl.col("request_id").n_unique())
              .filter(pl.col("tenants").list.len() > 1)
              .with_columns(subject=pl.col("tenants").list.join(", ")))
    for r in (shared.group_by("subject").agg(blocks=pl.len(), tokens=pl.col("tokens").cast(pl.Int64).sum(),
                                             requests=pl.col("requests").sum())
              .sort("subject").iter_rows(named=True)):
        out.append({
            "finding": "cross_tenant_keys", "severity": Severity.MEDIUM.value, "subject": r["subject"],
            "blocks": r["blocks"], "tokens": r["tokens"], "bytes": r["tokens"] * bytes_per_token,
            "requests": r["requests"],
            "detail": f"{r['blocks']:,} block keys ({r['tokens']:,} tokens) were needed by tenants "
                      f"{r['subject']} ({r['requests']:,} requests), with no hit across tenants yet: their "
                      f"prompts map to the same cache keys; {_SALT_ADVICE}."})
    return out


def _cross_salt(events: pl.DataFrame) -> list[dict[str, object]]:
    salted = (events.filter(pl.col("extra_key").is_not_null())
              .group_by("block_hash").agg(salts=pl.col("extra_key").unique().sort())
              .filter(pl.col("salts").list.len() > 1))
    if salted.is_empty():
        return []
    salts = sorted({s for row in salted["salts"].to_list() for s in row})
    shown = ", ".join(salts[:5]) + (", ..." if len(salts) > 5 else "")
    return [{"finding": "cross_salt_keys", "severity": Severity.HIGH.value, "subject": shown,
             "blocks": salted.height,
             "detail": f"{salted.height} block keys were published with different extra keys (cache salts "
                       f"{shown}): the salt does not change the key, so salted tenants share KV; check the "
                       "engine's hashing of cache_salt."}]


def _name_diff(a: str, b: str) -> str:
    """The parts of two namespace names that differ, e.g. ``'sha256' vs 'sha256_cbor'``."""
    pa, pb = re.split(r"[|;,/ :@=]+", a), re.split(r"[|;,/ :@=]+", b)
    only_a = [p for p in pa if p not in pb]
    only_b = [p for p in pb if p not in pa]
    if not only_a and not only_b:
        return f"{a!r} vs {b!r}"
    return f"{' '.join(only_a) or '(nothing)'!r} vs {' '.join(only_b) or '(nothing)'!r}"


def _incompatible(outcomes: pl.DataFrame, request_blocks: duckdb.DuckDBPyRelation,
                  bytes_per_token: int) -> list[dict[str, object]]:
    missed = outcomes.filter((pl.col("outcome").cast(pl.Utf8) == Outcome.MISS_INCOMPATIBLE.value)
                             & pl.col("key_diff").is_not_null())
    if missed.is_empty():
        return []
    spaces = request_blocks.select("request_id", "position", "namespace").pl()
    missed = (missed.join(spaces, on=["request_id", "position"], how="left")
              .with_columns(pl.col("namespace").fill_null("(none)")))
    out: list[dict[str, object]] = []
    for r in (missed.group_by("namespace", "key_diff").agg(blocks=pl.len(),
                                                            tokens=pl.col("tokens").cast(pl.Int64).sum(),
                                                            requests=pl.col("request_id").n_unique())
              .sort("namespace", "key_diff").iter_rows(named=True)):
        out.append({
            "finding": "incompatible_keys", "severity": Severity.MEDIUM.value,
            "subject": f"{r['namespace']} vs {r['key_diff']}", "blocks": r["blocks"], "tokens": r["tokens"],
            "bytes": r["tokens"] * bytes_per_token, "requests": r["requests"],
            "detail": f"{r['blocks']:,} blocks ({r['tokens']:,} tokens, {r['requests']:,} requests) needed "
                      f"under namespace {r['namespace']} were recomputed although the same token content was "
                      f"stored under {r['key_diff']} (they differ in "
                      f"{_name_diff(r['namespace'], r['key_diff'])}); "
                      "if both serve the same model, align hash algorithm, seed, block size and revision."})
    return out


def _distinct_keys(rel: duckdb.DuckDBPyRelation, label: str) -> pl.DataFrame:
    """label, content_hash, block_hash: each distinct triple of ``rel`` with a content hash and a label."""
    return (rel.filter(f"content_hash IS NOT NULL AND {label} IS NOT NULL")
            .select(duckdb.ColumnExpression(label).cast(duckdb.sqltype("VARCHAR")).alias("label"),
                    "content_hash", "block_hash").distinct().pl())


def _keyed_apart(rel: duckdb.DuckDBPyRelation, label: str, what: str, scans: Scans, name: str,
                 source: str) -> list[dict[str, object]]:
    """``_different_keys`` of ``rel``'s labels. Only a content hash keyed to two block hashes can
    be one: the least and greatest block hash of each content hash are a lake aggregate that
    continues (``scans``: the next run reads only the new rows), and the distinct keys are read
    only when some content hash has two (none, in a fleet that keys alike)."""
    keyed = rel.filter(f"content_hash IS NOT NULL AND {label} IS NOT NULL")
    spread = scans.aggregate(name, source, keyed, ["content_hash"],
                             {"lo": ("min(block_hash)", "min"), "hi": ("max(block_hash)", "max")})
    apart = spread.filter(pl.col("lo") != pl.col("hi")).select("content_hash")
    if apart.is_empty():
        return []
    return _different_keys(_distinct_keys(rel, label).join(apart, on="content_hash", how="semi"), what)


def _different_keys(keys: pl.DataFrame, what: str) -> list[dict[str, object]]:
    """Pairs of ``label`` values that keyed the same ``content_hash`` to different block hashes
    (``keys``: ``_distinct_keys``)."""
    multi = keys.group_by("content_hash").agg(n=pl.col("block_hash").n_unique()).filter(pl.col("n") > 1)
    keys = keys.join(multi.select("content_hash"), on="content_hash")
    pairs = (keys.join(keys, on="content_hash", suffix="_b")
             .filter((pl.col("label") < pl.col("label_b")) & (pl.col("block_hash") != pl.col("block_hash_b")))
             .group_by("label", "label_b").agg(blocks=pl.col("content_hash").n_unique())
             .sort("label", "label_b"))
    return [{"finding": "same_content_different_keys", "severity": Severity.MEDIUM.value,
             "subject": f"{r['label']} vs {r['label_b']}", "blocks": r["blocks"],
             "detail": f"{what} {r['label']} and {r['label_b']} keyed {r['blocks']:,} blocks of identical "
                       "token content to different block hashes: hash algorithm, seed, model revision or "
                       "cache salt differ, so they can never share these blocks."}
            for r in pairs.iter_rows(named=True)]


def _block_sizes(request_blocks: duckdb.DuckDBPyRelation, stored: duckdb.DuckDBPyRelation,
                 scans: Scans) -> list[dict[str, object]]:
    router_sizes = sorted(scans.aggregate("isolation.router_sizes", "request_blocks",
                                          request_blocks.filter("block_size_tokens IS NOT NULL"),
                                          ["block_size_tokens"])["block_size_tokens"].to_list())
    counts = scans.aggregate("isolation.engine_sizes", "kv_events", stored.filter("block_tokens IS NOT NULL"),
                             ["replica", "block_tokens"], {"n": ("CAST(count(*) AS BIGINT)", "sum")})
    engine = (counts.group_by("replica").agg(sizes=pl.col("block_tokens").unique().sort(),
                                             blocks=pl.col("n").sum().cast(pl.UInt32))
              .sort("replica"))
    out: list[dict[str, object]] = []
    for r in engine.iter_rows(named=True):
        odd = [s for s in r["sizes"] if s not in router_sizes]
        if router_sizes and odd:
            out.append({
                "finding": "block_size_mismatch", "severity": Severity.HIGH.value, "subject": r["replica"],
                "blocks": r["blocks"],
                "detail": f"replica {r['replica']} stored {r['blocks']:,} blocks of "
                          f"{', '.join(map(str, r['sizes']))} tokens, but the router keys prompts in "
                          f"blocks of {', '.join(map(str, router_sizes))} tokens: none of its keys can match "
                          "the router's; configure one block size."})
    all_sizes = sorted({s for row in engine["sizes"].to_list() for s in row})
    if len(all_sizes) > 1:
        holders = {s: ", ".join(engine.filter(pl.col("sizes").list.contains(s))["replica"].cast(pl.Utf8))
                   for s in all_sizes}
        by_size = [f"{s} ({holders[s]})" for s in all_sizes]
        out.append({
            "finding": "engine_block_size_mismatch", "severity": Severity.MEDIUM.value,
            "subject": ", ".join(engine["replica"].cast(pl.Utf8).to_list()),
            "blocks": int(engine["blocks"].sum()),
            "detail": f"replicas store blocks of different sizes, tokens (replicas): {'; '.join(by_size)}: "
                      "replicas of different block sizes cannot share keys."})
    return out


def isolation_findings(
    *,
    requests: duckdb.DuckDBPyRelation,
    request_blocks: duckdb.DuckDBPyRelation,
    kv_events: duckdb.DuckDBPyRelation,
    block_outcomes: pl.DataFrame,
    scenario: str,
    bytes_per_token: int,
    scans: Scans | None = None,
) -> pl.DataFrame:
    """Isolation and compatibility findings of ``scenario``, from its rows (see the module docstring).

    Columns: scenario, finding, subject (tenants, replicas or namespaces involved), blocks
    (blocks or block keys involved), detail (the finding in words, with numbers), severity
    (kvlens.schema.Severity: high, medium, low), tokens and bytes (tokens x
    ``bytes_per_token``) when the finding is about needed blocks, requests (requests involved,
    when known). Sorted by severity (high first), finding, blocks (most first), subject.
    ``scans``: continues the block sizes and salts from the previous run's (analyzers/scans.py).
    """
    scans = scans or Scans({"kv_events": (kv_events, "ts_ns"),
                            "request_blocks": (request_blocks, "arrival_ns")})
    # Each finding reads only the rows it can be about, filtered and reduced in DuckDB: a fleet's
    # lake is read as counts and distinct keys, not as frames of every block and event.
    tenants, tblocks = _tenant_blocks(requests, request_blocks)
    stored = kv_events.filter("kind = 'stored'")
    rows = [
        *_cross_tenant(tenants, tblocks, block_outcomes, bytes_per_token),
        *_cross_salt(scans.aggregate("isolation.salts", "kv_events", stored.filter("extra_key IS NOT NULL"),
                                     ["block_hash", "extra_key"])),
        *_incompatible(block_outcomes, request_blocks, bytes_per_token),
        *_keyed_apart(stored, "replica", "replicas", scans, "isolation.replica_keys", "kv_events"),
        *_keyed_apart(request_blocks, "namespace", "namespaces", scans, "isolation.namespace_keys",
                      "request_blocks"),
        *_block_sizes(request_blocks, stored, scans),
    ]
    return (_rows(rows).with_columns(scenario=pl.lit(scenario))
            .with_columns(rank=pl.col("severity").replace_strict(_SEVERITY_ORDER, return_dtype=pl.Int8))
            .sort(["rank", "finding", "blocks", "subject"], descending=[False, False, True, False])
            .select(list(_SCHEMA)))
