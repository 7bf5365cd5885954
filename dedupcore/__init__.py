"""dedupcore: idempotent consumers, exactly-once effect over at-least-once delivery."""

from dedupcore._core import hash64, shard_many, shard_of
from dedupcore.bloom import BloomFilter, BloomRing

__all__ = ["BloomFilter", "BloomRing", "hash64", "shard_many", "shard_of"]
__version__ = "0.1.0"
