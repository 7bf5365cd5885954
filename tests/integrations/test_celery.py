"""IdempotentTask on a real Celery worker over the real RabbitMQ, and SIGKILLs at chosen points.

Each worker test starts ``celery worker`` (prefork, 2 processes) on a queue of
its own, with the tasks of tests/integrations/celery_tasks.py; the test sends
tasks by name and reads their results over ``rpc://``. A worker is killed only
where a task said it waits (``PAUSED <key> <point>``), never at a random moment:
the whole worker (its process group), as a crashed host or container would be,
then a new worker is started and the broker redelivers what was not acked.

What the kills show (docs/integrations.md, "Celery"): with claim/complete
around an effect the store cannot see (a line appended to a file), a worker
killed between the effect and ``complete`` applies that effect twice -- once per
kill at that point, and at no other point; with the effect and the dedup row
in one PostgreSQL transaction, no kill applies anything twice.

The tests without a worker (options, ``apply()``, the missing extra) need no server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

celery = pytest.importorskip("celery")

from dedupcore import DedupStore  # noqa: E402
from dedupcore.errors import InProgressError  # noqa: E402
from dedupcore.integrations.celery import IdempotentTask, close_stores  # noqa: E402
from dedupcore.patterns.table import ensure_table  # noqa: E402
from tests.support.procs import ROOT, LineProcess, child_env  # noqa: E402
from tests.support.servers import (  # noqa: E402
    SERVERS,
    forget_redis_keys,
    pg_connect,
    redis_url,
    require_server,
    uid,
)

#: Seconds to wait for a result, a line or a worker: far more than any of them takes.
PATIENCE = 60.0
#: The lease of the kill tests' claims: a redelivery takes a dead worker's key over after it.
SHORT_LEASE = "2"


# -- the worker ------------------------------------------------------------------------------


class Worker:
    """``celery worker`` on ``queue`` in a session of its own (so it dies whole)."""

    def __init__(self, queue: str, env: dict[str, str], name: str) -> None:
        argv = [
            "setsid",  # its own process group: killpg reaches the pool processes too
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.integrations.celery_tasks",
            "worker",
            "-Q",
            queue,
            "-c",
            "2",
            "-P",
            "prefork",
            "-n",
            f"{uid('dc')}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "warning",
        ]
        self.proc = LineProcess(argv, env=env, name=name)
        self.proc.expect("READY", PATIENCE)

    def paused(self) -> tuple[str, str, int]:
        """The next ``PAUSED`` line: (key, point, pid of the pool process)."""
        key, point, pid = self.proc.expect("PAUSED", PATIENCE).split()
        return key, point, int(pid)

    def kill(self) -> None:
        """SIGKILL to the worker and its pool processes at once."""
        self.proc.sigkill_group()

    def close(self) -> None:
        self.proc.close_group()


class Lab:
    """One test's queue, shared directory, store prefix and tables, and its workers."""

    def __init__(self, home: Path, **env: str) -> None:
        require_server("rabbitmq")
        self.home = home
        self.queue = uid("dc_celery")
        self.env = {
            **child_env(),
            "DC_CELERY_DIR": str(home),
            "DC_CELERY_AMQP": SERVERS.rabbitmq,
            "DC_CELERY_REDIS": redis_url("integrations"),
            "DC_CELERY_PREFIX": uid("dc_celery"),
            **env,
        }
        self.app = celery.Celery("dc_celery_client", broker=SERVERS.rabbitmq, backend="rpc://")
        self.app.conf.update(
            task_serializer="json", result_serializer="json", accept_content=["json"]
        )
        self.workers: list[Worker] = []
        self.tables: dict[str, str] = {}

    def worker(self) -> Worker:
        w = Worker(self.queue, self.env, f"worker {len(self.workers) + 1}")
        self.workers.append(w)
        return w

    def send(self, task: str, item: dict[str, Any], **options: Any) -> Any:
        return self.app.send_task(task, args=[item], queue=self.queue, **options)

    def go(self, key: str) -> None:
        """Lets a task waiting at its pause point go on."""
        (self.home / f"go-{key}").touch()

    def effects(self, key: str) -> int:
        """How many times the file effect of ``key`` was applied."""
        path = self.home / "effects" / key
        return len(path.read_text().split()) if path.exists() else 0

    def runs(self, key: str) -> int:
        """How many times the body of ``dc.transfer`` started for ``key``."""
        path = self.home / f"runs-{key}"
        return len(path.read_text().split()) if path.exists() else 0

    def ledger_tables(self) -> dict[str, str]:
        """The transactional task's dedup and effects tables on PostgreSQL, for the workers
        (dropped by :meth:`close` once its workers are dead)."""
        require_server("postgresql")
        dedup, effects = uid("dc_celery_d"), uid("dc_celery_e")
        self.tables = {"DC_CELERY_TABLE": dedup, "DC_CELERY_EFFECTS": effects}
        with pg_connect(autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {effects} (key text, task_id text)")
        with pg_connect() as conn:  # made before the workers start, as docs/integrations.md says
            ensure_table(conn, table=dedup)
        self.env.update(self.tables, DC_CELERY_POSTGRES=SERVERS.postgresql)
        return self.tables

    def close(self) -> None:
        for w in self.workers:
            w.close()
        if self.tables:
            with pg_connect(autocommit=True) as conn:
                conn.execute("SET lock_timeout = '20s'")
                for name in self.tables.values():
                    conn.execute(f"DROP TABLE IF EXISTS {name}")
        with contextlib.suppress(Exception), self.app.connection_for_write() as conn:
            channel = conn.default_channel
            channel.queue_delete(self.queue)
            channel.exchange_delete(self.queue)
        self.app.close()
        if "DC_CELERY_PREFIX" in self.env:
            forget_redis_keys("integrations", self.env["DC_CELERY_PREFIX"])


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Callable[..., Lab]]:
    """``lab(**env)`` -> a :class:`Lab` whose workers get ``env`` too; closed after the test."""
    made: list[Lab] = []

    def make(**env: str) -> Lab:
        require_server("redis")
        made.append(Lab(tmp_path, **env))
        return made[-1]

    yield make
    for one in made:
        one.close()


