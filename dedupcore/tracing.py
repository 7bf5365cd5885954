"""OpenTelemetry spans around a store's calls: a claim visible in a trace.

``traced(store)`` wraps any claim API (a store, a stack, a :class:`~dedupcore.Client`,
or a :class:`dedupcore.aio.Client`) so that every claim, completion,
release, renewal and read is a span of the current trace (docs/tracing.md):
``dedupcore.claim``, ``dedupcore.complete``, ``dedupcore.release``,
``dedupcore.extend`` and ``dedupcore.get``, with the namespace, the batch
size and, for a claim, how many keys were NEW, DUPLICATE or IN_PROGRESS
and how many were taken over. Keys are never attributes: they may carry
personal data. A call that raises records the exception and sets the
span's status to ERROR. It needs ``opentelemetry-api`` (the ``otel``
extra); without an SDK configured the spans cost next to nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version as _version
from typing import Any

from dedupcore._checks import extra_imports
from dedupcore.api import (
    AsyncClaimAPI,
    ChangeBatch,
    Claim,
    ClaimAPI,
    ClaimBatch,
    ExtendBatch,
    KeyRecord,
    Outcome,
)
from dedupcore.wrapper import StoreWrapper, Wrapping

with extra_imports("opentelemetry", "otel", "dedupcore.tracing"):
    from opentelemetry import trace
    from opentelemetry.trace import Span, Status, StatusCode, Tracer, TracerProvider

__all__ = ["TracedAsyncStore", "TracedStore", "traced"]

#: The attribute names of a span (docs/tracing.md has the table).
NAMESPACE = "dedupcore.namespace"
KEYS = "dedupcore.keys"
OUTCOME = "dedupcore.outcome"
TAKEOVERS = "dedupcore.takeovers"
_COUNTS = {
    Outcome.NEW: "dedupcore.new",
    Outcome.DUPLICATE: "dedupcore.duplicate",
    Outcome.IN_PROGRESS: "dedupcore.in_progress",
}


class _Spans(Wrapping):
    """What both traced fronts share: the tracer, the span of a call, its outcome
    attributes, and the store's own attributes."""

    def __init__(self, store: Any, tracer: Tracer) -> None:
        super().__init__(store)
        self.tracer = tracer
        self._system = type(store).__name__

    @contextmanager
    def _span(self, operation: str, namespace: str, keys: int) -> Iterator[Span]:
        attributes: dict[str, Any] = {
            NAMESPACE: namespace,
            KEYS: keys,
            "dedupcore.store": self._system,
        }
        with self.tracer.start_as_current_span(
            f"dedupcore.{operation}",
            kind=trace.SpanKind.CLIENT,
            attributes=attributes,
            record_exception=True,
            set_status_on_exception=True,
        ) as span:
            yield span

    def _refused(self, operation: str, exc: Exception) -> None:
        """A call its arguments' check refused: a span of its own, with the error."""
        with self.tracer.start_as_current_span(f"dedupcore.{operation}") as span:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))

    @staticmethod
    def _answered(span: Span, claims: list[Claim]) -> None:
        counts = dict.fromkeys(_COUNTS, 0)
        takeovers = 0
        for c in claims:
            counts[c.outcome] += 1
            takeovers += c.takeover
        for outcome, n in counts.items():
            span.set_attribute(_COUNTS[outcome], n)
        span.set_attribute(TAKEOVERS, takeovers)
        if len(claims) == 1:
            span.set_attribute(OUTCOME, claims[0].outcome.value)

    @staticmethod
    def _change(batch: ChangeBatch) -> str:
        return "complete" if batch.completing else "release"


class TracedStore(_Spans, StoreWrapper):
    """A claim API whose calls are spans (see :func:`traced`); every other attribute
    is the store's own."""

    store: ClaimAPI

    def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        with self._span("claim", batch.namespace, len(batch)) as span:
            claims = self.store._claim_batch(batch)
            self._answered(span, claims)
            return claims

    def _change_batch(self, batch: ChangeBatch) -> None:
        with self._span(self._change(batch), batch.namespace, len(batch)):
            self.store._change_batch(batch)

    def _extend_batch(self, batch: ExtendBatch) -> None:
        with self._span("extend", batch.namespace, len(batch)):
            self.store._extend_batch(batch)

    def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        with self._span("get", ns.decode(), 1):
            return self.store._get_record(ns, key)


class TracedAsyncStore(_Spans, AsyncClaimAPI):
    """:class:`TracedStore` for an asyncio front end (:class:`dedupcore.aio.Client`)."""

    store: AsyncClaimAPI

    async def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        with self._span("claim", batch.namespace, len(batch)) as span:
            claims = await self.store._claim_batch(batch)
            self._answered(span, claims)
            return claims

    async def _change_batch(self, batch: ChangeBatch) -> None:
        with self._span(self._change(batch), batch.namespace, len(batch)):
            await self.store._change_batch(batch)

    async def _extend_batch(self, batch: ExtendBatch) -> None:
        with self._span("extend", batch.namespace, len(batch)):
            await self.store._extend_batch(batch)

    async def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        with self._span("get", ns.decode(), 1):
            return await self.store._get_record(ns, key)

    async def stats(self) -> dict[str, Any]:
        return await self.store.stats()

    async def aclose(self) -> None:
        await self.store.aclose()


def traced(
    store: ClaimAPI | AsyncClaimAPI,
    *,
    tracer_provider: TracerProvider | None = None,
) -> TracedStore | TracedAsyncStore:
    """``store`` with a span around each call (docs/tracing.md).

    ``tracer_provider``: where the spans go (default the global one that
    ``opentelemetry.trace.set_tracer_provider`` set). A sync claim API gives a
    :class:`TracedStore`, an asyncio one a :class:`TracedAsyncStore`;
    anything else is a TypeError.
    """
    tracer = trace.get_tracer("dedupcore", _version("dedupcore"), tracer_provider=tracer_provider)
    if isinstance(store, (TracedStore, TracedAsyncStore)):
        raise TypeError("this store is traced already: its calls would be spans twice")
    if isinstance(store, ClaimAPI):
        return TracedStore(store, tracer)
    if isinstance(store, AsyncClaimAPI):
        return TracedAsyncStore(store, tracer)
    raise TypeError(f"traced() takes a claim API, not {type(store).__name__}")
