"""DedupMiddleware on FastStream's RabbitMQ, NATS JetStream and Kafka brokers (both Kafka
clients), real servers.

The contract tests run each broker in this process (tests/integrations/
faststream_worker.py's :class:`Rig`: a queue, stream or topic of its own); the
kill tests run the worker as a child process on RabbitMQ and on NATS JetStream
and SIGKILL it where its handlers said they wait (``PAUSED <key> <point>``),
never at a random moment, then start another and let the broker redeliver.

What the kills show (docs/faststream.md): with claim/complete around an effect
the store cannot see (a line appended to a file), a worker killed between the
effect and ``complete`` applies that effect twice -- once per kill at that
point, and at no other point; with the effect and the dedup row in one
PostgreSQL transaction, no kill applies anything twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest

pytest.importorskip("faststream")

from faststream import Context
from faststream.middlewares import AckPolicy

from dedupcore import DedupStore, Outcome
from dedupcore.integrations import Delivery, TransactionalTable, Verdict
from dedupcore.integrations.faststream import DedupMiddleware
from dedupcore.patterns.table import ensure_table
from tests.integrations.faststream_worker import PATIENCE, Rig
from tests.support.procs import LineProcess, child_env
from tests.support.servers import (
    SERVERS,
    forget_redis_keys,
    pg_connect,
    redis_url,
    require_server,
    uid,
)

#: FastStream's brokers: RabbitMQ, NATS JetStream, and the Kafka-protocol server through
#: both of FastStream's Kafka clients (``faststream.kafka`` on aiokafka,
#: ``faststream.confluent`` on confluent-kafka).
KINDS = ["rabbit", "nats", "kafka", "confluent"]
SERVER = {"rabbit": "rabbitmq", "nats": "nats", "kafka": "kafka", "confluent": "kafka"}
URL = {
    "rabbit": SERVERS.rabbitmq,
    "nats": SERVERS.nats,
    "kafka": SERVERS.kafka,
    "confluent": SERVERS.kafka,
}


def body_key(body: bytes, headers: Any) -> Any:
    return json.loads(body)["id"]


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Waits (polling the event loop) until ``predicate()``; fails after PATIENCE."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PATIENCE
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def rig_of(kind: str) -> AsyncIterator[Rig]:
    require_server(SERVER[kind])
    rig = Rig(kind, URL[kind])
    await rig.create()
    try:
        yield rig
    finally:
        await rig.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DedupStore]:
    with DedupStore.open(tmp_path / "store") as opened:
        yield opened


# -- the contract on each broker --------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_duplicate_is_acked_without_running_the_handler(kind: str, store: DedupStore) -> None:
    handled: list[str] = []
    middleware = DedupMiddleware(store, namespace="fs/dups", key=body_key, retry_delay=0.05)

    async def handle(item: dict[str, Any], dedup: Annotated[Delivery, Context("dedup")]) -> str:
        assert dedup.key == item["id"] and dedup.claim is not None
        handled.append(item["id"])
        return "done"

    async def scenario() -> None:
        async with rig_of(kind) as rig:
            await rig.start(middleware, handle)
            for key in ("a", "b", "a"):  # "a" published twice: a producer's retry
                await rig.publish({"id": key})
            await until(lambda: middleware.counts[Verdict.ACKED] == 3, "three acks")

    asyncio.run(scenario())
    assert sorted(handled) == ["a", "b"]
    assert middleware.counts[Verdict.FAILED] == middleware.counts[Verdict.INVALID] == 0
    assert store.claim("a", namespace="fs/dups").outcome is Outcome.DUPLICATE


@pytest.mark.parametrize("kind", KINDS)
def test_a_message_without_a_key_is_rejected(kind: str, store: DedupStore) -> None:
    handled: list[Any] = []
    middleware = DedupMiddleware(store, namespace="fs/keys", key_header="x-key")

    async def handle(body: bytes, dedup: Annotated[Delivery, Context("dedup")]) -> None:
        handled.append(dedup.key)

    async def scenario() -> None:
        async with rig_of(kind) as rig:
            await rig.start(middleware, handle)
            await rig.publish(b"no key at all")
            await rig.publish(b"by id", message_id="m-1")  # Kafka has no producer's id
            await rig.publish(b"by header", headers={"x-key": "h-1"}, message_id="m-2")
            await until(lambda: sum(middleware.counts.values()) == 3, "three verdicts")

    asyncio.run(scenario())
    if kind in ("kafka", "confluent"):
        assert handled == ["h-1"] and middleware.counts[Verdict.INVALID] == 2
    else:
        assert sorted(handled) == ["h-1", "m-1"] and middleware.counts[Verdict.INVALID] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_failing_handler_releases_the_key_and_the_redelivery_runs_it(
    kind: str, store: DedupStore
) -> None:
    runs: list[str] = []
    middleware = DedupMiddleware(store, namespace="fs/fail", key=body_key)

    async def handle(item: dict[str, Any]) -> None:
        runs.append(item["id"])
        if len(runs) == 1:
            raise RuntimeError("the first run fails")

    async def scenario() -> None:
        async with rig_of(kind) as rig:
            await rig.start(middleware, handle, AckPolicy.NACK_ON_ERROR)
            await rig.publish({"id": "f-1"})
            await until(lambda: middleware.counts[Verdict.ACKED] == 1, "the redelivery's ack")

    asyncio.run(scenario())
    assert runs == ["f-1", "f-1"] and middleware.counts[Verdict.FAILED] == 1
    assert store.claim("f-1", namespace="fs/fail").outcome is Outcome.DUPLICATE


@pytest.mark.parametrize("kind", KINDS)
def test_a_key_in_progress_elsewhere_is_redelivered_until_it_is_free(
    kind: str, store: DedupStore
) -> None:
    handled: list[str] = []
    middleware = DedupMiddleware(store, namespace="fs/busy", key=body_key, retry_delay=0.05)
    held = store.claim("p-1", namespace="fs/busy", owner="another consumer", lease=600)

    async def handle(item: dict[str, Any]) -> None:
        handled.append(item["id"])

    async def scenario() -> None:
        async with rig_of(kind) as rig:
            await rig.start(middleware, handle)
            await rig.publish({"id": "p-1"})
            # Two IN_PROGRESS answers: the first nack did bring the message back.
            await until(lambda: middleware.counts[Verdict.RETRY] >= 2, "a redelivery")
            assert handled == []
            store.release("p-1", held.token, namespace="fs/busy")
            await until(lambda: middleware.counts[Verdict.ACKED] == 1, "the ack after release")

    asyncio.run(scenario())
    assert handled == ["p-1"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_unavailable_store_redelivers_until_it_answers(kind: str) -> None:
    """The async daemon client, awaited on the loop; no daemon listens at first."""
    from dedupcore import aio
    from tests.support.daemon import Lab

    handled: list[str] = []
    daemons = Lab()
    try:
        daemon = daemons.daemon(start=False)
        client = aio.Client(daemon.socket, retries=0)
        middleware = DedupMiddleware(client, namespace="fs/down", key=body_key, retry_delay=0.05)

        async def handle(item: dict[str, Any]) -> None:
            handled.append(item["id"])

        async def scenario() -> None:
            async with rig_of(kind) as rig:
                await rig.start(middleware, handle)
                await rig.publish({"id": "u-1"})
                await until(lambda: middleware.counts[Verdict.RETRY] >= 2, "a redelivery")
                assert handled == []  # never run on a claim nobody decided
                await asyncio.to_thread(daemon.start)
                await until(lambda: middleware.counts[Verdict.ACKED] == 1, "the ack")
            await client.aclose()

        asyncio.run(scenario())
    finally:
        daemons.close()
    assert handled == ["u-1"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_transactional_mode_commits_the_effect_with_the_dedup_row(
    kind: str, pg: Any, pg_tables: list[str]
) -> None:
    dedup, effects = uid("dc_fs_d"), uid("dc_fs_e")
    pg_tables.extend([dedup, effects])
    pg.execute(f"CREATE TABLE {effects} (key text)")
    pg.commit()
    conn = pg_connect()
    middleware = DedupMiddleware(
        TransactionalTable(conn, table=dedup), namespace="fs/ledger", key=body_key
    )
    runs: list[str] = []

    def handle(item: dict[str, Any], dedup: Annotated[Delivery, Context("dedup")]) -> None:
        runs.append(item["id"])
        dedup.conn.execute(f"INSERT INTO {effects} VALUES (%s)", (item["id"],))
        if runs == ["t-2"]:
            raise RuntimeError("rolled back with its dedup row")

    async def scenario() -> None:
        async with rig_of(kind) as rig:
            await rig.start(middleware, handle)
            await rig.publish({"id": "t-2"})
            await rig.publish({"id": "t-1"})
            await rig.publish({"id": "t-1"})
            await until(lambda: middleware.counts[Verdict.ACKED] == 3, "three acks")

    try:
        asyncio.run(scenario())
    finally:
        conn.close()
    assert sorted(runs) == ["t-1", "t-2", "t-2"] and middleware.counts[Verdict.FAILED] == 1
    rows = pg.execute(f"SELECT key, count(*) FROM {effects} GROUP BY key ORDER BY key")
    assert rows.fetchall() == [("t-1", 1), ("t-2", 1)]
    pg.rollback()  # its read lock would hold up the drop of the tables


def test_a_message_acked_before_its_handler_is_refused() -> None:
    from faststream.rabbit import RabbitBroker, TestRabbitBroker

    ran: list[Any] = []
    broker = RabbitBroker(logger=None)
    middleware = DedupMiddleware(TransactionalTable(None, create=False), namespace="fs/first")

    @broker.subscriber("q", ack_policy=AckPolicy.ACK_FIRST)
    async def handle(body: bytes) -> None:
        ran.append(body)

    broker.add_middleware(middleware)

    async def scenario() -> None:
        async with TestRabbitBroker(broker) as br:
            with pytest.raises(RuntimeError, match="acked before its handler ran"):
                await br.publish(b"x", "q", message_id="m-1")

    asyncio.run(scenario())
    assert ran == []


# -- a worker killed mid-handler ----------------------------------------------------------


class Kills:
    """One kill test's queue, shared directory, Redis prefix or tables, and its workers."""

    def __init__(self, home: Path, kind: str, **env: str) -> None:
        require_server(SERVER[kind])
        require_server("redis")
        self.home = home
        self.rig = Rig(kind, URL[kind])
        self.env = {
            **child_env(),
            "FS_KIND": kind,
            "FS_URL": URL[kind],
            "FS_NAME": self.rig.name,
            "FS_DIR": str(home),
            "FS_REDIS": redis_url("integrations"),
            "FS_PREFIX": uid("dc_fs"),
            **env,
        }
        self.workers: list[LineProcess] = []
        self.tables: dict[str, str] = {}
        asyncio.run(self.rig.create())

    def ledger(self) -> dict[str, str]:
        """Transactional mode: the dedup and effects tables on PostgreSQL, for the workers."""
        require_server("postgresql")
        dedup, effects = uid("dc_fs_d"), uid("dc_fs_e")
        self.tables = {"FS_TABLE": dedup, "FS_EFFECTS": effects}
        with pg_connect(autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {effects} (key text, pid int)")
        with pg_connect() as conn:
            ensure_table(conn, table=dedup)
        self.env.update(self.tables, FS_POSTGRES=SERVERS.postgresql)
        return self.tables

    def worker(self) -> LineProcess:
        argv = [sys.executable, "-m", "tests.integrations.faststream_worker"]
        w = LineProcess(argv, env=self.env, name=f"worker {len(self.workers) + 1}")
        self.workers.append(w)
        w.expect("READY", PATIENCE)
        return w

    def publish(self, *items: dict[str, Any]) -> None:
        async def send() -> None:
            await self.rig.start()
            for item in items:
                await self.rig.publish(item)
            await self.rig.stop()

        asyncio.run(send())

    def effects(self, key: str) -> int:
        if self.tables:
            with pg_connect() as conn:
                row = conn.execute(
                    f"SELECT count(*) FROM {self.tables['FS_EFFECTS']} WHERE key = %s", (key,)
                ).fetchone()
            return int(row[0])
        path = self.home / "effects" / key
        return len(path.read_text().split()) if path.exists() else 0

    def done(self, w: LineProcess, keys: list[str]) -> dict[str, str]:
        """The outcome each key's delivery had on worker ``w`` (its ``DONE`` lines)."""
        found: dict[str, str] = {}
        while not set(keys) <= set(found):
            key, outcome = w.expect("DONE", PATIENCE).split()
            if key in keys:  # not a message of an earlier round acked again
                found.setdefault(key, outcome)
        return found

    def close(self) -> None:
        for w in self.workers:
            w.close()
        asyncio.run(self.rig.close())
        if self.tables:
            with pg_connect(autocommit=True) as conn:
                for name in self.tables.values():
                    conn.execute(f"DROP TABLE IF EXISTS {name}")
        forget_redis_keys("integrations", self.env["FS_PREFIX"])


@pytest.fixture
def kills(tmp_path: Path) -> Iterator[Callable[..., Kills]]:
    made: list[Kills] = []

    def make(kind: str = "rabbit", **env: str) -> Kills:
        made.append(Kills(tmp_path, kind, **env))
        return made[-1]

    yield make
    for one in made:
        one.close()


def kill_round(
    k: Kills, plan: dict[str, str], at_pause: Callable[[], None] = lambda: None
) -> dict[str, str]:
    """Sends a message per key of ``plan``, kills the worker once each waits at its point,
    lets a new worker take them; how each key's last delivery ended."""
    k.publish(*({"id": key, "pause": point} for key, point in plan.items()))
    w = k.worker()  # all of them wait for it: one fetch (NATS) or prefetch (RabbitMQ) takes all
    assert dict(w.expect("PAUSED", PATIENCE).split() for _ in plan) == plan
    at_pause()
    w.sigkill()  # one kill cuts them all where they wait
    w = k.worker()  # the broker redelivers; dead claims are taken over after the lease
    outcomes = k.done(w, list(plan))
    # Its keys are done: this kill cuts none of them (a message killed between its
    # DONE and its ack comes back as a DUPLICATE and applies nothing).
    w.sigkill()
    return outcomes


@pytest.mark.parametrize("kind", ["rabbit", "nats"])
def test_a_killed_worker_applies_a_store_mode_effect_twice_only_between_effect_and_complete(
    kills: Callable[..., Kills], kind: str
) -> None:
    k = kills(kind, FS_LEASE="2")  # a redelivery takes a dead worker's claim over after 2 s
    outcomes = kill_round(k, {"k-1": "after_effect", "k-3": "after_claim", "k-4": "after_complete"})
    outcomes.update(kill_round(k, {"k-2": "after_effect", "k-5": "after_complete"}))
    applied = {key: k.effects(key) for key in outcomes}
    twice = sorted(key for key, n in applied.items() if n == 2)
    # The window: a kill between the effect and complete applies the effect again;
    # a kill before the effect or after complete does not.
    assert twice == ["k-1", "k-2"] and max(applied.values()) == 2
    assert applied["k-3"] == applied["k-4"] == applied["k-5"] == 1
    assert outcomes["k-4"] == outcomes["k-5"] == "DUPLICATE"  # completed before the kill
    assert outcomes["k-1"] == outcomes["k-2"] == outcomes["k-3"] == "NEW"


@pytest.mark.parametrize("kind", ["rabbit", "nats"])
def test_a_killed_worker_never_applies_a_transactional_effect_twice(
    kills: Callable[..., Kills], kind: str
) -> None:
    k = kills(kind)
    tables = k.ledger()

    # One message a round: a worker runs one dedup transaction at a time.
    def not_committed() -> None:
        assert k.effects("l-1") == 0

    def committed() -> None:
        assert k.effects("l-2") == 1

    outcomes = kill_round(k, {"l-1": "after_effect"}, not_committed)
    outcomes.update(kill_round(k, {"l-2": "after_complete"}, committed))
    assert outcomes == {"l-1": "NEW", "l-2": "DUPLICATE"}
    assert (k.effects("l-1"), k.effects("l-2")) == (1, 1)  # two kill points, nothing twice
    with pg_connect() as conn:
        assert conn.execute(f"SELECT count(*) FROM {tables['FS_TABLE']}").fetchone() == (2,)
