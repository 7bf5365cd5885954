"""End to end: transfers through real RabbitMQ / NATS JetStream into real PostgreSQL, with chaos.

For each broker, a producer publishes ``E2E_MESSAGES`` (default 10,000)
transfers (account, amount, transfer id) with publisher confirms and
re-publishes ``E2E_RETRY_FRACTION`` (default 20%) of them later, as a
producer does after a lost confirm (a re-send carries a new broker message
id; the business id in the body is the same). Three consumer processes
(``e2e_consumer.py``) apply ``balance += amount`` and a change-log row in
one transaction; a chaos loop SIGKILLs a random consumer every few hundred
applied transfers and starts a replacement, and every consumer SIGKILLs
itself after the commit and before the ack of every ``E2E_KILL_EVERY``-th
transfer it applies.

With dedupcore (the broker wrapper over the transactional dedup table),
every balance must equal the sum of its unique transfers, the change log
must hold exactly one row per unique transfer, and no message may be left
unacknowledged. The same scenario without dedupcore must let duplicates
reach the change log: the test asserts that it does, so it shows the
assertions can fail.

Each run uses its own queue / stream / tables (uuid names) and deletes them.
The figures of every run are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dedupcore.patterns.table import ensure_table
from tests.support.servers import SERVERS, pg_connect, require_server, uid

ROOT = Path(__file__).resolve().parents[2]
CONSUMER = Path(__file__).with_name("e2e_consumer.py")

MESSAGES = int(os.environ.get("E2E_MESSAGES", "10000"))
RETRY_FRACTION = float(os.environ.get("E2E_RETRY_FRACTION", "0.2"))
CONSUMERS = int(os.environ.get("E2E_CONSUMERS", "3"))
# Smaller runs (E2E_MESSAGES) kill more often, so that every run has kills of both kinds.
KILL_EVERY = int(os.environ.get("E2E_KILL_EVERY", str(max(5, min(397, MESSAGES // 10)))))
# Applied transfers between two chaos kills: "every few hundred messages".
CHAOS_MIN, CHAOS_MAX = max(5, min(200, MESSAGES // 20)), max(10, min(500, MESSAGES // 8))
ACCOUNTS = 50
#: Bound for a whole run on a loaded machine; only a hang reaches it.
DEADLINE = float(os.environ.get("E2E_DEADLINE", "600"))

pytestmark = pytest.mark.slow


@dataclass
class Transfers:
    """The producer's plan: every transfer once, some twice, in publish order."""

    unique: dict[str, tuple[int, int]]  # transfer id -> (account, amount)
    publishes: list[tuple[str, int]]  # (transfer id, attempt) in publish order

    @classmethod
    def make(cls, n: int, retry_fraction: float, seed: int) -> Transfers:
        rnd = random.Random(seed)
        unique = {f"t-{i}": (rnd.randrange(ACCOUNTS), rnd.randint(1, 1000)) for i in range(n)}
        order: list[tuple[float, str, int]] = [(i, f"t-{i}", 1) for i in range(n)]
        for i in rnd.sample(range(n), int(n * retry_fraction)):
            # The retry goes out a little later, after other transfers.
            order.append((i + rnd.uniform(1, max(2, n / 5)), f"t-{i}", 2))
        order.sort()
        return cls(unique, [(tid, attempt) for _, tid, attempt in order])

    def body(self, tid: str) -> bytes:
        account, amount = self.unique[tid]
        return json.dumps({"transfer_id": tid, "account": account, "amount": amount}).encode()

    def expected_balances(self) -> dict[int, int]:
        out = dict.fromkeys(range(ACCOUNTS), 0)
        for account, amount in self.unique.values():
            out[account] += amount
        return out


@dataclass
class Figures:
    broker: str
    mode: str
    messages: int = 0
    published: int = 0
    duplicates_published: int = 0
    chaos_kills: int = 0
    self_kills_between_commit_and_ack: int = 0
    consumers_started: int = 0
    changelog_rows: int = 0
    duplicate_rows: int = 0
    seconds: float = 0.0


