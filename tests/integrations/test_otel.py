"""OpenTelemetry spans of ``traced(store)``, read from the SDK's in-memory exporter:
the embedded store, the memory table, a daemon's sync client and its asyncio client
(a real ``dedupcore serve`` process)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from dedupcore import aio
from dedupcore.api import ClaimAPI, Outcome
from dedupcore.errors import ConflictError, StaleTokenError
from dedupcore.memory import MemoryTable
from dedupcore.store import DedupStore
from dedupcore.tracing import TracedAsyncStore, TracedStore, traced
from tests.support.daemon import Daemon
from tests.support.stores import unique_ns


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _by_name(exporter: InMemorySpanExporter) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for span in exporter.get_finished_spans():
        assert isinstance(span, ReadableSpan)
        out.append((span.name, dict(span.attributes or {})))
    return out


def _script(api: ClaimAPI, ns: str) -> None:
    first = api.claim_many(["a", "b"], namespace=ns, fingerprints=[b"x", None])
    assert api.claim("a", namespace=ns, owner="other").outcome is Outcome.IN_PROGRESS
    api.complete("a", first[0].token, namespace=ns, result="r")
    api.release("b", first[1].token, namespace=ns)
    assert api.claim("a", namespace=ns).outcome is Outcome.DUPLICATE
    assert api.get("a", namespace=ns) is not None


@pytest.fixture(params=["embedded", "memory", "daemon"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ClaimAPI]:
    if request.param == "embedded":
        s: ClaimAPI = DedupStore.open(tmp_path / "data")
    elif request.param == "memory":
        s = MemoryTable()
    else:
        daemon: Daemon = request.getfixturevalue("daemon")
        s = daemon.client()
    yield s
    s.close()


def test_every_call_is_a_span_with_its_outcomes(
    store: ClaimAPI, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    api = traced(store, tracer_provider=provider)
    assert isinstance(api, TracedStore)
    ns = unique_ns("otel")
    _script(api, ns)
    got = _by_name(exporter)
    assert [name for name, _ in got] == [
        "dedupcore.claim",
        "dedupcore.claim",
        "dedupcore.complete",
        "dedupcore.release",
        "dedupcore.claim",
        "dedupcore.get",
    ]
    claim_two, busy, complete, _release, dup, get = (attrs for _, attrs in got)
    assert claim_two["dedupcore.namespace"] == ns and claim_two["dedupcore.keys"] == 2
    assert claim_two["dedupcore.new"] == 2 and "dedupcore.outcome" not in claim_two
    assert busy["dedupcore.outcome"] == "in_progress" and busy["dedupcore.in_progress"] == 1
    assert dup["dedupcore.outcome"] == "duplicate" and dup["dedupcore.takeovers"] == 0
    assert complete["dedupcore.keys"] == 1 and get["dedupcore.namespace"] == ns
    assert complete["dedupcore.store"] == type(store).__name__
    for _, attrs in got:  # keys are never attributes
        assert not any(v in ("a", "b", b"a", b"b") for v in attrs.values())


def test_a_failed_call_records_its_error(
    store: ClaimAPI, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    api = traced(store, tracer_provider=provider)
    ns = unique_ns("otel")
    c = api.claim("k", namespace=ns, fingerprint=b"one")
    with pytest.raises(ConflictError):
        api.claim("k", namespace=ns, fingerprint=b"two")
    with pytest.raises(StaleTokenError):
        api.complete("k", c.token + 1, namespace=ns)
    with pytest.raises(TypeError):
        api.claim_many([1.5], namespace=ns)  # type: ignore[list-item]
    failed = [s for s in exporter.get_finished_spans() if s.status.status_code is StatusCode.ERROR]
    kinds = [
        (s.name, str(s.events[0].attributes["exception.type"]).rsplit(".", 1)[-1])  # type: ignore[index]
        for s in failed
    ]
    assert kinds == [
        ("dedupcore.claim", "ConflictError"),
        ("dedupcore.complete", "StaleTokenError"),
        ("dedupcore.claim", "TypeError"),
    ]


def test_the_async_client_is_traced_too(
    daemon: Daemon, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    ns = unique_ns("otel")

    async def main() -> None:
        api = traced(aio.Client(daemon.socket), tracer_provider=provider)
        assert isinstance(api, TracedAsyncStore)
        async with api.processing("k", namespace=ns) as c:
            assert c.outcome is Outcome.NEW
            c.result = 1
        assert (await api.claim("k", namespace=ns)).result == 1
        await api.aclose()

    asyncio.run(main())
    got = _by_name(exporter)
    assert [name for name, _ in got] == ["dedupcore.claim", "dedupcore.complete", "dedupcore.claim"]
    assert got[0][1]["dedupcore.outcome"] == "new" and got[2][1]["dedupcore.duplicate"] == 1


def test_traced_refuses_what_it_cannot_wrap(spans: tuple[TracerProvider, Any]) -> None:
    provider, _ = spans
    table = traced(MemoryTable(), tracer_provider=provider)
    with pytest.raises(TypeError, match="traced already"):
        traced(table)
    with pytest.raises(TypeError, match="claim API"):
        traced(object())  # type: ignore[arg-type]
    assert table.limits == MemoryTable().limits
