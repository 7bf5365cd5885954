"""The idempotent decorator's conveniences: key paths, the disable switch, the duplicate cache.

The decorator and ``processing`` cases run through both drivers, the sync
``ClaimAPI`` and the async ``AsyncClaimAPI``, over the same store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedupcore import api
from dedupcore.api import (
    Claim,
    ClaimBatch,
    DuplicateCache,
    InProgressError,
    KeyPathError,
    Outcome,
    key_path,
)
from dedupcore.errors import ConflictError
from dedupcore.store import DedupStore
from dedupcore.writebehind import MemoryTable
from tests.support.drivers import MODES, AsyncOver, Driver
from tests.support.fakes import FakeClock

NS = "orders/billing"


class Counting(MemoryTable):
    """A store that counts its claim round trips."""

    def __init__(self) -> None:
        super().__init__()
        self.claims = 0

    def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        self.claims += 1
        return super()._claim_batch(batch)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DedupStore]:
    s = DedupStore.open(tmp_path / "data", durability="power-loss-unsafe")
    yield s
    s.close()


@pytest.fixture(autouse=True)
def enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with idempotency on and the disabled warning not yet logged."""
    monkeypatch.delenv(api.DISABLE_ENV, raising=False)
    api._disabled_logged.clear()


# -- key paths -------------------------------------------------------------------


@dataclass
class Order:
    id: str
    lines: list[dict[str, Any]]


SQS_EVENT = {
    "Records": [
        {"messageId": "m-1", "body": '{"order": {"id": 42, "lines": [{"sku": "a"}]}}'},
        {"messageId": "m-2", "body": "not json"},
    ],
    "headers": {"Idempotency-Key": "idem-7", "x.y": "dotted"},
}


@pytest.mark.parametrize(
    "path, expected",
    [
        ("Records[0].messageId", "m-1"),
        ("Records[-1].messageId", "m-2"),
        ("Records[0].body.order.id", "42"),  # a JSON body is parsed; an int key is its text
        ("Records[0].body.order.lines[0].sku", "a"),
        ('headers."Idempotency-Key"', "idem-7"),
        ('headers."x.y"', "dotted"),
    ],
)
def test_key_path_finds_the_key(path: str, expected: str) -> None:
    assert key_path(path)(SQS_EVENT) == expected


def test_key_path_reads_attributes_and_top_level_lists() -> None:
    assert key_path("id")(Order("o-1", [])) == "o-1"
    assert key_path("lines[0].sku")(Order("o-1", [{"sku": "b"}])) == "b"
    assert key_path("[1].id")([{"id": "x"}, {"id": "y"}]) == "y"
    assert key_path("k")({"k": b"raw"}) == b"raw"


def test_a_sub_document_is_hashed_canonically() -> None:
    one = key_path("order")({"order": {"id": 1, "lines": [1, 2]}})
    same = key_path("order")({"order": {"lines": [1, 2], "id": 1}})
    other = key_path("order")({"order": {"id": 2, "lines": [1, 2]}})
    assert isinstance(one, str) and one.startswith("sha256:") and len(one) == 7 + 64
    assert one == same != other


@pytest.mark.parametrize(
    "path, where",
    [
        ("Records[5].messageId", "Records[5]"),
        ("Records[0].nope", "Records[0].nope"),
        ("Records[1].body.order", "Records[1].body.order"),  # "not json"
        ("headers.missing", "headers.missing"),
        ("Records.messageId", "Records.messageId"),  # a list has no fields
        ("Records[0].messageId[0]", "Records[0].messageId[0]"),
    ],
)
def test_nothing_at_the_path_is_a_key_path_error(path: str, where: str) -> None:
    with pytest.raises(KeyPathError, match=where.replace("[", r"\[").replace("]", r"\]")):
        key_path(path)(SQS_EVENT)


@pytest.mark.parametrize("value", [None, "", b""])
def test_an_empty_value_is_a_key_path_error(value: object) -> None:
    with pytest.raises(KeyPathError, match="empty"):
        key_path("k")({"k": value})


