"""RetryPolicy: its waits, its retried calls (on a fake clock), and the clients that use it."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import dedupcore.client
from dedupcore import aio
from dedupcore.api import Claim, Outcome
from dedupcore.client import Client
from dedupcore.errors import StaleTokenError, UnavailableError
from dedupcore.integrations._common import _AsyncGate, _Gate
from dedupcore.retry import DEFAULT_RETRY, RetryPolicy, policy_from_args
from dedupcore.writebehind import MemoryTable

EXACT = RetryPolicy(attempts=4, initial=0.05, cap=0.3, multiplier=2.0, jitter=0.0)


class FakeSleep:
    """Records the waits instead of waiting."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)

    async def asleep(self, seconds: float) -> None:
        self.waits.append(seconds)


def failing(times: int, exc: BaseException, result: Any = "ok") -> Callable[[], Any]:
    """A call that raises ``exc`` its first ``times`` calls, then returns ``result``."""
    calls = itertools.count()

    def fn() -> Any:
        if next(calls) < times:
            raise exc
        return result

    return fn


# -- the waits -------------------------------------------------------------------------


def test_the_default_waits_double_up_to_one_second() -> None:
    nominal = [DEFAULT_RETRY.nominal(n) for n in range(8)]
    assert nominal == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert DEFAULT_RETRY.attempts == 5 and DEFAULT_RETRY.jitter == 0.1


def test_exact_waits_without_jitter() -> None:
    assert list(EXACT.delays()) == [0.05, 0.1, 0.2, 0.3]
    assert EXACT.nominal(10**9) == 0.3  # no overflow far past the cap


@given(
    attempts=st.integers(0, 40),
    initial=st.floats(1e-4, 5.0),
    grow=st.floats(1.0, 100.0),
    multiplier=st.floats(1.0, 10.0),
    jitter=st.floats(0.0, 1.0),
    rands=st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=40, max_size=40),
)
def test_waits_stay_between_their_jittered_and_nominal_values(
    attempts: int,
    initial: float,
    grow: float,
    multiplier: float,
    jitter: float,
    rands: list[float],
) -> None:
    p = RetryPolicy(attempts, initial, initial * grow, multiplier, jitter)
    feed = iter(rands)
    waits = list(p.delays(lambda: next(feed)))
    assert len(waits) == attempts
    nominal = [p.nominal(n) for n in range(attempts)]
    assert nominal == sorted(nominal)  # never shrinks
    for n, (w, r) in enumerate(zip(waits, rands, strict=False)):
        assert nominal[n] <= p.cap
        assert w == pytest.approx(nominal[n] * (1 - jitter * r))
        assert (1 - jitter) * nominal[n] - 1e-12 <= w <= nominal[n]


# -- retried calls ---------------------------------------------------------------------


@pytest.mark.parametrize("failures", [0, 1, 4])
def test_call_retries_until_it_succeeds(failures: int) -> None:
    sleep = FakeSleep()
    fn = failing(failures, UnavailableError("down"))
    assert EXACT.call(fn, retry_on=UnavailableError, sleep=sleep) == "ok"
    assert sleep.waits == [0.05, 0.1, 0.2, 0.3][:failures]


def test_call_raises_the_last_failure_after_the_retries() -> None:
    sleep = FakeSleep()
    with pytest.raises(ConnectionError, match="down"):
        EXACT.call(failing(5, ConnectionError("down")), retry_on=OSError, sleep=sleep)
    assert sleep.waits == [0.05, 0.1, 0.2, 0.3]


def test_call_raises_other_errors_at_once() -> None:
    sleep = FakeSleep()
    with pytest.raises(StaleTokenError):
        EXACT.call(failing(1, StaleTokenError("taken")), retry_on=ConnectionError, sleep=sleep)
    assert sleep.waits == []


def test_no_retries_tries_once() -> None:
    sleep = FakeSleep()
    once = RetryPolicy(attempts=0)
    with pytest.raises(TimeoutError):
        once.call(failing(1, TimeoutError()), retry_on=TimeoutError, sleep=sleep)
    assert sleep.waits == []


@pytest.mark.parametrize("failures, ok", [(0, True), (3, True), (4, True), (5, False)])
def test_acall_is_call_for_coroutines(failures: int, ok: bool) -> None:
    sleep = FakeSleep()
    fn = failing(failures, UnavailableError("down"))

    async def afn() -> Any:
        return fn()

    async def main() -> Any:
        return await EXACT.acall(afn, retry_on=UnavailableError, sleep=sleep.asleep)

    if ok:
        assert asyncio.run(main()) == "ok"
    else:
        with pytest.raises(UnavailableError):
            asyncio.run(main())
    assert sleep.waits == [0.05, 0.1, 0.2, 0.3][:failures]


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"attempts": 1.0}, TypeError),
        ({"attempts": True}, TypeError),
        ({"attempts": -1}, ValueError),
        ({"attempts": 10**7}, ValueError),
        ({"initial": "0.1"}, TypeError),
        ({"initial": 0}, ValueError),
        ({"initial": float("nan")}, ValueError),
        ({"cap": float("inf")}, ValueError),
        ({"initial": 2.0, "cap": 1.0}, ValueError),
        ({"multiplier": 0.5}, ValueError),
        ({"multiplier": None}, TypeError),
        ({"jitter": -0.1}, ValueError),
        ({"jitter": 1.5}, ValueError),
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        RetryPolicy(**kwargs)


