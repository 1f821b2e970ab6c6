"""The spine's contract: every lake and analysis table, declared once.

The lake writer, the DuckDB views, the generated docs page (docs/schema.md) and the tests
all read these declarations. Names carry units (``_ns``, ``_ms``, ``_bytes``, ``_tokens``,
``_blocks``, ``_ratio``); times are int64 nanoseconds since the Unix epoch (UTC); block
hashes are UBIGINT. Closed vocabularies are StrEnums mirrored as DuckDB ENUM types.

Lake tables are partitioned ``<table>/scenario=NAME/date=YYYY-MM-DD/``: ``scenario`` lives
in the path, not in the Parquet file, and comes back as a column through the views.
"""

from __future__ import annotations

import builtins
import enum
from dataclasses import dataclass

import pyarrow as pa

__all__ = [
    "ANALYSIS_TABLES",
    "ENUMS",
    "HIT_OUTCOMES",
    "HIT_OUTCOMES_SQL",
    "LAKE_TABLES",
    "SCHEMA_VERSION",
    "TABLES",
    "Column",
    "EventKind",
    "Medium",
    "Outcome",
    "RoutingPolicy",
    "Severity",
    "Table",
    "TransferStatus",
    "arrow_schema",
    "render_markdown",
]

SCHEMA_VERSION = 1


class EventKind(enum.StrEnum):
    """What a KV-cache event did to a block."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    INACTIVE = "inactive"  # newer vLLM's BlockInactive: still cached, no request references it


class Medium(enum.StrEnum):
    """The tier a block lives in (vLLM GPU/CPU/STORAGE, SGLang GPU/CPU_PINNED/DISK/EXTERNAL)."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
    POOL = "pool"
    UNKNOWN = "unknown"


class Outcome(enum.StrEnum):
    """One outcome per needed full block, decided in this order (DESIGN.md section 1).

    ``miss_group``: resident, with its whole prefix, in the full-attention KV cache group(s), but
    the request's hit was cut short before it by another group (a sliding window, vLLM's hybrid
    KV-cache manager). ``unobserved``: no KV events came from the serving replica, so whether the
    block was resident is unknown: neither a hit nor a miss (``reusable`` says whether an unbounded
    cache could have served it).
    """

    HIT_LOCAL = "hit_local"
    HIT_OFFLOAD = "hit_offload"
    HIT_REMOTE = "hit_remote"
    RECOMPUTED_LAST = "recomputed_last"
    MISS_GROUP = "miss_group"
    MISS_LOAD_FAILED = "miss_load_failed"
    MISS_AFTER_GAP = "miss_after_gap"
    MISS_ROUTING = "miss_routing"
    MISS_EVICTED = "miss_evicted"
    MISS_INCOMPATIBLE = "miss_incompatible"
    MISS_COLD = "miss_cold"
    UNOBSERVED = "unobserved"


# The outcomes that are hits; every other outcome is recomputed (DESIGN.md section 1).
HIT_OUTCOMES: tuple[str, ...] = (Outcome.HIT_LOCAL.value, Outcome.HIT_OFFLOAD.value, Outcome.HIT_REMOTE.value)
# The same, as an SQL list: `outcome IN ('hit_local', ...)`.
HIT_OUTCOMES_SQL = "(" + ", ".join(f"'{o}'" for o in HIT_OUTCOMES) + ")"


class TransferStatus(enum.StrEnum):
    OK = "ok"
    TIMEOUT = "timeout"
    ERROR = "error"
    INCOMPATIBLE = "incompatible"


class RoutingPolicy(enum.StrEnum):
    RECORDED = "recorded"  # each request stays on the replica it was recorded on (a what-if's baseline)
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    SESSION_AFFINITY = "session_affinity"
    PREFIX_HASH = "prefix_hash"
    CACHE_AWARE = "cache_aware"


class Severity(enum.StrEnum):
    """How urgent an isolation finding is (isolation_findings.severity, stored as VARCHAR)."""

    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"


# DuckDB ENUM type name -> the StrEnum it mirrors.
ENUMS: dict[str, type[enum.StrEnum]] = {
    "event_kind": EventKind,
    "medium": Medium,
    "outcome": Outcome,
    "transfer_status": TransferStatus,
    "routing_policy": RoutingPolicy,
}


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # a DuckDB type, or the name of one of ENUMS
    doc: str
    unit: str = ""

    @property
    def enum(self) -> builtins.type[enum.StrEnum] | None:  # `type` is a field name here
        return ENUMS.get(self.type)


@dataclass(frozen=True)
class Table:
    name: str
    kind: str  # "lake" (sources and the simulator write it) or "analysis" (kvlens analyze)
    doc: str
    columns: tuple[Column, ...]
    time_column: str | None = None  # its date partitions a lake table

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"{self.name} has no column {name!r}")

    @property
    def file_columns(self) -> tuple[Column, ...]:
        """Columns stored inside a lake segment (scenario lives in the partition path)."""
        return tuple(c for c in self.columns if c.name != "scenario")


def _c(name: str, type_: str, doc: str, unit: str = "") -> Column:
    return Column(name, type_, doc, unit)


_SCENARIO = _c("scenario", "VARCHAR", "where the rows came from: `live`, an import name, or a what-if")

