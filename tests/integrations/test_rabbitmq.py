"""The RabbitMQ wrappers' contract on the real broker (pika and aio-pika), small message counts.

Each test declares its own queues (uuid names, deleted afterwards).
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.integrations.rabbitmq import (
    AsyncDedupConsumer,
    DedupConsumer,
    Delivery,
    TransactionalTable,
    Verdict,
)
from dedupcore.record import State
from tests.support.fakes import FirstBlocks, Recorder
from tests.support.servers import SERVERS, require_server, uid

#: The rows of the store matrix (tests/support/stores.py) these tests run against.
STORE_KINDS = ("embedded", "daemon", "sql", "redis")
NS = "transfers/ledger"
PATIENCE = 60.0


def body_key(body: bytes, headers: Any) -> Any:
    return json.loads(body).get("id")


def publish(ch: Any, queue: str, body: dict[str, Any] | bytes, **props: Any) -> None:
    import pika

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    ch.basic_publish("", queue, raw, pika.BasicProperties(**props))


def pump(ch: Any, until: Callable[[], bool], timeout: float = PATIENCE) -> None:
    """Runs the connection's loop until ``until()`` (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "condition not reached in time"
        ch.connection.process_data_events(time_limit=0.05)


def ready(ch: Any, queue: str) -> int:
    return int(ch.queue_declare(queue, passive=True).method.message_count)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_new_then_duplicate_acked_without_handler(
    kind: str, channel: Any, store_factory: Any
) -> None:
    store = store_factory(kind)
    q = channel.declare()
    handler = Recorder()
    consumer = DedupConsumer(store, handler, namespace=NS, key=body_key)
    consumer.consume(channel, q)
    for k in ("a", "b", "a", "b", "a"):
        publish(channel, q, {"id": k})
    pump(channel, lambda: consumer.counts[Verdict.ACKED] == 5)
    assert sorted(handler.keys) == ["a", "b"]
    assert ready(channel, q) == 0
    for k in ("a", "b"):
        rec = store.get(k, namespace=NS)
        assert rec is not None and rec.state is State.PROCESSED


