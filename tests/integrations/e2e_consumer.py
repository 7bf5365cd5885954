"""One consumer process of the end-to-end transfer scenario (RabbitMQ or NATS JetStream).

Run as ``python e2e_consumer.py '<json config>'``. It applies transfers to
PostgreSQL: ``balance += amount`` on the account and one change-log row.

- ``mode == "dedup"``: through dedupcore's consumer wrapper in table mode
  (the dedup row commits in the business transaction).
- ``mode == "plain"``: the same writes, commit, ack -- no dedup at all.

``kill_every = N`` makes the process SIGKILL itself after the commit of its
N-th applied transfer (and every N-th after that) and before the ack: the
worst moment for a consumer to die. SIGTERM stops it cleanly (the broker
gets its connection closed and requeues what it did not ack).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

import psycopg


def main() -> None:
    cfg: dict[str, Any] = json.loads(sys.argv[1])
    conn = connect(cfg["pg_url"])
    accounts, changelog = cfg["accounts"], cfg["changelog"]
    kill_every = int(cfg.get("kill_every") or 0)
    applied = 0

    def apply(c: Any, transfer: dict[str, Any]) -> None:
        cur = c.cursor()
        cur.execute(
            f"UPDATE {accounts} SET balance = balance + %s WHERE id = %s",
            (transfer["amount"], transfer["account"]),
        )
        cur.execute(
            f"INSERT INTO {changelog} (transfer_id, account, amount, pid) VALUES (%s, %s, %s, %s)",
            (transfer["transfer_id"], transfer["account"], transfer["amount"], os.getpid()),
        )

    def committed() -> None:
        """Called after the business commit and before the ack."""
        nonlocal applied
        applied += 1
        if kill_every and applied % kill_every == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    if cfg["broker"] == "rabbitmq":
        run_rabbitmq(cfg, conn, apply, committed)
    else:
        asyncio.run(run_nats(cfg, conn, apply, committed))


def connect(url: str) -> Any:
    """A PostgreSQL connection, retried while the server is out of connection slots."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return psycopg.connect(url)
        except psycopg.OperationalError as exc:
            if "too many clients" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def transfer_key(body: bytes, headers: Any) -> str:
    return str(json.loads(body)["transfer_id"])


def run_rabbitmq(cfg: dict[str, Any], conn: Any, apply: Any, committed: Any) -> None:
    import pika

    from dedupcore.api import Outcome
    from dedupcore.integrations.rabbitmq import DedupConsumer, TransactionalTable

    amqp = pika.BlockingConnection(pika.URLParameters(cfg["amqp_url"]))
    ch = amqp.channel()
    ch.basic_qos(prefetch_count=int(cfg.get("prefetch", 20)))
    signal.signal(signal.SIGTERM, lambda *_: amqp.add_callback_threadsafe(ch.stop_consuming))

    if cfg["mode"] == "dedup":

        def handler(d: Any) -> None:
            apply(d.conn, json.loads(d.body))

        def before_ack(d: Any, outcome: Outcome) -> None:
            if outcome is Outcome.NEW:
                committed()

        consumer = DedupConsumer(
            TransactionalTable(conn, table=cfg["dedup_table"], create=False),
            handler,
            namespace=cfg["namespace"],
            key=transfer_key,
            retry_delay=0.2,
            before_ack=before_ack,
        )
        consumer.consume(ch, cfg["queue"])
    else:

        def on_message(channel: Any, method: Any, properties: Any, body: bytes) -> None:
            apply(conn, json.loads(body))
            conn.commit()
            committed()
            channel.basic_ack(method.delivery_tag)

        ch.basic_consume(cfg["queue"], on_message)
    print("ready", flush=True)
    ch.start_consuming()
    amqp.close()


async def run_nats(cfg: dict[str, Any], conn: Any, apply: Any, committed: Any) -> None:
    import nats
    from nats.errors import TimeoutError as NatsTimeout

    from dedupcore.api import Outcome
    from dedupcore.integrations.nats import JetStreamConsumer
    from dedupcore.integrations.rabbitmq import TransactionalTable

    nc = await nats.connect(cfg["nats_url"])
    js = nc.jetstream()
    sub = await js.pull_subscribe(cfg["subject"], durable=cfg["durable"], stream=cfg["stream"])
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    batch = int(cfg.get("prefetch", 20))
    print("ready", flush=True)
    if cfg["mode"] == "dedup":

        def handler(d: Any) -> None:
            apply(d.conn, json.loads(d.body))

        def before_ack(d: Any, outcome: Outcome) -> None:
            if outcome is Outcome.NEW:
                committed()

        consumer = JetStreamConsumer(
            TransactionalTable(conn, table=cfg["dedup_table"], create=False),
            handler,
            namespace=cfg["namespace"],
            key=transfer_key,
            retry_delay=0.2,
            before_ack=before_ack,
        )
        await consumer.run(sub, batch=batch, fetch_timeout=0.5, stop=stop)
    else:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(batch, timeout=0.5)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            for msg in msgs:
                apply(conn, json.loads(msg.data))
                conn.commit()
                committed()
                await msg.ack()
    await nc.flush()
    await nc.close()


if __name__ == "__main__":
    main()