KV_EVENTS = Table("kv_events", "lake", "One row per block hash per KV-cache event.", (
    _c("ts_ns", "BIGINT", "event time as the engine stamped it", "ns"),
    _c("recv_ns", "BIGINT", "time the collector received the batch", "ns"),
    _SCENARIO,
    _c("replica", "VARCHAR", "serving replica (engine instance) that emitted the event"),
    _c("dp_rank", "INTEGER", "data-parallel rank within the replica, when reported"),
    _c("seq", "UBIGINT", "publisher's batch sequence number"),
    _c("kind", "event_kind", "stored, removed, cleared (a cleared row has no block) or inactive (still "
       "cached, no request references it)"),
    _c("block_hash", "UBIGINT", "engine block hash, normalised to unsigned 64-bit"),
    _c("parent_hash", "UBIGINT", "hash of the previous block in the chain; NULL for a root"),
    _c("position", "INTEGER", "block index in its chain when known", "blocks"),
    _c("block_tokens", "INTEGER", "tokens in the block", "tokens"),
    _c("medium", "medium", "tier the block lives in"),
    _c("group_idx", "INTEGER", "KV cache group (hybrid models)"),
    _c("spec_kind", "VARCHAR", "KV cache spec kind of the group, when reported"),
    _c("sliding_window_tokens", "INTEGER", "sliding window of the group's KV cache spec, when reported",
       "tokens"),
    _c("remaining_copies", "INTEGER", "for a removal: physical copies of the block the engine still holds "
       "(vLLM remaining_copy_counts), when reported; NULL: one copy of possibly several went", "blocks"),
    _c("lora_name", "VARCHAR", "LoRA adapter the block was computed under"),
    _c("extra_key", "VARCHAR", "other hash inputs (cache salt, multimodal ids), as published"),
    _c("content_hash", "UBIGINT", "chained hash of the block's token ids alone (no extra keys, no model)"),
    _c("namespace", "VARCHAR", "cache-key namespace: model, revision, LoRA, salt, block size, algo"),
    _c("session_id", "VARCHAR", "conversation or session, when known"),
    _c("locality", "VARCHAR", "where the publisher runs (node, zone), when known"),
    _c("token_ids", "INTEGER[]", "the block's token ids; NULL unless collected with --keep-tokens"),
), time_column="ts_ns")

REQUESTS = Table("requests", "lake", "One row per request.", (
    _c("request_id", "VARCHAR", "request id as the source gave it"),
    _SCENARIO,
    _c("arrival_ns", "BIGINT", "arrival at the serving replica (or gateway)", "ns"),
    _c("first_token_ns", "BIGINT", "first output token", "ns"),
    _c("end_ns", "BIGINT", "last output token", "ns"),
    _c("replica", "VARCHAR", "replica that served it; NULL when the source does not say"),
    _c("model", "VARCHAR", "model name"),
    _c("tenant", "VARCHAR", "tenant (as given, or hashed with --hash-tenants)"),
    _c("session_id", "VARCHAR", "conversation or session"),
    _c("prompt_tokens", "INTEGER", "prompt length", "tokens"),
    _c("output_tokens", "INTEGER", "generated length", "tokens"),
    _c("cached_tokens", "INTEGER", "prefix-cache hit tokens as the engine reported", "tokens"),
    _c("ttft_ms", "DOUBLE", "time to first token", "ms"),
    _c("queue_ms", "DOUBLE", "time in queue", "ms"),
    _c("prefill_ms", "DOUBLE", "time in prefill", "ms"),
    _c("source", "VARCHAR", "format the row came from (mooncake, bailian, gateway, otlp, sim, ...)"),
    _c("cached_device_tokens", "INTEGER", "of cached_tokens, served from the GPU, when the engine says "
       "(SGLang cached_tokens_details.device)", "tokens"),
    _c("cached_host_tokens", "INTEGER", "of cached_tokens, loaded from host memory, when the engine says "
       "(SGLang cached_tokens_details.host)", "tokens"),
    _c("cached_storage_tokens", "INTEGER", "of cached_tokens, loaded from storage or a shared pool, when the "
       "engine says (SGLang cached_tokens_details.storage: its L3)", "tokens"),
), time_column="arrival_ns")

REQUEST_BLOCKS = Table("request_blocks", "lake", "One row per block a request's prompt needs.", (
    _c("request_id", "VARCHAR", "the request"),
    _SCENARIO,
    _c("arrival_ns", "BIGINT", "the request's arrival (orders the access stream)", "ns"),
    _c("position", "INTEGER", "block index in the prompt, from 0", "blocks"),
    _c("block_hash", "UBIGINT", "prefix-chained block key"),
    _c("content_hash", "UBIGINT", "chained hash of token content alone, when known"),
    _c("token_hash", "UBIGINT", "hash of the block's own token ids alone, not chained; NULL unless token "
       "ids were known (prompt hygiene)"),
    _c("block_tokens", "INTEGER", "tokens in the block; fewer than block_size_tokens for a partial tail",
       "tokens"),
    _c("block_size_tokens", "INTEGER", "the cache's block size; only full blocks can be reused", "tokens"),
    _c("namespace", "VARCHAR", "cache-key namespace the key was computed in"),
    _c("token_ids", "INTEGER[]", "the block's token ids; NULL unless kvlens gateway ran with --keep-tokens"),
), time_column="arrival_ns")

