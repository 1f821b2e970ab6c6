"""The spine's value limits: what each schema type can hold, checked where outside bytes become rows.

A decoder that yields a row its column cannot hold (a time past int64 nanoseconds, a NaN, a
``dp_rank`` past INTEGER, a negative UBIGINT hash) does not fail where it decodes: it fails
later, in the lake writer, with every other row of the batch. So every collector checks its
rows here first and turns a value that does not fit into a counted decode error of that one
event, span or line.

- ``INTEGER`` [-2**31, 2**31-1], ``BIGINT`` [-2**63, 2**63-1], ``UBIGINT`` [0, 2**64-1], as
  DuckDB and Arrow store them; booleans are not integers here.
- ``DOUBLE``: finite only. NaN and infinities fit the storage but no analysis can use them
  (a percentile, a sum, a join on time), and no engine means them.
- ``VARCHAR``: a ``str`` that encodes as UTF-8 (a lone surrogate does not).
- ENUM columns: a value of their StrEnum. ``MAP(VARCHAR, VARCHAR)``: (str, str) pairs.
  ``INTEGER[]``: a list of INTEGER values.
- NULL (None) fits every column.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from kvlens.schema import Column, Table

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "INT64_MAX",
    "INT64_MIN",
    "UINT64_MAX",
    "fits",
    "ints_fit",
    "row_problem",
]

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1

_INT_RANGES = {"INTEGER": (INT32_MIN, INT32_MAX), "BIGINT": (INT64_MIN, INT64_MAX),
               "UBIGINT": (0, UINT64_MAX)}


def _int_fits(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _str_fits(value: Any) -> bool:
    if type(value) is not str:
        return False
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def fits(column: Column, value: Any) -> bool:
    """Whether ``value`` can be stored in ``column`` and used by the analyses (None always can)."""
    if value is None:
        return True
    kind = column.type
    if kind in _INT_RANGES:
        return _int_fits(value, *_INT_RANGES[kind])
    if kind == "DOUBLE":
        return type(value) in (float, int) and math.isfinite(value)
    if kind == "BOOLEAN":
        return type(value) is bool
    enum = column.enum
    if enum is not None:
        return value in enum._value2member_map_
    if kind == "VARCHAR":
        return _str_fits(value)
    if kind == "MAP(VARCHAR, VARCHAR)":
        pairs = list(value.items()) if isinstance(value, Mapping) else value
        return isinstance(pairs, list | tuple) and all(
            isinstance(p, tuple | list) and len(p) == 2 and _str_fits(p[0]) and _str_fits(p[1])
            for p in pairs)
    if kind == "INTEGER[]":
        return isinstance(value, list | tuple) and all(_int_fits(v, INT32_MIN, INT32_MAX) for v in value)
    raise KeyError(f"no limits known for column type {kind!r} ({column.name})")


_ARRAY_CODES = {"INTEGER": "i", "BIGINT": "q", "UBIGINT": "Q"}  # C types of exactly these ranges


def ints_fit(column: Column, values: Sequence[Any]) -> bool:
    """Whether every value of ``values`` (ints or None) fits the integer ``column``: converted to a C
    array in one call for the usual all-int list, one by one otherwise."""
    try:
        array(_ARRAY_CODES[column.type], values)  # refuses floats, None and values out of range
        return True
    except (OverflowError, TypeError):
        return all(fits(column, v) for v in values)


_BY_NAME: dict[str, dict[str, Column]] = {}


def row_problem(table: Table, row: Mapping[str, Any]) -> str | None:
    """The first column of ``row`` whose value ``table`` cannot hold, in words; None when all fit.

    Keys that are not columns of ``table`` are a problem too (the writer would refuse them).
    """
    columns = _BY_NAME.get(table.name)
    if columns is None:
        columns = _BY_NAME[table.name] = {c.name: c for c in table.columns}
    for name, value in row.items():
        column = columns.get(name)
        if column is None:
            return f"{table.name} has no column {name!r}"
        if value is None:
            continue
        kind = column.type
        if kind in _INT_RANGES:  # the common case, inline
            low, high = _INT_RANGES[kind]
            if type(value) is int and low <= value <= high:
                continue
        elif kind == "VARCHAR" and type(value) is str and value.isascii():
            continue
        if not fits(column, value):
            return f"{name} = {value!r:.60} does not fit {table.name}.{name} ({column.type})"
    return None
