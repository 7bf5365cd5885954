"""The claim API every store shares (docs/architecture.md, "The contract").

:class:`ClaimAPI` (``contract.py``) writes the public calls once: each
checks its arguments into a :class:`ClaimBatch` or :class:`ChangeBatch`
(``batches.py``) and hands it to the store's primitives (``_claim_batch``,
``_change_batch``, ``_get_record``, with ``stats``); the single-key forms,
``processing()`` and the ``idempotent`` decorator come with it.
:class:`AsyncClaimAPI` is its asyncio twin (for :class:`dedupcore.aio.Client`),
sharing the decisions of ``conveniences.py``. ``answers.py`` holds what a
claim answers; ``deferred.py`` what the daemon asks of a store it decides on
its event loop. Every name is importable from here.
"""

from __future__ import annotations

from dedupcore.api.answers import Claim, KeyRecord, Outcome, namespace_counts
from dedupcore.api.batches import (
    MAX_FINGERPRINT_BYTES,
    MAX_OWNER_BYTES,
    MAX_TOKEN,
    ChangeBatch,
    ClaimBatch,
    ExtendBatch,
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
    HEARTBEAT_LEASE,
    DuplicateCache,
    idempotency_disabled,
    key_path,
)
from dedupcore.api.conveniences import (
    _disabled_logged as _disabled_logged,
)
from dedupcore.api.decorator import (
    _decorated_key as _decorated_key,  # the Celery integration builds on it
)
from dedupcore.api.serializers import (
    CustomSerializer,
    DataclassSerializer,
    PydanticSerializer,
    Serializer,
)
from dedupcore.errors import InProgressError, KeyPathError

__all__ = [
    "DISABLE_ENV",
    "HEARTBEAT_LEASE",
    "MAX_FINGERPRINT_BYTES",
    "MAX_OWNER_BYTES",
    "MAX_TOKEN",
    "AsyncClaimAPI",
    "ChangeBatch",
    "Claim",
    "ClaimAPI",
    "ClaimBatch",
    "CustomSerializer",
    "DataclassSerializer",
    "DuplicateCache",
    "ExtendBatch",
    "InProgressError",
    "KeyPathError",
    "KeyRecord",
    "Limits",
    "Outcome",
    "PydanticSerializer",
    "Serializer",
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
