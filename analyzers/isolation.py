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

import math
import re
from pathlib import Path

import duckdb
import polars as pl

from kvlens.analyzers.scans import Scans
from kvlens.schema import HIT_OUTCOMES, Outcome, Severity

__all__ = ["isolation_findings", "isolation_findings_out_of_core"]

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
    reuse = hits.group_by("owner", "tenant").agg(blocks=pl.len(),
                                                 tokens=pl.col("tokens").cast(pl.Int64).sum(),
                                                 requests=pl.col("request_id").n_unique())
    crossed = set(hits["block_hash"].to_list())
    shared = (blocks.filter(~pl.col("block_hash").is_in(list(crossed)))
              .group_by("block_hash").agg(tenants=pl.col("tenant").unique().sort(),
                                          tokens=pl.col("block_tokens").first().cast(pl.Int64),
                                          requests=pl.col("request_id").n_unique())
              .filter(pl.col("tenants").list.len() > 1)
              .with_columns(subject=pl.col("tenants").list.join(", ")))
    keys = shared.group_by("subject").agg(blocks=pl.len(), tokens=pl.col("tokens").cast(pl.Int64).sum(),
                                          requests=pl.col("requests").sum())
    return _tenant_rows(reuse, keys, bytes_per_token)


def _tenant_rows(reuse: pl.DataFrame, keys: pl.DataFrame, bytes_per_token: int) -> list[dict[str, object]]:
    """The cross-tenant findings: ``reuse`` (owner, tenant: blocks, tokens, requests of the hits
    across them) and ``keys`` (subject: blocks, tokens, requests of the keys several tenants need
    with no such hit)."""
    out: list[dict[str, object]] = []
    for r in reuse.sort("owner", "tenant").iter_rows(named=True):
        out.append({
            "finding": "cross_tenant_reuse", "severity": Severity.HIGH.value,
            "subject": f"{r['owner']} -> {r['tenant']}", "blocks": r["blocks"], "tokens": r["tokens"],
            "bytes": r["tokens"] * bytes_per_token, "requests": r["requests"],
            "detail": f"{r['blocks']:,} cache hits ({r['tokens']:,} tokens) in {r['requests']:,} requests of "
                      f"tenant {r['tenant']} were served from blocks first computed for tenant {r['owner']}: "
                      f"the tenants share cache keys; {_SALT_ADVICE}."})
    for r in keys.sort("subject").iter_rows(named=True):
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
    return _salt_rows(salted.height, sorted({s for row in salted["salts"].to_list() for s in row}))


