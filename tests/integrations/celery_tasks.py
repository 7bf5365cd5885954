"""The Celery app and tasks that tests/integrations/test_celery.py runs on a real worker.

The worker is ``celery -A tests.integrations.celery_tasks worker``; the test gives it
its settings in the environment:

- ``DC_CELERY_DIR``: a directory shared with the test (effects, markers, go files);
- ``DC_CELERY_AMQP``: the broker; ``DC_CELERY_REDIS`` and ``DC_CELERY_PREFIX``: the
  Redis store of the store-mode tasks; ``DC_CELERY_DAEMON``: a daemon's socket, which
  makes the daemon's :class:`~dedupcore.Client` their store instead;
- ``DC_CELERY_POSTGRES``, ``DC_CELERY_TABLE`` and ``DC_CELERY_EFFECTS``: the database,
  dedup table and effects table of the transactional task;
- ``DC_CELERY_LEASE``: the lease of the store-mode claims, in seconds.

A task's payload is ``{"id": key, "pause": point, "fail_first": bool}``. At the
point named by ``pause`` the first run of that key (and only the first: a marker
file says it paused) prints ``PAUSED <key> <point> <pid>`` and waits until the
test creates ``go-<key>`` -- or kills the worker, which is what the test does
where it wants a crash. The points: ``after_claim`` (the body has started),
``after_effect`` (the effect is applied, the body has not returned) and
``after_complete`` (the key is completed or the transaction committed; the
message is not acked yet). Every run that applies an effect writes one line
into ``effects/<key>`` (store mode) or one row into the effects table
(transactional mode). The worker prints ``READY`` once it consumes and
``RETRY <task id>`` for each retry.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_retry, worker_ready

from dedupcore.integrations.celery import IdempotentTask
from tests.support.workers import first, paused, say

HOME = Path(os.environ.get("DC_CELERY_DIR", "."))
LEASE = float(os.environ.get("DC_CELERY_LEASE", "60"))
TABLE = os.environ.get("DC_CELERY_TABLE", "dedupcore_consumed")
EFFECTS = os.environ.get("DC_CELERY_EFFECTS", "dc_celery_effects")

app = Celery(
    "dc_celery_tests",
    broker=os.environ.get("DC_CELERY_AMQP", "amqp://guest:guest@127.0.0.1:5672//"),
    backend="rpc://",
)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_redirect_stdouts=False,  # the tasks' lines go to the test
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


class Flaky(Exception):
    """The first run of a ``fail_first`` payload raises this."""


def pause(item: Any, point: str) -> None:
    """Waits at ``point`` if the payload asks for it and this key never paused there."""
    key = paused(HOME, item, point, pid=True)
    if key is not None:
        while not (HOME / f"go-{key}").exists():
            time.sleep(0.02)


def redis_store() -> Any:
    if os.environ.get("DC_CELERY_DAEMON"):
        from dedupcore import Client

        return Client(os.environ["DC_CELERY_DAEMON"])
    from dedupcore.redis import RedisStore

    return RedisStore.from_url(os.environ["DC_CELERY_REDIS"], prefix=os.environ["DC_CELERY_PREFIX"])


def postgres() -> Any:
    import psycopg

    return psycopg.connect(os.environ["DC_CELERY_POSTGRES"])


def apply_to_file(key: str, task_id: str) -> None:
    """The non-transactional effect: one line per run that applies it."""
    effects = HOME / "effects"
    effects.mkdir(exist_ok=True)
    with open(effects / key, "a") as f:
        f.write(task_id + "\n")


@app.task(
    base=IdempotentTask,
    bind=True,
    name="dc.transfer",
    dedup_store=redis_store,
    dedup_key="id",
    dedup_namespace="celery/transfers",
    dedup_lease=LEASE,
    dedup_retry_delay=0.2,
    autoretry_for=(Flaky,),
    retry_kwargs={"countdown": 0.05, "max_retries": 3},
)
def transfer(self: IdempotentTask, item: dict[str, Any]) -> dict[str, Any]:
    """Store mode, keyed by the payload's id."""
    key = item["id"]
    with open(HOME / f"runs-{key}", "a") as f:
        f.write(self.request.id + "\n")
    pause(item, "after_claim")
    if item.get("fail_first") and first(HOME, f"failed-{key}"):
        raise Flaky(key)
    apply_to_file(key, self.request.id)
    pause(item, "after_effect")
    return {"applied": key, "by": self.request.id}


@app.task(base=IdempotentTask, bind=True, name="dc.by_id", dedup_store=redis_store)
def by_id(self: IdempotentTask, item: dict[str, Any]) -> dict[str, Any]:
    """Store mode, keyed by the task id."""
    apply_to_file(item["id"], self.request.id)
    return {"applied": item["id"], "by": self.request.id}


@app.task(
    base=IdempotentTask,
    bind=True,
    name="dc.ledger",
    dedup_connection=postgres,
    dedup_table=TABLE,
    dedup_key="id",
    dedup_namespace="celery/ledger",
)
def ledger(self: IdempotentTask, item: dict[str, Any]) -> dict[str, Any]:
    """Transactional mode: the effect row and the dedup row commit together."""
    key = item["id"]
    self.dedup.conn.execute(
        f"INSERT INTO {EFFECTS} (key, task_id) VALUES (%s, %s)", (key, self.request.id)
    )
    pause(item, "after_effect")
    return {"applied": key, "by": self.request.id}


@task_postrun.connect
def _after(args: Any = (), state: Any = None, **_: Any) -> None:
    """After the key is completed (or committed), before the message is acked."""
    if state == "SUCCESS" and args:
        pause(args[0], "after_complete")


@task_retry.connect
def _retried(request: Any = None, **_: Any) -> None:
    say(f"RETRY {request.id}")


@worker_ready.connect
def _ready(**_: Any) -> None:
    say("READY")