@pytest.mark.parametrize("bad", ["", ".a", "a..b", "a[", "a[x]", "a.", 'a"b"', "a[0]b", "a]b"])
def test_a_malformed_path_is_refused_when_it_is_given(bad: str) -> None:
    with pytest.raises(ValueError, match="key path"):
        key_path(bad)


names = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8)


def quoted(name: str) -> str:
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


@given(st.lists(st.one_of(names, st.integers(-3, 3)), min_size=1, max_size=6), names)
def test_key_path_round_trip(steps: list[str | int], leaf: str) -> None:
    """A document built along any path of (quoted) names and indexes gives back its leaf."""
    if isinstance(steps[0], int):
        steps = ["root", *steps]
    doc: Any = leaf
    for step in reversed(steps):
        if isinstance(step, int):
            size = abs(step) + (1 if step >= 0 else 0)
            items: list[Any] = [None] * size
            items[step] = doc
            doc = items
        else:
            doc = {step: doc}
    path = "".join(f"[{s}]" if isinstance(s, int) else f".{quoted(s)}" for s in steps).lstrip(".")
    assert key_path(path)(doc) == leaf


# -- the decorator, sync and async ---------------------------------------------------


@pytest.fixture(params=MODES)
def front(request: pytest.FixtureRequest, store: DedupStore) -> Driver:
    return Driver(store, request.param)


def test_decorator_takes_the_key_from_the_payload(front: Driver) -> None:
    calls: list[Any] = []

    @front.idempotent(namespace=NS, key="order.id")
    def handle(event: dict[str, Any], context: object = None) -> dict[str, Any]:
        calls.append(event)
        return {"charged": event["order"]["amount"]}

    assert handle({"order": {"id": "o-1", "amount": 5}}) == {"charged": 5}
    assert handle({"order": {"id": "o-1", "amount": 999}}, "ctx") == {"charged": 5}  # duplicate
    assert handle(event={"order": {"id": "o-2", "amount": 7}}) == {"charged": 7}
    assert len(calls) == 2
    rec = front.store.get("o-1", namespace=NS)
    assert rec is not None and rec.result == {"charged": 5}


def test_decorator_payload_argument_by_name(front: Driver) -> None:
    calls = 0

    @front.idempotent(namespace=NS, key="Records[0].messageId", payload="event")
    def handle(context: object, event: dict[str, Any]) -> int:
        nonlocal calls
        calls += 1
        return calls

    assert handle(None, SQS_EVENT) == 1
    assert handle(context=None, event=SQS_EVENT) == 1
    assert calls == 1
    with pytest.raises(TypeError, match="no argument named 'evt'"):
        front.idempotent(namespace=NS, key="id", payload="evt")(handle)
    with pytest.raises(TypeError, match="key is a function"):
        front.idempotent(namespace=NS, key=lambda e: e, payload="event")(handle)


def test_decorator_without_a_key_does_not_run(front: Driver) -> None:
    calls = 0

    @front.idempotent(namespace=NS, key="order.id")
    def handle(event: dict[str, Any]) -> None:
        nonlocal calls
        calls += 1

    with pytest.raises(KeyPathError):
        handle({"order": {}})
    assert calls == 0


def test_decorator_with_a_key_function_still_works(front: Driver) -> None:
    runs = []

    @front.idempotent(namespace=NS, key=lambda a, b: f"{a}-{b}")
    def add(a: int, b: int) -> int:
        runs.append((a, b))
        return a + b

    assert add(1, 2) == 3 and add(1, 2) == 3 and add(2, 2) == 4
    assert runs == [(1, 2), (2, 2)]


def test_decorator_in_progress_and_failure(front: Driver) -> None:
    calls = 0

    @front.idempotent(namespace=NS, key="id")
    def handle(event: dict[str, Any]) -> int:
        nonlocal calls
        calls += 1
        if event.get("fail"):
            raise RuntimeError("no")
        return calls

    held = front.store.claim("busy", namespace=NS, owner="someone-else")
    with pytest.raises(InProgressError, match="busy"):
        handle({"id": "busy"})
    for _ in range(2):  # released after each failure, so it runs again
        with pytest.raises(RuntimeError, match="no"):
            handle({"id": "f", "fail": True})
    assert calls == 2
    front.store.complete("busy", held.token, namespace=NS, result=7)
    assert handle({"id": "busy"}) == 7 and calls == 2