TRANSFERS = Table("transfers", "lake", "One row per KV load or store between tiers, replicas or the pool.", (
    _c("request_id", "VARCHAR", "request the transfer served"),
    _SCENARIO,
    _c("ts_ns", "BIGINT", "start of the transfer", "ns"),
    _c("replica", "VARCHAR", "replica that received the bytes"),
    _c("origin", "VARCHAR", "where they came from: a replica name, `pool`, or a tier"),
    _c("block_hash", "UBIGINT", "block moved; NULL when only a count is known"),
    _c("blocks", "INTEGER", "blocks moved", "blocks"),
    _c("bytes", "BIGINT", "bytes moved", "bytes"),
    _c("duration_ms", "DOUBLE", "transfer time", "ms"),
    _c("status", "transfer_status", "ok, timeout, error, incompatible"),
), time_column="ts_ns")

METRIC_SAMPLES = Table("metric_samples", "lake", "One row per scraped Prometheus sample.", (
    _c("ts_ns", "BIGINT", "scrape time", "ns"),
    _SCENARIO,
    _c("replica", "VARCHAR", "replica scraped"),
    _c("name", "VARCHAR", "metric name, as exposed"),
    _c("labels", "MAP(VARCHAR, VARCHAR)", "label set"),
    _c("value", "DOUBLE", "sample value"),
), time_column="ts_ns")

PROBE_RUNS = Table("probe_runs", "lake", "One row per GPU-probe measurement.", (
    _c("run_id", "VARCHAR", "one probe invocation"),
    _SCENARIO,
    _c("ts_ns", "BIGINT", "measurement time", "ns"),
    _c("device", "VARCHAR", "device name"),
    _c("path", "VARCHAR", "what was measured: h2d_pinned, prefill, ..."),
    _c("model", "VARCHAR", "model geometry used"),
    _c("prefix_tokens", "INTEGER", "prefix length", "tokens"),
    _c("kv_bytes", "BIGINT", "KV bytes of that prefix", "bytes"),
    _c("ms", "DOUBLE", "median time", "ms"),
    _c("gbps", "DOUBLE", "achieved bandwidth", "GB/s"),
    _c("byte_exact", "BOOLEAN", "destination equals source byte for byte"),
    _c("source", "VARCHAR", "gpu, cpu or model"),
), time_column="ts_ns")

SIMULATIONS = Table("simulations", "lake",
                    "One row per what-if written by kvlens simulate: what its modelled figures assume.", (
    _c("created_ns", "BIGINT", "when kvlens simulate wrote it (wall clock)", "ns"),
    _SCENARIO,
    _c("engine", "VARCHAR", "vllm (block pool + continuous batching) or lru"),
    _c("replicas", "INTEGER", "replicas simulated"),
    _c("routing", "routing_policy", "routing policy"),
    _c("load_factor", "DOUBLE", "load fallback factor K; NULL without fallback"),
    _c("gpu_blocks", "INTEGER", "KV blocks per replica as vLLM counts --num-gpu-blocks-override; NULL for "
       "an unbounded or lru cache", "blocks"),
    _c("capacity_tokens", "BIGINT", "lru: cached tokens per replica; NULL: unbounded", "tokens"),
    _c("pool_tokens", "BIGINT", "shared pool, in tokens; NULL: none", "tokens"),
    _c("max_seqs", "INTEGER", "running sequences per replica"),
    _c("max_batched_tokens", "INTEGER", "vllm: tokens per scheduler step", "tokens"),
    _c("rate_scale", "DOUBLE", "arrivals replayed this many times denser", "ratio"),
    _c("model", "VARCHAR", "model geometry the bytes and step times use"),
    _c("step_model", "VARCHAR", "how times were modelled (device, efficiency, probe fit or calibration)"),
    _c("assumptions", "VARCHAR", "all of it in words, as the report and dashboard print it"),
), time_column="created_ns")

_OUTCOME_KEY = (_SCENARIO, _c("replica", "VARCHAR", "serving replica"))

SCENARIOS = Table("scenarios", "analysis", "One row per analyzed scenario: what it was measured with.", (
    _SCENARIO,
    _c("model", "VARCHAR", "model geometry the bytes were computed with"),
    _c("kv_bytes_per_token", "BIGINT", "KV bytes per token of that model", "bytes"),
    _c("requests", "BIGINT", "requests in the scenario"),
    _c("needed_blocks", "BIGINT", "full blocks needed", "blocks"),
    _c("analyzed_ns", "BIGINT", "when kvlens analyze ran", "ns"),
    _c("model_source", "VARCHAR", "where the geometry came from: `given` (--model, --model-config), "
       "`requests` (the requests' model), or `default` (assumed: no model known)"),
    _c("provenance", "VARCHAR", "`simulated` (kvlens simulate wrote its requests: every figure modelled) or "
       "`measured` (recorded by sources outside kvlens)"),
    _c("sources", "VARCHAR", "formats its requests came from (requests.source), comma-separated"),
    _c("ttft_label", "VARCHAR", "its TTFT figures: `measured`, `modelled`, or NULL when it has none"),
    _c("assumptions", "VARCHAR", "what its modelled figures assume, in words; NULL when nothing is modelled"),
))

