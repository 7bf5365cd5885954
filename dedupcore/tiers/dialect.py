"""Deprecated: the SQL dialects moved to :mod:`dedupcore.sql.dialects` (docs/compatibility.md).

The names of this module still import from here, with a
``DeprecationWarning``; this module will be removed in 0.3.0.
"""

import warnings

from dedupcore.sql.dialects import (
    DEFAULT_TIMEOUT,
    DIALECTS,
    connect_url,
    detect_dialect,
    driver_error,
    is_unique_violation,
    on_conflict_do_nothing,
    placeholder,
    quote,
)

warnings.warn(
    "dedupcore.tiers.dialect moved to dedupcore.sql.dialects; the old module will be "
    "removed in 0.3.0",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "DIALECTS",
    "connect_url",
    "detect_dialect",
    "driver_error",
    "is_unique_violation",
    "on_conflict_do_nothing",
    "placeholder",
    "quote",
]