def test_the_policy_is_frozen() -> None:
    with pytest.raises(AttributeError):
        EXACT.attempts = 9  # type: ignore[misc]


def test_shorthands_make_a_policy() -> None:
    assert policy_from_args(None) is DEFAULT_RETRY
    p = policy_from_args(None, retries=2, backoff=0.01)
    assert (p.attempts, p.initial, p.cap, p.jitter) == (2, 0.01, 1.0, 0.1)
    assert policy_from_args(None, backoff=3.0).cap == 3.0  # a first wait above the cap
    assert policy_from_args(EXACT) is EXACT
    with pytest.raises(TypeError, match="not both"):
        policy_from_args(EXACT, retries=1)
    with pytest.raises(TypeError, match="RetryPolicy"):
        policy_from_args(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        policy_from_args(None, retries=-1)
    with pytest.raises(TypeError):
        policy_from_args(None, backoff="slow")  # type: ignore[arg-type]


# -- the users of the policy -----------------------------------------------------------


def test_sync_client_reconnects_as_its_policy_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sleep = FakeSleep()
    monkeypatch.setattr(dedupcore.client.time, "sleep", sleep)
    with Client(tmp_path / "none.sock", retry=EXACT) as c, pytest.raises(UnavailableError):
        c.ping()
    assert sleep.waits == [0.05, 0.1, 0.2, 0.3]
    sleep.waits.clear()
    with Client(tmp_path / "none.sock", retries=1, backoff=0.5) as c:
        assert c.retry.attempts == 1
        with pytest.raises(UnavailableError):
            c.ping()
    assert len(sleep.waits) == 1 and 0.45 <= sleep.waits[0] <= 0.5
    with pytest.raises(TypeError, match="not both"):
        Client(tmp_path / "none.sock", retry=EXACT, backoff=0.1)


def test_async_client_reconnects_as_its_policy_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sleep = FakeSleep()
    monkeypatch.setattr(aio.asyncio, "sleep", sleep.asleep)

    async def main() -> None:
        async with aio.Client(tmp_path / "none.sock", retry=EXACT) as c:
            with pytest.raises(UnavailableError):
                await c.ping()

    asyncio.run(main())
    assert sleep.waits == [0.05, 0.1, 0.2, 0.3]
    assert aio.Client(tmp_path / "x").retry is DEFAULT_RETRY  # the sync client's default
    assert Client(tmp_path / "x").retry is DEFAULT_RETRY
    with pytest.raises(TypeError, match="not both"):
        aio.Client(tmp_path / "none.sock", retry=EXACT, retries=1)


class Flaky(MemoryTable):
    """A store whose next ``fail`` completions raise UnavailableError."""

    def __init__(self, fail: int) -> None:
        super().__init__()
        self.fail = fail
        self.completes = 0

    def complete_many(self, items: Any, *, namespace: str) -> None:
        self.completes += 1
        if self.fail:
            self.fail -= 1
            raise UnavailableError("store away")
        super().complete_many(items, namespace=namespace)


TINY = RetryPolicy(attempts=3, initial=0.001, cap=0.001, jitter=0.0)


@pytest.mark.parametrize("fail, done", [(0, True), (3, True), (4, False)])
def test_gates_retry_a_completion_as_their_policy_says(fail: int, done: bool) -> None:
    for gate_type in (_Gate, _AsyncGate):
        store = Flaky(fail)
        gate = gate_type(
            store,
            lambda d: None,
            namespace="ns",
            lease=None,
            owner="me",
            before_ack=None,
            retry=TINY,
        )
        c: Claim = store.claim("k", namespace="ns")
        assert c.outcome is Outcome.NEW
        if isinstance(gate, _AsyncGate):
            asyncio.run(gate._acomplete("k", c.token))
        else:
            gate._complete("k", c.token)
        assert store.completes == min(fail, 3) + 1
        rec = store.get("k", namespace="ns")
        assert rec is not None and (rec.state.name == "PROCESSED") is done


def test_the_wrappers_take_a_policy_or_the_old_shorthand() -> None:
    from dedupcore.integrations.kafka import KafkaDedupLoop
    from dedupcore.integrations.nats import JetStreamConsumer
    from dedupcore.integrations.rabbitmq import AsyncDedupConsumer, DedupConsumer

    store = MemoryTable()
    loop = KafkaDedupLoop(object(), store, lambda d: None, namespace="ns", complete_retries=2)
    assert loop.retry.attempts == 2 and loop.retry.cap == 1.0
    assert KafkaDedupLoop(object(), store, print, namespace="ns", retry=TINY).retry is TINY
    assert KafkaDedupLoop(object(), store, print, namespace="ns").retry is DEFAULT_RETRY
    with pytest.raises(TypeError, match="complete_retries"):
        KafkaDedupLoop(object(), store, print, namespace="ns", retry=TINY, complete_retries=1)
    for wrapper in (DedupConsumer, AsyncDedupConsumer, JetStreamConsumer):
        assert wrapper(store, print, namespace="ns", retry=TINY)._gate.retry is TINY
        assert wrapper(store, print, namespace="ns")._gate.retry is DEFAULT_RETRY
        with pytest.raises(TypeError, match="RetryPolicy"):
            wrapper(store, print, namespace="ns", retry=3)  # type: ignore[arg-type]
