"""Deprecated: Redis as the authority moved to :mod:`dedupcore.redis`.

This path keeps working, with a ``DeprecationWarning``, until 0.3.0
(docs/compatibility.md, "Moved and removed names").
"""

import warnings

warnings.warn(
    "dedupcore.tiers.redis moved to dedupcore.redis; the old path will be removed in 0.3.0",
    DeprecationWarning,
    stacklevel=2,
)

from dedupcore.redis import DEFAULT_TIMEOUT, RedisStore, deadline_client  # noqa: E402

__all__ = ["DEFAULT_TIMEOUT", "RedisStore", "deadline_client"]
