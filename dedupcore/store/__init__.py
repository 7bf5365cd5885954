"""The embedded store: :class:`DedupStore` over one data directory.

``from dedupcore.store import DedupStore`` is the import the docs show; the
modules of this package hold the store by concern (docs/architecture.md).
"""

from dedupcore.store.store import (
    Claim,
    DedupStore,
    InProgressError,
    KeyRecord,
    Outcome,
    StoreLockedError,
)
from dedupcore.store.store import ReplyColumns as ReplyColumns  # the daemon's reply

__all__ = [
    "Claim",
    "DedupStore",
    "InProgressError",
    "KeyRecord",
    "Outcome",
    "StoreLockedError",
]
