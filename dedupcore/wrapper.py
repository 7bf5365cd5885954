"""A claim API around another one: what the instrumented store (Prometheus) and the
traced stores (OpenTelemetry) share.

A wrapper is itself a claim API over the wrapped store's primitives: the
public calls check their arguments once (dedupcore/api/contract.py) and the
wrapper's primitives pass the checked batches on, counting or tracing them on
the way. Every other attribute (``sweep``, ``purge``, ``flush``, ``config``,
...) is the wrapped store's own, except a :class:`~dedupcore.api.deferred.DeferredStore`'s
members: forwarded, they would let the daemon's fast path pass the wrapper by.
"""

from __future__ import annotations

from typing import Any

from dedupcore.api import ChangeBatch, Claim, ClaimAPI, ClaimBatch, ExtendBatch, KeyRecord, Limits
from dedupcore.api.deferred import DEFERRED_MEMBERS
from dedupcore.tiers.base import failure_of

__all__ = ["StoreWrapper", "Wrapping"]


class Wrapping:
    """The wrapped store, its limits, and its other attributes (sync or asyncio)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        #: The store's.
        self.limits: Limits = store.limits

    def __getattr__(self, name: str) -> Any:
        if name == "store":  # not yet set (unpickling, a failed __init__)
            raise AttributeError(name)
        if name in DEFERRED_MEMBERS:  # the daemon's fast path would pass the wrapper by
            raise AttributeError(f"{type(self).__name__} does not forward {name}")
        return getattr(self.store, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.store!r})"


class StoreWrapper(Wrapping, ClaimAPI):
    """A sync claim API whose primitives, figures, durability, failure and ``close`` are
    the wrapped store's; a subclass overrides the primitives it watches."""

    store: ClaimAPI

    def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        return self.store._claim_batch(batch)

    def _change_batch(self, batch: ChangeBatch) -> None:
        self.store._change_batch(batch)

    def _extend_batch(self, batch: ExtendBatch) -> None:
        self.store._extend_batch(batch)

    def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        return self.store._get_record(ns, key)

    def _wait_change(self, batch: ClaimBatch, timeout: float, attempt: int) -> None:
        self.store._wait_change(batch, timeout, attempt)

    def stats(self) -> dict[str, Any]:
        """The store's own figures."""
        return self.store.stats()

    @property
    def failed(self) -> BaseException | None:
        """The wrapped store's failure (see :func:`~dedupcore.tiers.base.failure_of`)."""
        return failure_of(self.store)

    def durability(self) -> str:
        return self.store.durability()

    def durability_report(self) -> tuple[int, str]:
        return self.store.durability_report()

    def close(self) -> None:
        self.store.close()
