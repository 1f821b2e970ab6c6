"""Sample data: a small synthetic gateway log with token ids, for the analyses the public traces cannot show.

The Mooncake trace has hash ids only: no token ids, no tenants. This generator writes a gateway
JSONL log (README, "Gateway log format") of a made-up multi-tenant agent service whose prompts
carry real token ids, with two faults planted on purpose, so that the demo exercises the prompt
hygiene analysis and the isolation audit on data with a known answer:

- tenant ``acme``'s client puts the current time into the first block of its system prompt on
  a share of its requests (``TIMESTAMPED_SHARE``): those requests split from the shared chain
  at block 0 while the rest of the system prompt repeats;
- tenants ``bolt`` and ``corp`` use the same public system prompt with no cache salt, so their
  blocks are reused across tenants.

Everything is synthetic and deterministic (seeded); nothing here is measured.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["AGENT_MODEL", "BLOCK_TOKENS", "TENANTS", "TIMESTAMPED_SHARE", "write_agent_log"]

AGENT_MODEL = "llama-3.1-8b"
BLOCK_TOKENS = 16
TIMESTAMPED_SHARE = 0.3
# tenant -> (system prompt id, system prompt blocks, tool blocks)
TENANTS = {"acme": ("acme-sys", 40, 24), "bolt": ("public-sys", 32, 8), "corp": ("public-sys", 32, 16)}
_VOCAB = 32_000


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, _VOCAB) for _ in range(n)]


def write_agent_log(path: Path, *, requests: int = 1500, start_ns: int = 1_700_000_000 * 10**9,
                    span_s: float = 1800.0, seed: int = 7) -> Path:
    """Write ``requests`` gateway lines over ``span_s`` seconds to ``path``; returns the path."""
    rng = random.Random(seed)
    system = {name: _tokens(rng, blocks * BLOCK_TOKENS)
              for name, blocks in sorted({(s, b) for s, b, _ in TENANTS.values()})}
    tools = {tenant: _tokens(rng, t * BLOCK_TOKENS) for tenant, (_, _, t) in TENANTS.items()}
    sessions: dict[str, list[int]] = {}
    arrivals = sorted(rng.uniform(0, span_s) for _ in range(requests))
    lines = []
    for i, at_s in enumerate(arrivals):
        tenant = rng.choice(sorted(TENANTS))
        sys_id = TENANTS[tenant][0]
        prompt = list(system[sys_id])
        if tenant == "acme" and rng.random() < TIMESTAMPED_SHARE:
            # "Current time: 2023-11-14T22:13:20Z" rendered into the first block's tokens.
            stamp = _tokens(random.Random(int(at_s * 1000)), 8)
            prompt[:8] = stamp
        prompt += tools[tenant]
        session = f"{tenant}-{rng.randrange(40)}"
        history = sessions.setdefault(session, [])
        turn = _tokens(rng, rng.randrange(40, 400))
        prompt += history + turn
        history.extend(turn + _tokens(rng, rng.randrange(20, 200)))
        del history[:-4000]
        lines.append({
            "request_id": f"agent-{i:05d}", "arrival_ns": start_ns + round(at_s * 1e9),
            "tenant": tenant, "session_id": session, "model": AGENT_MODEL,
            "prompt_tokens": len(prompt), "output_tokens": rng.randrange(20, 300),
            "block_size": BLOCK_TOKENS, "token_ids": prompt,
        })
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
