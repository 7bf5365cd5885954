"""DedupMiddleware on a real Dramatiq worker over the real RabbitMQ, and SIGKILLs at chosen points.

Each worker test starts ``dramatiq tests.integrations.dramatiq_tasks`` (one
process, two threads) on a queue of its own; the test enqueues messages by
actor name and reads the worker's lines (its log goes to stdout). A worker is
killed only where an actor said it waits (``PAUSED <key> <point>``), never at a
random moment: the whole worker (its process group), as a crashed host would
lose it; then a new worker starts and the broker redelivers what was not acked.

What the kills show (docs/dramatiq.md): with claim/complete around an effect
the store cannot see (a line appended to a file), a worker killed between the
effect and ``complete`` applies that effect twice -- once per kill at that
point, and at no other point; with the effect and the dedup row in one
PostgreSQL transaction, no kill applies anything twice.

The test without a worker (the options) needs no server.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

dramatiq = pytest.importorskip("dramatiq")

from dedupcore import DedupStore  # noqa: E402
from dedupcore.integrations.dramatiq import DedupMiddleware, current  # noqa: E402
from dedupcore.patterns.table import ensure_table  # noqa: E402
from tests.support.procs import LineProcess, child_env, wait_until  # noqa: E402
from tests.support.servers import (  # noqa: E402
    SERVERS,
    forget_redis_keys,
    pg_connect,
    redis_url,
    require_server,
    uid,
)

#: Seconds to wait for a line or a worker: far more than any of them takes.
PATIENCE = 60.0
#: A line that says how one message of a key ended: its actor ran, or it was a duplicate.
ENDED = re.compile(r"^DONE (\S+)$|key '([^']+)' was processed before")


class Worker:
    """``dramatiq`` on ``queue`` in a session of its own (so it dies whole)."""

    def __init__(self, queue: str, env: dict[str, str], name: str) -> None:
        argv = [
            "setsid",  # its own process group: killpg reaches the worker process too
            sys.executable,
            "-m",
            "dramatiq",
            "tests.integrations.dramatiq_tasks",
            "--processes",
            "1",
            "--threads",
            "2",
            "--queues",
            queue,
            "--log-file",
            "/dev/stdout",
        ]
        self.proc = LineProcess(argv, env=env, name=name)
        self.wait_for("READY")

    def wait_for(self, text: str) -> str:
        """The next line that holds ``text``."""
        while True:
            line = self.proc.next_line(PATIENCE)
            if line is None:
                raise AssertionError(
                    f"{self.proc.name} ended before {text!r}: {self.proc.stderr()}"
                )
            if text in line:
                return line

    def paused(self) -> tuple[str, str]:
        """The next ``PAUSED`` line: (key, point)."""
        key, point = self.wait_for("PAUSED ").split("PAUSED ", 1)[1].split()
        return key, point

    def ended(self, keys: list[str]) -> dict[str, str]:
        """How each of ``keys`` ended on this worker: ``ran`` or ``duplicate``."""
        found: dict[str, str] = {}
        while not set(keys) <= set(found):
            line = self.proc.next_line(PATIENCE)
            if line is None:
                raise AssertionError(f"{self.proc.name} ended: {self.proc.stderr()}")
            m = ENDED.search(line)
            if m and (m.group(1) or m.group(2)) in keys:
                found.setdefault(m.group(1) or m.group(2), "ran" if m.group(1) else "duplicate")
        return found

    def kill(self) -> None:
        """SIGKILL to the worker and its processes at once."""
        self.proc.sigkill_group()

    def close(self) -> None:
        self.proc.close_group()


class Lab:
    """One test's queue, shared directory, store prefix and tables, and its workers."""

    def __init__(self, home: Path, **env: str) -> None:
        require_server("rabbitmq")
        require_server("redis")
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        self.home = home
        self.queue = uid("dc_dq")
        self.env = {
            **child_env(),
            "DQ_DIR": str(home),
            "DQ_AMQP": SERVERS.rabbitmq,
            "DQ_QUEUE": self.queue,
            "DQ_REDIS": redis_url("integrations"),
            "DQ_PREFIX": uid("dc_dq"),
            **env,
        }
        self.broker = RabbitmqBroker(url=SERVERS.rabbitmq)
        self.workers: list[Worker] = []
        self.tables: dict[str, str] = {}

    def worker(self) -> Worker:
        w = Worker(self.queue, self.env, f"worker {len(self.workers) + 1}")
        self.workers.append(w)
        return w

    def send(self, item: dict[str, Any], actor: str = "dq.transfer", **fields: Any) -> Any:
        message = dramatiq.Message(
            queue_name=self.queue, actor_name=actor, args=(item,), kwargs={}, options={}, **fields
        )
        return self.broker.enqueue(message)

    def effects(self, key: str) -> int:
        """How many times the effect of ``key`` was applied."""
        if self.tables:
            with pg_connect() as conn:
                row = conn.execute(
                    f"SELECT count(*) FROM {self.tables['DQ_EFFECTS']} WHERE key = %s", (key,)
                ).fetchone()
            return int(row[0])
        path = self.home / "effects" / key
        return len(path.read_text().split()) if path.exists() else 0

    def runs(self, key: str) -> int:
        """How many times the actor started for ``key``."""
        path = self.home / f"runs-{key}"
        return len(path.read_text().split()) if path.exists() else 0

    def dead_letters(self) -> int:
        """How many messages Dramatiq dead-lettered (its ``.XQ`` queue)."""
        import pika

        conn = pika.BlockingConnection(pika.URLParameters(SERVERS.rabbitmq))
        try:
            found = conn.channel().queue_declare(f"{self.queue}.XQ", passive=True)
            return int(found.method.message_count)
        finally:
            conn.close()

    def ledger(self) -> dict[str, str]:
        """Transactional mode: the dedup and effects tables on PostgreSQL, for the workers."""
        require_server("postgresql")
        dedup, effects = uid("dc_dq_d"), uid("dc_dq_e")
        self.tables = {"DQ_TABLE": dedup, "DQ_EFFECTS": effects}
        with pg_connect(autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {effects} (key text)")
        with pg_connect() as conn:  # made before the workers start, as docs/dramatiq.md says
            ensure_table(conn, table=dedup)
        self.env.update(self.tables, DQ_POSTGRES=SERVERS.postgresql)
        return self.tables

    def redis_store(self) -> Any:
        from dedupcore.redis import RedisStore

        return RedisStore.from_url(self.env["DQ_REDIS"], prefix=self.env["DQ_PREFIX"])

    def close(self) -> None:
        for w in self.workers:
            w.close()
        if self.tables:
            with pg_connect(autocommit=True) as conn:
                conn.execute("SET lock_timeout = '20s'")
                for name in self.tables.values():
                    conn.execute(f"DROP TABLE IF EXISTS {name}")
        with contextlib.suppress(Exception):
            channel = self.broker.channel
            for suffix in ("", ".DQ", ".XQ"):
                channel.queue_delete(self.queue + suffix)
        self.broker.close()
        forget_redis_keys("integrations", self.env["DQ_PREFIX"])


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Callable[..., Lab]]:
    """``lab(**env)`` -> a :class:`Lab` whose workers get ``env`` too; closed after the test."""
    made: list[Lab] = []

    def make(**env: str) -> Lab:
        made.append(Lab(tmp_path, **env))
        return made[-1]

    yield make
    for one in made:
        one.close()