def test_in_progress_is_nacked_after_the_delay_and_redelivered(
    channel: Any, store_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_factory("embedded")
    other = store.claim("x", namespace=NS, lease=120.0, owner="someone-else")
    assert other.outcome is Outcome.NEW
    q = channel.declare()
    handler = Recorder()
    consumer = DedupConsumer(store, handler, namespace=NS, key=body_key, retry_delay=0.3)
    seen: list[tuple[bool, Verdict]] = []
    # The order of what happens, not how long it took: the nack is held on the
    # connection's timer for retry_delay, and the redelivery comes after it fires.
    events: list[str] = []
    decide = consumer.handle
    schedule = channel.connection.call_later

    def held(delay: float, nack: Callable[[], None]) -> Any:
        def fire() -> None:
            events.append("nacked")
            nack()

        events.append(f"held {delay}")
        return schedule(delay, fire)

    monkeypatch.setattr(channel.connection, "call_later", held)

    def spy(ch: Any, method: Any, props: Any, body: bytes) -> Verdict:
        events.append("delivered")
        v = decide(ch, method, props, body)
        seen.append((bool(method.redelivered), v))
        return v

    consumer.handle = spy  # type: ignore[method-assign]
    consumer.consume(channel, q)
    publish(channel, q, {"id": "x"})
    pump(channel, lambda: len(seen) >= 2)
    assert [v for _, v in seen[:2]] == [Verdict.RETRY, Verdict.RETRY]
    assert seen[1][0] is True  # requeued by the nack, not a new message
    assert events[:4] == ["delivered", "held 0.3", "nacked", "delivered"]
    assert handler.calls == []
    # The other owner finishes: the next redelivery is a DUPLICATE, acked without the handler.
    store.complete("x", other.token, namespace=NS)
    pump(channel, lambda: consumer.counts[Verdict.ACKED] == 1)
    assert handler.calls == []
    assert ready(channel, q) == 0


def test_in_progress_released_elsewhere_then_runs_once(channel: Any, store_factory: Any) -> None:
    store = store_factory("embedded")
    other = store.claim("y", namespace=NS, lease=120.0, owner="someone-else")
    q = channel.declare()
    handler = Recorder()
    consumer = DedupConsumer(store, handler, namespace=NS, key=body_key, retry_delay=0.1)
    consumer.consume(channel, q)
    publish(channel, q, {"id": "y"})
    pump(channel, lambda: consumer.counts[Verdict.RETRY] >= 1)
    store.release("y", other.token, namespace=NS)
    pump(channel, lambda: consumer.counts[Verdict.ACKED] == 1)
    assert handler.keys == ["y"]


def test_handler_failure_releases_and_requeues(channel: Any, store_factory: Any) -> None:
    store = store_factory("embedded")
    q = channel.declare()
    handler = Recorder(fail=2)
    consumer = DedupConsumer(store, handler, namespace=NS, key=body_key, retry_delay=0.05)
    states: list[Any] = []

    def after_failure(d: Delivery, outcome: Outcome) -> None:
        states.append(outcome)

    consumer._gate.before_ack = after_failure
    consumer.consume(channel, q)
    publish(channel, q, {"id": "f"})
    pump(channel, lambda: consumer.counts[Verdict.FAILED] >= 1)
    # Released, not recorded as processed: the key is free for the redelivery.
    rec = store.get("f", namespace=NS)
    assert rec is None or rec.state is not State.PROCESSED
    pump(channel, lambda: consumer.counts[Verdict.ACKED] == 1)
    assert consumer.counts[Verdict.FAILED] == 2
    assert handler.keys == ["f", "f", "f"]
    assert [d.redelivered for d in handler.calls] == [False, True, True]
    assert states == [Outcome.NEW]
    rec = store.get("f", namespace=NS)
    assert rec is not None and rec.state is State.PROCESSED
    assert ready(channel, q) == 0


def test_missing_key_and_refused_key_are_dead_lettered(channel: Any, store_factory: Any) -> None:
    store = store_factory("embedded")
    dlq = channel.declare()
    q = channel.declare(**{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    handler = Recorder()
    consumer = DedupConsumer(store, handler, namespace=NS, key=body_key, key_header="x-id")
    consumer.consume(channel, q)
    publish(channel, q, {"nothing": 1})  # no id, no header, no message_id
    publish(channel, q, b"not json", message_id="m-1")  # the key function raises
    publish(channel, q, {"id": "k" * 600})  # longer than the store's max_key_bytes
    publish(channel, q, {}, headers={"x-id": "from-header"})
    publish(channel, q, {}, message_id="from-message-id")
    pump(channel, lambda: sum(consumer.counts.values()) == 5)
    assert consumer.counts[Verdict.INVALID] == 3
    assert sorted(handler.keys) == ["from-header", "from-message-id"]
    pump(channel, lambda: ready(channel, dlq) == 3)
    assert ready(channel, q) == 0


def test_failure_without_requeue_goes_to_the_dead_letter_exchange(
    channel: Any, store_factory: Any
) -> None:
    store = store_factory("embedded")
    dlq = channel.declare()
    q = channel.declare(**{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    consumer = DedupConsumer(
        store, Recorder(fail=1), namespace=NS, key=body_key, failure_requeue=False
    )
    consumer.consume(channel, q)
    publish(channel, q, {"id": "z"})
    pump(channel, lambda: ready(channel, dlq) == 1)
    rec = store.get("z", namespace=NS)
    assert rec is None or rec.state is not State.PROCESSED


def test_quorum_queue_delivery_limit_dead_letters_a_failing_message(
    channel: Any, store_factory: Any
) -> None:
    """The broker counts redeliveries (x-delivery-limit) and dead-letters; the wrapper does not."""
    store = store_factory("embedded")
    dlq = channel.declare()
    q = uid("dc_quorum")
    channel.declare(
        q,
        durable=True,
        **{
            "x-queue-type": "quorum",
            "x-delivery-limit": 2,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dlq,
        },
    )
    handler = Recorder(fail=10**6)
    consumer = DedupConsumer(store, handler, namespace=NS, key=body_key, retry_delay=0.05)
    consumer.consume(channel, q)
    publish(channel, q, {"id": "poison"})
    pump(channel, lambda: ready(channel, dlq) == 1)
    assert len(handler.calls) == 3  # the first delivery and two redeliveries
    rec = store.get("poison", namespace=NS)
    assert rec is None or rec.state is not State.PROCESSED


def test_auto_ack_is_refused(channel: Any, store_factory: Any) -> None:
    consumer = DedupConsumer(store_factory("embedded"), Recorder(), namespace=NS)
    with pytest.raises(ValueError, match="auto_ack"):
        consumer.consume(channel, channel.declare(), auto_ack=True)


def test_table_mode_commits_business_writes_with_the_dedup_row(
    channel: Any, pg: Any, pg_tables: list[str]
) -> None:
    ded, biz = uid("dc_ded"), uid("dc_biz")
    pg_tables += [ded, biz]
    pg.execute(f"CREATE TABLE {biz} (k text, n int)")
    pg.commit()
    q = channel.declare()
    calls: list[str] = []

    def handler(d: Delivery) -> None:
        calls.append(str(d.key))
        assert d.consumption is not None and d.consumption.new
        d.conn.execute(f"INSERT INTO {biz} VALUES (%s, %s)", (d.key, len(calls)))
        if d.key == "boom" and calls.count("boom") == 1:
            raise RuntimeError("rolled back with the dedup row")

    consumer = DedupConsumer(
        TransactionalTable(pg, table=ded), handler, namespace=NS, key=body_key, retry_delay=0.05
    )
    consumer.consume(channel, q)
    for k in ("a", "a", "boom", "b", "a"):
        publish(channel, q, {"id": k})
    pump(channel, lambda: consumer.counts[Verdict.ACKED] == 5)
    assert sorted(calls) == ["a", "b", "boom", "boom"]
    rows = pg.execute(f"SELECT k FROM {biz} ORDER BY k").fetchall()
    pg.commit()
    assert [r[0] for r in rows] == ["a", "b", "boom"]  # the failed attempt left nothing
    assert consumer.counts[Verdict.FAILED] == 1
    assert ready(channel, q) == 0


# -- aio-pika --------------------------------------------------------------------------


async def aio_ready(queue: str) -> int:
    """Messages ready in ``queue``, asked on a connection of its own.

    (A robust channel answers a passive declare of a queue it declared
    with the count of that first declaration.)
    """
    import aio_pika

    conn = await aio_pika.connect(SERVERS.rabbitmq)
    try:
        ch = await conn.channel()
        declared = await ch.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)
    finally:
        await conn.close()


async def aio_wait_ready(queue: str, n: int) -> None:
    """Waits until ``queue`` holds ``n`` ready messages (a nack from another
    connection may still be on its way)."""
    deadline = time.monotonic() + PATIENCE
    while (count := await aio_ready(queue)) != n:
        assert time.monotonic() < deadline, f"{count} ready, not {n}"
        await asyncio.sleep(0.02)


async def _aio_run(
    store: Any,
    bodies: list[dict[str, Any] | bytes],
    handler: Any,
    until: Callable[[AsyncDedupConsumer], bool],
    **kw: Any,
) -> AsyncDedupConsumer:
    import aio_pika

    conn = await aio_pika.connect_robust(SERVERS.rabbitmq)
    try:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=10)
        q = await ch.declare_queue(f"dc_aio_{uuid.uuid4().hex[:16]}", auto_delete=False)
        try:
            consumer = AsyncDedupConsumer(store, handler, namespace=NS, key=body_key, **kw)
            await consumer.consume(q)
            for b in bodies:
                raw = b if isinstance(b, bytes) else json.dumps(b).encode()
                # aio-pika gives every message a random message_id of its own.
                await ch.default_exchange.publish(aio_pika.Message(raw), routing_key=q.name)
            deadline = time.monotonic() + PATIENCE
            while not until(consumer):
                assert time.monotonic() < deadline, f"not reached: {consumer.counts}"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
            assert await aio_ready(q.name) == 0
        finally:
            await q.delete(if_unused=False, if_empty=False)
    finally:
        await conn.close()
    return consumer


def test_aio_pika_concurrent_copies_of_a_key_run_once(store_factory: Any) -> None:
    """Ten copies of one key arrive at once (prefetch 10): the handler runs once."""
    require_server("rabbitmq")
    store = store_factory("embedded")
    calls: list[Any] = []

    async def handler(d: Delivery) -> None:
        calls.append(d.key)
        await asyncio.sleep(0.2)  # keep the claim while the copies arrive

    consumer = asyncio.run(
        _aio_run(
            store,
            [{"id": "same"}] * 10 + [{"id": "other"}],
            handler,
            lambda c: c.counts[Verdict.ACKED] == 11,
            retry_delay=0.05,
        )
    )
    assert sorted(calls) == ["other", "same"]
    assert consumer.counts[Verdict.RETRY] >= 1


def test_aio_pika_with_the_async_daemon_client_and_failures(store_factory: Any) -> None:
    require_server("rabbitmq")
    from dedupcore import aio

    sync_client = store_factory("daemon")
    calls: list[Any] = []

    def handler(d: Delivery) -> None:
        calls.append(d.key)
        if d.key == "bad" and calls.count("bad") == 1:
            raise RuntimeError("first attempt fails")

    async def main() -> AsyncDedupConsumer:
        async with aio.Client(sync_client.path) as client:
            return await _aio_run(
                client,
                [{"id": "a"}, {"id": "bad"}, {"id": "a"}, b"not json"],
                handler,
                lambda c: c.counts[Verdict.ACKED] == 3 and c.counts[Verdict.INVALID] == 1,
                retry_delay=0.05,
            )

    consumer = asyncio.run(main())
    assert sorted(calls) == ["a", "bad", "bad"]
    assert consumer.counts[Verdict.FAILED] == 1
    rec = sync_client.get("bad", namespace=NS)
    assert rec is not None and rec.state is State.PROCESSED


def test_interrupted_handler_releases_then_propagates(store_factory: Any) -> None:
    """A KeyboardInterrupt in the handler gives the key back before it stops the consumer."""
    from types import SimpleNamespace

    store = store_factory("embedded")

    def handler(d: Delivery) -> None:
        raise KeyboardInterrupt

    consumer = DedupConsumer(store, handler, namespace=NS, key=body_key)
    method = SimpleNamespace(delivery_tag=1, redelivered=False)
    props = SimpleNamespace(headers=None, message_id=None)
    with pytest.raises(KeyboardInterrupt):
        consumer.handle(object(), method, props, b'{"id": "k"}')
    rec = store.get("k", namespace=NS)
    assert rec is None or rec.state is not State.PROCESSING
    assert store.claim("k", namespace=NS, owner="next").outcome is Outcome.NEW


# -- graceful stop -------------------------------------------------------------------------


def _restart_and_redeliver(channel: Any, store: Any, q: str, handler: FirstBlocks) -> None:
    """A copy of "a" is delivered again to a restarted consumer: not applied again; the
    messages the stopped consumer left are handled now."""
    publish(channel, q, {"id": "a"})
    again = DedupConsumer(store, handler, namespace=NS, key=body_key)
    again.consume(channel, q)
    pump(channel, lambda: again.counts[Verdict.ACKED] == 3)
    assert sorted(handler.calls) == ["a", "b", "c"]
    assert again.counts[Verdict.ACKED] == 3 and ready(channel, q) == 0
    assert again.stop(timeout=0) is False  # asked on the connection's thread: not done yet
    pump(channel, lambda: again.stopped)
    assert channel.consumer_tags == []


def test_pika_stop_from_another_thread_finishes_the_message_in_flight(
    channel: Any, store_factory: Any
) -> None:
    import pika

    store = store_factory("embedded")
    q = channel.declare()
    for k in ("a", "b", "c"):
        publish(channel, q, {"id": k})
    blocking = FirstBlocks("a", PATIENCE)
    acks: list[Any] = []
    consumer = DedupConsumer(
        store, blocking, namespace=NS, key=body_key, before_ack=lambda d, o: acks.append(d.key)
    )
    errors: list[BaseException] = []

    def consume() -> None:  # a connection of its own: pika objects stay on their thread
        conn = pika.BlockingConnection(pika.URLParameters(SERVERS.rabbitmq))
        try:
            ch = conn.channel()
            ch.basic_qos(prefetch_count=10)  # b and c wait in pika's buffer meanwhile
            consumer.consume(ch, q)
            ch.start_consuming()  # returns once stop() cancelled the consumer
        except BaseException as exc:  # a second ack of one tag closes the channel
            errors.append(exc)
        finally:
            conn.close()

    runner = threading.Thread(target=consume)
    runner.start()
    assert blocking.started.wait(PATIENCE)
    answer: list[bool] = []
    stopper = threading.Thread(target=lambda: answer.append(consumer.stop(timeout=PATIENCE)))
    stopper.start()
    assert consumer._stop.asked.wait(PATIENCE)
    assert not consumer.stopped  # the handler still runs
    blocking.release.set()
    stopper.join(PATIENCE)
    runner.join(PATIENCE)
    assert not runner.is_alive() and errors == []
    assert answer == [True] and consumer.stop() is True  # done, and idempotent
    assert blocking.calls == ["a"] and acks == ["a"]
    assert consumer.counts[Verdict.ACKED] == 1 and sum(consumer.counts.values()) == 1
    rec = store.get("a", namespace=NS)
    assert rec is not None and rec.state is State.PROCESSED
    pump(channel, lambda: ready(channel, q) == 2)  # b and c are back, never started
    for k in ("b", "c"):
        assert store.get(k, namespace=NS) is None
    with pytest.raises(RuntimeError, match="stopped"):
        consumer.consume(channel, q)
    _restart_and_redeliver(channel, store, q, blocking)


def test_pika_stop_from_a_signal_handler(channel: Any, store_factory: Any) -> None:
    """SIGUSR1's handler (on the consuming thread, mid-message) stops the consumer: the
    message finishes, start_consuming() returns, the rest stays in the queue."""
    store = store_factory("embedded")
    q = channel.declare()
    for k in ("a", "b", "c"):
        publish(channel, q, {"id": k})
    handler = FirstBlocks(key="none")  # records, never blocks
    answers: list[bool] = []

    def on_signal(signum: int, frame: Any) -> None:
        answers.append(consumer.stop())

    def signalling(d: Delivery) -> None:
        handler(d)
        signal.raise_signal(signal.SIGUSR1)  # the handler runs here, on this thread

    consumer = DedupConsumer(store, signalling, namespace=NS, key=body_key)
    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        channel.basic_qos(prefetch_count=10)
        consumer.consume(channel, q)
        channel.start_consuming()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert answers == [False]  # could not wait on its own thread
    assert consumer.stopped and channel.consumer_tags == []
    assert handler.calls == ["a"] and consumer.counts[Verdict.ACKED] == 1
    pump(channel, lambda: ready(channel, q) == 2)
    _restart_and_redeliver(channel, store, q, handler)


def test_aio_pika_stop_finishes_the_message_in_flight(store_factory: Any) -> None:
    """stop() from a worker thread while the handler awaits an event."""
    require_server("rabbitmq")
    import aio_pika

    store = store_factory("embedded")
    blocking = FirstBlocks("a", PATIENCE)
    handler, calls = blocking.handle_async, blocking.calls

    async def main() -> None:
        conn = await aio_pika.connect_robust(SERVERS.rabbitmq)
        try:
            ch = await conn.channel()
            await ch.set_qos(prefetch_count=1)
            q = await ch.declare_queue(f"dc_aio_{uuid.uuid4().hex[:16]}", auto_delete=False)
            try:
                for k in ("a", "b", "c"):
                    await ch.default_exchange.publish(
                        aio_pika.Message(json.dumps({"id": k}).encode()), routing_key=q.name
                    )
                consumer = AsyncDedupConsumer(store, handler, namespace=NS, key=body_key)
                await consumer.consume(q)
                await blocking.wait_started()
                stopping = asyncio.create_task(asyncio.to_thread(consumer.stop, PATIENCE))
                assert await asyncio.to_thread(consumer._stop.asked.wait, PATIENCE)
                assert not consumer.stopped  # the handler still runs
                blocking.release.set()
                assert await asyncio.wait_for(stopping, PATIENCE) is True
                await consumer.astop()  # idempotent
                assert calls == ["a"] and consumer.counts[Verdict.ACKED] == 1
                await aio_wait_ready(q.name, 2)  # b and c are back (or never left)

                # Restart, with a copy of "a" delivered again: only b and c run.
                await ch.default_exchange.publish(
                    aio_pika.Message(json.dumps({"id": "a"}).encode()), routing_key=q.name
                )
                again = AsyncDedupConsumer(store, handler, namespace=NS, key=body_key)
                await again.consume(q)
                deadline = time.monotonic() + PATIENCE
                while again.counts[Verdict.ACKED] < 3:
                    assert time.monotonic() < deadline, again.counts
                    await asyncio.sleep(0.02)
                assert again.stop() is False  # on the loop's thread: started, not awaited
                await again.astop()
                assert again.stopped
            finally:
                await q.delete(if_unused=False, if_empty=False)
        finally:
            await conn.close()

    asyncio.run(main())
    assert sorted(calls) == ["a", "b", "c"]


def test_pika_stop_nacks_a_held_message_at_once(channel: Any, store_factory: Any) -> None:
    """A message held for a delayed nack (IN_PROGRESS elsewhere) goes back when the
    consumer stops, not after its retry_delay."""
    store = store_factory("embedded")
    store.claim("x", namespace=NS, lease=120.0, owner="someone-else")
    q = channel.declare()
    consumer = DedupConsumer(store, Recorder(), namespace=NS, key=body_key, retry_delay=3600.0)
    consumer.consume(channel, q)
    publish(channel, q, {"id": "x"})
    pump(channel, lambda: consumer.counts[Verdict.RETRY] == 1)  # held for an hour
    with pytest.raises(ValueError):
        consumer.stop(timeout=-1)
    with pytest.raises(TypeError):
        consumer.stop(timeout="now")  # type: ignore[arg-type]
    assert not consumer.stopping  # a refused call asks for nothing
    assert consumer.stop(timeout=0) is False  # on the connection's thread
    pump(channel, lambda: consumer.stopped)
    pump(channel, lambda: ready(channel, q) == 1)
    assert channel.consumer_tags == []


def test_aio_pika_stop_nacks_a_held_message_at_once(store_factory: Any) -> None:
    require_server("rabbitmq")
    import aio_pika

    store = store_factory("embedded")
    store.claim("x", namespace=NS, lease=120.0, owner="someone-else")

    async def main() -> None:
        conn = await aio_pika.connect_robust(SERVERS.rabbitmq)
        try:
            ch = await conn.channel()
            q = await ch.declare_queue(f"dc_aio_{uuid.uuid4().hex[:16]}", auto_delete=False)
            try:
                consumer = AsyncDedupConsumer(
                    store, Recorder(), namespace=NS, key=body_key, retry_delay=3600.0
                )
                await consumer.consume(q)
                await ch.default_exchange.publish(
                    aio_pika.Message(json.dumps({"id": "x"}).encode()), routing_key=q.name
                )
                deadline = time.monotonic() + PATIENCE
                while consumer.counts[Verdict.RETRY] < 1:  # then held for an hour
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                with pytest.raises(ValueError):
                    consumer.stop(timeout=float("nan"))
                assert not consumer.stopping
                await asyncio.wait_for(consumer.astop(), PATIENCE)
                assert consumer.stopped
                await aio_wait_ready(q.name, 1)  # nacked back by the stop, not in an hour
            finally:
                await q.delete(if_unused=False, if_empty=False)
        finally:
            await conn.close()

    asyncio.run(main())


def test_pika_select_connection_stop_from_another_thread(channel: Any, store_factory: Any) -> None:
    """The same stop on a SelectConnection: the cancel is queued on its ioloop."""
    import pika

    store = store_factory("embedded")
    q = channel.declare()
    for k in ("a", "b", "c"):
        publish(channel, q, {"id": k})
    blocking = FirstBlocks("a", PATIENCE)
    consumer = DedupConsumer(store, blocking, namespace=NS, key=body_key)
    opened: list[Any] = []
    errors: list[BaseException] = []

    def on_channel(ch: Any) -> None:
        ch.basic_qos(prefetch_count=10, callback=lambda _frame: consumer.consume(ch, q))

    def run() -> None:
        try:
            conn = pika.SelectConnection(
                pika.URLParameters(SERVERS.rabbitmq),
                on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
                on_close_callback=lambda c, reason: c.ioloop.stop(),
            )
            opened.append(conn)
            conn.ioloop.start()
        except BaseException as exc:
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    assert blocking.started.wait(PATIENCE)
    answer: list[bool] = []
    stopper = threading.Thread(target=lambda: answer.append(consumer.stop(timeout=PATIENCE)))
    stopper.start()
    assert consumer._stop.asked.wait(PATIENCE)
    blocking.release.set()
    stopper.join(PATIENCE)
    assert answer == [True]
    conn = opened[0]
    conn.ioloop.add_callback_threadsafe(conn.close)
    runner.join(PATIENCE)
    assert not runner.is_alive() and errors == []
    assert blocking.calls == ["a"] and consumer.counts[Verdict.ACKED] == 1
    pump(channel, lambda: ready(channel, q) == 2)
    _restart_and_redeliver(channel, store, q, blocking)