def ledger_effects(tables: dict[str, str]) -> dict[str, int]:
    with pg_connect() as conn:
        rows = conn.execute(
            f"SELECT key, count(*) FROM {tables['DC_CELERY_EFFECTS']} GROUP BY key"
        ).fetchall()
    return {key: n for key, n in rows}


# -- on a worker -------------------------------------------------------------------------


def test_a_second_send_of_a_key_returns_the_stored_result(lab: Callable[..., Lab]) -> None:
    lab_ = lab()
    lab_.worker()
    first = lab_.send("dc.transfer", {"id": "t-1"})
    stored = first.get(timeout=PATIENCE)
    assert stored == {"applied": "t-1", "by": first.id}
    again = lab_.send("dc.transfer", {"id": "t-1"})  # a producer's retry: another task id
    assert again.id != first.id
    assert again.get(timeout=PATIENCE) == stored  # the first run's result, by the first id
    assert lab_.effects("t-1") == 1 and lab_.runs("t-1") == 1

    # Keyed by the task id (the default): the same id sent twice runs once.
    one = lab_.send("dc.by_id", {"id": "b-1"}, task_id="task-b-1").get(timeout=PATIENCE)
    two = lab_.send("dc.by_id", {"id": "b-1"}, task_id="task-b-1").get(timeout=PATIENCE)
    other = lab_.send("dc.by_id", {"id": "b-1"}, task_id="task-b-2").get(timeout=PATIENCE)
    assert one == two == {"applied": "b-1", "by": "task-b-1"}
    assert other == {"applied": "b-1", "by": "task-b-2"}
    assert lab_.effects("b-1") == 2  # task-b-1 once, task-b-2 once


def test_the_daemon_serves_the_prefork_pool(lab: Callable[..., Lab], tmp_path: Path) -> None:
    from tests.support.daemon import Lab as DaemonLab

    daemons = DaemonLab()
    try:
        served = daemons.daemon()
        lab_ = lab(DC_CELERY_DAEMON=str(served.socket))
        lab_.worker()
        results = [lab_.send("dc.transfer", {"id": f"d-{i % 3}"}) for i in range(6)]
        answers = [r.get(timeout=PATIENCE) for r in results]
        for i, answer in enumerate(answers):
            assert answer == answers[i % 3] and answer["applied"] == f"d-{i % 3}"
        assert [lab_.effects(f"d-{i}") for i in range(3)] == [1, 1, 1]
    finally:
        daemons.close()


def test_an_exception_releases_the_key_and_the_retry_runs_the_body(
    lab: Callable[..., Lab],
) -> None:
    # The lease (60 s) outlasts the wait for the result: a key left claimed after the
    # failure would hold the retry IN_PROGRESS until the test gave up.
    lab_ = lab(DC_CELERY_LEASE="60")
    lab_.worker()
    result = lab_.send("dc.transfer", {"id": "f-1", "fail_first": True})
    assert result.get(timeout=PATIENCE / 2) == {"applied": "f-1", "by": result.id}
    assert lab_.runs("f-1") == 2  # failed once, then ran again
    assert lab_.effects("f-1") == 1


