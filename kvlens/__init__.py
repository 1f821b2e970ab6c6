"""kvlens, the spine: the schema (the contract), the lake, model geometry, errors and the CLI."""

from kvlens.errors import ConfigError, InputError, KvlensError, NoDataError, SchemaVersionError
from kvlens.schema import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "ConfigError", "InputError", "KvlensError", "NoDataError", "SchemaVersionError"]
__version__ = "0.1.0"
