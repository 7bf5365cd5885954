"""One deadline per call: the arithmetic on a fake clock, and the hooks that apply it.

The hooks are driven without a server: redis-py's retry and connection
methods under a deadline (each attempt's time left, no retry with too
little left), the SQL store's bounded connect and its deadlock retries.
Real servers that stop answering are in tests/authorities/test_deadlines.py.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from dedupcore.errors import UnavailableError
from dedupcore.retry import (
    RETRY_FLOOR,
    Deadline,
    current_deadline,
    deadline_scope,
    one_call,
)
from tests.support.fakes import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# -- Deadline ----------------------------------------------------------------------------


def test_each_wait_gets_the_time_left_never_a_fresh_timeout(clock: FakeClock) -> None:
    d = Deadline(1.0, clock=clock)
    assert d.at == 101.0
    assert d.left() == d.budget() == 1.0
    clock.sleep(0.3)
    assert d.left() == pytest.approx(0.7)
    assert d.budget(0.5) == 0.5  # a wait's own cap still holds
    assert d.budget(5.0) == pytest.approx(0.7)  # a fresh full timeout would be 1.0
    assert not d.expired()
    clock.sleep(0.7)
    assert d.expired() and d.left() == 0.0 and d.budget(5.0) == 0.0
    clock.sleep(3.0)
    assert d.left() == 0.0  # never negative


def test_a_retry_starts_only_while_a_tenth_of_the_timeout_is_left(clock: FakeClock) -> None:
    d = Deadline(2.0, clock=clock)
    floor = 2.0 * RETRY_FLOOR
    assert d.retry_wait(0.05) == 0.05  # plenty left: the backoff as it is
    clock.sleep(2.0 - floor - 0.1)  # floor + 0.1 s left
    assert d.retry_wait(0.5) == pytest.approx(0.1)  # cut so that the floor is left after it
    assert d.retry_wait(-1.0) == 0.0
    clock.sleep(0.1)  # exactly the floor left: a retry may still start, without sleeping
    assert d.retry_wait(0.05) == pytest.approx(0.0)
    clock.sleep(0.001)
    assert d.retry_wait(0.0) is None  # too little left for another attempt
    clock.sleep(10.0)
    assert d.retry_wait(0.0) is None


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_a_deadline_needs_a_positive_finite_timeout(bad: float) -> None:
    with pytest.raises(ValueError, match="timeout"):
        Deadline(bad)
    with pytest.raises(TypeError, match="timeout"):
        Deadline("1")  # type: ignore[arg-type]


def test_a_call_inside_a_call_keeps_the_earlier_deadline(clock: FakeClock) -> None:
    assert current_deadline() is None
    with deadline_scope(None) as none:
        assert none is None and current_deadline() is None
    with deadline_scope(1.0, clock=clock) as outer:
        assert outer is not None and current_deadline() is outer
        with deadline_scope(5.0, clock=clock) as inner:
            assert inner is outer  # an inner call never extends the outer one's time
        with deadline_scope(None) as same:
            assert same is outer
        with deadline_scope(0.5, clock=clock) as shorter:
            assert shorter is not outer and shorter is not None and shorter.at == 100.5
            assert current_deadline() is shorter
        assert current_deadline() is outer
    assert current_deadline() is None


def test_one_call_runs_a_method_under_the_object_s_timeout() -> None:
    class Store:
        def __init__(self, timeout: float | None) -> None:
            self.timeout = timeout

        @one_call
        def call(self) -> Deadline | None:
            return current_deadline()

    d = Store(3.0).call()
    assert d is not None and d.timeout == 3.0
    assert Store(None).call() is None
    assert current_deadline() is None


def test_each_thread_has_its_own_deadline() -> None:
    seen: list[Deadline | None] = []
    with deadline_scope(1.0):
        t = threading.Thread(target=lambda: seen.append(current_deadline()))
        t.start()
        t.join()
    assert seen == [None]


# -- redis-py's retry and connections under a deadline -------------------------------------


@pytest.fixture
def redis_hooks(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> Any:
    pytest.importorskip("redis", reason="the [redis] extra is not installed")
    from dedupcore.redis import connection as tier

    monkeypatch.setattr(tier.time, "sleep", clock.sleep)
    return tier


def _attempts(
    tier: Any, clock: FakeClock, *, timeout: float, takes: float, retries: int
) -> tuple[list[float], list[float]]:
    """Runs a call that always fails after ``takes`` s; each attempt's budget, each sleep."""
    import redis
    from redis.backoff import ConstantBackoff

    budgets: list[float] = []
    sleeps: list[float] = []
    retry = tier._DeadlineRetry(ConstantBackoff(0.05), retries)

    def do() -> None:
        d = current_deadline()
        assert d is not None
        budgets.append(d.budget())
        clock.sleep(takes)
        raise redis.ConnectionError("lost")

    real_sleep = clock.sleep

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        real_sleep(seconds)

    tier.time.sleep = sleep
    with deadline_scope(timeout, clock=clock), pytest.raises(redis.ConnectionError):
        retry.call_with_retry(do, lambda error: None)
    return budgets, sleeps


