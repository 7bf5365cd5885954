"""What a store declares so that the daemon decides its batches on the event loop.

A :class:`DeferredStore` decides a checked batch without waiting for its log
and says which log position the answer waits for; the daemon hands that wait
to its group commit (docs/daemon.md). The daemon asks ``isinstance(store,
DeferredStore)``; a store that is not one is served by its blocking calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from dedupcore._engine import FORM_CHECK, FORM_CLAIMS, FORM_COLUMNS
from dedupcore.api.batches import ChangeBatch, ClaimBatch, Limits
from dedupcore.errors import BatchTooLargeError

__all__ = [
    "DEFERRED_MEMBERS",
    "FORM_CHECK",
    "FORM_CLAIMS",
    "FORM_COLUMNS",
    "Admit",
    "DeferredStore",
    "ReplyColumns",
    "bounded_reply",
]

#: A claim batch's answers in columns (``form=FORM_COLUMNS``): outcomes, tokens,
#: result indexes, results, cold indexes, takeover indexes.
ReplyColumns = tuple[bytes, bytes, list[int], list[Any], list[int], list[int]]

#: Called with the bytes of the stored results a decided claim batch's answer
#: carries, before anything is applied; raising refuses the batch unchanged.
Admit = Callable[[int], None]


@runtime_checkable
class DeferredStore(Protocol):
    """A store whose batches are decided now and made durable later.

    ``claim_deferred(batch, form=, admit=)`` answers ``(answer, lsn)``: the
    answer in ``form`` (FORM_CLAIMS: a list of Claims; FORM_COLUMNS:
    :data:`ReplyColumns`; FORM_CHECK: the bytes of the stored results it
    would carry, nothing applied, lsn 0). ``change_deferred(batch)`` answers
    the lsn of a completion or release (``check=True``: decided, nothing
    changed, a stale token raised, 0). No answer may be passed on before
    ``wait_durable(lsn)`` returned (lsn 0: nothing to wait for).
    ``has_namespace(ns)`` says whether a namespace has its id already;
    ``add_namespace(ns)`` gives it one, which can wait for the store's files
    (the daemon calls it in a worker thread before it decides the first batch
    of a namespace on its event loop). ``commit_bytes()`` is what the next
    commit would write;
    ``unsynced_commits`` is True where a commit writes to the OS without a sync.
    ``start_commit()`` starts the next commit on a native thread (False where
    it cannot); ``commit_fd()`` becomes readable when it is done, and
    ``finish_commit()`` then records it (True once none is under way).
    """

    limits: Limits

    @property
    def unsynced_commits(self) -> bool: ...

    def claim_deferred(
        self, batch: ClaimBatch, *, form: int = FORM_CLAIMS, admit: Admit | None = None
    ) -> tuple[Any, int]: ...

    def change_deferred(self, batch: ChangeBatch, *, check: bool = False) -> int: ...

    def wait_durable(self, lsn: int) -> None: ...

    def commit_bytes(self) -> int: ...

    def start_commit(self) -> bool: ...

    def finish_commit(self) -> bool: ...

    def commit_fd(self) -> int | None: ...


#: The members a DeferredStore has beyond the claim API: a wrapper that forwards
#: unknown attributes to the store inside it refuses these, so that it is not
#: taken for a DeferredStore and passed by (dedupcore/metrics.py).
DEFERRED_MEMBERS = frozenset(
    {
        "claim_deferred",
        "change_deferred",
        "wait_durable",
        "has_namespace",
        "add_namespace",
        "commit_bytes",
        "unsynced_commits",
        "start_commit",
        "finish_commit",
        "commit_fd",
    }
)


def bounded_reply(keys: int, reply_limit: int, row_bytes: int) -> Admit:
    """An ``admit`` refusing a claim of ``keys`` keys whose answer passes ``reply_limit``
    bytes: ``row_bytes`` per key plus the stored results it carries."""

    def admit(result_bytes: int) -> None:
        size = row_bytes * keys + result_bytes
        if size > reply_limit:
            raise BatchTooLargeError(
                f"the answer to a claim of these {keys} keys would be {size} bytes, over "
                f"{reply_limit} (the duplicates' stored results included); nothing was "
                "claimed: split the batch"
            )

    return admit
