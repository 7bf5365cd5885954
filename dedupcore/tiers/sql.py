"""Deprecated: the SQL authority moved to :mod:`dedupcore.sql` (docs/compatibility.md).

The names of this module still import from here, with a
``DeprecationWarning``; this module will be removed in 0.3.0.
"""

import random  # noqa: F401 (reached through this module by older code: sql.random)
import time  # noqa: F401 (likewise: sql.time)
import warnings
from typing import Any

from dedupcore.sql import (
    DEFAULT_TIMEOUT,
    DEFAULT_TOLERANCE,
    PARTITION_SPANS,
    PartitionDroppedError,
    SqlStore,
    check_event_time,
    dialect_of,
    id_time,
)
from dedupcore.sql.dialects import SQLiteDialect as _SQLite  # noqa: F401 (private, older code)
from dedupcore.sql.dialects import connect_url as _factory  # noqa: F401 (likewise)
from dedupcore.sql.transactions import connect_within as _connect_within  # noqa: F401

warnings.warn(
    "dedupcore.tiers.sql moved to dedupcore.sql (import SqlStore and the other names from "
    "there); the old module will be removed in 0.3.0",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_TOLERANCE",
    "PARTITION_SPANS",
    "PartitionDroppedError",
    "SqlStore",
    "check_event_time",
    "detect_dialect",
    "id_time",
]


def detect_dialect(conn: Any) -> str:
    """The engine's name of a DB-API connection: ``dedupcore.sql.dialect_of(conn).name``."""
    return dialect_of(conn).name
