"""A small deterministic mutator: byte-level edits and structure-aware edits of msgpack / JSON seeds.

The unit suite's fuzz slice uses it (the coverage-guided run, ``make fuzz``, uses atheris and
calls ``structured`` from its custom mutator). Structure-aware edits decode a seed, replace one
leaf (or wrap it) with a value from ``INTERESTING`` (the edges of int32, int64 and uint64, huge
and non-finite floats, wrong types, deep nesting, msgpack ext types) and encode it again: that is
how a real engine's batch with one impossible field is made.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec

__all__ = ["INTERESTING", "mutate", "structured"]

INTERESTING: tuple[Any, ...] = (
    0, -1, 1, 2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**63),
    1e300, -1e300, 1e10, 1e19, 5e-324, float("inf"), float("-inf"), float("nan"), -0.0,
    "", "-1", "0x", "ffffffffffffffffff", "NaN", "Infinity", "1e999", "\u0000", "é" * 3, "-0x1", "+1", "1_0",
    None, True, False, [], {}, b"", b"\x00" * 9, [None], {"type": "BlockStored"}, {"": None},
    msgspec.msgpack.Ext(1, b"x"),
)
_BYTES = (b"\x00", b"\xff", b"\x7f", b"\x80", b"\xc0", b"\xc1", b"\xc7\x01\x05", b"\xcb", b"\xcf", b"\xd3",
          b"\xdc\xff\xff", b"\xdd\xff\xff\xff\xff", b"\x91", b"[", b"{", b'"', b"\\u", b"9" * 40, b"-",
          b"e999", b"\n", b"\r\n", b"#", b"{", b"}", b"=", b'"', b"+Inf", b"NaN")


def _deep(rng: random.Random) -> Any:
    value: Any = None
    for _ in range(rng.choice((50, 500, 2000))):
        value = [value] if rng.random() < 0.5 else {"k": value}
    return value


def _leaves(obj: Any, path: tuple[Any, ...], out: list[tuple[Any, ...]]) -> None:
    out.append(path)
    if len(out) > 4000 or len(path) > 64:  # the mutator's own recursion stays shallow
        return
    if isinstance(obj, list):
        for i, v in enumerate(obj[:64]):
            _leaves(v, (*path, i), out)
    elif isinstance(obj, dict):
        for k, v in list(obj.items())[:64]:
            _leaves(v, (*path, k), out)


def _replace(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, list):
        copy = list(obj)
        copy[head] = _replace(obj[head], rest, value)
        return copy
    copy = dict(obj)
    copy[head] = _replace(obj[head], rest, value)
    return copy


def _pick_value(rng: random.Random, old: Any) -> Any:
    r = rng.random()
    if r < 0.05:
        return _deep(rng)
    if r < 0.12 and isinstance(old, list) and old:
        return old + old[: rng.randrange(1, len(old) + 1)]  # longer list
    if r < 0.16 and isinstance(old, int | float) and not isinstance(old, bool):
        return -old if old else 1
    return rng.choice(INTERESTING)


def structured(data: bytes, rng: random.Random, kind: str) -> bytes | None:
    """``data`` decoded (kind ``msgpack`` or ``json``), one leaf changed, encoded again; None if it
    does not decode."""
    try:
        obj = msgspec.msgpack.decode(data) if kind == "msgpack" else msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    paths: list[tuple[Any, ...]] = []
    _leaves(obj, (), paths)
    path = rng.choice(paths)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        obj = _replace(obj, path, _pick_value(rng, _get(obj, path)))
    try:
        if kind == "msgpack":
            return msgspec.msgpack.encode(obj)
        return _json_encode(obj)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return None


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _json_encode(obj: Any) -> bytes:
    import json

    def fix(o: Any) -> Any:  # bytes and ext values have no JSON form: use text
        if isinstance(o, bytes | msgspec.msgpack.Ext):
            return repr(o)
        raise TypeError(type(o).__name__)

    return json.dumps(obj, default=fix, allow_nan=True).encode()


def _bytewise(data: bytes, rng: random.Random, others: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        op = rng.randrange(7)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif op == 2:
            b[i:i] = rng.choice(_BYTES)
        elif op == 3 and b:
            del b[i:i + rng.randrange(1, 16)]
        elif op == 4 and b:
            j = rng.randrange(len(b))
            b[i:i] = b[j:j + rng.randrange(1, 32)]
        elif op == 5:
            del b[i:]  # truncation
        elif op == 6 and others:
            other = rng.choice(others)
            j = rng.randrange(len(other) + 1)
            b = b[:i] + bytearray(other[j:])  # splice
    return bytes(b)


def mutate(data: bytes, rng: random.Random, *, kind: str | None, others: list[bytes],
           prefix: int = 0) -> bytes:
    """One mutant of ``data``; ``prefix`` leading bytes (a target's selector byte) are kept as they are
    by the structure-aware edits. ``kind``: msgpack, json or None (text: bytes only)."""
    if kind and rng.random() < 0.6:
        out = structured(data[prefix:], rng, kind)
        if out is not None:
            return data[:prefix] + out
    return _bytewise(data, rng, others)