# -- on a worker -------------------------------------------------------------------------


def test_a_second_message_of_a_key_is_skipped_without_running_the_actor(
    lab: Callable[..., Lab],
) -> None:
    lab_ = lab()
    w = lab_.worker()
    lab_.send({"id": "t-1"})
    assert w.ended(["t-1"]) == {"t-1": "ran"}
    lab_.send({"id": "t-1"})  # a producer's retry: another message id, the same business id
    assert w.ended(["t-1"]) == {"t-1": "duplicate"}
    assert lab_.effects("t-1") == lab_.runs("t-1") == 1

    # Keyed by the message id (the default): the same id twice runs once.
    for message_id, how in (("m-1", "ran"), ("m-1", "duplicate"), ("m-2", "ran")):
        lab_.send({"id": message_id}, actor="dq.by_id", message_id=message_id)
        assert w.ended([message_id]) == {message_id: how}
    assert lab_.effects("m-1") == lab_.effects("m-2") == 1


def test_a_failing_actor_releases_the_key_and_the_retry_runs_it(lab: Callable[..., Lab]) -> None:
    # The lease (60 s) outlasts the test: a key left claimed after the failure would hold
    # Dramatiq's retry IN_PROGRESS until the test gave up.
    lab_ = lab(DQ_LEASE="60")
    w = lab_.worker()
    lab_.send({"id": "f-1", "fail_first": True})
    assert w.ended(["f-1"]) == {"f-1": "ran"}
    assert lab_.runs("f-1") == 2 and lab_.effects("f-1") == 1  # failed once, then ran


def test_a_key_held_elsewhere_is_sent_again_until_it_is_free(lab: Callable[..., Lab]) -> None:
    lab_ = lab(DQ_LEASE="60")
    store = lab_.redis_store()
    try:
        held = store.claim("p-1", namespace="dq.transfer", owner="another worker", lease=600)
        w = lab_.worker()
        lab_.send({"id": "p-1"})
        w.wait_for("key 'p-1' is held by another owner")
        w.wait_for("key 'p-1' is held by another owner")  # it came back, and is held still
        assert lab_.runs("p-1") == 0
        store.release("p-1", held.token, namespace="dq.transfer")
        assert w.ended(["p-1"]) == {"p-1": "ran"}
    finally:
        store.close()
    assert lab_.effects("p-1") == 1


