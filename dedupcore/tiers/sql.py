"""Deprecated: the SQL authority moved to :mod:`dedupcore.sql` (docs/compatibility.md).

The names of this module still import from here, with a
``DeprecationWarning``; this module will be removed in 0.3.0.
"""

import random  # noqa: F401 (reached through this module by older code: sql.random)
import time  # noqa: F401 (likewise: sql.time)
import warnings

from dedupcore.sql import (
    DEFAULT_TIMEOUT,
    DEFAULT_TOLERANCE,
    PARTITION_SPANS,
    PartitionDroppedError,
    SqlStore,
    check_event_time,
    detect_dialect,
    id_time,
)
from dedupcore.sql.dialects import _DIALECTS
from dedupcore.sql.dialects import connect_url as _factory  # noqa: F401 (private, reached by older code)
from dedupcore.sql.watchdog import _connect_within  # noqa: F401 (likewise)

warnings.warn(
    "dedupcore.tiers.sql moved to dedupcore.sql (import SqlStore and the other names from "
    "there); the old module will be removed in 0.3.0",
    DeprecationWarning,
    stacklevel=2,
)

#: Private names that older code reached inside this module.
_SQLite = _DIALECTS["sqlite"]

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