BLOCK_OUTCOMES = Table("block_outcomes", "analysis", "One outcome per needed full block per request.", (
    _SCENARIO,
    _c("request_id", "VARCHAR", "the request"),
    _c("replica", "VARCHAR", "serving replica"),
    _c("arrival_ns", "BIGINT", "the request's arrival", "ns"),
    _c("position", "INTEGER", "block index in the prompt", "blocks"),
    _c("block_hash", "UBIGINT", "block key"),
    _c("outcome", "outcome", "hit or miss cause"),
    _c("tokens", "INTEGER", "tokens of the block", "tokens"),
    _c("bytes", "BIGINT", "KV bytes of the block", "bytes"),
    _c("holder", "VARCHAR", "for miss_routing: a replica (or `pool`) that held it"),
    _c("removed_ns", "BIGINT", "for miss_evicted: when it was last removed", "ns"),
    _c("remover", "VARCHAR", "for miss_evicted: where it was removed from"),
    _c("key_diff", "VARCHAR", "for miss_incompatible: the namespace it was stored under"),
    _c("cut_group", "INTEGER", "for miss_group: the KV cache group (group_idx) that cut the hit short"),
    _c("reusable", "BOOLEAN", "an earlier request of the scenario needed the same block: an unbounded "
       "cache could have served it"),
    _c("origin", "VARCHAR", "for a hit: where it was served from: gpu, cpu, disk, pool, or the replica a "
       "transfer came from"),
))

MISS_LEDGER = Table("miss_ledger", "analysis", "Blocks, tokens and bytes per outcome per replica.", (
    *_OUTCOME_KEY,
    _c("outcome", "outcome", "hit or miss cause"),
    _c("blocks", "BIGINT", "blocks", "blocks"),
    _c("tokens", "BIGINT", "tokens", "tokens"),
    _c("bytes", "BIGINT", "KV bytes", "bytes"),
    _c("events_incomplete", "BOOLEAN", "some of these blocks belong to requests with events_incomplete "
       "(request_ledger): the collector lost KV events of their replica that its replay could not fill"),
))

REQUEST_LEDGER = Table("request_ledger", "analysis",
                       "Per request: prompt tokens split by what the ledger found.", (
    *_OUTCOME_KEY,
    _c("request_id", "VARCHAR", "the request"),
    _c("arrival_ns", "BIGINT", "arrival", "ns"),
    _c("prompt_tokens", "BIGINT", "prompt length", "tokens"),
    _c("hit_tokens", "BIGINT", "tokens of hit_local, hit_offload and hit_remote blocks", "tokens"),
    _c("recomputed_last_tokens", "BIGINT", "the block given back by the one-computed-token rule", "tokens"),
    _c("miss_tokens", "BIGINT", "tokens of blocks with a miss outcome", "tokens"),
    _c("tail_partial_tokens", "BIGINT", "tokens of the final, not-full block: recomputed by definition",
       "tokens"),
    _c("unobserved_tokens", "BIGINT", "tokens of unobserved blocks: no KV events from the replica, "
       "residency unknown", "tokens"),
    _c("reusable_tokens", "BIGINT", "tokens of blocks an earlier request needed: what an unbounded cache "
       "could have served", "tokens"),
    _c("device_hit_tokens", "BIGINT", "of hit_tokens, served from the serving replica's GPU", "tokens"),
    _c("host_hit_tokens", "BIGINT", "of hit_tokens, loaded from its CPU tier", "tokens"),
    _c("disk_hit_tokens", "BIGINT", "of hit_tokens, loaded from its disk tier", "tokens"),
    _c("remote_hit_tokens", "BIGINT", "of hit_tokens, loaded from the shared pool or another replica",
       "tokens"),
    _c("cached_tokens", "BIGINT", "prefix-cache hit tokens as the engine reported, when known", "tokens"),
    _c("dominant_miss", "outcome", "the miss outcome with the most tokens; NULL for a full hit"),
    _c("ttft_ms", "DOUBLE", "time to first token", "ms"),
    _c("queue_ms", "DOUBLE", "time in queue", "ms"),
    _c("events_incomplete", "BOOLEAN", "an unfillable gap in its replica's KV events (batches the collector "
       "lost, metric kvlens_collector_gap_batches) began before its arrival with no cache clear since: "
       "its outcomes may be wrong"),
))

REQUEST_SOURCES = Table("request_sources", "analysis",
                        "Per joined source: which requests it matched and its clock offset.", (
    _SCENARIO,
    _c("source_scenario", "VARCHAR", "the scenario whose requests were joined by request id"),
    _c("source", "VARCHAR", "formats seen in it (otlp, gateway, ...)"),
    _c("requests", "BIGINT", "requests of the scenario"),
    _c("matched", "BIGINT", "of them, found in the source"),
    _c("missing", "BIGINT", "of them, absent from the source"),
    _c("only_in_source", "BIGINT", "source requests with no request in the scenario"),
    _c("matched_by_suffix", "BIGINT", "of matched, through vLLM's `<id>-<index>` / `<id>_<index>` engine id"),
    _c("ambiguous", "BIGINT", "requests whose id several suffixed source ids share (one call, many prompts): "
       "left unmatched"),
    _c("clock_offset_ms", "DOUBLE", "median of source arrival minus scenario arrival", "ms"),
    _c("clock_offset_iqr_ms", "DOUBLE", "interquartile range of that offset", "ms"),
))

REUSE = Table("reuse", "analysis", "Reuse distance per re-access, per stream.", (
    _SCENARIO,
    _c("stream", "VARCHAR",
       "access stream: requests (full blocks only), a replica/tier, fleet, or a prefix group"),
    _c("block_hash", "UBIGINT", "block re-accessed"),
    _c("ts_ns", "BIGINT", "time of the re-access", "ns"),
    _c("distance_blocks", "BIGINT", "distinct blocks touched since the previous access", "blocks"),
    _c("distance_bytes", "BIGINT", "distinct bytes touched since the previous access", "bytes"),
    _c("interval_ns", "BIGINT", "time since the previous access", "ns"),
))

