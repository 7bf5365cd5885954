"""The JetStream wrapper's contract on the real NATS server, small message counts.

Each test makes its own stream and durable pull consumer (uuid names) and
deletes the stream afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.integrations.nats import JetStreamConsumer
from dedupcore.integrations.rabbitmq import Delivery, TransactionalTable, Verdict
from dedupcore.record import State
from tests.support.fakes import FirstBlocks, Recorder
from tests.support.servers import SERVERS, require_server, uid

NS = "transfers/ledger"
PATIENCE = 60.0


def body_key(body: bytes, headers: Any) -> Any:
    return json.loads(body).get("id")


@dataclass
class Stream:
    nc: Any
    js: Any
    name: str
    subject: str
    durable: str

    async def publish(self, body: dict[str, Any] | bytes, msg_id: str | None = None) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        await self.js.publish(self.subject, raw, headers=headers)

    async def subscribe(self) -> Any:
        return await self.js.pull_subscribe(self.subject, durable=self.durable, stream=self.name)

    async def pending(self) -> tuple[int, int]:
        info = await self.js.consumer_info(self.name, self.durable)
        return int(info.num_pending), int(info.num_ack_pending)


@asynccontextmanager
async def stream(**consumer_config: Any) -> AsyncIterator[Stream]:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

    nc = await nats.connect(SERVERS.nats)
    js = nc.jetstream()
    u = uid("dc")
    s = Stream(nc, js, u.upper(), f"dc.{u}", f"c_{u}")
    await js.add_stream(StreamConfig(name=s.name, subjects=[s.subject], storage=StorageType.MEMORY))
    try:
        await js.add_consumer(
            s.name,
            ConsumerConfig(
                durable_name=s.durable, ack_policy=AckPolicy.EXPLICIT, **consumer_config
            ),
        )
        yield s
    finally:
        await js.delete_stream(s.name)
        await nc.close()


async def run_until(
    consumer: JetStreamConsumer, sub: Any, until: Callable[[], bool], timeout: float = PATIENCE
) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(sub, batch=10, fetch_timeout=0.2, stop=stop))
    deadline = time.monotonic() + timeout
    try:
        while not until():
            assert time.monotonic() < deadline, f"not reached: {consumer.counts}"
            assert not task.done(), task.exception()
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await task


@pytest.fixture(autouse=True)
def _nats() -> None:
    require_server("nats")


@pytest.mark.parametrize("kind", ["embedded", "daemon", "redis"])
def test_new_duplicate_and_msg_id_fallback(kind: str, store_factory: Any) -> None:
    store = store_factory(kind)
    handler = Recorder()

    async def main() -> JetStreamConsumer:
        async with stream() as s:
            consumer = JetStreamConsumer(store, handler, namespace=NS, key=body_key)
            for body, mid in [
                ({"id": "a"}, "m1"),
                ({"id": "a"}, "m2"),  # a producer re-send: new Nats-Msg-Id, same business id
                ({}, "m3"),  # no business id: the Nats-Msg-Id is the key
                ({}, "m4"),
            ]:
                await s.publish(body, mid)
            sub = await s.subscribe()
            await run_until(consumer, sub, lambda: consumer.counts[Verdict.ACKED] == 4)
            await asyncio.sleep(0.1)
            assert await s.pending() == (0, 0)
            return consumer

    asyncio.run(main())
    assert sorted(handler.keys) == ["a", "m3", "m4"]
    rec = store.get("a", namespace=NS)
    assert rec is not None and rec.state is State.PROCESSED


def test_in_progress_is_naked_with_delay(store_factory: Any) -> None:
    store = store_factory("embedded")
    other = store.claim("x", namespace=NS, lease=120.0, owner="someone-else")
    handler = Recorder()
    seen: list[tuple[int, Verdict]] = []
    #: The delay each nak asked of the server (which holds the redelivery back that long).
    naks: list[float | None] = []

    async def main() -> None:
        async with stream() as s:
            consumer = JetStreamConsumer(
                store, handler, namespace=NS, key=body_key, retry_delay=0.5
            )
            decide = consumer.handle

            async def spy(msg: Any) -> Verdict:
                nak = msg.nak

                async def recorded(delay: float | None = None, **kwargs: Any) -> None:
                    naks.append(delay)
                    await nak(delay=delay, **kwargs)

                msg.nak = recorded
                v = await decide(msg)
                seen.append((msg.metadata.num_delivered, v))
                return v

            consumer.handle = spy  # type: ignore[method-assign]
            await s.publish({"id": "x"})
            sub = await s.subscribe()
            await run_until(consumer, sub, lambda: len(seen) >= 2)
            assert [v for _, v in seen[:2]] == [Verdict.RETRY, Verdict.RETRY]
            assert [n for n, _ in seen[:2]] == [1, 2]
            assert naks[:2] == [0.5, 0.5]  # each redelivery asked to be held retry_delay
            store.complete("x", other.token, namespace=NS)
            await run_until(consumer, sub, lambda: consumer.counts[Verdict.ACKED] == 1)
            guard = time.monotonic() + PATIENCE  # only a guard against a hang
            while await s.pending() != (0, 0):  # the ack reaches the server
                assert time.monotonic() < guard, await s.pending()
                await asyncio.sleep(0.01)

    asyncio.run(main())
    assert handler.calls == []  # a DUPLICATE at last: acked, never handled


def test_failure_releases_and_naks_then_max_deliver_stops_redelivery(store_factory: Any) -> None:
    store = store_factory("embedded")
    handler = Recorder(fail=10**6)

    async def main() -> JetStreamConsumer:
        async with stream(max_deliver=3) as s:
            consumer = JetStreamConsumer(
                store, handler, namespace=NS, key=body_key, retry_delay=0.05
            )
            await s.publish({"id": "poison"})
            sub = await s.subscribe()
            await run_until(consumer, sub, lambda: consumer.counts[Verdict.FAILED] == 3)
            await asyncio.sleep(0.5)  # no fourth delivery: the server gave up after max_deliver
            await run_until(consumer, sub, lambda: True)
            assert consumer.counts[Verdict.FAILED] == 3
            rec = store.get("poison", namespace=NS)
            assert rec is None or rec.state is not State.PROCESSED  # released each time
            return consumer

    asyncio.run(main())
    assert [d.redelivered for d in handler.calls] == [False, True, True]


def test_failure_then_success_runs_again(store_factory: Any) -> None:
    store = store_factory("embedded")
    handler = Recorder(fail=1)

    async def main() -> JetStreamConsumer:
        async with stream() as s:
            consumer = JetStreamConsumer(
                store, handler, namespace=NS, key=body_key, retry_delay=0.05
            )
            await s.publish({"id": "f"})
            sub = await s.subscribe()
            await run_until(consumer, sub, lambda: consumer.counts[Verdict.ACKED] == 1)
            return consumer

    consumer = asyncio.run(main())
    assert handler.keys == ["f", "f"]
    assert consumer.counts[Verdict.FAILED] == 1


def test_missing_key_is_terminated(store_factory: Any) -> None:
    store = store_factory("embedded")
    handler = Recorder()

    async def main() -> JetStreamConsumer:
        async with stream() as s:
            consumer = JetStreamConsumer(store, handler, namespace=NS, key=body_key)
            await s.publish({})  # no business id and no Nats-Msg-Id
            await s.publish(b"not json", "m-1")  # the key function raises
            await s.publish({"id": "ok"})
            sub = await s.subscribe()
            await run_until(consumer, sub, lambda: sum(consumer.counts.values()) == 3)
            await asyncio.sleep(0.3)
            assert await s.pending() == (0, 0)  # termed: not pending, not redelivered
            return consumer

    consumer = asyncio.run(main())
    assert consumer.counts[Verdict.INVALID] == 2
    assert handler.keys == ["ok"]


def test_async_handler_with_the_async_daemon_client(store_factory: Any) -> None:
    from dedupcore import aio

    sync_client = store_factory("daemon")
    calls: list[Any] = []

    async def handler(d: Delivery) -> None:
        calls.append(d.key)

    async def main() -> None:
        async with stream() as s, aio.Client(sync_client.path) as client:
            consumer = JetStreamConsumer(client, handler, namespace=NS, key=body_key)
            for k in ("a", "b", "a"):
                await s.publish({"id": k})
            sub = await s.subscribe()
            await run_until(consumer, sub, lambda: consumer.counts[Verdict.ACKED] == 3)

    asyncio.run(main())
    assert sorted(calls) == ["a", "b"]


def test_table_mode_commits_with_the_business_write(pg: Any, pg_tables: list[str]) -> None:
    ded, biz = uid("dc_ded"), uid("dc_biz")
    pg_tables += [ded, biz]
    pg.execute(f"CREATE TABLE {biz} (k text)")
    pg.commit()
    calls: list[str] = []
    outcomes: list[Outcome] = []

    def handler(d: Delivery) -> None:
        calls.append(str(d.key))
        d.conn.execute(f"INSERT INTO {biz} VALUES (%s)", (d.key,))
        if d.key == "boom" and calls.count("boom") == 1:
            raise RuntimeError("rolled back with the dedup row")

    async def main() -> JetStreamConsumer:
        async with stream() as s:
            consumer = JetStreamConsumer(
                TransactionalTable(pg, table=ded),
                handler,
                namespace=NS,
                key=body_key,
                retry_delay=0.05,
                before_ack=lambda d, o: outcomes.append(o),
            )
            for k in ("a", "boom", "a", "b"):
                await s.publish({"id": k})
            sub = await s.subscribe()
            await run_until(consumer, sub, lambda: consumer.counts[Verdict.ACKED] == 4)
            return consumer

    with pytest.raises(TypeError, match="plain function"):
        JetStreamConsumer(TransactionalTable(pg, table=ded), _async_noop, namespace=NS)
    consumer = asyncio.run(main())
    assert sorted(calls) == ["a", "b", "boom", "boom"]
    assert outcomes.count(Outcome.DUPLICATE) == 1
    rows = pg.execute(f"SELECT k FROM {biz} ORDER BY k").fetchall()
    pg.commit()
    assert [r[0] for r in rows] == ["a", "b", "boom"]
    assert consumer.counts[Verdict.FAILED] == 1


async def _async_noop(d: Delivery) -> None:
    return None


# -- graceful stop -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["astop", "thread"])
def test_stop_finishes_the_message_in_flight_and_naks_the_rest(
    how: str, store_factory: Any
) -> None:
    """Stop while the handler awaits an event: it finishes and is acked once, the rest of
    the batch is nak-ed unstarted; a restarted consumer handles those, and a copy of the
    finished message published again is a DUPLICATE."""
    store = store_factory("embedded")
    blocking = FirstBlocks("a", PATIENCE)
    handler, calls = blocking.handle_async, blocking.calls
    acks: list[Any] = []

    async def main() -> None:
        async with stream() as s:
            for k in ("a", "b", "c"):
                await s.publish({"id": k})
            sub = await s.subscribe()
            consumer = JetStreamConsumer(
                store,
                handler,
                namespace=NS,
                key=body_key,
                ack_sync=True,  # the ack is confirmed before the stop returns
                before_ack=lambda d, o: acks.append(d.key),
            )
            runner = asyncio.create_task(consumer.run(sub, batch=10, fetch_timeout=0.2))
            await blocking.wait_started()
            if how == "astop":
                assert consumer.stop() is False  # on the loop's thread: started, not awaited
                stopping: asyncio.Future[Any] = asyncio.ensure_future(consumer.astop())
            else:
                stopping = asyncio.ensure_future(asyncio.to_thread(consumer.stop, PATIENCE))
                assert await asyncio.to_thread(consumer._stop.asked.wait, PATIENCE)
            assert not consumer.stopped  # the handler still runs
            blocking.release.set()
            result = await asyncio.wait_for(stopping, PATIENCE)
            assert result is (True if how == "thread" else None)
            await asyncio.wait_for(runner, PATIENCE)
            assert consumer.stopped and consumer.stop() is True
            assert calls == ["a"] and acks == ["a"]
            assert consumer.counts[Verdict.ACKED] == 1 and sum(consumer.counts.values()) == 1
            rec = store.get("a", namespace=NS)
            assert rec is not None and rec.state is State.PROCESSED
            await consumer.run(sub)  # a stopped consumer fetches nothing
            assert calls == ["a"]

            await s.publish({"id": "a"})  # a copy of the finished message
            again = JetStreamConsumer(store, handler, namespace=NS, key=body_key, ack_sync=True)
            await run_until(again, sub, lambda: again.counts[Verdict.ACKED] == 3)
            assert await s.pending() == (0, 0)

    asyncio.run(main())
    assert sorted(calls) == ["a", "b", "c"]  # "a" was not applied again
