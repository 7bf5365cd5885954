"""Redis as the dedup authority: :class:`RedisStore` (docs/stores.md).

Needs redis-py, which comes with the ``[redis]`` extra; without it, importing
this package raises :class:`~dedupcore.errors.MissingExtraError`.
"""

from dedupcore.redis.store import DEFAULT_TIMEOUT, RedisStore, deadline_client

__all__ = ["DEFAULT_TIMEOUT", "RedisStore", "deadline_client"]