class Business:
    """The business tables of one run in PostgreSQL (accounts, change log, dedup table)."""

    def __init__(self) -> None:
        u = uid("e2e")
        self.accounts, self.changelog, self.dedup = f"{u}_acct", f"{u}_chg", f"{u}_ded"
        self.conn = pg_connect(autocommit=True)
        self.conn.execute(
            f"CREATE TABLE {self.accounts} (id int PRIMARY KEY, balance bigint NOT NULL)"
        )
        self.conn.execute(
            f"CREATE TABLE {self.changelog} (id bigserial PRIMARY KEY, transfer_id text NOT NULL,"
            " account int NOT NULL, amount bigint NOT NULL, pid int NOT NULL,"
            " txid bigint NOT NULL DEFAULT txid_current(),"
            " at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        with self.conn.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {self.accounts} (id, balance) VALUES (%s, 0)",
                [(i,) for i in range(ACCOUNTS)],
            )
        with pg_connect() as c:
            ensure_table(c, table=self.dedup)

    def applied(self) -> tuple[int, int]:
        """(change-log rows, distinct transfers in it)."""
        row = self.conn.execute(
            f"SELECT count(*), count(DISTINCT transfer_id) FROM {self.changelog}"
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def balances(self) -> dict[int, int]:
        rows = self.conn.execute(f"SELECT id, balance FROM {self.accounts}").fetchall()
        return {int(i): int(b) for i, b in rows}

    def rows_per_transfer(self) -> dict[str, int]:
        rows = self.conn.execute(
            f"SELECT transfer_id, count(*) FROM {self.changelog} GROUP BY transfer_id"
        ).fetchall()
        return {str(t): int(n) for t, n in rows}

    def explain(self, transfer_ids: list[str]) -> str:
        """Change-log rows (process, transaction, time) and dedup row of each transfer."""
        out = []
        for tid in transfer_ids:
            rows = self.conn.execute(
                f"SELECT pid, txid, at FROM {self.changelog} WHERE transfer_id = %s ORDER BY id",
                (tid,),
            ).fetchall()
            ded = self.conn.execute(
                f"SELECT namespace, xmin::text, created FROM {self.dedup}"
                " WHERE \"key\" = convert_to(%s, 'UTF8')",
                (tid,),
            ).fetchall()
            out.append(f"{tid}: change log (pid, txid, at) {rows}; dedup rows (ns, xmin) {ded}")
        return "\n".join(out)

    def drop(self) -> None:
        if os.environ.get("E2E_KEEP"):
            print(f"kept tables {self.accounts} {self.changelog} {self.dedup}")
            return
        for t in (self.accounts, self.changelog, self.dedup):
            with contextlib.suppress(Exception):
                self.conn.execute(f"DROP TABLE IF EXISTS {t}")
        self.conn.close()


class Consumers:
    """The consumer processes: started, SIGKILLed by chaos, replaced when they die."""

    def __init__(self, config: dict[str, Any], logdir: Path, figures: Figures) -> None:
        self.config = config
        self.logdir = logdir
        self.figures = figures
        self.procs: list[subprocess.Popen[bytes]] = []
        self.killed: set[int] = set()  # pids this harness SIGKILLed
        self.rnd = random.Random(7)
        self.logs: list[Path] = []

    def start_one(self) -> subprocess.Popen[bytes]:
        self.figures.consumers_started += 1
        log = self.logdir / f"consumer-{self.figures.consumers_started}.log"
        self.logs.append(log)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(log, "wb") as fh:
            return subprocess.Popen(
                [sys.executable, str(CONSUMER), json.dumps(self.config)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )

    def start(self, n: int) -> None:
        self.procs = [self.start_one() for _ in range(n)]

    def replace_dead(self) -> None:
        for i, p in enumerate(self.procs):
            rc = p.poll()
            if rc is None:
                continue
            if p.pid in self.killed:
                pass
            elif rc == -signal.SIGKILL:
                self.figures.self_kills_between_commit_and_ack += 1
            else:
                raise AssertionError(f"consumer {p.pid} exited with {rc}:\n{self.tail()}")
            self.procs[i] = self.start_one()

    def chaos_kill(self) -> None:
        p = self.rnd.choice(self.procs)
        if p.poll() is None:
            self.killed.add(p.pid)
            p.send_signal(signal.SIGKILL)
            p.wait()
            self.figures.chaos_kills += 1

    def stop(self) -> None:
        """SIGTERM: each consumer closes its broker connection cleanly."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def tail(self) -> str:
        out = []
        for log in self.logs[-4:]:
            with contextlib.suppress(OSError):
                out.append(f"--- {log.name}\n" + log.read_text(errors="replace")[-2000:])
        return "\n".join(out)


def run_scenario(
    *,
    figures: Figures,
    business: Business,
    transfers: Transfers,
    config: dict[str, Any],
    publish: Callable[[], None],
    drained: Callable[[], bool],
    tmp_path: Path,
) -> None:
    """Producer thread + consumers + chaos until everything is applied and acked."""
    start = time.monotonic()
    config = dict(
        config,
        mode=figures.mode,
        pg_url=SERVERS.postgresql,
        accounts=business.accounts,
        changelog=business.changelog,
        dedup_table=business.dedup,
        namespace=f"e2e/{business.dedup}",
        kill_every=KILL_EVERY,
    )
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            publish()
        except BaseException as exc:
            errors.append(exc)

    consumers = Consumers(config, tmp_path, figures)
    consumers.start(CONSUMERS)
    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    rnd = random.Random(11)
    next_kill = rnd.randint(CHAOS_MIN, CHAOS_MAX)
    try:
        while True:
            assert time.monotonic() - start < DEADLINE, (
                f"not done after {DEADLINE} s: applied {business.applied()}, {figures}\n"
                + consumers.tail()
            )
            assert not errors, f"producer failed: {errors[0]!r}"
            consumers.replace_dead()
            rows, distinct = business.applied()
            if os.environ.get("E2E_DEBUG"):
                print(
                    f"{time.monotonic() - start:6.1f}s rows={rows} distinct={distinct} "
                    f"producer={'on' if thread.is_alive() else 'done'} pub={figures.published}",
                    flush=True,
                )
            everything_applied = not thread.is_alive() and distinct >= len(transfers.unique)
            if not everything_applied and rows >= next_kill:
                consumers.chaos_kill()
                next_kill = rows + rnd.randint(CHAOS_MIN, CHAOS_MAX)
            if everything_applied and drained():
                break
            time.sleep(0.2)
        consumers.stop()
    finally:
        consumers.kill_all()
        thread.join(30)
    figures.seconds = round(time.monotonic() - start, 1)
    counts = business.rows_per_transfer()
    figures.changelog_rows = sum(counts.values())
    figures.duplicate_rows = sum(n - 1 for n in counts.values() if n > 1)
    print(f"\nE2E {json.dumps(figures.__dict__)}", flush=True)


def check_exactly_once(business: Business, transfers: Transfers) -> None:
    counts = business.rows_per_transfer()
    assert set(counts) == set(transfers.unique), "change log misses or invents transfers"
    twice = {t: n for t, n in counts.items() if n != 1}
    assert not twice, (
        f"{len(twice)} transfers applied more than once; the first ones:\n"
        + business.explain(sorted(twice)[:5])
    )
    assert business.balances() == transfers.expected_balances()


def check_duplicates_reached(business: Business, transfers: Transfers, figures: Figures) -> None:
    counts = business.rows_per_transfer()
    assert set(counts) == set(transfers.unique)
    assert figures.duplicate_rows > 0, "without dedupcore no duplicate reached the table"
    assert business.balances() != transfers.expected_balances()


# -- RabbitMQ ------------------------------------------------------------------------------


def rabbit_counts(queue: str) -> tuple[int, int] | None:
    """(messages, unacknowledged) of the queue, as the broker reports them.

    Without ``rabbitmqctl`` (the management CLI) on this machine, None: the
    test then relies on the check after the consumers closed their channels
    (every unacked message is requeued by then, so the queue must be empty).
    """
    if shutil.which("rabbitmqctl") is None:
        return None
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "name", "messages", "messages_unacknowledged"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == queue:
            return int(parts[1]), int(parts[2])
    return None


@pytest.fixture
def rabbit_queue() -> Iterator[str]:
    require_server("rabbitmq")
    import pika

    q = uid("e2e_q")
    conn = pika.BlockingConnection(pika.URLParameters(SERVERS.rabbitmq))
    conn.channel().queue_declare(q)
    conn.close()
    yield q
    with contextlib.suppress(Exception):
        conn = pika.BlockingConnection(pika.URLParameters(SERVERS.rabbitmq))
        conn.channel().queue_delete(q)
        conn.close()


@pytest.mark.parametrize("mode", ["dedup", "plain"])
def test_rabbitmq_transfers_exactly_once(mode: str, rabbit_queue: str, tmp_path: Path) -> None:
    require_server("postgresql")
    import pika

    transfers = Transfers.make(MESSAGES, RETRY_FRACTION, seed=1)
    figures = Figures("rabbitmq", mode, messages=MESSAGES)
    business = Business()

    def publish() -> None:
        conn = pika.BlockingConnection(pika.URLParameters(SERVERS.rabbitmq))
        ch = conn.channel()
        ch.confirm_delivery()  # basic_publish returns once the broker confirmed (raises if not)
        for tid, attempt in transfers.publishes:
            ch.basic_publish(
                "",
                rabbit_queue,
                transfers.body(tid),
                pika.BasicProperties(
                    message_id=f"{tid}/{attempt}", content_type="application/json"
                ),
                mandatory=True,
            )
            figures.published += 1
            figures.duplicates_published += attempt > 1
        conn.close()

    def drained() -> bool:
        # Cheap check first (ready messages), then the broker's own count of unacked ones.
        conn = pika.BlockingConnection(pika.URLParameters(SERVERS.rabbitmq))
        ready = conn.channel().queue_declare(rabbit_queue, passive=True).method.message_count
        conn.close()
        return ready == 0 and rabbit_counts(rabbit_queue) in ((0, 0), None)

    try:
        run_scenario(
            figures=figures,
            business=business,
            transfers=transfers,
            config={"broker": "rabbitmq", "amqp_url": SERVERS.rabbitmq, "queue": rabbit_queue},
            publish=publish,
            drained=drained,
            tmp_path=tmp_path,
        )
        assert figures.published == len(transfers.publishes)
        # All consumers are gone: anything they had not acked would be ready again now.
        conn = pika.BlockingConnection(pika.URLParameters(SERVERS.rabbitmq))
        assert conn.channel().queue_declare(rabbit_queue, passive=True).method.message_count == 0
        conn.close()
        assert figures.chaos_kills > 0 and figures.self_kills_between_commit_and_ack > 0
        if mode == "dedup":
            check_exactly_once(business, transfers)
        else:
            check_duplicates_reached(business, transfers, figures)
    finally:
        business.drop()


# -- NATS JetStream ------------------------------------------------------------------------


class Nats:
    """A JetStream stream and durable pull consumer of one run, on a loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        u = uid("e2e")
        self.stream, self.subject, self.durable = u.upper(), f"e2e.{u}", f"c_{u}"
        self.nc: Any = self.run(self._connect())

    def run(self, coro: Any, timeout: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _connect(self) -> Any:
        import nats
        from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

        nc = await nats.connect(SERVERS.nats)
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(name=self.stream, subjects=[self.subject], storage=StorageType.MEMORY)
        )
        await js.add_consumer(
            self.stream,
            ConsumerConfig(
                durable_name=self.durable,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=2.0,  # a killed consumer's messages come back after 2 s
                max_ack_pending=2000,
            ),
        )
        return nc

    async def publish_all(self, transfers: Transfers, figures: Figures) -> None:
        js = self.nc.jetstream()
        window = 200
        batch = transfers.publishes
        for i in range(0, len(batch), window):
            chunk = batch[i : i + window]
            # Each publish awaits its JetStream ack (the publisher confirm); a chunk at a time.
            acks = await asyncio.gather(
                *(
                    js.publish(
                        self.subject,
                        transfers.body(tid),
                        headers={"Nats-Msg-Id": f"{tid}/{attempt}"},
                    )
                    for tid, attempt in chunk
                )
            )
            assert all(not a.duplicate for a in acks)
            figures.published += len(chunk)
            figures.duplicates_published += sum(attempt > 1 for _, attempt in chunk)

    async def pending(self) -> tuple[int, int]:
        info = await self.nc.jetstream().consumer_info(self.stream, self.durable)
        return int(info.num_pending), int(info.num_ack_pending)

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.jetstream().delete_stream(self.stream)
        await self.nc.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self._close(), timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def jetstream() -> Iterator[Nats]:
    require_server("nats")
    n = Nats()
    yield n
    n.close()


@pytest.mark.parametrize("mode", ["dedup", "plain"])
def test_jetstream_transfers_exactly_once(mode: str, jetstream: Nats, tmp_path: Path) -> None:
    require_server("postgresql")
    transfers = Transfers.make(MESSAGES, RETRY_FRACTION, seed=2)
    figures = Figures("nats", mode, messages=MESSAGES)
    business = Business()
    try:
        run_scenario(
            figures=figures,
            business=business,
            transfers=transfers,
            config={
                "broker": "nats",
                "nats_url": SERVERS.nats,
                "stream": jetstream.stream,
                "subject": jetstream.subject,
                "durable": jetstream.durable,
            },
            publish=lambda: jetstream.run(jetstream.publish_all(transfers, figures)),
            drained=lambda: jetstream.run(jetstream.pending()) == (0, 0),
            tmp_path=tmp_path,
        )
        assert figures.published == len(transfers.publishes)
        assert jetstream.run(jetstream.pending()) == (0, 0)
        assert figures.chaos_kills > 0 and figures.self_kills_between_commit_and_ack > 0
        if mode == "dedup":
            check_exactly_once(business, transfers)
        else:
            check_duplicates_reached(business, transfers, figures)
    finally:
        business.drop()
