"""Redis as the dedup authority: :class:`RedisStore` (docs/stores.md).

Needs redis-py, which comes with the ``[redis]`` extra: without it, importing
this package (or any module of it) raises
:class:`~dedupcore.errors.MissingExtraError`, which names the extra.

The modules, by concern (docs/architecture.md): ``store`` (:class:`RedisStore`:
checks, the claim API, server settings, demotion), ``cluster`` (which server
each call goes to), ``connection`` (clients whose waits keep the call's
deadline) and the Lua scripts ``claim.lua`` and ``change.lua``.
"""

from dedupcore._checks import extra_imports

with extra_imports("redis", "redis", "dedupcore.redis"):  # used by every module of it
    from dedupcore.redis.connection import deadline_client
    from dedupcore.redis.store import DEFAULT_TIMEOUT, RedisStore

__all__ = ["DEFAULT_TIMEOUT", "RedisStore", "deadline_client"]
