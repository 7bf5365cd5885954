"""Redis as a hot cache of PROCESSED records in front of another authority.

Only PROCESSED records are cached, and only after the authority holds them
(write-through on completion, fill on a DUPLICATE answer): a PROCESSED record
never changes, so a cache hit is always a correct DUPLICATE, and everything
else (NEW, IN_PROGRESS, leases, tokens) is decided by the authority. The TTL
is the namespace's ``hot_window``.

Each entry is one string ``<prefix>:<namespace>:<key>`` holding a msgpack
array ``[token, fingerprint_known, fingerprint, result]``. Reads and writes
are non-transactional pipelines, so keys of one batch may live on any Redis
Cluster node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

import dedupcore.keys as _keys
from dedupcore._checks import extra_imports
from dedupcore.retry import one_call
from dedupcore.tiers.base import Cached, CacheTier, check_timeout

with extra_imports("redis", "redis", "dedupcore.tiers.cache"):
    from redis.exceptions import RedisError

__all__ = ["RedisCache"]


class RedisCache(CacheTier):
    """A :class:`CacheTier` on a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client."""

    name = "redis-cache"
    unavailable = (RedisError, ConnectionError, TimeoutError, OSError)

    def __init__(self, client: Any, *, prefix: str = "dcc") -> None:
        self.client = client
        self.prefix = _keys.check_namespace(prefix)
        #: Seconds one read or write of the cache may take (docs/timeouts.md); set by
        #: :meth:`from_url`. None: the client's own timeouts and retries.
        self.timeout: float | None = None

    @classmethod
    def from_url(cls, url: str, *, timeout: float = 0.5, **options: Any) -> RedisCache:
        """A cache on ``redis://``, ``rediss://`` or ``unix://`` (redis-py's URL syntax).

        A short deadline by default: each read or write of the cache ends
        within ``timeout`` seconds (0.5), its connect, reply waits and one
        retry included (docs/timeouts.md), so a cache that does not answer
        quickly is skipped rather than waited for. ``options`` are redis-py
        client arguments.
        """
        from dedupcore.redis import deadline_client

        wait = check_timeout(timeout)
        cache = cls(deadline_client(url, wait, **options))
        cache.timeout = wait
        return cache

    def _name(self, namespace: bytes, key: bytes) -> bytes:
        return self.prefix + b":" + namespace + b":" + key

    @one_call
    def _get_many(self, namespace: bytes, keys: Sequence[bytes]) -> list[Cached | None]:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.get(self._name(namespace, k))
        out: list[Cached | None] = []
        for raw in pipe.execute():
            if raw is None:
                out.append(None)
                continue
            try:
                token, known, fp, result = msgpack.unpackb(raw, raw=True)
                out.append(Cached(int(token), result, fp, bool(known)))
            except (ValueError, TypeError, msgpack.UnpackException):
                out.append(None)  # not ours or damaged: the authority decides
        return out

    @one_call
    def _put_many(
        self, namespace: bytes, entries: Sequence[tuple[bytes, Cached]], ttl: float
    ) -> None:
        ms = max(1, int(ttl * 1000))
        pipe = self.client.pipeline(transaction=False)
        for k, e in entries:
            value = msgpack.packb(
                [e.token, e.fingerprint_known, e.fingerprint, e.result], use_bin_type=True
            )
            pipe.set(self._name(namespace, k), value, px=ms)
        pipe.execute()

    def close(self) -> None:
        self.client.close()

    def stats(self) -> dict[str, Any]:
        return {"prefix": self.prefix.decode()}
