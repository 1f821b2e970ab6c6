"""Dashboards: the SELECTs behind the report: its first screen (attribution, avoidable misses, actions),
its findings and its whole-scenario sections.

Constants only, read by dashboards/attribution.py, decisions.py, actions.py, findings.py and
report.py through ``dashboards.read.rows``; each statement's columns are unpacked there, in order.
Windows bind ``$start_ns`` / ``$end_ns`` (dashboards/read.py), scenarios ``$scenario`` or
``$names``. What the dashboard's pages share with the report is in dashboards/queries.py.
"""

from __future__ import annotations

from kvlens.dashboards.queries import NAMES_IN_WINDOW
from kvlens.dashboards.read import in_window
from kvlens.schema import HIT_OUTCOMES_SQL

__all__ = [
    "AVOIDABLE_SQL",
    "CAPACITY_ACTION_SQL",
    "CAPACITY_FINDING_SQL",
    "COLD_SHARE_SQL",
    "CROSSOVER_FINDING_SQL",
    "CROSSOVER_POINTS_SQL",
    "FANOUT_FINDING_SQL",
    "HYGIENE_ACTION_SQL",
    "HYGIENE_FINDING_SQL",
    "ISOLATION_FINDING_SQL",
    "MISS_SHARES_SQL",
    "NEVER_READ_SQL",
    "PREFIX_ACTION_SQL",
    "PREFIX_WORTH_SQL",
    "PROBE_RUNS_SQL",
    "SHARED_REQUESTS_SQL",
    "SIMULATIONS_SQL",
    "SLOWEST_CLASS_SQL",
    "SLOWEST_WARMUP_SQL",
    "TOP_PREFIXES_SQL",
    "TOP_PREFIX_SQL",
    "UNOBSERVED_SQL",
    "WHAT_IF_SERVED_SQL",
    "WORST_REPLICA_SQL",
]

_SCENARIO_IN_WINDOW = f"scenario = $scenario AND {in_window('arrival_ns')}"

# The first screen: why the hit ratio changed (dashboards/attribution.py, beside queries.HEADLINE_SQL).
MISS_SHARES_SQL = f"""
SELECT CAST(outcome AS VARCHAR), replica, sum(tokens)
FROM block_outcomes WHERE {_SCENARIO_IN_WINDOW} AND outcome NOT IN {HIT_OUTCOMES_SQL}
GROUP BY ALL ORDER BY 1, 2
"""

# ... what was avoidable (dashboards/decisions.py).
AVOIDABLE_SQL = f"""
SELECT CAST(outcome AS VARCHAR), replica, sum(tokens) FROM block_outcomes
WHERE {_SCENARIO_IN_WINDOW} AND list_contains($causes, outcome)
GROUP BY ALL ORDER BY 3 DESC, 1, 2
"""

PREFIX_WORTH_SQL = """
SELECT prefix_hash, prefix_tokens, requests, avoidable_miss_tokens FROM prefix_ranking
WHERE scenario = $scenario AND avoidable_miss_tokens > 0
ORDER BY avoidable_miss_tokens DESC, prefix_hash LIMIT $limit
"""

# ... and what to do (dashboards/actions.py).
SHARED_REQUESTS_SQL = f"""
SELECT w.scenario, count(*), sum(p.prompt_tokens), sum(p.hit_tokens), sum(w.hit_tokens),
       quantile_cont(p.ttft_ms, 0.99), quantile_cont(w.ttft_ms, 0.99)
FROM request_ledger p JOIN request_ledger w ON w.request_id = p.request_id AND w.scenario <> p.scenario
WHERE p.scenario = $scenario AND {in_window("p.arrival_ns")}
  AND list_contains($what_ifs, w.scenario) AND coalesce(p.unobserved_tokens, 0) = 0
GROUP BY w.scenario ORDER BY w.scenario
"""

# The lake's simulations view: what each what-if changed (absent when the lake is not reachable).
SIMULATIONS_SQL = """
SELECT scenario, CAST(routing AS VARCHAR), load_factor, replicas, capacity_tokens, gpu_blocks, pool_tokens
FROM analysis.main.simulations WHERE list_contains($names, scenario)
QUALIFY row_number() OVER (PARTITION BY scenario ORDER BY created_ns DESC) = 1
"""

PREFIX_ACTION_SQL = """
SELECT prefix_hash, prefix_tokens, reuses, replicas, benefit_ms, recommendation,
       CASE WHEN recompute_label = 'measured' AND remote_label = 'measured' THEN 'measured'
            ELSE 'modelled' END,
       coalesce(avoidable_miss_tokens, 0) * coalesce(h_remote_ratio, 1)
FROM prefix_ranking WHERE scenario = $scenario AND benefit_ms > 0
ORDER BY rank NULLS LAST, benefit_ms DESC, prefix_hash LIMIT 1
"""