def test_each_decorator_refuses_the_other_kind_of_function(store: DedupStore) -> None:
    async def coro(event: Any) -> None:
        pass

    def plain(event: Any) -> None:
        pass

    with pytest.raises(TypeError, match="async def"):
        store.idempotent(namespace=NS, key="id")(coro)
    with pytest.raises(TypeError, match="async def"):
        AsyncOver(store).idempotent(namespace=NS, key="id")(plain)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="decorates a function"):
        store.idempotent(namespace=NS, key="id")("not callable")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key path"):
        AsyncOver(store).idempotent(namespace=NS, key="a..b")(coro)


def test_async_processing_completes_releases_and_keeps_a_refused_result(
    store: DedupStore,
) -> None:
    api = AsyncOver(store)

    async def main() -> None:
        async with api.processing("p1", namespace=NS) as c:
            assert c.outcome is Outcome.NEW
            c.result = "done"
        async with api.processing("p1", namespace=NS) as c:
            assert c.outcome is Outcome.DUPLICATE and c.result == "done"
        with pytest.raises(RuntimeError):
            async with api.processing("p2", namespace=NS):
                raise RuntimeError("boom")
        assert (await api.claim("p2", namespace=NS)).outcome is Outcome.NEW
        with pytest.raises(TypeError):
            async with api.processing("p3", namespace=NS) as c:
                c.result = object()
        dup = await api.claim("p3", namespace=NS)
        assert dup.outcome is Outcome.DUPLICATE and dup.result is None

    asyncio.run(main())


