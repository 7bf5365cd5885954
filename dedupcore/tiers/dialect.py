"""Deprecated: the SQL dialects moved to :mod:`dedupcore.sql.dialects` (docs/compatibility.md).

The names of this module still import from here, with a
``DeprecationWarning``; this module will be removed in 0.3.0. Its functions
that took an engine's name are methods of the dialect objects now
(``dialect_of(name).ph``, ``.q(ident)``, ``.on_conflict_do_nothing(columns)``).
"""

import warnings
from collections.abc import Sequence
from typing import Any

from dedupcore.sql.dialects import (
    DEFAULT_TIMEOUT,
    connect_url,
    dialect_of,
    driver_error,
    is_unique_violation,
)
from dedupcore.sql.dialects import DIALECTS as _BY_NAME

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

#: The engines' names.
DIALECTS = tuple(_BY_NAME)


def detect_dialect(conn: Any) -> str:
    """The engine's name of a DB-API connection: ``dialect_of(conn).name``."""
    return dialect_of(conn).name


def placeholder(dialect: str) -> str:
    """The driver's parameter marker: ``dialect_of(dialect).ph``."""
    return dialect_of(dialect).ph


def quote(dialect: str, ident: str) -> str:
    """``ident`` quoted as an identifier: ``dialect_of(dialect).q(ident)``."""
    return dialect_of(dialect).q(ident)


def on_conflict_do_nothing(dialect: str, columns: Sequence[str]) -> str:
    """``dialect_of(dialect).on_conflict_do_nothing(columns)``."""
    return dialect_of(dialect).on_conflict_do_nothing(columns)