CAPACITY_ACTION_SQL = """
SELECT c.hit_ratio_bytes_at_eff, c.hit_ratio_bytes_at_2x_eff, c.c_eff_bytes
FROM capacity c WHERE c.scenario = $scenario AND c.hit_ratio_bytes_at_eff IS NOT NULL
"""

HYGIENE_ACTION_SQL = f"""
SELECT count(*), sum(lost_tokens) FROM hygiene
WHERE {_SCENARIO_IN_WINDOW} HAVING sum(lost_tokens) > 0
"""

# The findings (dashboards/findings.py), in the report's order.
WORST_REPLICA_SQL = f"""
WITH per AS (
    SELECT scenario, replica, CAST(outcome AS VARCHAR) AS outcome, sum(tokens) AS tokens
    FROM block_outcomes WHERE {NAMES_IN_WINDOW} GROUP BY ALL
), prompt AS (
    SELECT scenario, replica, sum(prompt_tokens) AS prompt_tokens FROM request_ledger
    WHERE {NAMES_IN_WINDOW} GROUP BY ALL
), fleet AS (
    SELECT scenario, sum(prompt_tokens) AS prompt_tokens FROM prompt GROUP BY ALL
), cause AS (
    SELECT scenario, outcome, sum(tokens) AS tokens FROM per GROUP BY ALL
), top_cause AS (
    SELECT c.scenario, c.outcome, c.tokens / f.prompt_tokens AS fleet_share, c.tokens
    FROM cause c JOIN fleet f USING (scenario) WHERE list_contains($actionable, c.outcome)
    QUALIFY row_number() OVER (PARTITION BY c.scenario ORDER BY c.tokens DESC, c.outcome) = 1
)
SELECT t.scenario, t.outcome, t.fleet_share, p.replica, per.tokens / p.prompt_tokens AS replica_share,
       t.tokens
FROM top_cause t JOIN per USING (scenario, outcome) JOIN prompt p USING (scenario, replica)
WHERE t.fleet_share > 0
QUALIFY row_number() OVER (PARTITION BY t.scenario ORDER BY replica_share DESC, p.replica) = 1
ORDER BY t.scenario
"""

# The same blocks (request, position, key) in the other scenarios: what they got there.
WHAT_IF_SERVED_SQL = f"""
SELECT b.scenario, sum(a.tokens), sum(a.tokens) FILTER (WHERE b.outcome IN {HIT_OUTCOMES_SQL})
FROM block_outcomes a JOIN block_outcomes b
  ON a.request_id = b.request_id AND a.position = b.position AND a.block_hash = b.block_hash
WHERE a.scenario = $scenario AND a.replica = $replica AND a.outcome = $outcome
  AND {in_window("a.arrival_ns")}
  AND b.scenario <> $scenario AND list_contains($names, b.scenario)
GROUP BY b.scenario ORDER BY b.scenario
"""

COLD_SHARE_SQL = f"""
SELECT b.scenario, sum(b.tokens) FILTER (WHERE b.outcome = 'miss_cold') / any_value(r.prompt_tokens)
FROM block_outcomes b JOIN (
    SELECT scenario, sum(prompt_tokens) AS prompt_tokens FROM request_ledger WHERE {NAMES_IN_WINDOW}
    GROUP BY ALL) r USING (scenario)
WHERE list_contains($names, b.scenario) AND {in_window("b.arrival_ns")}
GROUP BY b.scenario ORDER BY b.scenario
"""

UNOBSERVED_SQL = f"""
SELECT scenario, sum(unobserved_tokens) / sum(prompt_tokens),
       sum(reusable_tokens) FILTER (WHERE unobserved_tokens > 0)
           / sum(prompt_tokens) FILTER (WHERE unobserved_tokens > 0)
FROM request_ledger WHERE {NAMES_IN_WINDOW} GROUP BY ALL HAVING sum(unobserved_tokens) > 0 ORDER BY 1
"""

CAPACITY_FINDING_SQL = """
WITH p AS (
    SELECT scenario, sum(prompt_tokens) AS prompt, sum(tail_partial_tokens) AS tail FROM request_ledger
    WHERE list_contains($names, scenario) GROUP BY ALL
)
SELECT list(c.scenario ORDER BY c.scenario), c.c_eff_bytes, c.hit_ratio_bytes_at_eff,
       c.hit_ratio_bytes_at_2x_eff,
       c.c_active_decode_bytes + c.c_reserved_bytes + c.c_fragmentation_bytes AS subtracted, c.active_source,
       round((p.prompt - p.tail) / p.prompt, 6) AS full_share
FROM capacity c JOIN p USING (scenario)
WHERE list_contains($names, c.scenario) AND c.hit_ratio_bytes_at_eff IS NOT NULL AND p.prompt > 0
GROUP BY ALL ORDER BY 1
"""

