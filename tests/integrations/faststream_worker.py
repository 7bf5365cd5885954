"""FastStream brokers for tests/integrations/test_faststream.py, and its worker process.

:class:`Rig` is one FastStream broker of a kind ("rabbit", "nats", "kafka" on
aiokafka, "confluent" on confluent-kafka: the same Kafka-protocol server) on
the real server, with a queue, a JetStream stream or a Kafka topic of its own
(uuid names, deleted on close): ``await rig.start(middleware, handler,
ack_policy)`` subscribes ``handler`` behind the middleware, ``await
rig.publish(...)`` sends.

Run as ``python -m tests.integrations.faststream_worker``, it is the worker the
kill tests SIGKILL: it subscribes on the rig named by its environment and
prints ``READY``. Its settings:

- ``FS_KIND``, ``FS_NAME``: the broker kind and the rig's name (queue, stream, topic);
- ``FS_DIR``: a directory shared with the test (effects, markers);
- ``FS_REDIS``, ``FS_PREFIX``, ``FS_LEASE``: the Redis store of store mode and its lease;
- ``FS_POSTGRES``, ``FS_TABLE``, ``FS_EFFECTS``: transactional mode's database, dedup
  table and effects table (store mode without them).

A payload is ``{"id": key, "pause": point}``. At the point named by ``pause``
the first delivery of that key (a marker file says it paused) prints ``PAUSED
<key> <point>`` and waits until the process is killed. The points:
``after_claim`` (the handler has started), ``after_effect`` (the effect is
applied, the handler has not returned) and ``after_complete`` (the key is
completed or the transaction committed; the message is not acked yet). Every
run that applies an effect writes one line into ``effects/<key>`` (store mode)
or one row into the effects table (transactional mode); every message acked after
a NEW or DUPLICATE claim prints ``DONE <key> <outcome>`` just before its ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

from faststream.middlewares import AckPolicy

from tests.support.workers import paused, say

#: Seconds to wait for a broker or a message: far more than any of them takes.
PATIENCE = 60.0


class Rig:
    """One FastStream broker of ``kind`` on the real server, and its queue, stream or topic."""

    def __init__(
        self, kind: str, url: str, name: str | None = None, *, ack_wait: float = 30.0
    ) -> None:
        self.kind = kind
        #: Seconds before JetStream redelivers a message not acked (a killed worker's).
        self.ack_wait = ack_wait
        self.url = url
        self.name = name or f"dc_fs_{uuid.uuid4().hex[:16]}"
        self.broker: Any = None

    async def create(self) -> None:
        """Makes the queue, stream or topic, so that messages can wait for a subscriber."""
        if self.kind == "rabbit":
            await asyncio.to_thread(
                self._pika_channel_call, "queue_declare", queue=self.name, durable=True
            )
        elif self.kind == "nats":
            import nats
            from nats.js.api import StorageType, StreamConfig

            nc = await nats.connect(self.url)
            try:
                subjects = [f"{self.name}.>"]
                config = StreamConfig(self.name, subjects=subjects, storage=StorageType.MEMORY)
                await nc.jetstream().add_stream(config)
            finally:
                await nc.close()
        else:
            from confluent_kafka.admin import AdminClient, NewTopic

            admin = AdminClient({"bootstrap.servers": self.url})
            made = admin.create_topics([NewTopic(self.name, num_partitions=2)])[self.name]
            await asyncio.to_thread(made.result, PATIENCE)

    def _broker(self) -> Any:
        if self.kind == "rabbit":
            from faststream.rabbit import RabbitBroker

            return RabbitBroker(self.url, logger=None)
        if self.kind == "nats":
            from faststream.nats import NatsBroker

            return NatsBroker(self.url, logger=None)
        if self.kind == "confluent":
            from faststream.confluent import KafkaBroker as ConfluentBroker

            return ConfluentBroker(self.url, logger=None)
        from faststream.kafka import KafkaBroker

        return KafkaBroker(self.url, logger=None)

    def _subscriber(self, middleware: Any, ack_policy: AckPolicy) -> tuple[Any, Any]:
        """A router behind ``middleware`` and its subscriber on this rig's source."""
        if self.kind == "rabbit":
            from faststream.rabbit import RabbitQueue, RabbitRouter

            router: Any = RabbitRouter(middlewares=[middleware])
            queue = RabbitQueue(self.name, durable=True)
            return router, router.subscriber(queue, ack_policy=ack_policy)
        if self.kind == "nats":
            from faststream.nats import ConsumerConfig, JStream, NatsRouter, PullSub
            from nats.js.api import StorageType

            router = NatsRouter(middlewares=[middleware])
            stream = JStream(self.name, subjects=[f"{self.name}.>"], storage=StorageType.MEMORY)
            return router, router.subscriber(
                f"{self.name}.in",
                stream=stream,
                durable=self.name,
                pull_sub=PullSub(batch_size=10, timeout=0.2),
                config=ConsumerConfig(ack_wait=self.ack_wait),
                ack_policy=ack_policy,
            )
        if self.kind == "confluent":
            from faststream.confluent import KafkaRouter as ConfluentRouter

            router = ConfluentRouter(middlewares=[middleware])
        else:
            from faststream.kafka import KafkaRouter

            router = KafkaRouter(middlewares=[middleware])
        return router, router.subscriber(
            self.name,
            group_id=self.name,
            auto_offset_reset="earliest",
            ack_policy=ack_policy,
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
        )

    async def start(
        self,
        middleware: Any = None,
        handler: Callable[..., Any] | None = None,
        ack_policy: AckPolicy = AckPolicy.NACK_ON_ERROR,
    ) -> None:
        """Subscribes ``handler`` behind ``middleware`` (a router's) and starts the broker;
        without a handler, a broker that only publishes."""
        self.broker = self._broker()
        if handler is not None:
            router, sub = self._subscriber(middleware, ack_policy)
            sub(handler)
            self.broker.include_router(router)
        await self.broker.start()

    async def publish(
        self,
        body: Any,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        """Sends ``body`` (a dict is sent as JSON); ``message_id`` as the broker's own id."""
        headers = dict(headers or {})
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        if self.kind == "rabbit":
            # Through pika: aio-pika (FastStream's client) gives a message without a
            # message_id a random one, and this rig must send one without.
            await asyncio.to_thread(self._pika_publish, raw, headers, message_id)
        elif self.kind == "nats":
            import nats

            # Through nats-py: FastStream's publisher adds a message_id header of its own.
            if message_id is not None:
                headers["Nats-Msg-Id"] = message_id
            nc = await nats.connect(self.url)
            try:
                await nc.jetstream().publish(f"{self.name}.in", raw, headers=headers or None)
            finally:
                await nc.close()
        else:
            await self.broker.publish(raw, self.name, headers=headers, partition=0)

    def _pika_channel_call(self, method: str, **kwargs: Any) -> None:
        """``channel.<method>(**kwargs)`` on a pika connection of its own."""
        import pika

        conn = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            getattr(conn.channel(), method)(**kwargs)
        finally:
            conn.close()

    def _pika_publish(self, body: bytes, headers: dict[str, str], message_id: str | None) -> None:
        import pika

        properties = pika.BasicProperties(headers=headers, message_id=message_id)
        self._pika_channel_call(
            "basic_publish", exchange="", routing_key=self.name, body=body, properties=properties
        )

    async def stop(self) -> None:
        if self.broker is not None:
            await self.broker.stop()
            self.broker = None

    async def close(self) -> None:
        """Stops the broker and deletes the queue, stream or topic."""
        await self.stop()
        with contextlib.suppress(Exception):
            if self.kind == "rabbit":
                await asyncio.to_thread(self._pika_channel_call, "queue_delete", queue=self.name)
            elif self.kind == "nats":
                import nats

                nc = await nats.connect(self.url)
                await nc.jetstream().delete_stream(self.name)
                await nc.close()
            else:
                from confluent_kafka.admin import AdminClient

                admin = AdminClient({"bootstrap.servers": self.url})
                await asyncio.to_thread(admin.delete_topics([self.name])[self.name].result, 60)


# -- the worker process ------------------------------------------------------------------------

HOME = Path(os.environ.get("FS_DIR", "."))


async def pause(item: Any, point: str) -> None:
    """Waits to be killed at ``point`` if the payload asks for it, the first time only."""
    if paused(HOME, item, point) is not None:
        await asyncio.Event().wait()


def apply_to_file(key: str) -> None:
    """The effect of store mode: one line per run that applies it."""
    effects = HOME / "effects"
    effects.mkdir(exist_ok=True)
    with open(effects / key, "a") as f:
        f.write(f"{os.getpid()}\n")


async def main() -> None:
    from faststream import Context

    from dedupcore.integrations import TransactionalTable
    from dedupcore.integrations.faststream import DedupMiddleware

    env = os.environ
    table_mode = bool(env.get("FS_POSTGRES"))
    if table_mode:
        import psycopg

        store: Any = TransactionalTable(psycopg.connect(env["FS_POSTGRES"]), table=env["FS_TABLE"])
    else:
        from dedupcore.redis import RedisStore

        store = RedisStore.from_url(env["FS_REDIS"], prefix=env["FS_PREFIX"])

    async def before_ack(delivery: Any, outcome: Any) -> None:
        await pause(json.loads(delivery.body), "after_complete")
        say(f"DONE {delivery.key} {outcome.name}")

    middleware = DedupMiddleware(
        store,
        namespace="faststream/kills",
        key=lambda body, headers: json.loads(body)["id"],
        lease=float(env.get("FS_LEASE", "60")),
        retry_delay=0.2,
        before_ack=before_ack,
    )

    async def handle(item: dict[str, Any], dedup: Annotated[Any, Context("dedup")]) -> None:
        await pause(item, "after_claim")
        if table_mode:
            dedup.conn.execute(
                f"INSERT INTO {env['FS_EFFECTS']} (key, pid) VALUES (%s, %s)",
                (item["id"], os.getpid()),
            )
        else:
            apply_to_file(item["id"])
        await pause(item, "after_effect")

    # A killed worker's messages come back to the next one 2 s after their delivery.
    rig = Rig(env["FS_KIND"], env["FS_URL"], env["FS_NAME"], ack_wait=2)
    await rig.start(middleware, handle)
    say("READY")
    await asyncio.Event().wait()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