MRC = Table("mrc", "analysis", "LRU hit ratio against capacity, per stream.", (
    _SCENARIO,
    _c("stream", "VARCHAR", "access stream (`requests`: every full block of request_blocks in arrival order, "
       "then position; partial tails are never cached)"),
    _c("method", "VARCHAR", "exact, shards (sampled), or partitioned (merged from K block-hash "
       "partitions: kvlens analyze --partitions/--ray)"),
    _c("capacity_blocks", "BIGINT", "cache capacity: slots of one block each (paged KV memory)", "blocks"),
    _c("capacity_bytes", "BIGINT",
       "capacity_blocks x full-block bytes (block_size_tokens x KV bytes per token)", "bytes"),
    _c("hit_ratio_blocks", "DOUBLE", "LRU hits over the stream's accesses (full blocks, not prompt tokens)",
       "ratio"),
    _c("hit_ratio_bytes", "DOUBLE", "hit bytes over the stream's bytes (full blocks)", "ratio"),
))

FLOWS = Table("flows", "analysis", "Bytes read, written and copied per tier and replica per window.", (
    *_OUTCOME_KEY,
    _c("window_start_ns", "BIGINT", "start of the window", "ns"),
    _c("tier", "medium", "tier"),
    _c("read_bytes", "BIGINT", "bytes loaded from the tier", "bytes"),
    _c("write_bytes", "BIGINT", "bytes stored into the tier", "bytes"),
    _c("replica_bytes", "BIGINT", "bytes copied between replicas", "bytes"),
    _c("never_read_bytes", "BIGINT", "bytes written and removed without a read", "bytes"),
    _c("read_unwritten_bytes", "BIGINT", "of read_bytes, reads of blocks with no store in the lake", "bytes"),
    _c("unread_resident_bytes", "BIGINT", "bytes written, never read, still resident at the end", "bytes"),
))

FANOUT = Table("fanout", "analysis", "Per window: how many replicas needed, and pulled, the same prefix.", (
    _SCENARIO,
    _c("window_start_ns", "BIGINT", "start of the window (request arrivals)", "ns"),
    _c("needed_blocks", "BIGINT", "distinct blocks needed in the window", "blocks"),
    _c("shared_blocks", "BIGINT", "of them, needed by two replicas or more", "blocks"),
    _c("fanout_max_replicas", "BIGINT", "most replicas that needed one block"),
    _c("fanout_mean_replicas", "DOUBLE", "mean replicas per needed block"),
    _c("duplicate_bytes", "BIGINT", "block bytes x (replicas that needed it - 1), summed", "bytes"),
    _c("pulled_bytes", "BIGINT", "bytes loaded remotely (hit_remote)", "bytes"),
    _c("pulled_max_replicas", "BIGINT", "most replicas that loaded one block remotely"),
    _c("top_block_hash", "UBIGINT", "the block with the largest fan-out"),
))

LATENCY_TAILS = Table("latency_tails", "analysis", "TTFT percentiles per replica, window and prefix class.", (
    *_OUTCOME_KEY,
    _c("window_start_ns", "BIGINT", "start of the window", "ns"),
    _c("prefix_class", "VARCHAR", "full_hit, partial_hit, or miss by dominant cause"),
    _c("requests", "BIGINT", "requests in the cell"),
    _c("ttft_p50_ms", "DOUBLE", "TTFT median", "ms"),
    _c("ttft_p95_ms", "DOUBLE", "TTFT 95th percentile", "ms"),
    _c("ttft_p99_ms", "DOUBLE", "TTFT 99th percentile", "ms"),
    _c("p99_p50_ratio", "DOUBLE", "tail ratio; flagged above 5", "ratio"),
    _c("queue_p50_ms", "DOUBLE", "queue time median", "ms"),
    _c("flagged", "BOOLEAN", "p99_p50_ratio above 5"),
    _c("queue_p99_ms", "DOUBLE", "queue time 99th percentile", "ms"),
))