def test_in_progress_retries_until_the_holder_completes(lab: Callable[..., Lab]) -> None:
    lab_ = lab(DC_CELERY_LEASE="60")
    w = lab_.worker()
    holder = lab_.send("dc.transfer", {"id": "p-1", "pause": "after_effect"})
    assert w.paused()[:2] == ("p-1", "after_effect")
    waiter = lab_.send("dc.transfer", {"id": "p-1"})  # the other pool process takes it
    assert w.proc.expect("RETRY", PATIENCE) == waiter.id  # IN_PROGRESS: re-sent for later
    lab_.go("p-1")
    stored = holder.get(timeout=PATIENCE)
    assert waiter.get(timeout=PATIENCE) == stored == {"applied": "p-1", "by": holder.id}
    assert lab_.effects("p-1") == 1 and lab_.runs("p-1") == 1


def test_a_killed_worker_applies_a_store_mode_effect_twice_only_between_effect_and_complete(
    lab: Callable[..., Lab],
) -> None:
    lab_ = lab(DC_CELERY_LEASE=SHORT_LEASE)
    kills: dict[str, list[str]] = {"after_claim": [], "after_effect": [], "after_complete": []}

    def kill_at(plan: dict[str, str]) -> dict[str, Any]:
        """Sends one task per key, waits until each paused at its point, kills the worker."""
        w = lab_.worker()
        sent = {key: lab_.send("dc.transfer", {"id": key, "pause": p}) for key, p in plan.items()}
        for _ in plan:
            key, point, _pid = w.paused()
            assert plan[key] == point
            kills[point].append(key)
        w.kill()
        return sent

    # Two pool processes: two tasks wait at once, then the worker dies.
    first = kill_at({"k-1": "after_effect", "k-2": "after_effect"})
    w = lab_.worker()  # the broker redelivers; the dead claims are taken over after the lease
    done = {key: r.get(timeout=PATIENCE) for key, r in first.items()}
    w.kill()  # k-1 and k-2 are done: this kill cuts nothing
    second = kill_at({"k-3": "after_claim", "k-4": "after_complete"})
    lab_.worker()
    done.update({key: r.get(timeout=PATIENCE) for key, r in second.items()})

    assert sorted(done) == ["k-1", "k-2", "k-3", "k-4"]
    assert all(done[k]["applied"] == k for k in done)
    applied = {key: lab_.effects(key) for key in done}
    twice = sorted(key for key, n in applied.items() if n == 2)
    assert max(applied.values()) <= 2
    # The window: a kill between the effect and complete applies the effect again;
    # a kill before the effect or after complete does not.
    assert twice == sorted(kills["after_effect"]) == ["k-1", "k-2"]
    assert applied["k-3"] == applied["k-4"] == 1
    assert lab_.runs("k-4") == 1  # the redelivery after complete was a DUPLICATE


def test_a_killed_worker_never_applies_a_transactional_effect_twice(
    lab: Callable[..., Lab],
) -> None:
    lab_ = lab()
    ledger_tables = lab_.ledger_tables()
    w = lab_.worker()
    plan = {"l-1": "after_effect", "l-2": "after_complete"}
    sent = {key: lab_.send("dc.ledger", {"id": key, "pause": p}) for key, p in plan.items()}
    for _ in plan:
        key, point, _pid = w.paused()
        assert plan[key] == point
    assert ledger_effects(ledger_tables) == {"l-2": 1}  # l-1's row is not committed
    w.kill()  # l-1: effect written, not committed; l-2: committed, not acked
    lab_.worker()
    done = {key: r.get(timeout=PATIENCE) for key, r in sent.items()}
    assert done == {key: {"applied": key, "by": sent[key].id} for key in plan}
    assert ledger_effects(ledger_tables) == {"l-1": 1, "l-2": 1}  # two kills, nothing twice
    with pg_connect() as conn:
        rows = conn.execute(f"SELECT count(*) FROM {ledger_tables['DC_CELERY_TABLE']}").fetchone()
    assert rows == (2,)