def test_the_retry_gets_the_time_left_and_stops_when_too_little_is_left(
    redis_hooks: Any, clock: FakeClock
) -> None:
    # Each attempt fails after 0.3 s; 0.05 s backoff; 1 s timeout, so the floor is 0.1 s.
    budgets, sleeps = _attempts(redis_hooks, clock, timeout=1.0, takes=0.3, retries=10)
    assert budgets == pytest.approx([1.0, 0.65, 0.30])
    # After the third attempt nothing is left: no fourth, though 10 retries were allowed.
    assert sleeps == pytest.approx([0.05, 0.05])


def test_the_retry_backoff_is_cut_to_leave_the_floor(redis_hooks: Any, clock: FakeClock) -> None:
    # Attempts of 0.18 s: after the fourth, 0.13 s are left, so the 0.05 s backoff is cut
    # to 0.03 s and the fifth attempt starts with the floor (0.1 s); then none is left.
    budgets, sleeps = _attempts(redis_hooks, clock, timeout=1.0, takes=0.18, retries=10)
    assert budgets == pytest.approx([1.0, 0.77, 0.54, 0.31, 0.10])
    assert sleeps == pytest.approx([0.05, 0.05, 0.05, 0.03])


def test_the_retry_count_still_bounds_the_retries(redis_hooks: Any, clock: FakeClock) -> None:
    budgets, _ = _attempts(redis_hooks, clock, timeout=10.0, takes=0.01, retries=1)
    assert budgets == pytest.approx([10.0, 9.94])


def test_outside_a_deadline_the_retry_is_redis_py_s_own(redis_hooks: Any) -> None:
    import redis
    from redis.backoff import NoBackoff

    calls = []

    def do() -> None:
        calls.append(1)
        raise redis.ConnectionError("lost")

    with pytest.raises(redis.ConnectionError):
        redis_hooks._DeadlineRetry(NoBackoff(), 2).call_with_retry(do, lambda error: None)
    assert len(calls) == 3


class _FakeSocket:
    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def settimeout(self, value: float | None) -> None:
        self.timeouts.append(value)


class _FakeConnection:
    """What the deadline mixin calls of redis-py's connection, recorded."""

    def __init__(self) -> None:
        self.socket_timeout: float | None = 5.0
        self.socket_connect_timeout: float | None = 2.0
        self._sock: Any = None
        self.connect_waits: list[float | None] = []
        self.read_waits: list[Any] = []
        self.disconnects = 0

    def _connect(self) -> _FakeSocket:
        self.connect_waits.append(self.socket_connect_timeout)
        return _FakeSocket()

    def connect_check_health(self, check_health: bool = True) -> None:
        self._sock = self._connect()

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        pass

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        self.read_waits.append(kwargs.get("timeout"))
        return b"OK"

    def disconnect(self) -> None:
        self.disconnects += 1
        self._sock = None


def test_every_wait_of_a_connection_gets_the_time_left(redis_hooks: Any, clock: FakeClock) -> None:
    import redis

    conn = redis_hooks._with_deadline(_FakeConnection)()
    assert redis_hooks._with_deadline(type(conn)) is type(conn)  # mixed in once
    # Outside a call: the connection's own timeouts.
    conn.read_response()
    assert conn.read_waits == [None]
    with deadline_scope(3.0, clock=clock):
        conn.send_packed_command(b"PING")  # connects first
        assert conn.connect_waits == [2.0]  # its own cap: less than the 3 s left
        assert conn.socket_connect_timeout == 2.0  # restored after the connect
        assert conn._sock.timeouts == [3.0, 5.0]  # the send's wait, then its own again
        clock.sleep(1.0)
        conn.read_response()
        clock.sleep(1.5)
        conn.read_response(timeout=0.25)  # a wait the caller chose stays
        conn.disconnect()
        conn.send_packed_command(b"PING")  # a reconnect gets the time left
        assert conn.connect_waits == [2.0, pytest.approx(0.5)]
        clock.sleep(0.5)
        with pytest.raises(redis.TimeoutError, match="deadline"):
            conn.read_response()  # no time left: fails at once, and drops the connection
        assert conn._sock is None and conn.disconnects == 2
        with pytest.raises(TimeoutError, match="deadline passed before connecting"):
            conn.send_packed_command(b"PING")  # (redis-py turns it into its TimeoutError)
        conn._sock = _FakeSocket()
        with pytest.raises(redis.TimeoutError, match="deadline"):
            conn.send_packed_command(b"PING")  # connected, but no time left to send
        assert conn._sock.timeouts == []
    assert conn.read_waits == [None, pytest.approx(2.0), 0.25]