PREFIX_RANKING = Table("prefix_ranking", "analysis",
                       "Prefix groups ranked by expected benefit of publishing.", (
    _SCENARIO,
    _c("prefix_hash", "UBIGINT", "last block of the prefix chain"),
    _c("prefix_tokens", "BIGINT", "tokens in the prefix", "tokens"),
    _c("reuses", "BIGINT", "re-accesses"),
    _c("replicas", "BIGINT", "replicas that needed it"),
    _c("bytes", "BIGINT", "KV bytes of the prefix", "bytes"),
    _c("benefit_ms", "DOUBLE", "expected benefit of publishing", "ms"),
    _c("recommendation", "VARCHAR", "publish to pool / pin / keep local / do not publish"),
    _c("reason", "VARCHAR", "the reason in words"),
    _c("rank", "BIGINT", "1 for the largest expected benefit"),
    _c("parent_hash", "UBIGINT", "tip of the parent prefix group; NULL when the prefix starts at the root"),
    _c("segment_tokens", "BIGINT", "tokens the prefix adds to its parent group", "tokens"),
    _c("segment_bytes", "BIGINT", "KV bytes the prefix adds to its parent group", "bytes"),
    _c("requests", "BIGINT", "requests that needed the prefix"),
    _c("miss_routing_tokens", "BIGINT", "segment tokens missed while another replica or the pool held them",
       "tokens"),
    _c("miss_evicted_tokens", "BIGINT", "segment tokens missed after an eviction", "tokens"),
    _c("hit_remote_tokens", "BIGINT", "segment tokens already loaded remotely", "tokens"),
    _c("miss_load_failed_tokens", "BIGINT", "segment tokens whose load failed", "tokens"),
    _c("avoidable_miss_tokens", "BIGINT", "miss_routing + miss_evicted tokens of the segment", "tokens"),
    _c("h_remote_ratio", "DOUBLE", "segment loads a publish would serve, per request", "ratio"),
    _c("path", "VARCHAR", "load path priced: local_tier (one replica) or pool"),
    _c("recompute_ms", "DOUBLE", "prefill one load of the segment saves (T_recompute)", "ms"),
    _c("recompute_label", "VARCHAR", "measured (GPU probe) or modelled"),
    _c("remote_ms", "DOUBLE", "one load of the segment (T_remote)", "ms"),
    _c("remote_label", "VARCHAR", "measured (GPU probe) or modelled"),
    _c("gross_ms", "DOUBLE", "requests x h_remote x (T_recompute - T_remote)", "ms"),
    _c("stall_ms", "DOUBLE", "P_stall: failed loads x T_remote", "ms"),
    _c("write_ms", "DOUBLE", "P_write: one publish of the segment", "ms"),
    _c("eviction_ms", "DOUBLE", "P_eviction: content its bytes displace from a full pool", "ms"),
    _c("first_arrival_ns", "BIGINT", "first request that needed it", "ns"),
    _c("last_arrival_ns", "BIGINT", "last request that needed it", "ns"),
))

CROSSOVER = Table("crossover", "analysis",
                  "Recompute against load per prefix length and load path, each figure labelled.", (
    _SCENARIO,
    _c("device", "VARCHAR", "device the figures describe (the probe's, or the configured model's)"),
    _c("model", "VARCHAR", "model geometry"),
    _c("prefix_tokens", "BIGINT", "prefix length", "tokens"),
    _c("kv_bytes", "BIGINT", "KV bytes of the prefix", "bytes"),
    _c("path", "VARCHAR", "load path: local_tier, peer, pool"),
    _c("recompute_ms", "DOUBLE", "prefill of the prefix from scratch (T_recompute)", "ms"),
    _c("recompute_label", "VARCHAR", "measured (fit to GPU probe prefill) or modelled (FLOPs)"),
    _c("recompute_extrapolated", "BOOLEAN", "prefix length outside the probe's measured lengths"),
    _c("load_ms", "DOUBLE", "T_lookup + T_queue + S/B_eff + T_stage + T_install", "ms"),
    _c("load_label", "VARCHAR", "measured when every byte term came from the GPU probe, else modelled"),
    _c("winner", "VARCHAR", "load or recompute"),
))

HYGIENE = Table("hygiene", "analysis", "Requests whose chains split early before repeated content.", (
    _SCENARIO,
    _c("request_id", "VARCHAR", "the request"),
    _c("split_position", "INTEGER", "block index where the chain diverged", "blocks"),
    _c("lost_tokens", "BIGINT", "tokens reusable if the dynamic part moved to the end", "tokens"),
    _c("lost_bytes", "BIGINT", "their KV bytes", "bytes"),
    _c("arrival_ns", "BIGINT", "the request's arrival", "ns"),
    _c("lost_blocks", "BIGINT", "full blocks after the split whose content repeats", "blocks"),
    _c("repeated_token_hash", "UBIGINT", "token hash of the first repeated block"),
    _c("first_request_id", "VARCHAR", "earliest request carrying the repeated content after the same prefix: "
       "names the offender group"),
    _c("offender_rank", "BIGINT", "rank of the offender group by tokens lost (1 = most)"),
    _c("offender_requests", "BIGINT", "requests in the offender group"),
    _c("offender_lost_tokens", "BIGINT", "tokens the offender group loses", "tokens"),
))

ISOLATION_FINDINGS = Table("isolation_findings", "analysis",
                           "Cross-tenant reuse and incompatible cache keys.", (
    _SCENARIO,
    _c("finding", "VARCHAR", "cross_tenant_reuse, cross_tenant_keys, cross_salt_keys, incompatible_keys, "
       "same_content_different_keys, block_size_mismatch, engine_block_size_mismatch"),
    _c("subject", "VARCHAR", "tenants, replicas or namespaces involved"),
    _c("blocks", "BIGINT", "blocks (or block keys) involved", "blocks"),
    _c("detail", "VARCHAR", "the finding in words, with numbers"),
    _c("severity", "VARCHAR", "high, medium or low (kvlens.schema.Severity)"),
    _c("tokens", "BIGINT", "tokens of the blocks involved, when the finding is about needed blocks",
       "tokens"),
    _c("bytes", "BIGINT", "their KV bytes", "bytes"),
    _c("requests", "BIGINT", "requests involved, when known"),
))

