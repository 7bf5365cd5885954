"""A relational database as the dedup authority: PostgreSQL, MariaDB/MySQL or SQLite.

:class:`SqlStore` (:mod:`dedupcore.sql.store`) keeps one record per
``(namespace, key)`` in a table and decides each batch in one transaction.
The engines' SQL and drivers differ only in :mod:`dedupcore.sql.dialects`;
partitions by event time are in :mod:`dedupcore.sql.partitions`
(docs/sql-partitions.md).
"""

from dedupcore.errors import PartitionDroppedError
from dedupcore.sql.dialects import DEFAULT_TIMEOUT, Dialect, dialect_of
from dedupcore.sql.partitions import DEFAULT_TOLERANCE, PARTITION_SPANS, check_event_time, id_time
from dedupcore.sql.store import SqlStore

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_TOLERANCE",
    "PARTITION_SPANS",
    "Dialect",
    "PartitionDroppedError",
    "SqlStore",
    "check_event_time",
    "dialect_of",
    "id_time",
]