SLOWEST_CLASS_SQL = """
SELECT scenario, prefix_class, requests, ttft_p50_ms, ttft_p99_ms, p99_p50_ratio FROM latency_tails
WHERE list_contains($names, scenario) AND replica = '*' AND window_start_ns IS NULL
  AND prefix_class <> 'all' AND ttft_p99_ms IS NOT NULL
ORDER BY ttft_p99_ms DESC, scenario, prefix_class LIMIT 1
"""

TOP_PREFIX_SQL = """
SELECT scenario, prefix_hash, prefix_tokens, reuses, replicas, benefit_ms, recommendation, reason,
       recompute_label, remote_label, coalesce(avoidable_miss_tokens, 0)
FROM prefix_ranking WHERE list_contains($names, scenario) AND benefit_ms > 0
ORDER BY benefit_ms DESC NULLS LAST, scenario, prefix_hash LIMIT 1
"""

HYGIENE_FINDING_SQL = f"""
SELECT scenario, count(*), sum(lost_tokens), sum(lost_bytes) FROM hygiene
WHERE {NAMES_IN_WINDOW}
GROUP BY ALL ORDER BY 3 DESC, 1 LIMIT 1
"""

ISOLATION_FINDING_SQL = """
SELECT scenario, finding, any_value(severity), count(*), sum(blocks),
       arg_min(detail, CASE severity WHEN 'high' THEN 0 WHEN 'medium' THEN 1 ELSE 2 END)
FROM isolation_findings WHERE list_contains($names, scenario) GROUP BY ALL
ORDER BY min(CASE severity WHEN 'high' THEN 0 WHEN 'medium' THEN 1 ELSE 2 END), sum(blocks) DESC, 1, 2 LIMIT 3
"""

NEVER_READ_SQL = f"""
SELECT scenario, CAST(tier AS VARCHAR), sum(write_bytes), sum(never_read_bytes) FROM flows
WHERE list_contains($names, scenario) AND {in_window("window_start_ns")}
GROUP BY ALL HAVING sum(never_read_bytes) > 0
ORDER BY sum(never_read_bytes) / sum(write_bytes) DESC NULLS LAST, 1, 2 LIMIT 1
"""

SLOWEST_WARMUP_SQL = """
SELECT scenario, replica, steady_after_ns, prewarm_bytes, saved_tokens FROM warmup
WHERE list_contains($names, scenario) AND steady_after_ns IS NOT NULL
ORDER BY steady_after_ns DESC, scenario, replica LIMIT 1
"""

CROSSOVER_FINDING_SQL = """
SELECT device, model, path, min(prefix_tokens) FILTER (WHERE winner = 'load') AS from_tokens,
       max(prefix_tokens), string_agg(DISTINCT load_label, '/' ORDER BY load_label),
       string_agg(DISTINCT recompute_label, '/' ORDER BY recompute_label)
FROM crossover WHERE list_contains($names, scenario)
GROUP BY ALL ORDER BY 1, 2, 3
"""

FANOUT_FINDING_SQL = f"""
SELECT scenario, sum(needed_blocks), sum(shared_blocks), max(fanout_max_replicas), sum(duplicate_bytes)
FROM fanout WHERE list_contains($names, scenario) AND {in_window("window_start_ns")}
GROUP BY ALL HAVING sum(shared_blocks) > 0 ORDER BY sum(duplicate_bytes) DESC, 1 LIMIT 1
"""

# The report's whole-scenario sections (dashboards/report/build.py).
TOP_PREFIXES_SQL = """
SELECT scenario, prefix_hash, prefix_tokens, reuses, replicas, bytes, benefit_ms, recommendation,
       CASE WHEN recompute_label = 'measured' AND remote_label = 'measured' THEN 'measured'
            ELSE 'modelled' END
FROM prefix_ranking WHERE list_contains($names, scenario) AND benefit_ms > 0
QUALIFY row_number() OVER (PARTITION BY scenario ORDER BY rank NULLS LAST, benefit_ms DESC NULLS LAST,
                                                          prefix_hash) <= 5
ORDER BY scenario, rank NULLS LAST, benefit_ms DESC NULLS LAST, prefix_hash
"""

CROSSOVER_POINTS_SQL = """
SELECT DISTINCT device, model, path, prefix_tokens, recompute_ms, recompute_label, load_ms, load_label, winner
FROM crossover WHERE list_contains($names, scenario) ORDER BY 1, 2, 3, 4
"""

# The lake's GPU probe rows through the analysis DB's view (dashboards/worth.py).
PROBE_RUNS_SQL = "SELECT * FROM analysis.main.probe_runs WHERE source = 'gpu'"
