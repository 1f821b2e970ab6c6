"""Collectors: bytes from the outside world -> schema rows -> the lake. No analysis here."""

from kvlens.collector.imports import FORMATS, ImportResult, import_files

__all__ = ["FORMATS", "ImportResult", "import_files"]
