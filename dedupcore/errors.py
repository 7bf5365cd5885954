"""Exceptions of dedupcore.

Every error derives from :class:`DedupError` and also from the built-in
exception it means, so ``except ValueError`` keeps working for callers that
do not know dedupcore.

Every public exception of the package is defined here (the modules that
raise them re-export theirs), and :data:`__all__` lists them all: the
daemon's protocol builds its table of the errors a reply can name from it
(``dedupcore/daemon/protocol.py``, docs/daemon.md).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BatchTooLargeError",
    "ConflictError",
    "CorruptFileError",
    "DedupError",
    "ExpiredTokenError",
    "FrameError",
    "InProgressError",
    "InvalidTokenError",
    "KeyPathError",
    "MissingExtraError",
    "MissingKeyError",
    "NotADataDirectoryError",
    "PartialBatchError",
    "PartitionDroppedError",
    "RequestRefusedError",
    "SchemaError",
    "SettingsError",
    "SocketPathError",
    "StaleTokenError",
    "StoreLockedError",
    "UnavailableError",
    "UnstoredResultError",
    "UnsupportedFormatError",
    "UnsupportedPlatformError",
    "WalFailedError",
]


class DedupError(Exception):
    """Root of every dedupcore error."""


class ConflictError(DedupError, ValueError):
    """The key was claimed before with a different fingerprint (IETF Idempotency-Key 422)."""


class StaleTokenError(DedupError, ValueError):
    """The fencing token is not the key's current one: the lease was taken over."""


class UnavailableError(DedupError, ConnectionError):
    """A tier needed to decide could not answer; the claim was not decided."""


class CorruptFileError(DedupError, ValueError):
    """A file on disk is truncated, damaged or not a dedupcore file."""


class UnsupportedFormatError(CorruptFileError):
    """A file was written by a newer format version than this dedupcore reads."""


class SchemaError(DedupError, LookupError):
    """A table is missing, or lacks the columns or unique index a dedup pattern needs."""


class SocketPathError(DedupError, OSError):
    """The daemon's socket path cannot be used safely."""


class BatchTooLargeError(DedupError, ValueError):
    """A batch whose reply could exceed the daemon's frame limit; nothing of it was applied.

    Split the batch into smaller ones.
    """


class PartialBatchError(DedupError):
    """A batch the client sent in several frames failed part way through.

    ``applied`` holds what the daemon answered for the parts before the
    failure: the :class:`~dedupcore.api.Claim` of each of the first
    ``len(applied)`` keys of a claim, or the count of items completed,
    released or renewed. The part that failed and every key after it were
    not applied, except after an :class:`UnavailableError` (the cause), whose
    part may or may not have been. The cause is ``__cause__``.
    """

    def __init__(self, message: str, applied: Any = None) -> None:
        super().__init__(message)
        self.applied = applied


class MissingExtraError(DedupError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it.

    For example ``pip install 'dedupcore[redis]'`` for a Redis authority or cache
    (docs/compatibility.md, "Installing").
    """


class UnsupportedPlatformError(DedupError, OSError):
    """This platform lacks something a part of dedupcore needs (docs/compatibility.md).

    For example ``SO_PEERCRED``, with which the daemon checks who connects: only
    Linux has it.
    """


# -- the embedded store and its log ------------------------------------------------


class StoreLockedError(DedupError, BlockingIOError):
    """The data directory is owned by another process."""


class WalFailedError(DedupError, OSError):
    """A write to the log failed earlier; its tail is unknown, so it refuses to append.

    Reopen the log: opening finds the last valid record and cuts the rest.
    """


class NotADataDirectoryError(DedupError, ValueError):
    """The path is not a data directory of the embedded store."""


# -- remote authorities -----------------------------------------------------------------


class RequestRefusedError(DedupError, ValueError):
    """A server refused a request's arguments or data: a bad request, not an outage.

    Retrying cannot help, so it is a ``ValueError`` as every other bad input,
    never an :class:`~dedupcore.errors.UnavailableError` (which callers retry).
    """


class PartitionDroppedError(DedupError, ValueError):
    """The event time's partition was dropped (it is older than the exact window).

    The store has no row to decide with and nowhere to write one; a stack
    with a cold archive answers the keys the archive holds before they get
    here (docs/sql-partitions.md).
    """


# -- the claim API's conveniences ----------------------------------------------------------


class InProgressError(DedupError):
    """Raised by :meth:`DedupStore.idempotent` while another owner holds the key."""


class KeyPathError(DedupError, LookupError):
    """A key path found nothing (or an empty value) in the payload: no key to dedup on."""


# -- the daemon's protocol ----------------------------------------------------------------


class FrameError(DedupError, ValueError):
    """A frame or message that does not follow the protocol."""


# -- patterns and integrations -----------------------------------------------------------


class InvalidTokenError(DedupError, ValueError):
    """The token was not issued with this secret and namespace: forged, garbled or foreign."""


class ExpiredTokenError(InvalidTokenError):
    """The token is genuine but its expiry has passed and it was never redeemed."""


class UnstoredResultError(DedupError, ValueError):
    """The operation ran once, but its result could not be stored (or is no longer stored).

    ``result`` holds the value on the attempt that produced it, and is None
    on retries. The token is used up: the operation will not run again.
    """

    def __init__(self, message: str, result: Any = None) -> None:
        super().__init__(message)
        self.result = result


class MissingKeyError(DedupError, ValueError):
    """A message carries no dedup key (no business id, key header or message id)."""


# -- the command line -----------------------------------------------------------------------


class SettingsError(DedupError, ValueError):
    """A setting that cannot be used; the message names the key and where it came from."""