def _salt_rows(keys: int, salts: list[str]) -> list[dict[str, object]]:
    """The cross-salt finding of ``keys`` block keys published under several of ``salts`` (sorted;
    the first six are enough)."""
    shown = ", ".join(salts[:5]) + (", ..." if len(salts) > 5 else "")
    return [{"finding": "cross_salt_keys", "severity": Severity.HIGH.value, "subject": shown,
             "blocks": keys,
             "detail": f"{keys} block keys were published with different extra keys (cache salts "
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
    return _incompatible_rows(missed.group_by("namespace", "key_diff").agg(
        blocks=pl.len(), tokens=pl.col("tokens").cast(pl.Int64).sum(),
        requests=pl.col("request_id").n_unique()), bytes_per_token)


def _incompatible_rows(groups: pl.DataFrame, bytes_per_token: int) -> list[dict[str, object]]:
    """The incompatible-keys findings of ``groups`` (namespace, key_diff: blocks, tokens, requests)."""
    out: list[dict[str, object]] = []
    for r in groups.sort("namespace", "key_diff").iter_rows(named=True):
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
    return _keyed_rows(_key_pairs(keys), what)


def _key_pairs(keys: pl.DataFrame) -> pl.DataFrame:
    """label, label_b, blocks: the content hashes of ``keys`` (``_distinct_keys``) each pair of
    labels keyed to different block hashes (a sum over disjoint sets of content hashes)."""
    multi = keys.group_by("content_hash").agg(n=pl.col("block_hash").n_unique()).filter(pl.col("n") > 1)
    keys = keys.join(multi.select("content_hash"), on="content_hash")
    return (keys.join(keys, on="content_hash", suffix="_b")
            .filter((pl.col("label") < pl.col("label_b")) & (pl.col("block_hash") != pl.col("block_hash_b")))
            .group_by("label", "label_b").agg(blocks=pl.col("content_hash").n_unique()))


def _keyed_rows(pairs: pl.DataFrame, what: str) -> list[dict[str, object]]:
    """The same-content findings of ``pairs`` (``_key_pairs``) of ``what`` (replicas, namespaces)."""
    return [{"finding": "same_content_different_keys", "severity": Severity.MEDIUM.value,
             "subject": f"{r['label']} vs {r['label_b']}", "blocks": r["blocks"],
             "detail": f"{what} {r['label']} and {r['label_b']} keyed {r['blocks']:,} blocks of identical "
                       "token content to different block hashes: hash algorithm, seed, model revision or "
                       "cache salt differ, so they can never share these blocks."}
            for r in pairs.sort("label", "label_b").iter_rows(named=True)]


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
    return _findings(rows, scenario)


def _findings(rows: list[dict[str, object]], scenario: str) -> pl.DataFrame:
    """The findings' frame, sorted by severity, finding, blocks (most first), subject."""
    return (_rows(rows).with_columns(scenario=pl.lit(scenario))
            .with_columns(rank=pl.col("severity").replace_strict(_SEVERITY_ORDER, return_dtype=pl.Int8))
            .sort(["rank", "finding", "blocks", "subject"], descending=[False, False, True, False])
            .select(list(_SCHEMA)))


# Out of core: the rows of one partition of content hashes' keys in memory at once (their pairs).
_ROWS_PER_PARTITION = 2_000_000


def isolation_findings_out_of_core(con: duckdb.DuckDBPyConnection, scenario: str, *, work: Path,
                                   partitions: int, bytes_per_token: int) -> pl.DataFrame:
    """``isolation_findings``' rows of ``scenario``, out of core (``kvlens analyze --out-of-core``,
    issue 17): from the lake views on ``con`` and the ``block_outcomes`` rows in its analysis DB,
    every finding reduced by DuckDB (it spills past its memory limit) to the few rows it names.

    - cross-tenant: each key's first tenant (its earliest full block, by arrival then request),
      the hits of other tenants and the keys several tenants need, grouped in SQL; the tokens of
      a key needed by several tenants are those of its least full block where ``isolation_findings``
      takes any one (a key's full blocks are of one size);
    - cross-salt: the keys stored under several extra keys, counted, and the first six salts;
    - incompatible keys: the ``miss_incompatible`` outcomes by namespace and key_diff;
    - same content, different keys: the distinct (label, content hash, block hash) of the content
      hashes keyed to two block hashes or more, written in partitions by content hash and given to
      ``_key_pairs`` one at a time (a content hash is in one partition: the counts add up);
    - block sizes: ``_block_sizes`` itself (its aggregates are DuckDB's and small).

    Exact: the rows ``isolation_findings`` gives (tests/test_ooc_warmup.py); the integers are SQL
    counts and sums. Memory in Python: the findings' groups (tenant pairs, replicas, namespaces)
    and one partition of the keyed-apart keys (their pairs about ``_ROWS_PER_PARTITION`` rows at
    most, unless one content hash alone has more; ``partitions`` of them at least where there are
    as many keys). ``work``: a directory for the
    spill files.
    """
    def rows_of(table: str) -> duckdb.DuckDBPyRelation:
        scoped = duckdb.ColumnExpression("scenario") == duckdb.ConstantExpression(scenario)
        return con.table(table).filter(scoped)

    request_blocks, kv_events = rows_of("request_blocks"), rows_of("kv_events")
    scans = Scans({"kv_events": (kv_events, "ts_ns"), "request_blocks": (request_blocks, "arrival_ns")})
    stored = kv_events.filter("kind = 'stored'")
    q = _quoted(scenario)
    rows = [
        *_tenants_out_of_core(con, q, bytes_per_token, work),
        *_salts_out_of_core(con, q),
        *_incompatible_out_of_core(con, q, bytes_per_token),
        *_keyed_apart_out_of_core(con, stored, "replica", "replicas", work / "replica_keys", partitions),
        *_keyed_apart_out_of_core(con, request_blocks, "namespace", "namespaces", work / "namespace_keys",
                                  partitions),
        *_block_sizes(request_blocks, stored, scans),
    ]
    return _findings(rows, scenario)


def _tenants_out_of_core(con: duckdb.DuckDBPyConnection, q: str, bytes_per_token: int, work: Path
                         ) -> list[dict[str, object]]:
    """``_cross_tenant`` in SQL over the scenario (``q``, quoted) of ``con``: each key's first
    tenant and the hits across tenants are written to ``work`` once, then grouped."""
    ((tenanted,),) = con.execute(
        f"SELECT count(*) FROM requests WHERE scenario = {q} AND tenant IS NOT NULL").fetchall()
    if not tenanted:  # most fleets: no block of the lake need be read
        return []
    outcome_in = ", ".join("'" + o + "'" for o in HIT_OUTCOMES)
    first, hits = (_quoted(str(work / name)) for name in ("tenant_first.parquet", "tenant_hits.parquet"))
    tenants = f"(SELECT request_id, tenant FROM requests WHERE scenario = {q} AND tenant IS NOT NULL)"
    blocks = f"""(SELECT b.request_id, b.arrival_ns, b.block_hash, b.block_tokens, t.tenant
                  FROM request_blocks b JOIN {tenants} t USING (request_id)
                  WHERE b.scenario = {q} AND b.block_tokens >= b.block_size_tokens)"""
    con.execute(f"""COPY (SELECT block_hash, tenant AS owner FROM {blocks}
                          QUALIFY row_number() OVER (PARTITION BY block_hash
                                                     ORDER BY arrival_ns NULLS FIRST, request_id) = 1)
                    TO {first} (FORMAT parquet)""")
    con.execute(f"""COPY (SELECT o.request_id, o.block_hash, o.tokens, t.tenant, f.owner
                          FROM block_outcomes o JOIN {tenants} t USING (request_id)
                            JOIN {first} f USING (block_hash)
                          WHERE o.scenario = {q} AND CAST(o.outcome AS VARCHAR) IN ({outcome_in})
                            AND f.owner <> t.tenant)
                    TO {hits} (FORMAT parquet)""")
    reuse = con.sql(f"""
        SELECT owner, tenant, count(*) AS blocks, CAST(sum(tokens) AS BIGINT) AS tokens,
               count(DISTINCT request_id) AS requests
        FROM {hits} GROUP BY owner, tenant""").pl()
    keys = con.sql(f"""
        WITH shared AS (SELECT block_hash, array_to_string(list_sort(list(DISTINCT tenant)), ', ') AS subject,
                               min(block_tokens) AS tokens, count(DISTINCT request_id) AS requests
                        FROM {blocks} b
                          ANTI JOIN (SELECT DISTINCT block_hash FROM {hits}) h USING (block_hash)
                        GROUP BY block_hash HAVING count(DISTINCT tenant) > 1)
        SELECT subject, count(*) AS blocks, CAST(sum(tokens) AS BIGINT) AS tokens,
               CAST(sum(requests) AS BIGINT) AS requests
        FROM shared GROUP BY subject""").pl()
    return _tenant_rows(reuse, keys, bytes_per_token)


def _salts_out_of_core(con: duckdb.DuckDBPyConnection, q: str) -> list[dict[str, object]]:
    """``_cross_salt`` in SQL: the count of keys stored under several salts, and their first six
    salts (all ``_salt_rows`` shows)."""
    salted = f"""(SELECT block_hash FROM kv_events
                  WHERE scenario = {q} AND kind = 'stored' AND extra_key IS NOT NULL
                  GROUP BY block_hash HAVING count(DISTINCT extra_key) > 1)"""
    ((keys,),) = con.execute(f"SELECT count(*) FROM {salted}").fetchall()
    if not keys:
        return []
    salts = con.execute(f"""SELECT DISTINCT extra_key FROM kv_events SEMI JOIN {salted} s USING (block_hash)
                            WHERE scenario = {q} AND kind = 'stored' AND extra_key IS NOT NULL
                            ORDER BY extra_key LIMIT 6""").fetchall()
    return _salt_rows(keys, [s for (s,) in salts])


def _incompatible_out_of_core(con: duckdb.DuckDBPyConnection, q: str, bytes_per_token: int
                              ) -> list[dict[str, object]]:
    """``_incompatible`` in SQL: the ``miss_incompatible`` outcomes grouped by namespace, key_diff."""
    groups = con.sql(f"""
        SELECT coalesce(b.namespace, '(none)') AS namespace, o.key_diff, count(*) AS blocks,
               CAST(sum(o.tokens) AS BIGINT) AS tokens, count(DISTINCT o.request_id) AS requests
        FROM block_outcomes o LEFT JOIN request_blocks b
          ON b.scenario = {q} AND b.request_id = o.request_id AND b.position = o.position
        WHERE o.scenario = {q} AND CAST(o.outcome AS VARCHAR) = '{Outcome.MISS_INCOMPATIBLE.value}'
          AND o.key_diff IS NOT NULL
        GROUP BY ALL""").pl()
    return _incompatible_rows(groups, bytes_per_token) if groups.height else []


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _keyed_apart_out_of_core(con: duckdb.DuckDBPyConnection, rel: duckdb.DuckDBPyRelation, label: str,
                             what: str, spill: Path, partitions: int) -> list[dict[str, object]]:
    """``_keyed_apart`` of ``rel``'s labels: the content hashes keyed to two block hashes or more
    found in SQL; their distinct keys written by content hash to ``spill`` and paired one partition
    at a time."""
    keyed = rel.filter(f"content_hash IS NOT NULL AND {label} IS NOT NULL")
    apart = keyed.aggregate("content_hash, min(block_hash) AS lo, max(block_hash) AS hi", "content_hash") \
        .filter("lo <> hi").select("content_hash").set_alias("apart")
    keys = (keyed.set_alias("keyed").join(apart, "content_hash", how="semi")
            .select(duckdb.ColumnExpression(label).cast(duckdb.sqltype("VARCHAR")).alias("label"),
                    "content_hash", "block_hash").distinct())
    # A content hash's m keys pair into m * m rows: a partition holds about _ROWS_PER_PARTITION
    ((rows, most),) = keys.aggregate("content_hash, count(*) AS m", "content_hash").aggregate(
        "CAST(coalesce(sum(m), 0) AS BIGINT), coalesce(max(m), 0)").fetchall()
    if not rows:
        return []
    k = max(math.ceil(rows * most / _ROWS_PER_PARTITION), min(partitions, rows))
    keys.project(f"*, content_hash % {k} AS p").write_parquet(str(spill), partition_by=["p"])
    pairs = [_key_pairs(pl.read_parquet(part / "*.parquet", hive_partitioning=False))
             for part in sorted(spill.glob("p=*"))]
    return _keyed_rows(pl.concat(pairs).group_by("label", "label_b").agg(pl.col("blocks").sum()), what)
