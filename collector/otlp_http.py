"""Collector HTTP pieces of the OTLP receiver: errors with a status, bounded bodies, draining.

- ``inflate_bounded``: gzip/deflate to at most a limit, one step at a time;
- ``_Budget``: the receiver's memory for bodies, shared by all requests; ``_Grant`` is one
  request's share;
- ``_drain``: read and drop the rest of a body the receiver answers with an error before reading
  it (Content-Length or chunked framing, RFC 9112 section 7.1), so the client reads the status
  instead of a broken pipe;
- ``_status_body``: a ``google.rpc.Status`` as OTLP/HTTP answers errors.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from typing import Any

__all__ = ["inflate_bounded"]

_PROTOBUF, _JSON = "application/x-protobuf", "application/json"
_INFLATE_STEP = 1 << 20  # inflate this much at a time, reserving each step from the budget


class _HttpError(Exception):
    def __init__(self, status: int, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.close = status, close


class _Budget:
    """Bytes of request bodies in memory, all requests together; ``take`` waits for room."""

    def __init__(self, total_bytes: int, metrics: Any) -> None:
        self.total, self.used, self.metrics = total_bytes, 0, metrics
        self._cond = threading.Condition()

    def take(self, n: int, timeout_s: float) -> None:
        """Reserve ``n`` bytes, or _HttpError 503 after ``timeout_s`` (one request alone may use all)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.used and self.used + n > self.total:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _HttpError(503, "the receiver's memory for bodies is in use; retry later")
                self._cond.wait(left)
            self.used += n
            self.metrics.budget_bytes.set(self.used)

    def give(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self.metrics.budget_bytes.set(self.used)
            self._cond.notify_all()


class _Grant:
    """One request's share of the budget, given back whole when the request ends."""

    def __init__(self, budget: _Budget | None, timeout_s: float) -> None:
        self.budget, self.timeout_s, self.held = budget, timeout_s, 0

    def take(self, n: int) -> None:
        if self.budget is not None and n:
            self.budget.take(n, self.timeout_s)
            self.held += n

    def keep(self, n: int) -> None:
        """Give back all but ``n`` of the bytes held."""
        if self.budget is not None and 0 <= n < self.held:
            self.budget.give(self.held - n)
            self.held = n

    def release(self) -> None:
        if self.budget is not None and self.held:
            self.budget.give(self.held)
            self.held = 0


def inflate_bounded(data: bytes | bytearray, limit_bytes: int, *,
                    encoding: str = "gzip") -> bytes | bytearray:
    """Gunzip (all members) or inflate (``deflate``: zlib) to at most ``limit_bytes``; _HttpError 413/400.

    Output grows one step at a time into one buffer, never past the limit (plus one step).
    """
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    out = bytearray()
    while data:
        d = zlib.decompressobj(wbits)
        pending = data
        while not d.eof:
            try:
                chunk = d.decompress(pending, min(_INFLATE_STEP, limit_bytes - len(out) + 1))
            except zlib.error as e:
                raise _HttpError(400, f"broken {encoding} body: {e}") from None
            pending = d.unconsumed_tail
            if not chunk:
                if not pending:
                    break  # the input ended before the stream did
                continue
            if len(out) + len(chunk) > limit_bytes:
                raise _HttpError(413, f"body inflates past the limit of {limit_bytes} bytes")
            out += chunk
        if not d.eof or (d.unused_data and encoding != "gzip"):
            raise _HttpError(400, f"truncated or trailing data in the {encoding} body")
        data = d.unused_data
    return out


def _status_body(content_type: str, message: str) -> bytes:
    """A ``google.rpc.Status`` (code 3, INVALID_ARGUMENT) in the request's encoding."""
    if content_type == _JSON:
        return json.dumps({"code": 3, "message": message}).encode()
    msg = message.encode()[:4096]
    return b"\x08\x03\x12" + _varint(len(msg)) + msg


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


# An error answered before the body was read still reads (and drops) up to this much of it, so
# that a client still writing its body reads the status instead of a broken pipe; a larger
# declared body is refused with the connection closed.
_DRAIN_MAX_BYTES = 16 << 20


class _CountingReader:
    """The request body stream, counting what the handler has read (and keeping its first bytes)."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.count, self.head = raw, 0, b""

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.raw.read(n)
        if self.count < 32:
            self.head += data[:32 - self.count]
        self.count += len(data)
        return data


def _drain(reader: _CountingReader, headers: Any) -> bool:
    """Read and drop the unread rest of a declared or chunked body; False when that is not possible."""
    if "chunked" in (headers.get("Transfer-Encoding") or "").lower():
        return reader.count == 0 and _drain_chunked(reader.raw)
    try:
        rest = int(headers.get("Content-Length", "")) - reader.count
    except ValueError:
        return False
    if rest < 0 or rest > _DRAIN_MAX_BYTES:
        return False
    while rest > 0:
        chunk = reader.raw.read(min(rest, 1 << 16))
        if not chunk:
            return False
        rest -= len(chunk)
    return True


def _drain_chunked(raw: Any) -> bool:
    """Read a chunked body to its end (RFC 9112 section 7.1), at most _DRAIN_MAX_BYTES of it."""
    total = 0
    while True:
        line = raw.readline(1024)
        try:
            size = int(line.split(b";", 1)[0].strip(), 16) if line.endswith(b"\n") else -1
        except ValueError:
            return False
        if size < 0:
            return False
        if size == 0:  # the last chunk; then trailer fields until an empty line
            for _ in range(100):
                trailer = raw.readline(8192)
                if not trailer.endswith(b"\n"):
                    return False
                if not trailer.strip():
                    return True
            return False
        total += size
        if total > _DRAIN_MAX_BYTES:
            return False
        while size > 0:
            data = raw.read(min(size, 1 << 16))
            if not data:
                return False
            size -= len(data)
        if raw.readline(1024).strip():  # the CRLF after the chunk's data
            return False
