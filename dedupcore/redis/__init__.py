"""Redis as the dedup authority: :class:`RedisStore` (docs/stores.md).

Needs redis-py, which comes with the ``[redis]`` extra: without it, importing
this package (or any module of it) raises
:class:`~dedupcore.errors.MissingExtraError`, which names the extra.

The modules, by concern (docs/architecture.md): ``store`` (:class:`RedisStore`:
checks, the claim API, server settings, demotion), ``cluster`` (which server
each call goes to), ``connection`` (clients whose waits keep the call's
deadline) and the Lua scripts ``claim.lua`` and ``change.lua``.
"""

try:
    import redis  # noqa: F401  (checked here, before any module of the package uses it)
except ModuleNotFoundError as exc:  # redis-py comes with the [redis] extra
    if exc.name != "redis":
        raise
    from dedupcore.errors import MissingExtraError

    raise MissingExtraError(
        "dedupcore.redis needs redis, which is not installed: pip install 'dedupcore[redis]'"
    ) from exc

from dedupcore.redis.connection import deadline_client
from dedupcore.redis.store import DEFAULT_TIMEOUT, RedisStore

__all__ = ["DEFAULT_TIMEOUT", "RedisStore", "deadline_client"]
