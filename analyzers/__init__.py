"""Analyzers: lake relations -> Polars frames; no I/O besides the relations given."""

__all__: list[str] = []
