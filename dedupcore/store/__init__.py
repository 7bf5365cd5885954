"""The embedded store: :class:`DedupStore` over one data directory.

``from dedupcore.store import DedupStore`` is the import the docs show; the
modules of this package hold the store by concern (docs/architecture.md).
"""

from dedupcore.store.store import (
    FRONT_COVERS,
    LOCK_FILE,
    LOG_HEAD_FILE,
    Claim,
    DedupStore,
    InProgressError,
    KeyRecord,
    Outcome,
    ReplyColumns,
    StoreLockedError,
    read_covers,
)

__all__ = [
    "Claim",
    "DedupStore",
    "InProgressError",
    "KeyRecord",
    "Outcome",
    "StoreLockedError",
]