CAPACITY = Table("capacity", "analysis",
                 "Effective capacity C_eff and where it sits on the exact requests curve.", (
    _SCENARIO,
    _c("c_physical_bytes", "BIGINT", "KV cache the stream is served from (kvlens analyze --cache-tokens)",
       "bytes"),
    _c("c_active_decode_bytes", "BIGINT",
       "held by running requests (kv_cache_usage_perc, or running x context)", "bytes"),
    _c("c_reserved_bytes", "BIGINT", "configured reserve", "bytes"),
    _c("c_fragmentation_bytes", "BIGINT", "half a block per running sequence, unless configured", "bytes"),
    _c("c_eff_bytes", "BIGINT", "C_physical - C_active_decode - C_reserved - C_fragmentation", "bytes"),
    _c("active_source", "VARCHAR",
       "where C_active_decode came from: kv_cache_usage_perc, running_requests, none"),
    _c("hit_ratio_bytes_at_eff", "DOUBLE", "exact LRU byte hit ratio at C_eff", "ratio"),
    _c("hit_ratio_bytes_at_2x_eff", "DOUBLE", "the same at twice C_eff", "ratio"),
    _c("gain_from_2x_ratio", "DOUBLE", "what doubling the effective capacity would buy", "ratio"),
))

TTL_COVERAGE = Table("ttl_coverage", "analysis",
                     "Per TTL: the re-accesses it covers and the bytes it pins.", (
    _SCENARIO,
    _c("ttl_s", "DOUBLE", "time to live after a block's last access", "s"),
    _c("reaccesses", "BIGINT", "re-accesses in the requests stream"),
    _c("covered_reaccesses", "BIGINT", "re-accesses within the TTL of the previous access"),
    _c("covered_ratio", "DOUBLE", "covered re-accesses over re-accesses", "ratio"),
    _c("covered_bytes_ratio", "DOUBLE", "covered re-accessed bytes over re-accessed bytes", "ratio"),
    _c("pinned_mean_bytes", "DOUBLE", "mean bytes the TTL keeps resident", "bytes"),
    _c("pinned_peak_bytes", "DOUBLE", "peak bytes the TTL keeps resident", "bytes"),
    _c("lru_hit_ratio_bytes_at_peak", "DOUBLE", "exact LRU byte hit ratio with the peak bytes as capacity",
       "ratio"),
    _c("ttl_hit_ratio_bytes", "DOUBLE", "covered re-access bytes over all accessed bytes", "ratio"),
))

WARMUP = Table("warmup", "analysis", "Time to a steady hit ratio for each new replica.", (
    *_OUTCOME_KEY,
    _c("first_request_ns", "BIGINT", "first request served", "ns"),
    _c("steady_after_ns", "BIGINT",
       "time from the start until the hit ratio reached the fleet's steady level; NULL if never", "ns"),
    _c("prewarm_bytes", "BIGINT", "bytes a pre-warm of the hot prefixes would move", "bytes"),
    _c("start_ns", "BIGINT", "the start: first request or event, or a cleared event", "ns"),
    _c("start_kind", "VARCHAR", "first_seen or cleared"),
    _c("fleet_hit_ratio", "DOUBLE", "steady level: fleet hit over full-block tokens, second half",
       "ratio"),
    _c("warmup_requests", "BIGINT", "requests before steady (all of the start's when never steady)"),
    _c("warmup_recomputed_tokens", "BIGINT", "tokens recomputed in warm-up beyond the steady level",
       "tokens"),
    _c("prewarm_blocks", "BIGINT", "blocks of the top-k hot prefixes", "blocks"),
    _c("prewarm_prefixes", "BIGINT", "prefix chains among them"),
    _c("concurrent_starts", "BIGINT", "N: replica starts within the pre-warm window of this one"),
    _c("prewarm_bandwidth_bytes_per_s", "DOUBLE", "N x prewarm_bytes / pre-warm window (N·W/Δt)", "bytes/s"),
    _c("saved_tokens", "BIGINT", "warm-up miss tokens the pre-warm would have turned into hits", "tokens"),
    _c("saved_ms", "DOUBLE", "their prefill time at the scenario's measured ms per recomputed token", "ms"),
))

RECONCILIATION = Table("reconciliation", "analysis",
                       "Engine prefix-cache token counters beside the ledger, per replica and window.", (
    *_OUTCOME_KEY,
    _c("window_start_ns", "BIGINT", "the replica's first sample (or counter creation), or a window's start",
       "ns"),
    _c("window_end_ns", "BIGINT", "last sample of the replica, or the window's end", "ns"),
    _c("engine_queries_tokens", "BIGINT", "increase of vllm:prefix_cache_queries (resets handled)", "tokens"),
    _c("engine_hit_tokens", "BIGINT", "increase of vllm:prefix_cache_hits (resets handled)", "tokens"),
    _c("engine_external_hit_tokens", "BIGINT", "increase of vllm:external_prefix_cache_hits (KV connector)",
       "tokens"),
    _c("counter_resets", "BIGINT", "counter decreases seen (engine restarts) in the window"),
    _c("ledger_requests", "BIGINT", "requests of the ledger arriving in the window"),
    _c("ledger_prompt_tokens", "BIGINT", "their prompt tokens", "tokens"),
    _c("ledger_hit_tokens", "BIGINT", "their hit tokens as the ledger found them", "tokens"),
    _c("reported_cached_tokens", "BIGINT", "their cached_tokens as the engine reported them, when known",
       "tokens"),
    _c("difference_tokens", "BIGINT", "engine hits (local + external) minus ledger hit tokens", "tokens"),
    _c("difference_ratio", "DOUBLE", "difference_tokens over the engine's hits", "ratio"),
    _c("reported_difference_tokens", "BIGINT", "engine hits (local + external) minus reported cached tokens",
       "tokens"),
))

