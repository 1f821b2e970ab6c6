"""Collector for the Alibaba Qwen/Bailian usage traces (JSONL): a line -> a request and its 16-token blocks.

Fields (FORMATS.md 5.2): ``chat_id``, ``parent_chat_id`` (-1 for a root), ``timestamp``
(seconds from the trace start), ``input_length``, ``output_length``, ``type``, ``turn``,
``hash_ids`` (salted SipHash of 16-token blocks, remapped). The session of a request is
the root of its ``parent_chat_id`` chain.
"""

from __future__ import annotations

from typing import Any

from kvlens.collector.fields import (
    INT64_MAX,
    FieldError,
    Parsed,
    Parser,
    hash_id_request,
    need_int,
    need_number,
    seconds_ns,
)

__all__ = ["BLOCK_TOKENS", "parser"]

BLOCK_TOKENS = 16


def parser(*, model: str | None, t0_ns: int) -> Parser:
    namespace = model or "bailian"
    roots: dict[int, int] = {}  # chat_id -> root chat_id, for chats seen so far

    def parse(rec: Any, *, lineno: int, stem: str) -> Parsed:
        chat = need_int(rec, "chat_id", minimum=-(1 << 63), maximum=INT64_MAX)
        parent = rec.get("parent_chat_id", -1)
        if isinstance(parent, bool) or not isinstance(parent, int):
            raise FieldError("parent_chat_id", f"expected an integer, got {parent!r:.40}")
        # A parent not seen (yet) is its own root: the chain is cut at the trace's edge.
        root = chat if parent < 0 else roots.get(parent, parent)
        roots[chat] = root
        return hash_id_request(rec, {
            "request_id": str(chat),
            "arrival_ns": seconds_ns(need_number(rec, "timestamp"), "timestamp", offset_ns=t0_ns),
            "model": model,
            "session_id": str(root),
            "source": "bailian",
        }, block_tokens=BLOCK_TOKENS, namespace=namespace)

    return parse
