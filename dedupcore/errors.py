"""Exceptions of dedupcore.

Every error derives from :class:`DedupError` and also from the built-in
exception it means, so ``except ValueError`` keeps working for callers that
do not know dedupcore.
"""

from __future__ import annotations


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