TIER_RECONCILIATION = Table(
    "tier_reconciliation", "analysis",
    "Hit tokens by source per replica: the ledger's, the engine's per request, its counters'.", (
    *_OUTCOME_KEY,
    _c("source", "VARCHAR", "device (GPU), host (CPU), disk, or remote (the shared pool, a peer, a "
       "connector)"),
    _c("ledger_hit_tokens", "BIGINT", "hit tokens the ledger attributes to the source", "tokens"),
    _c("reported_tokens", "BIGINT", "the requests' own split of cached tokens (SGLang "
       "cached_tokens_details), when reported", "tokens"),
    _c("engine_counter_tokens", "BIGINT", "increase of vllm:prompt_tokens_cached_by_source (p2p and "
       "external_unspecified as remote) or sglang:cached_tokens{cache_source}, when scraped", "tokens"),
    _c("difference_tokens", "BIGINT", "the counter, else the reported split, minus the ledger", "tokens"),
))

TIER_PAYOFF = Table("tier_payoff", "analysis",
                    "Per location and tier: blocks stored, demoted and evicted, and the hits it served.", (
    _SCENARIO,
    _c("replica", "VARCHAR", "the location: a replica, or `pool`"),
    _c("tier", "VARCHAR", "gpu, cpu, disk or pool"),
    _c("stored_blocks", "BIGINT", "store events into the tier (physical copies written)", "blocks"),
    _c("stored_bytes", "BIGINT", "their KV bytes", "bytes"),
    _c("removed_blocks", "BIGINT", "removal events from the tier", "blocks"),
    _c("demoted_blocks", "BIGINT", "gpu tier: removals whose block stayed on a lower tier of the location "
       "(a demotion, not an eviction)", "blocks"),
    _c("evicted_blocks", "BIGINT", "removals that were not demotions", "blocks"),
    _c("hit_blocks", "BIGINT", "hits the tier served", "blocks"),
    _c("hit_tokens", "BIGINT", "their tokens", "tokens"),
    _c("hit_bytes", "BIGINT", "their KV bytes", "bytes"),
    _c("served_per_stored_ratio", "DOUBLE", "hit bytes over stored bytes", "ratio"),
    _c("paid_off", "BOOLEAN", "the tier served at least the bytes written to it; NULL when nothing was "
       "stored"),
))

LAKE_TABLES: tuple[Table, ...] = (KV_EVENTS, REQUESTS, REQUEST_BLOCKS, TRANSFERS, METRIC_SAMPLES, PROBE_RUNS,
                                  SIMULATIONS)
ANALYSIS_TABLES: tuple[Table, ...] = (
    SCENARIOS, BLOCK_OUTCOMES, MISS_LEDGER, REQUEST_LEDGER, REQUEST_SOURCES, REUSE, MRC, CAPACITY,
    TTL_COVERAGE, FLOWS, FANOUT, LATENCY_TAILS, PREFIX_RANKING, CROSSOVER, HYGIENE, ISOLATION_FINDINGS,
    WARMUP, RECONCILIATION, TIER_RECONCILIATION, TIER_PAYOFF,
)
TABLES: dict[str, Table] = {t.name: t for t in LAKE_TABLES + ANALYSIS_TABLES}

_ARROW = {
    "BIGINT": pa.int64(),
    "UBIGINT": pa.uint64(),
    "INTEGER": pa.int32(),
    "DOUBLE": pa.float64(),
    "BOOLEAN": pa.bool_(),
    "VARCHAR": pa.string(),
    "MAP(VARCHAR, VARCHAR)": pa.map_(pa.string(), pa.string()),
    "INTEGER[]": pa.list_(pa.int32()),
}


def arrow_type(column: Column) -> pa.DataType:
    # Enum columns are stored as strings in Parquet; the views cast them to the ENUM type.
    return pa.string() if column.enum else _ARROW[column.type]


def arrow_schema(table: Table) -> pa.Schema:
    """The Arrow schema of one lake segment of ``table`` (no ``scenario``: it is the path)."""
    return pa.schema([pa.field(c.name, arrow_type(c)) for c in table.file_columns])


def render_markdown() -> str:
    """docs/schema.md, generated; tests fail when the committed page differs."""
    out = [
        "# kvlens schema",
        "",
        f"Generated from `kvlens/schema.py` (schema version {SCHEMA_VERSION}) by "
        "`kvlens schema --markdown`; do not edit by hand.",
        "",
        "Times are int64 nanoseconds since the Unix epoch (UTC). Lake tables are partitioned "
        "`<table>/scenario=NAME/date=YYYY-MM-DD/`.",
        "",
        "## Vocabularies",
        "",
    ]
    for type_name, enum_cls in ENUMS.items():
        out.append(f"- `{type_name}`: " + ", ".join(f"`{m.value}`" for m in enum_cls))
    for kind, tables in (("Lake tables", LAKE_TABLES), ("Analysis tables", ANALYSIS_TABLES)):
        out += ["", f"## {kind}"]
        for t in tables:
            out += ["", f"### `{t.name}`", "", t.doc, "", "| column | type | unit | meaning |",
                    "|---|---|---|---|"]
            out += [f"| `{c.name}` | {c.type} | {c.unit} | {c.doc} |" for c in t.columns]
    return "\n".join(out) + "\n"
