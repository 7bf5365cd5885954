"""The four idempotency patterns, for when the business write lives in your own database.

- :mod:`dedupcore.patterns.unique` - business unique key: insert once, a
  unique-key conflict is DUPLICATE.
- :mod:`dedupcore.patterns.table` - transactional dedup table: the dedup row
  commits in the same transaction as the business write.
- :mod:`dedupcore.patterns.state` - state machine with compare-and-set on
  ``status`` and ``version``.
- :mod:`dedupcore.patterns.tokens` - idempotency tokens issued to callers and
  redeemed once over any store.
"""

from dedupcore.patterns.state import StateMachine, Transition, TransitionOutcome
from dedupcore.patterns.table import Consumption, consume, ensure_table
from dedupcore.patterns.tokens import (
    ExpiredTokenError,
    InvalidTokenError,
    Tokens,
    UnstoredResultError,
    issue_token,
    redeem,
)
from dedupcore.patterns.unique import SchemaError, insert_once, is_unique_violation

__all__ = [
    "Consumption",
    "ExpiredTokenError",
    "InvalidTokenError",
    "SchemaError",
    "StateMachine",
    "Tokens",
    "Transition",
    "TransitionOutcome",
    "UnstoredResultError",
    "consume",
    "ensure_table",
    "insert_once",
    "is_unique_violation",
    "issue_token",
    "redeem",
]
