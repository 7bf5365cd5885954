"""The Dramatiq broker and actors that tests/integrations/test_dramatiq.py runs on a real worker.

The worker is ``dramatiq tests.integrations.dramatiq_tasks``; the test gives it its
settings in the environment:

- ``DQ_DIR``: a directory shared with the test (effects, markers);
- ``DQ_AMQP``: the RabbitMQ broker; ``DQ_REDIS`` and ``DQ_PREFIX``: the Redis store
  of store mode; ``DQ_LEASE``: its claims' lease in seconds;
- ``DQ_POSTGRES``, ``DQ_TABLE`` and ``DQ_EFFECTS``: with them the middleware is in
  transactional mode instead (database, dedup table, effects table).

A message's payload is ``{"id": key, "pause": point, "fail_first": bool}``. At
the point named by ``pause`` the first delivery of that key (a marker file says
it paused) prints ``PAUSED <key> <point>`` and waits until the worker is killed.
The points: ``after_claim`` (the actor has started), ``after_effect`` (the effect
is applied, the actor has not returned) and ``after_complete`` (the key is
completed or the transaction committed; the message is not acked yet). Every
run that applies an effect writes one line into ``effects/<key>`` (store mode)
or one row into the effects table (transactional mode); every message whose actor
ran prints ``DONE <key>`` before its ack (a duplicate is logged by the middleware
instead: ``key '<key>' was processed before``), and the worker prints ``READY``
once it consumes. Its log goes to stdout with these lines.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker

from dedupcore.integrations.dramatiq import DedupMiddleware, current
from tests.support.workers import first, paused, say

HOME = Path(os.environ.get("DQ_DIR", "."))
LEASE = float(os.environ.get("DQ_LEASE", "60"))
POSTGRES = os.environ.get("DQ_POSTGRES")
EFFECTS = os.environ.get("DQ_EFFECTS", "dq_effects")


class Flaky(Exception):
    """The first run of a ``fail_first`` payload raises this."""


def pause(item: Any, point: str) -> None:
    """Waits to be killed at ``point`` if the payload asks for it, the first time only."""
    if paused(HOME, item, point) is not None:
        threading.Event().wait()


def redis_store() -> Any:
    from dedupcore.redis import RedisStore

    return RedisStore.from_url(os.environ["DQ_REDIS"], prefix=os.environ["DQ_PREFIX"])


def postgres() -> Any:
    import psycopg

    return psycopg.connect(POSTGRES)


class Points(dramatiq.Middleware):
    """``after_complete`` and the ``DONE`` and ``READY`` lines, around the dedup middleware.

    Added before it, so its ``after_*`` hooks run after the middleware's own
    (Dramatiq runs them in reverse order): the key is completed by then.
    """

    def after_process_message(
        self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        if exception is None and not message.failed and message.args:
            pause(message.args[0], "after_complete")
            say(f"DONE {message.args[0].get('id')}")

    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        say("READY")


broker = RabbitmqBroker(url=os.environ.get("DQ_AMQP", "amqp://guest:guest@127.0.0.1:5672/%2F"))
broker.add_middleware(Points())
if POSTGRES:
    broker.add_middleware(
        DedupMiddleware(connection=postgres, table=os.environ["DQ_TABLE"], retry_delay=0.2)
    )
else:
    broker.add_middleware(DedupMiddleware(redis_store, lease=LEASE, retry_delay=0.2))
dramatiq.set_broker(broker)


def apply_to_file(key: str) -> None:
    """The effect of store mode: one line per run that applies it."""
    effects = HOME / "effects"
    effects.mkdir(exist_ok=True)
    with open(effects / key, "a") as f:
        f.write(f"{os.getpid()}\n")


def by_payload_id(args: tuple[Any, ...], kwargs: Any, options: Any) -> Any:
    return args[0].get("id")


@dramatiq.actor(
    actor_name="dq.transfer",
    queue_name=os.environ.get("DQ_QUEUE", "default"),
    dedup_key=by_payload_id,
    max_retries=3,
    min_backoff=50,
    max_backoff=100,
)
def transfer(item: dict[str, Any]) -> None:
    """Keyed by the payload's id; the effect in a file, or a row in transactional mode."""
    key = str(item.get("id"))  # a run without an id would leave runs-None
    with open(HOME / f"runs-{key}", "a") as f:
        f.write(f"{os.getpid()}\n")
    pause(item, "after_claim")
    if item.get("fail_first") and first(HOME, f"failed-{key}"):
        raise Flaky(key)
    if POSTGRES:
        current().conn.execute(f"INSERT INTO {EFFECTS} (key) VALUES (%s)", (key,))
    else:
        apply_to_file(key)
    pause(item, "after_effect")


@dramatiq.actor(actor_name="dq.by_id", queue_name=os.environ.get("DQ_QUEUE", "default"))
def by_id(item: dict[str, Any]) -> None:
    """Keyed by the message id (the default)."""
    apply_to_file(item["id"])
