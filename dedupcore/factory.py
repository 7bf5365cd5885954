"""Opening a store by URL: ``open_store`` builds the authority, a stack or shards.

``open_store`` turns a directory, a ``redis://``/``postgresql://``/... URL, a
store object or a list of those into the embedded store, a remote authority,
a :class:`~dedupcore.stack.TieredStore` or a
:class:`~dedupcore.stack.ShardedStore`. This module sits above the stores and
stacks it builds (docs/architecture.md, "The layers"); none of them imports it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dedupcore.api import ClaimAPI
from dedupcore.stack import ShardedStore, TieredStore
from dedupcore.tiers.archive import ColdArchive
from dedupcore.tiers.base import CacheTier

__all__ = ["open_store"]

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_SQL_SCHEMES = ("postgresql://", "postgres://", "mysql://", "mariadb://", "sqlite:///")


def _open_authority(target: Any, options: dict[str, Any]) -> ClaimAPI:
    if isinstance(target, ClaimAPI):
        return target
    if isinstance(target, os.PathLike):
        target = os.fspath(target)
    if not isinstance(target, str) or not target:
        raise TypeError(
            f"an authority is a URL, a directory or a store object, not {type(target).__name__}"
        )
    if target.startswith(_REDIS_SCHEMES):
        from dedupcore.redis import RedisStore

        return RedisStore.from_url(target, **options)
    if target.startswith(_SQL_SCHEMES):
        from dedupcore.sql import SqlStore

        return SqlStore.from_url(target, **options)
    if "://" in target and not target.startswith("file://"):
        scheme = target.split("://", 1)[0]
        raise ValueError(
            f"unknown store URL scheme {scheme!r}: use redis://, rediss://, unix://, "
            "postgresql://, mysql://, sqlite:/// or a directory"
        )
    from dedupcore.config import StoreConfig
    from dedupcore.store import DedupStore

    path = target[len("file://") :] if target.startswith("file://") else target
    return DedupStore.open(path, config=StoreConfig(**options))


def open_store(
    authority: str | os.PathLike[str] | ClaimAPI | Sequence[str | os.PathLike[str] | ClaimAPI],
    *,
    cache: str | CacheTier | None = None,
    front: bool | None = None,
    archive: str | os.PathLike[str] | ColdArchive | None = None,
    init_schema: bool = False,
    **options: Any,
) -> ClaimAPI:
    """Opens a store stack from URLs or objects.

    ``authority``: a directory (the embedded :class:`~dedupcore.DedupStore`),
    ``redis://``/``rediss://``/``unix://`` (:class:`RedisStore`),
    ``postgresql://``/``mysql://``/``sqlite:///path`` (:class:`SqlStore`), a
    store object you built with your own client, or a list of those (a
    :class:`ShardedStore`, one stack per shard). ``cache``: a Redis URL or a
    :class:`CacheTier`. ``front`` defaults to on for a remote authority and
    off for the embedded one, which has its own. ``options`` go to each
    authority's constructor (``retention``, ``namespaces``, ``lease``, ...).
    ``init_schema``: create a SQL authority's table when it is missing (what
    ``dedupcore sql init`` does); otherwise a missing table is an error.

    A stack is only built when it adds a tier: with no ``cache`` and no
    ``archive`` the authority itself is returned (a front filter alone saves
    nothing, since every key it passes still goes to the authority). A SQL
    authority returned alone keeps its retention through its own
    :meth:`~dedupcore.sql.SqlStore.sweep`.
    """
    if isinstance(authority, (list, tuple)):
        if not authority:
            raise ValueError("an empty list of shards")
        shards = [
            open_store(
                a,
                cache=cache,
                front=front,
                archive=_shard_dir(archive, i),
                init_schema=init_schema,
                **options,
            )
            for i, a in enumerate(authority)
        ]
        return ShardedStore(shards, max_key_bytes=options.get("max_key_bytes", 512))
    store = _open_authority(authority, dict(options))
    if init_schema:
        init = getattr(store, "init_schema", None)
        if init is not None:
            init()
    if cache is None and archive is None:
        return store
    from dedupcore.store import DedupStore

    if front is None:
        front = not isinstance(store, DedupStore)  # the embedded store has its own
    cache_tier: CacheTier | None
    if isinstance(cache, str):
        from dedupcore.tiers.cache import RedisCache

        cache_tier = RedisCache.from_url(cache)
    else:
        cache_tier = cache
    stack_options = {
        k: options[k]
        for k in ("retention", "namespaces", "max_key_bytes", "max_result_bytes")
        if k in options
    }
    try:
        return TieredStore(
            store,
            cache=cache_tier,
            front=front,
            archive=archive,
            **stack_options,
        )
    except BaseException:
        store.close()
        raise


def _shard_dir(
    archive: str | os.PathLike[str] | ColdArchive | None, i: int
) -> str | os.PathLike[str] | ColdArchive | None:
    if archive is None or isinstance(archive, ColdArchive):
        return archive
    return Path(archive) / f"shard-{i}"
