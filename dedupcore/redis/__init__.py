"""Redis as the dedup authority: :class:`RedisStore` (docs/stores.md).

Needs redis-py, which comes with the ``[redis]`` extra: without it, importing
this package (or any module of it) raises
:class:`~dedupcore.errors.MissingExtraError`, which names the extra.

The modules, by concern (docs/architecture.md): ``store`` (:class:`RedisStore`:
checks, the claim API, server settings, demotion), ``cluster`` (which server
each call goes to), ``connection`` (clients whose waits keep the call's
deadline) and the Lua scripts ``claim.lua`` and ``change.lua``.
"""

from dedupcore._checks import require_extra

# Checked here, before any module of the package uses redis-py (the [redis] extra).
require_extra("redis", "redis", "dedupcore.redis")

from dedupcore.redis.connection import deadline_client  # noqa: E402
from dedupcore.redis.store import DEFAULT_TIMEOUT, RedisStore  # noqa: E402

__all__ = ["DEFAULT_TIMEOUT", "RedisStore", "deadline_client"]
