"""dedupcore: idempotent consumers, exactly-once effect over at-least-once delivery."""

from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

from dedupcore._core import hash64, shard_many, shard_of
from dedupcore.api import Claim, InProgressError, KeyRecord, Outcome
from dedupcore.bloom import BloomFilter
from dedupcore.client import Client
from dedupcore.config import Retention, StoreConfig
from dedupcore.factory import open_store
from dedupcore.ring import BloomRing
from dedupcore.stack import ShardedStore, TieredStore

if TYPE_CHECKING:
    from dedupcore.store import DedupStore

__all__ = [
    "BloomFilter",
    "BloomRing",
    "Claim",
    "Client",
    "DedupStore",
    "InProgressError",
    "KeyRecord",
    "Outcome",
    "Retention",
    "ShardedStore",
    "StoreConfig",
    "TieredStore",
    "hash64",
    "open_store",
    "shard_many",
    "shard_of",
]
#: The installed distribution's version; pyproject.toml is the one place it is written.
__version__ = _version("dedupcore")


def __getattr__(name: str) -> Any:
    """``DedupStore`` on first use: a process that only talks to the daemon
    (``dedupcore.Client``) never loads the embedded store, its log or LMDB."""
    if name == "DedupStore":
        from dedupcore.store import DedupStore

        globals()["DedupStore"] = DedupStore
        return DedupStore
    raise AttributeError(f"module 'dedupcore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