# -- the disable switch ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_disabled_runs_every_time_and_logs_once(
    front: Driver,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    value: str,
) -> None:
    monkeypatch.setenv("DEDUPCORE_DISABLED", value)
    calls = 0

    @front.idempotent(namespace=NS, key="id")
    def handle(event: dict[str, Any]) -> int:
        nonlocal calls
        calls += 1
        return calls

    with caplog.at_level(logging.WARNING, logger="dedupcore"):
        assert [handle({"id": "k"}) for _ in range(3)] == [1, 2, 3]
        handle({})  # no key needed either: nothing is claimed
    assert front.store.get("k", namespace=NS) is None
    warnings = [r for r in caplog.records if "idempotency is disabled" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize("value", ["0", "false", "", "no"])
def test_other_values_leave_it_enabled(
    front: Driver, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("DEDUPCORE_DISABLED", value)
    calls = 0

    @front.idempotent(namespace=NS, key="id")
    def handle(event: dict[str, Any]) -> None:
        nonlocal calls
        calls += 1

    handle({"id": "k"})
    handle({"id": "k"})
    assert calls == 1


def test_the_switch_is_read_at_each_call(front: Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0

    @front.idempotent(namespace=NS, key="id")
    def handle(event: dict[str, Any]) -> None:
        nonlocal calls
        calls += 1

    handle({"id": "k"})
    monkeypatch.setenv("DEDUPCORE_DISABLED", "1")
    handle({"id": "k"})
    monkeypatch.delenv("DEDUPCORE_DISABLED")
    handle({"id": "k"})
    assert calls == 2


# -- the duplicate cache ----------------------------------------------------------------


@pytest.fixture(params=MODES)
def counted(request: pytest.FixtureRequest) -> tuple[Driver, Counting]:
    """A driver over a store that counts its claim round trips."""
    counting = Counting()
    return Driver(counting, request.param), counting


def test_a_hot_duplicate_costs_no_round_trip(counted: tuple[Driver, Counting]) -> None:
    front, counting = counted
    cache = DuplicateCache(maxsize=100, ttl=30.0, clock=FakeClock())
    calls = 0

    @front.idempotent(namespace=NS, key="id", cache=cache)
    def handle(event: dict[str, Any]) -> dict[str, int]:
        nonlocal calls
        calls += 1
        return {"n": calls}

    assert handle({"id": "k"}) == {"n": 1}  # NEW: not cached
    assert len(cache) == 0 and counting.claims == 1
    assert handle({"id": "k"}) == {"n": 1}  # DUPLICATE from the store: cached
    assert counting.claims == 2 and len(cache) == 1
    for _ in range(5):
        assert handle({"id": "k"}) == {"n": 1}
    assert counting.claims == 2 and calls == 1
    assert cache.stats() == {"size": 1, "hits": 5, "misses": 2, "evictions": 0}


def test_new_and_in_progress_are_never_cached(counted: tuple[Driver, Counting]) -> None:
    front, counting = counted
    cache = DuplicateCache(clock=FakeClock())
    held = counting.claim("busy", namespace=NS)
    assert not cache.put(held)
    busy = counting.claim("busy", namespace=NS)
    assert busy.outcome is Outcome.IN_PROGRESS and not cache.put(busy)

    @front.idempotent(namespace=NS, key="id", cache=cache)
    def handle(event: dict[str, Any]) -> None:
        pass

    before = counting.claims
    for _ in range(3):
        with pytest.raises(InProgressError):
            handle({"id": "busy"})
    assert counting.claims == before + 3 and len(cache) == 0
    counting.complete("busy", held.token, namespace=NS, result="done")
    assert handle({"id": "busy"}) == "done"
    assert len(cache) == 1


def test_entries_expire_after_the_ttl(counted: tuple[Driver, Counting]) -> None:
    front, counting = counted
    clock = FakeClock()
    cache = DuplicateCache(ttl=10.0, clock=clock)
    c = counting.claim("k", namespace=NS)
    counting.complete("k", c.token, namespace=NS, result=1)
    assert front.processing("k", namespace=NS, cache=cache).outcome is Outcome.DUPLICATE
    clock.now += 9.9
    d = front.processing("k", namespace=NS, cache=cache)
    assert d.outcome is Outcome.DUPLICATE and d.result == 1
    assert counting.claims == 2
    clock.now += 0.1  # exactly ttl after the answer: expired
    assert cache.get("k", namespace=NS) is None
    front.processing("k", namespace=NS, cache=cache)
    assert counting.claims == 3


def test_the_cache_is_bounded_least_recently_used_first() -> None:
    cache = DuplicateCache(maxsize=2, clock=FakeClock())
    for k in "ab":
        cache.put(Claim(k, NS, Outcome.DUPLICATE, 1, k))
    assert cache.get("a", namespace=NS) is not None  # a is now the most recent
    cache.put(Claim("c", NS, Outcome.DUPLICATE, 1, "c"))
    assert cache.get("b", namespace=NS) is None
    assert cache.get("a", namespace=NS) is not None and cache.get("c", namespace=NS) is not None
    assert cache.stats()["evictions"] == 1 and len(cache) == 2


def test_another_fingerprint_still_reaches_the_store(counted: tuple[Driver, Counting]) -> None:
    front, counting = counted
    cache = DuplicateCache(clock=FakeClock())
    c = counting.claim("k", namespace=NS, fingerprint=b"req-1")
    counting.complete("k", c.token, namespace=NS)
    d = front.processing("k", namespace=NS, fingerprint=b"req-1", cache=cache)
    assert d.outcome is Outcome.DUPLICATE
    front.processing("k", namespace=NS, fingerprint=b"req-1", cache=cache)
    assert counting.claims == 2  # the second one was a hit
    with pytest.raises(ConflictError):
        front.processing("k", namespace=NS, fingerprint=b"req-2", cache=cache)


def test_each_hit_is_a_fresh_copy() -> None:
    cache = DuplicateCache(clock=FakeClock())
    cache.put(Claim(b"k", NS, Outcome.DUPLICATE, 3, {"lines": [1, 2]}, exact=False))
    first = cache.get("k", namespace=NS)  # str and bytes name the same key
    assert first is not None and first.result == {"lines": [1, 2]}
    assert first.token == 3 and first.exact is False
    first.result["lines"].append(3)
    second = cache.get(b"k", namespace=NS)
    assert second is not None and second.result == {"lines": [1, 2]}


def test_cache_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        DuplicateCache(maxsize=0)
    with pytest.raises(ValueError):
        DuplicateCache(ttl=0)