# -- the SQL store ---------------------------------------------------------------------


def test_a_connect_is_given_up_at_the_deadline_and_closed_when_it_arrives() -> None:
    from dedupcore.sql.transactions import connect_within as _connect_within

    release = threading.Event()
    closed = threading.Event()

    class Conn:
        def close(self) -> None:
            closed.set()

    def slow() -> Conn:
        release.wait()
        return Conn()

    with pytest.raises(TimeoutError, match="deadline"):
        _connect_within(slow, 0.01)
    release.set()
    assert closed.wait(30), "the late connection was not closed"
    with pytest.raises(TimeoutError, match="deadline"):
        _connect_within(slow, 0.0)
    assert isinstance(_connect_within(Conn, 30.0), Conn)
    with pytest.raises(ZeroDivisionError):
        _connect_within(lambda: 1 / 0, 30.0)


@pytest.fixture
def deadlocking_sqlite(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Any, list[float], list[float]]]:
    """A SQLite store whose transactions all fail as deadlocks after 0.3 s on ``clock``.

    Yields the store, the busy wait each attempt was armed with, and the sleeps.
    """
    import random
    import time

    from dedupcore.sql import SqlStore
    from dedupcore.sql.dialects import SQLiteDialect

    busy: list[float] = []
    sleeps: list[float] = []
    real_arm = SQLiteDialect.arm

    def arm(self: Any, conn: Any, wait: float) -> None:
        busy.append(wait)
        real_arm(self, conn, wait)

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock.sleep(seconds)

    monkeypatch.setattr(SQLiteDialect, "arm", arm)
    monkeypatch.setattr(SQLiteDialect, "is_transient", lambda self, exc: True)
    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(random, "random", lambda: 0.5)  # no jitter
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    store = SqlStore(lambda: conn, dialect="sqlite", timeout=1.0, retries=50)
    store._tx(lambda cur: None)  # connected (and its durability read) before the test
    busy.clear()
    yield store, busy, sleeps
    conn.close()


def test_sql_deadlock_retries_get_the_time_left_and_stop_before_the_deadline(
    deadlocking_sqlite: tuple[Any, list[float], list[float]], clock: FakeClock
) -> None:
    store, busy, sleeps = deadlocking_sqlite

    def body(cur: Any) -> None:
        clock.sleep(0.3)
        raise sqlite3.OperationalError("deadlock detected")

    with deadline_scope(1.0, clock=clock), pytest.raises(UnavailableError, match="timeout of 1 s"):
        store._tx(body)
    # The busy wait of each attempt is the time left: 1 s, then less the 0.3 s attempt
    # and the backoff (0.01 s, 0.02 s at this jitter).
    assert busy == pytest.approx([1.0, 0.69, 0.37])
    # With 0.07 s left, under a tenth of 1 s, no fourth attempt (50 were allowed).
    assert sleeps == pytest.approx([0.01, 0.02])
    assert store.stats()["unavailable"] == 1


def test_a_sql_call_with_no_time_left_fails_before_it_sends_anything(
    deadlocking_sqlite: tuple[Any, list[float], list[float]], clock: FakeClock
) -> None:
    store, busy, _ = deadlocking_sqlite
    with deadline_scope(1.0, clock=clock):
        clock.sleep(1.0)
        with pytest.raises(UnavailableError, match="no answer within the call's timeout of 1 s"):
            store._tx(lambda cur: None)
    assert busy == []


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), 1e39])
def test_a_sql_store_refuses_a_bad_timeout_before_connecting(bad: float) -> None:
    from dedupcore.sql import SqlStore

    def never() -> Any:
        raise AssertionError("nothing may connect")

    with pytest.raises(ValueError, match="timeout"):
        SqlStore(never, dialect="sqlite", timeout=bad)
    with pytest.raises(TypeError, match="timeout"):
        SqlStore(never, dialect="sqlite", timeout="5")  # type: ignore[arg-type]
