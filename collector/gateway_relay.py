"""Collector (kvlens gateway): a replica's answer relayed to the client unchanged, and its usage and TTFT.

A streamed answer (``text/event-stream``) is relayed event by event as the replica sends it
(events end with a blank line, as vLLM's ``data: {...}\\n\\n`` and the SSE specification say);
each ``data:`` payload is read for the answer's id, the first token's time (the first event with
non-empty ``choices``) and ``usage``. When the gateway itself added
``stream_options.include_usage`` (the client did not ask), the one extra event it causes (vLLM's
final chunk: ``choices`` empty, ``usage`` set; vllm/entrypoints/openai/completion/serving.py) is
not relayed, so the client's stream is byte for byte the one it would have had.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["HOP_HEADERS", "Observed", "SseRelay", "observe_json", "wants_usage", "with_usage"]

# RFC 9110 7.6.1 hop-by-hop headers, plus what aiohttp sets itself for the relayed body.
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "transfer-encoding", "upgrade", "host", "content-length",
                         "content-encoding", "accept-encoding"})


@dataclass
class Observed:
    """What the gateway read from an answer."""

    response_id: str | None = None
    usage: dict[str, Any] | None = None
    first_token_ns: int | None = None


def observe_json(body: bytes, out: Observed) -> None:
    """A whole (not streamed) JSON answer: its id and usage."""
    try:
        obj = json.loads(body)
    except ValueError:
        return
    if isinstance(obj, dict):
        out.response_id = obj.get("id") if isinstance(obj.get("id"), str) else None
        out.usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else None


class SseRelay:
    """Splits a byte stream into SSE events; ``feed`` returns the bytes to relay now."""

    def __init__(self, out: Observed, *, strip_usage: bool) -> None:
        self.out, self.strip_usage = out, strip_usage
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        keep = []
        while True:
            end, size = self._event_end()
            if end < 0:
                break
            event, self._buf = self._buf[:end + size], self._buf[end + size:]
            if self._observe(event):
                keep.append(event)
        return b"".join(keep)

    def rest(self) -> bytes:
        """Whatever the replica sent after its last complete event (relayed as is)."""
        rest, self._buf = self._buf, b""
        return rest

    def _event_end(self) -> tuple[int, int]:
        lf, crlf = self._buf.find(b"\n\n"), self._buf.find(b"\r\n\r\n")
        if crlf >= 0 and (lf < 0 or crlf < lf):
            return crlf, 4
        return lf, 2

    def _observe(self, event: bytes) -> bool:
        """Read one event; False when it is the usage chunk the gateway asked for itself."""
        data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
        if not data or data == b"[DONE]":
            return True
        try:
            obj = json.loads(data)
        except ValueError:
            return True
        if not isinstance(obj, dict):
            return True
        if self.out.response_id is None and isinstance(obj.get("id"), str):
            self.out.response_id = obj["id"]
        choices = obj.get("choices")
        if choices and self.out.first_token_ns is None:
            self.out.first_token_ns = time.time_ns()
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.out.usage = usage
            if self.strip_usage and not choices:
                return False
        return True


def wants_usage(body: dict[str, Any]) -> bool:
    """Whether the client asked for the final usage chunk itself."""
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def with_usage(body: dict[str, Any]) -> dict[str, Any]:
    """The request body asking for the final usage chunk (the client's other stream options kept)."""
    given = body.get("stream_options")
    options: dict[str, Any] = given if isinstance(given, dict) else {}
    return {**body, "stream_options": {**options, "include_usage": True}}
