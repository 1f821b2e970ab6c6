"""kvlens, the spine: the schema (the contract), the lake, model geometry, errors and the CLI."""

import os
from pathlib import Path

from kvlens.errors import ConfigError, InputError, KvlensError, NoDataError, SchemaVersionError
from kvlens.schema import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "ConfigError", "InputError", "KvlensError", "NoDataError", "SchemaVersionError"]
__version__ = "0.1.0"

# numba's on-disk cache of the analyzers' compiled kernels pickles each kernel's module name and is
# keyed only by its source file's path and stamp, so an entry written before the kvlens.* namespace
# ("analyzers.replay") fails to load under it (ModuleNotFoundError) wherever the file did not change.
# kvlens keeps its kernels in a cache directory of its own, named for this layout, unless the user
# chose one (NUMBA_CACHE_DIR); numba reads the variable when first imported, which is after this.
_NUMBA_LAYOUT = "namespace-1"


def _numba_cache_dir() -> None:
    if "NUMBA_CACHE_DIR" in os.environ:
        return
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    base = cache_home / "kvlens" / "numba" / _NUMBA_LAYOUT
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # not writable: numba's own default (beside the source, else its user cache)
    if os.access(base, os.W_OK):
        os.environ["NUMBA_CACHE_DIR"] = str(base)


_numba_cache_dir()
