"""From a request's op and arguments to the store's call (docs/daemon.md)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from dedupcore.daemon.protocol import FrameError, Op

#: Ops answered on the event loop itself (they neither block nor touch the log).
_INLINE_OPS = frozenset({Op.PING})
#: Size of a CLAIM_MANY reply around its rows: frame header, [id, status, list header].
_REPLY_FIXED = 32
#: Upper bound of one claim row without its result: [outcome, token, result, exact, takeover].
_ROW_FIXED = 32
#: A CLAIM_MANY of more keys than this is decided on the event loop in slices of
#: SLICE_KEYS keys, with other connections' requests served between two slices.
SLICE_ABOVE = 8192
#: How long a large batch's next slice waits for the small requests in flight
#: to be answered, at most: under a steady stream of them batches still progress.
SMALL_FIRST_SECONDS = 0.005
#: Keys of one slice: about a millisecond of deciding. One slice of all the large
#: batches in flight is decided per pass of the event loop (they take turns), so a
#: request of another connection waits behind at most one slice per pass.
SLICE_KEYS = 1024
#: Ops the embedded store decides on the event loop (then only the commit is waited for).
_DEFERRED_OPS = frozenset({Op.CLAIM_MANY, Op.COMPLETE_MANY, Op.RELEASE_MANY})


class _Gate:
    """Two kinds of callers, each sharing the gate with its own kind only.

    Claim batches whose reply size was bounded by reading their keys' results
    first hold one side; completions (which store results) hold the other,
    so no result can grow between the reading and the claim.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = [0, 0]
        self._waiting = [0, 0]

    @contextlib.contextmanager
    def side(self, side: int) -> Iterator[None]:
        other = 1 - side
        with self._cond:
            self._waiting[side] += 1
            # Wait while the other side is in, or while it waits and this side is
            # in (so a steady stream of one kind cannot starve the other).
            while self._active[other] or (self._waiting[other] and self._active[side]):
                self._cond.wait()
            self._waiting[side] -= 1
            self._active[side] += 1
        try:
            yield
        finally:
            with self._cond:
                self._active[side] -= 1
                self._cond.notify_all()


_CLAIMS, _COMPLETES = 0, 1


def _max_result_bytes(store: Any, ceiling: int) -> int:
    """The largest result ``store`` keeps, as far as it says (else ``ceiling``)."""
    for holder in (store, getattr(store, "config", None)):
        limit = getattr(holder, "max_result_bytes", None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return ceiling


def _arg(args: dict[str, Any], name: str, kind: Any) -> Any:
    if name not in args:
        raise FrameError(f"missing argument {name!r}")
    value = args[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"argument {name!r} has type {type(value).__name__}")
    return value


def _optional(args: dict[str, Any], name: str, kind: Any) -> Any:
    if args.get(name) is None:
        return None
    return _arg(args, name, kind)


def _claim_options(args: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a CLAIM_MANY request for the store's claim methods."""
    return {
        "namespace": _arg(args, "ns", str),
        "lease": _optional(args, "lease", (int, float)),
        "owner": _optional(args, "owner", (bytes, str)),
        "fingerprints": _optional(args, "fps", list),
    }