def test_a_killed_pool_process_gives_its_message_back(lab: Callable[..., Lab]) -> None:
    """reject_on_worker_lost: the worker lives on, the message is requeued, not failed."""
    lab_ = lab(DC_CELERY_LEASE=SHORT_LEASE)
    w = lab_.worker()
    result = lab_.send("dc.transfer", {"id": "c-1", "pause": "after_claim"})
    key, _, pid = w.paused()
    assert key == "c-1"
    os.kill(pid, signal.SIGKILL)  # the pool process only
    assert result.get(timeout=PATIENCE) == {"applied": "c-1", "by": result.id}
    assert lab_.effects("c-1") == 1 and lab_.runs("c-1") == 2


# -- without a worker --------------------------------------------------------------------


@pytest.fixture
def app() -> Iterator[Any]:
    made = celery.Celery("dc_celery_eager", broker="memory://", backend="cache+memory://")
    yield made
    made.close()


def test_options_that_cannot_work_are_refused_when_the_task_is_made(
    app: Any, tmp_path: Path
) -> None:
    def body(item: Any) -> Any:
        return item

    def make(**options: Any) -> Any:
        return app.task(base=IdempotentTask, name=uid("t"), lazy=False, **options)(body)

    store = DedupStore.open(tmp_path / "s")
    try:
        with pytest.raises(TypeError, match="store object; give a factory"):
            make(dedup_store=store)
    finally:
        store.close()
    with pytest.raises(ValueError, match="acks_late=False"):
        make(dedup_store="redis://x", acks_late=False)
    with pytest.raises(ValueError, match="reject_on_worker_lost=False"):
        make(dedup_store="redis://x", reject_on_worker_lost=False)
    with pytest.raises(TypeError, match="not both"):
        make(dedup_store="redis://x", dedup_connection=lambda: None)
    with pytest.raises(ValueError):
        make(dedup_store="redis://x", dedup_key="order..id")  # a malformed key path
    with pytest.raises(TypeError, match="dedup_key must be"):
        make(dedup_store="redis://x", dedup_key=5)
    with pytest.raises(TypeError, match="dedup_payload"):
        make(dedup_store="redis://x", dedup_payload="item")
    with pytest.raises(ValueError, match="dedup_lease must be > 0"):
        make(dedup_store="redis://x", dedup_lease=0)
    with pytest.raises(TypeError, match="dedup_retry_delay"):
        make(dedup_store="redis://x", dedup_retry_delay="soon")
    with pytest.raises(ValueError):
        make(dedup_store="redis://x", dedup_namespace="has space")
    with pytest.raises(ValueError):
        make(dedup_connection=lambda: None, dedup_table="no-dashes")


def test_apply_claims_and_a_plain_call_does_not(app: Any, tmp_path: Path) -> None:
    made: list[DedupStore] = []
    ran: list[str] = []

    def factory() -> DedupStore:
        made.append(DedupStore.open(tmp_path / "s"))
        return made[-1]

    @app.task(base=IdempotentTask, bind=True, dedup_store=factory, dedup_key="id")
    def once(self: Any, item: dict[str, Any]) -> str:
        ran.append(item["id"])
        if not self.request.called_directly:
            assert self.dedup.key == item["id"] and self.dedup.claim is not None
        return f"done {item['id']}"

    try:
        assert once.apply(args=[{"id": "a"}]).get() == "done a"
        assert once.apply(args=[{"id": "a"}]).get() == "done a"  # DUPLICATE: stored result
        assert ran == ["a"] and len(made) == 1  # one store for the process
        assert once({"id": "a"}) == "done a" and ran == ["a", "a"]  # a function call
        # Held by another owner: eager mode cannot re-send itself, it says so.
        held = made[0].claim("b", namespace=once.name, owner="elsewhere")
        with pytest.raises(InProgressError):
            once.apply(args=[{"id": "b"}], throw=True)
        made[0].release("b", held.token, namespace=once.name)
        assert once.apply(args=[{"id": "b"}]).get() == "done b"
        with pytest.raises(RuntimeError, match="only there while"):
            _ = once.dedup
        close_stores()  # the next task opens the store again
        assert once.apply(args=[{"id": "b"}]).get() == "done b"
        assert len(made) == 2 and ran == ["a", "a", "b"]
    finally:
        close_stores()


def test_without_celery_the_module_names_the_extra(tmp_path: Path) -> None:
    script = tmp_path / "check.py"
    script.write_text(
        textwrap.dedent(
            """
            import importlib.abc, sys

            class Block(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path=None, target=None):
                    if name.split(".")[0] == "celery":
                        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                    return None

            sys.meta_path.insert(0, Block())
            from dedupcore.errors import MissingExtraError
            try:
                import dedupcore.integrations.celery
            except MissingExtraError as exc:
                print(exc)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "pip install 'dedupcore[celery]'" in out.stdout
