"""The claim API every front end shares: DedupStore, Client, and the daemon's answers.

:class:`ClaimAPI` holds what is the same whatever carries the batch calls:
single-key forms, ``processing()`` and the ``idempotent`` decorator. A front
end implements ``claim_many``, ``complete_many``, ``release_many``, ``get``
and ``stats``. :class:`AsyncClaimAPI` is its asyncio twin (for
:class:`dedupcore.aio.Client`): the same conveniences as coroutines, built on
the same helpers (argument checks, key paths, the disable switch, the
duplicate cache), so the two cannot drift apart.
"""

from __future__ import annotations

from dedupcore.api.answers import Claim, KeyRecord, Outcome, namespace_counts
from dedupcore.api.batches import (
    MAX_TOKEN,
    ChangeBatch,
    ClaimBatch,
    Limits,
    change_items,
    check_fingerprints,
    check_owner,
    check_token,
    fingerprint_conflict,
    pack_result,
    result_refused,
    unpack_result,
)
from dedupcore.api.contract import AsyncClaimAPI, ClaimAPI
from dedupcore.api.conveniences import (
    DISABLE_ENV,
    DuplicateCache,
    idempotency_disabled,
    key_path,
)
from dedupcore.api.conveniences import (
    _decorated_key as _decorated_key,  # the Celery integration builds on it
)
from dedupcore.api.conveniences import (
    _disabled_logged as _disabled_logged,
)
from dedupcore.errors import InProgressError, KeyPathError

__all__ = [
    "DISABLE_ENV",
    "MAX_TOKEN",
    "AsyncClaimAPI",
    "ChangeBatch",
    "Claim",
    "ClaimAPI",
    "ClaimBatch",
    "DuplicateCache",
    "InProgressError",
    "KeyPathError",
    "KeyRecord",
    "Limits",
    "Outcome",
    "change_items",
    "check_fingerprints",
    "check_owner",
    "check_token",
    "fingerprint_conflict",
    "idempotency_disabled",
    "key_path",
    "namespace_counts",
    "pack_result",
    "result_refused",
    "unpack_result",
]