def test_a_message_without_a_key_is_dead_lettered_without_running_the_actor(
    lab: Callable[..., Lab],
) -> None:
    lab_ = lab()
    w = lab_.worker()
    lab_.send({"no_id": 1})
    w.wait_for("has no dedup key")
    lab_.send({"id": "after"})
    assert w.ended(["after"]) == {"after": "ran"}
    wait_until(lambda: lab_.dead_letters() == 1, "the message in the dead-letter queue")
    assert lab_.runs("None") == 0  # the actor never ran on the message without an id


def test_a_killed_worker_applies_a_store_mode_effect_twice_only_between_effect_and_complete(
    lab: Callable[..., Lab],
) -> None:
    lab_ = lab(DQ_LEASE="2")  # a redelivery takes a dead worker's claim over after 2 s
    plans = [
        {"k-1": "after_effect", "k-3": "after_claim"},
        {"k-2": "after_effect", "k-4": "after_complete"},
    ]
    ended: dict[str, str] = {}
    for plan in plans:
        w = lab_.worker()
        for key, point in plan.items():
            lab_.send({"id": key, "pause": point})
        assert dict(w.paused() for _ in plan) == plan  # two threads: both wait at once
        w.kill()
        w = lab_.worker()  # the broker redelivers; dead claims are taken over after the lease
        ended.update(w.ended(list(plan)))
        # Its keys are done: this kill cuts none of them (a message killed between its
        # end and its ack comes back as a duplicate and applies nothing).
        w.kill()
    applied = {key: lab_.effects(key) for key in ended}
    twice = sorted(key for key, n in applied.items() if n == 2)
    # The window: a kill between the effect and complete applies the effect again;
    # a kill before the effect or after complete does not.
    assert twice == ["k-1", "k-2"] and max(applied.values()) == 2
    assert applied["k-3"] == applied["k-4"] == 1
    assert ended == {"k-1": "ran", "k-2": "ran", "k-3": "ran", "k-4": "duplicate"}


def test_a_killed_worker_never_applies_a_transactional_effect_twice(
    lab: Callable[..., Lab],
) -> None:
    lab_ = lab()
    tables = lab_.ledger()
    w = lab_.worker()
    plan = {"l-1": "after_effect", "l-2": "after_complete"}
    for key, point in plan.items():
        lab_.send({"id": key, "pause": point})
    assert dict(w.paused() for _ in plan) == plan
    assert (lab_.effects("l-1"), lab_.effects("l-2")) == (0, 1)  # l-1 is not committed
    w.kill()  # l-1: written, not committed; l-2: committed, not acked
    assert lab_.worker().ended(list(plan)) == {"l-1": "ran", "l-2": "duplicate"}
    assert (lab_.effects("l-1"), lab_.effects("l-2")) == (1, 1)  # two kill points, none twice
    with pg_connect() as conn:
        assert conn.execute(f"SELECT count(*) FROM {tables['DQ_TABLE']}").fetchone() == (2,)


# -- without a worker --------------------------------------------------------------------


def test_options_that_cannot_work_are_refused(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path / "s")
    try:
        with pytest.raises(TypeError, match="store object; give a factory"):
            DedupMiddleware(store)  # type: ignore[arg-type]
    finally:
        store.close()
    with pytest.raises(TypeError, match="one of them"):
        DedupMiddleware()
    with pytest.raises(TypeError, match="one of them"):
        DedupMiddleware("redis://x", connection=lambda: None)
    with pytest.raises(TypeError, match="key must be"):
        DedupMiddleware("redis://x", key="id")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease must be > 0"):
        DedupMiddleware("redis://x", lease=0)
    with pytest.raises(TypeError, match="retry_delay"):
        DedupMiddleware("redis://x", retry_delay="soon")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        DedupMiddleware(connection=lambda: None, table="no-dashes")
    with pytest.raises(RuntimeError, match="only there while"):
        current()

    from dramatiq.brokers.stub import StubBroker
    from dramatiq.middleware import MiddlewareError

    broker = StubBroker()
    broker.add_middleware(DedupMiddleware("redis://x"))

    def body(item: Any) -> None:
        return None

    refused = MiddlewareError
    with pytest.raises(refused, match="actor a1: namespace may only hold"):
        dramatiq.actor(body, broker=broker, actor_name="a1", dedup_namespace="has space")
    with pytest.raises(refused, match="dedup_key must be"):
        dramatiq.actor(body, broker=broker, actor_name="a2", dedup_key="id")
    with pytest.raises(refused, match="dedup_lease must be > 0"):
        dramatiq.actor(body, broker=broker, actor_name="a3", dedup_lease=0)
    with pytest.raises(refused, match="dedup_retry_delay"):
        dramatiq.actor(body, broker=broker, actor_name="a4", dedup_retry_delay="soon")
    with pytest.raises(refused, match="dedup must be"):
        dramatiq.actor(body, broker=broker, actor_name="a5", dedup="yes")
    dramatiq.actor(body, broker=broker, actor_name="ok", dedup_namespace="orders/mail")
    broker.close()
