"""The decorator's options, through the sync and the async API over one embedded store:
results of any type (``serializer=``), composite keys, ``on_duplicate=``,
``validate=`` and ``heartbeat=``."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest

from dedupcore.api import (
    Claim,
    CustomSerializer,
    DataclassSerializer,
    InProgressError,
    Outcome,
    PydanticSerializer,
)
from dedupcore.errors import ConflictError, KeyPathError
from dedupcore.memory import MemoryTable
from dedupcore.store import DedupStore
from tests.support.drivers import MODES, AsyncOver, Driver

NS = "orders/decorated"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DedupStore]:
    s = DedupStore.open(tmp_path / "data")
    yield s
    s.close()


@pytest.fixture(params=MODES)
def front(request: pytest.FixtureRequest, store: DedupStore) -> Driver:
    return Driver(store, request.param)


@pytest.fixture(autouse=True)
def enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEDUPCORE_DISABLED", raising=False)


@dataclasses.dataclass(frozen=True)
class Line:
    sku: str
    qty: int


@dataclasses.dataclass(frozen=True)
class Receipt:
    order: str
    total: float
    lines: list[Line]
    note: Line | None = None
    by_sku: dict[str, Line] = dataclasses.field(default_factory=dict)
    tags: tuple[str, ...] = ()


class Invoice(pydantic.BaseModel):
    order: str
    total: float
    lines: list[dict[str, int]]


def _receipt(event: dict[str, Any]) -> Receipt:
    line = Line(event["sku"], event["qty"])
    return Receipt(event["id"], 9.5, [line], note=line, by_sku={line.sku: line}, tags=("a", "b"))


@pytest.mark.parametrize("spec", [Receipt, DataclassSerializer(Receipt)])
def test_a_dataclass_result_is_replayed_as_the_same_dataclass(front: Driver, spec: Any) -> None:
    calls: list[str] = []

    @front.idempotent(namespace=NS, key="id", serializer=spec)
    def handle(event: dict[str, Any]) -> Receipt:
        calls.append(event["id"])
        return _receipt(event)

    event = {"id": "o-1", "sku": "x", "qty": 2}
    first = handle(event)
    again = handle(event)
    assert calls == ["o-1"]
    assert type(again) is Receipt and type(again.lines[0]) is Line
    assert type(again.note) is Line and type(again.by_sku["x"]) is Line
    assert again == first == _receipt(event)


@pytest.mark.parametrize("spec", [Invoice, PydanticSerializer(Invoice)])
def test_a_pydantic_result_is_replayed_as_the_same_model(front: Driver, spec: Any) -> None:
    calls: list[str] = []

    @front.idempotent(namespace=NS, key="id", serializer=spec)
    def handle(event: dict[str, Any]) -> Invoice:
        calls.append(event["id"])
        return Invoice(order=event["id"], total=3.25, lines=[{"x": 1}])

    first = handle({"id": "o-2"})
    again = handle({"id": "o-2"})
    assert calls == ["o-2"] and isinstance(again, Invoice) and again == first


def test_a_custom_pair_stores_what_it_dumps(front: Driver, store: DedupStore) -> None:
    pair = CustomSerializer(lambda v: {"c": [v.real, v.imag]}, lambda s: complex(*s["c"]))

    @front.idempotent(namespace=NS, key="id", serializer=pair)
    def handle(event: dict[str, Any]) -> complex:
        return complex(1, 2)

    assert handle({"id": "c"}) == handle({"id": "c"}) == complex(1, 2)
    record = store.get("c", namespace=NS)
    assert record is not None and record.result == {"c": [1.0, 2.0]}


def test_a_result_its_serializer_refuses_is_done_once_and_raised(front: Driver) -> None:
    calls: list[int] = []

    @front.idempotent(namespace=NS, key="id", serializer=Receipt)
    def handle(event: dict[str, Any]) -> Any:
        calls.append(1)
        return "not a receipt"

    with pytest.raises(TypeError, match="not a Receipt"):
        handle({"id": "bad"})
    # The work was done: the key is completed without a result, not released.
    assert handle({"id": "bad"}) is None and calls == [1]


def test_serializer_arguments_are_checked_when_decorating(front: Driver) -> None:
    for bad in (dict, 3, "json"):
        with pytest.raises(TypeError, match="serializer"):
            front.idempotent(namespace=NS, key="id", serializer=bad)(lambda e: e)
    with pytest.raises(TypeError):
        DataclassSerializer(Invoice)
    with pytest.raises(TypeError):
        PydanticSerializer(Receipt)
    with pytest.raises(TypeError):
        CustomSerializer(len, "not callable")  # type: ignore[arg-type]


def test_a_composite_key_is_the_values_of_its_paths_together(
    front: Driver, store: DedupStore
) -> None:
    calls: list[Any] = []

    @front.idempotent(namespace=NS, key=("tenant", "order.id"))
    def handle(event: dict[str, Any]) -> int:
        calls.append(event)
        return len(calls)

    a = {"tenant": "t1", "order": {"id": "7"}}
    b = {"tenant": "t2", "order": {"id": "7"}}
    c = {"tenant": "t1,7", "order": {"id": ""}}
    assert handle(a) == 1 and handle(b) == 2 and handle(a) == 1
    assert store.get('["t1","7"]', namespace=NS) is not None
    with pytest.raises(KeyPathError, match="empty"):
        handle(c)
    with pytest.raises(KeyPathError):
        handle({"tenant": "t1"})
    for bad in ((), ("a", 1)):
        with pytest.raises(TypeError, match="composite key"):
            front.idempotent(namespace=NS, key=bad)(lambda e: e)


def test_on_duplicate_gets_the_stored_result_and_the_claim(front: Driver) -> None:
    seen: list[tuple[Any, Outcome]] = []

    def replayed(result: Any, claim: Claim) -> Any:
        seen.append((result, claim.outcome))
        return {"replayed": result}

    @front.idempotent(namespace=NS, key="id", on_duplicate=replayed, serializer=Receipt)
    def handle(event: dict[str, Any]) -> Receipt:
        return _receipt(event)

    event = {"id": "d-1", "sku": "y", "qty": 1}
    assert handle(event) == _receipt(event) and seen == []
    assert handle(event) == {"replayed": _receipt(event)}
    assert seen == [(_receipt(event), Outcome.DUPLICATE)]
    with pytest.raises(TypeError, match="on_duplicate"):
        front.idempotent(namespace=NS, key="id", on_duplicate=3)(lambda e: e)


def test_an_async_on_duplicate_hook_is_awaited(store: DedupStore) -> None:
    api = AsyncOver(store)

    async def hook(result: Any, claim: Claim) -> Any:
        await asyncio.sleep(0)
        return ("hooked", result, claim.token)

    @api.idempotent(namespace=NS, key="id", on_duplicate=hook)
    async def handle(event: dict[str, Any]) -> str:
        return "first"

    async def main() -> tuple[Any, Any]:
        return await handle({"id": "h"}), await handle({"id": "h"})

    first, again = asyncio.run(main())
    assert first == "first" and again[:2] == ("hooked", "first") and again[2] >= 1


def test_validate_refuses_a_reused_key_with_other_values(front: Driver) -> None:
    calls: list[Any] = []

    @front.idempotent(namespace=NS, key="id", validate=("amount", "currency"))
    def charge(event: dict[str, Any]) -> str:
        calls.append(event)
        return "charged"

    first = {"id": "p-1", "amount": 5, "currency": "EUR", "note": "a"}
    assert charge(first) == "charged"
    # Other fields may change; the validated ones may not.
    assert charge({**first, "note": "retry"}) == "charged" and len(calls) == 1
    with pytest.raises(ConflictError):
        charge({**first, "amount": 6})
    with pytest.raises(KeyPathError):
        charge({"id": "p-2", "amount": 5})
    assert len(calls) == 1


def test_validate_with_a_key_function_reads_the_named_payload(front: Driver) -> None:
    @front.idempotent(
        namespace=NS, key=lambda ctx, body: body["id"], payload="body", validate="amount"
    )
    def charge(ctx: object, body: dict[str, Any]) -> int:
        return int(body["amount"])

    assert charge(None, {"id": "k", "amount": 1}) == 1
    with pytest.raises(ConflictError):
        charge(None, {"id": "k", "amount": 2})
    for bad in ((), [1], 5):
        with pytest.raises(TypeError, match="validate"):
            front.idempotent(namespace=NS, key="id", validate=bad)(lambda e: e)


def test_a_decorated_call_in_progress_elsewhere_raises(front: Driver, store: DedupStore) -> None:
    store.claim("busy", namespace=NS, lease=600, owner="other")

    @front.idempotent(namespace=NS, key="id", serializer=Receipt)
    def handle(event: dict[str, Any]) -> Receipt:
        raise AssertionError("must not run")

    with pytest.raises(InProgressError):
        handle({"id": "busy"})


def test_a_heartbeat_renews_the_claim_while_the_function_runs() -> None:
    table = MemoryTable()
    renewals: list[Any] = []
    extend = table.extend

    def spy(*args: Any, **kwargs: Any) -> None:
        extend(*args, **kwargs)
        renewals.append(kwargs["lease"])

    table.extend = spy  # type: ignore[method-assign]

    @table.idempotent(namespace=NS, key="id", heartbeat=True, lease=0.3)
    def slow(event: dict[str, Any]) -> str:
        while len(renewals) < 2:
            time.sleep(0.01)
        # Past the first lease, held by the renewals.
        assert table.claim("s", namespace=NS, owner="other").outcome is Outcome.IN_PROGRESS
        return "slow"

    assert slow({"id": "s"}) == "slow"
    assert renewals[:2] == [0.3, 0.3]
