"""``dedupcore demo``: consumer processes, SIGKILLs and an at-least-once stream, in two acts.

The same stream and the same kill plan run twice (docs/demo.md):

- **act one**, ``claim -> effect -> complete`` through ``dedupcore serve`` (a
  subprocess) on the embedded default store in a temporary directory: the
  effect is a line appended to a file, the completion a call to the daemon;
- **act two**, the transactional pattern (:mod:`dedupcore.patterns.table`):
  per message, the dedup row and the effect (a balance update and a row in an
  effects table) are written in one transaction of one SQLite database that
  the consumer processes share (WAL journal, a busy timeout). No daemon.

What both acts share:

- a producer that publishes ``keys`` business ids and, like a producer whose
  acknowledgement got lost, publishes some of them again
  (``duplicate_rate`` of everything published is such a retry);
- a broker stand-in: one partition per consumer and a committed offset per
  partition in shared memory. A batch is acknowledged (the offset moves)
  only after its last completion (act one) or commit (act two); a consumer
  that dies is restarted and gets everything after the committed offset
  again;
- consumer processes (``multiprocessing``, forked by a fork server that
  imported dedupcore once, so a restart takes milliseconds), SIGKILLed and
  restarted at planned places: after the claim, between the effect and the completion,
  between the completion and the acknowledgement, and at a moment of a batch
  drawn from the seed (before the claim, halfway through the effect, or one
  of the places above). The plan is drawn from the seed before the run and
  each consumer SIGKILLs itself when it gets there, so every planned kill
  happens however loaded the machine is, and both acts get the same kills.

Act one, per batch: ``claim_many`` -> apply the effect of every NEW claim ->
``complete_many`` -> acknowledge. An id held by another consumer
(IN_PROGRESS) is retried until it is DUPLICATE or NEW. A kill between
``complete`` and the acknowledgement redelivers messages whose claims are
completed: they come back DUPLICATE and are suppressed -- the case dedupcore
closes. A kill between the effect and ``complete`` redelivers messages whose
effect happened but whose claim is still PROCESSING under the dead
consumer's owner id: the restarted consumer gets its own claim back and
applies the effect again. No dedup store can see an effect it was not told
about. The act counts those re-applied effects on their own line instead of
hiding them, and checks that every other effect happened exactly once.

Act two, per message: ``consume`` inserts the dedup row (or finds it:
DUPLICATE), the effect is written on the same connection, and the block's
exit commits both. A kill anywhere before the commit -- after the claim,
halfway through the effect, between the effect and the commit -- rolls back
the dedup row and the effect together, so the redelivery is NEW and applies
the effect once; a kill after the commit leaves both, so the redelivery is
DUPLICATE. In a batch, the kills inside a transaction land on the first NEW
message of its second half, so the messages before it are committed and
come back DUPLICATE. The act counts effects per id from the effects table and
checks the balances against the exactly-once totals: 0 effects applied
twice. ``atomic=False`` commits the effect on a database of its own before
the dedup row (a split transaction) to show that the count then finds the
repeats.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import RawArray
from pathlib import Path
from typing import Any, TypedDict

__all__ = ["DemoResult", "run_demo", "simulate", "simulate_transactional"]

NAMESPACE = "orders/demo-consumers"

#: Where a consumer is killed (``RANDOM``: a moment of the batch drawn from the seed).
RANDOM, AFTER_CLAIM, AFTER_EFFECT, AFTER_COMPLETE = 0, 1, 2, 3
KILL_POINTS = {
    RANDOM: "at a random moment",
    AFTER_CLAIM: "after claim, before the effect",
    AFTER_EFFECT: "between the effect and complete",
    AFTER_COMPLETE: "between complete and the ack",
}
# The moments a RANDOM kill may land on besides the points above: once the
# batch is delivered (before its claim), and halfway through writing the effect.
BEFORE_CLAIM, MID_EFFECT = 4, 5
_RANDOM_MOMENTS = (BEFORE_CLAIM, AFTER_CLAIM, MID_EFFECT, AFTER_EFFECT, AFTER_COMPLETE)

#: One planned kill of a partition's consumer: at the first ``moment`` it reaches
#: in a batch starting at ``from_offset`` or later, counted under ``point``.
Kill = tuple[int, int, int]  # (from_offset, point, moment)

#: What the consumers import, once, in the fork server they are forked from.
_CONSUMER_MODULES = ("dedupcore.client", "dedupcore.patterns.table")

#: Act two's business database: the accounts a message credits.
ACCOUNTS = 16
_BUSINESS_DB, _DEDUP_DB = "business.sqlite", "dedup.sqlite"

# Shared counters, one row of _FIELDS per partition. A row is written by the
# partition's live consumer only (and by the supervisor while none is alive),
# so no locks: a SIGKILLed process cannot leave one held.
(
    _COMMITTED,  # broker: acknowledged offset
    _HIGH_WATER,  # broker: highest offset ever delivered
    _DELIVERIES,
    _REDELIVERIES,
    _DUPLICATE,
    _REDELIVERED_DUPLICATE,
    _REDELIVERED_NEW,
    _IN_PROGRESS,
    _SAME_BATCH,
    _KILLED,  # planned kills done: the next one due is plan[_KILLED]
    _FIELDS,
) = range(11)


@dataclass
class DemoResult:
    """The accounting of one act: :func:`simulate` or :func:`simulate_transactional`.

    ``transactional`` is True for act two, whose effects commit with the
    dedup row: there, any effect applied twice counts as unexplained, and
    ``balances_wrong`` counts the accounts whose balance differs from the sum
    of every message applied once. ``kills`` are the planned kills that
    happened, ``planned_kills`` the plan, both by point.
    """

    unique_messages: int
    producer_retries: int
    published: int
    deliveries: int
    redeliveries: int
    duplicates_suppressed: int
    redelivered_duplicates: int
    redelivered_new: int
    in_progress: int
    same_batch: int
    effects_applied: int
    effects_twice_window: int
    effects_twice_unexplained: int
    missing: int
    consumers: int
    kills: dict[str, int] = field(default_factory=dict)
    planned_kills: dict[str, int] = field(default_factory=dict)
    crashes: int = 0
    lease_takeovers: int = 0
    elapsed: float = 0.0
    transactional: bool = False
    balances_wrong: int = 0

    @property
    def effects_twice(self) -> int:
        """Effects applied again for an id already applied, for whatever reason."""
        return self.effects_twice_window + self.effects_twice_unexplained

    @property
    def all_kills_done(self) -> bool:
        """Every planned kill happened."""
        return self.kills == self.planned_kills

    @property
    def ok(self) -> bool:
        """Every message applied; the only extra effects are the effect/complete window's
        (act one) or none at all (act two)."""
        return (
            self.effects_applied == self.unique_messages + self.effects_twice_window
            and self.effects_twice_unexplained == 0
            and self.missing == 0
            and self.balances_wrong == 0
            and not (self.transactional and self.effects_twice_window)
        )


# -- both acts' consumers ------------------------------------------------------------------


def _due(row: Any, base: int, plan: list[Kill], offset: int, moment: int) -> bool:
    """Whether the partition's next planned kill is at ``moment`` of the batch at ``offset``."""
    done = int(row[base + _KILLED])
    if done >= len(plan):
        return False
    from_offset, _point, at = plan[done]
    return at == moment and offset >= from_offset


def _die(row: Any, base: int) -> None:
    """Counts the planned kill (shared memory outlives the process) and SIGKILLs itself."""
    row[base + _KILLED] += 1
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_point(row: Any, base: int, plan: list[Kill], offset: int, moment: int) -> None:
    if _due(row, base, plan, offset, moment):
        _die(row, base)


def _read_partition(tmp: Path, partition: int) -> list[bytes]:
    data = (tmp / f"partition-{partition}").read_bytes()
    return data.split(b"\n") if data else []


def _deliver(
    s: Any, base: int, messages: list[bytes], batch_size: int
) -> tuple[int, list[bytes], set[bytes]] | None:
    """The broker: the next batch after the committed offset, its offset and what in it
    was delivered before; None when the partition is acknowledged to its end."""
    offset = int(s[base + _COMMITTED])
    if offset >= len(messages):
        return None
    batch = messages[offset : offset + batch_size]
    end = offset + len(batch)
    high = int(s[base + _HIGH_WATER])
    seen = max(0, min(end, high) - offset)
    s[base + _DELIVERIES] += len(batch)
    s[base + _REDELIVERIES] += seen
    s[base + _HIGH_WATER] = max(high, end)
    return offset, batch, set(batch[:seen])


def _consumer(
    partition: int,
    incarnation: int,
    tmp_dir: str,
    shared: Any,
    batch_size: int,
    plan: list[Kill],
    socket_path: str,
    lease: float,
) -> None:
    """Act one's consumer of one partition: claim, apply the effect, complete, acknowledge.

    It SIGKILLs itself where ``plan`` says (see :func:`_kill_plan`).
    """
    from dedupcore.api import Outcome
    from dedupcore.client import Client

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    try:
        base = partition * _FIELDS
        s = shared
        tmp = Path(tmp_dir)
        messages = _read_partition(tmp, partition)
        owner = f"consumer-{partition}"  # stable across restarts: a restart gets its claims back
        fd = os.open(tmp / f"effects-{partition}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        step = 0
        with Client(socket_path, timeout=60.0, retries=100, backoff=0.02) as client:
            client.ping()
            while (delivery := _deliver(s, base, messages, batch_size)) is not None:
                offset, batch, redelivered = delivery
                _kill_point(s, base, plan, offset, BEFORE_CLAIM)
                # An id twice in one batch is claimed once.
                todo: list[bytes | str] = list(dict.fromkeys(batch))
                s[base + _SAME_BATCH] += len(batch) - len(todo)
                first = True
                while todo:
                    claims = client.claim_many(todo, namespace=NAMESPACE, owner=owner, lease=lease)
                    _kill_point(s, base, plan, offset, AFTER_CLAIM)
                    new = [c for c in claims if c.outcome is Outcome.NEW]
                    waiting = [c.key for c in claims if c.outcome is Outcome.IN_PROGRESS]
                    dup = [c for c in claims if c.outcome is Outcome.DUPLICATE]
                    s[base + _DUPLICATE] += len(dup)
                    s[base + _IN_PROGRESS] += len(waiting)
                    if first and redelivered:
                        s[base + _REDELIVERED_DUPLICATE] += sum(c.key in redelivered for c in dup)
                        s[base + _REDELIVERED_NEW] += sum(c.key in redelivered for c in new)
                    if new:
                        step += 1
                        # The business effect: one write for the batch's new messages.
                        # (Each write starts a new line, and a line counts only with its
                        # final " .", so a write torn by a SIGKILL is not an effect.)
                        t = time.monotonic_ns()
                        effect = b"\n" + b"".join(
                            b"E %d %d %d %s .\n" % (incarnation, step, t, _as_bytes(c.key))
                            for c in new
                        )
                        if _due(s, base, plan, offset, MID_EFFECT):
                            os.write(fd, effect[: len(effect) // 2])  # a torn effect
                            _die(s, base)
                        os.write(fd, effect)
                        _kill_point(s, base, plan, offset, AFTER_EFFECT)
                        client.complete_many([(c.key, c.token) for c in new], namespace=NAMESPACE)
                        t = time.monotonic_ns()
                        os.write(fd, b"\nC %d %d %d .\n" % (incarnation, step, t))
                    if waiting:
                        time.sleep(0.005)  # held by another consumer: nack, retry shortly
                    todo = waiting
                    first = False
                _kill_point(s, base, plan, offset, AFTER_COMPLETE)
                s[base + _COMMITTED] = offset + len(batch)  # the ack
    except BaseException:
        traceback.print_exc()
        raise


def _ledger_entry(key: bytes) -> tuple[int, int]:
    """Act two's effect of a message: ``(account, amount)`` to credit, from its id."""
    n = int(key.rsplit(b"-", 1)[1])
    return n % ACCOUNTS, n % 97 + 1


def _connect(path: Path) -> sqlite3.Connection:
    """A connection to one of act two's SQLite files, as every process opens it.

    The files are in WAL mode (set once when they are made); a writer waits
    up to 60 s for the writer lock. ``synchronous=NORMAL`` does not sync the
    log at each commit: a commit survives the death of its process, which is
    what the demo does, not a power loss.
    """
    conn = sqlite3.connect(path, timeout=60.0)
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def _table_consumer(
    partition: int,
    incarnation: int,
    tmp_dir: str,
    shared: Any,
    batch_size: int,
    plan: list[Kill],
    atomic: bool,
) -> None:
    """Act two's consumer of one partition: per message, the dedup row and the effect in
    one transaction (:func:`dedupcore.patterns.table.consume`); the batch is
    acknowledged after its last commit.

    It SIGKILLs itself where ``plan`` says; a kill inside a transaction lands
    on the first NEW message of the batch's second half. With ``atomic``
    False the effect is committed on a database of its own before the dedup
    row (a split transaction, to show what the count then finds).
    """
    from dedupcore.patterns.table import consume

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    try:
        base = partition * _FIELDS
        s = shared
        tmp = Path(tmp_dir)
        messages = _read_partition(tmp, partition)
        business = _connect(tmp / _BUSINESS_DB)
        conn = business if atomic else _connect(tmp / _DEDUP_DB)
        consumer = f"consumer-{partition}/{incarnation}"
        while (delivery := _deliver(s, base, messages, batch_size)) is not None:
            offset, batch, redelivered = delivery
            _kill_point(s, base, plan, offset, BEFORE_CLAIM)
            second_half = len(batch) // 2
            for i, key in enumerate(batch):
                with consume(conn, NAMESPACE, key) as c:
                    if c.new:
                        here = i >= second_half
                        if here:
                            _kill_point(s, base, plan, offset, AFTER_CLAIM)
                        account, amount = _ledger_entry(key)
                        business.execute(
                            "UPDATE accounts SET balance = balance + ? WHERE id = ?",
                            (amount, account),
                        )
                        if here:
                            _kill_point(s, base, plan, offset, MID_EFFECT)
                        business.execute(
                            "INSERT INTO effects (key, account, amount, consumer) "
                            "VALUES (?, ?, ?, ?)",
                            (key, account, amount, consumer),
                        )
                        if not atomic:
                            business.commit()
                        if here:
                            _kill_point(s, base, plan, offset, AFTER_EFFECT)
                # committed: the dedup row with the effect, or (DUPLICATE) nothing
                if c.new:
                    s[base + _REDELIVERED_NEW] += key in redelivered
                else:
                    s[base + _DUPLICATE] += 1
                    s[base + _REDELIVERED_DUPLICATE] += key in redelivered
            _kill_point(s, base, plan, offset, AFTER_COMPLETE)
            s[base + _COMMITTED] = offset + len(batch)  # the ack
    except BaseException:
        traceback.print_exc()
        raise


# -- the supervisor ---------------------------------------------------------------------------


def _publish(keys: int, duplicate_rate: float, rng: random.Random) -> tuple[list[bytes], int]:
    """The producer: every id once, some again (retries after a lost ack)."""
    ids = [b"order-%08d" % i for i in range(keys)]
    retries = int(keys * duplicate_rate / (1.0 - duplicate_rate))
    stream = ids + [ids[rng.randrange(keys)] for _ in range(retries)]
    rng.shuffle(stream)
    return stream, retries


def _kill_plan(sizes: list[int], batch: int, n_kills: int, rng: random.Random) -> list[list[Kill]]:
    """Each partition's planned kills, in the order they happen.

    The points take turns (shuffled), and the partitions too; a partition's
    kills are spread over batch starts in the first three quarters of its
    messages, so that batches remain after each one to reach its point (a
    kill between the effect and complete needs a batch with a NEW claim). A
    RANDOM kill lands on a moment of the batch drawn here.
    """
    points = [(RANDOM, AFTER_CLAIM, AFTER_EFFECT, AFTER_COMPLETE)[i % 4] for i in range(n_kills)]
    rng.shuffle(points)
    consumers = len(sizes)
    plan: list[list[Kill]] = [[] for _ in range(consumers)]
    for i, point in enumerate(points):
        moment = rng.choice(_RANDOM_MOMENTS) if point == RANDOM else point
        plan[i % consumers].append((0, point, moment))
    for p, kills in enumerate(plan):
        batches = max(1, (sizes[p] + batch - 1) // batch * 3 // 4)
        for j, (_, point, moment) in enumerate(kills):
            kills[j] = ((j + 1) * batches // (len(kills) + 1) * batch, point, moment)
    return plan


@dataclass(frozen=True)
class _Stream:
    """What both acts run: the published stream, its partitions' sizes and the kill plan."""

    keys: int
    stream: list[bytes]
    retries: int
    consumers: int
    batch: int
    sizes: list[int]
    plan: list[list[Kill]]

    @property
    def planned_kills(self) -> dict[str, int]:
        counts = Counter(point for kills in self.plan for _, point, _ in kills)
        return {name: counts[point] for point, name in KILL_POINTS.items()}


def _prepare(
    keys: int,
    duplicate_rate: float,
    seed: int,
    consumers: int,
    batch: int | None,
    kills: int | None,
) -> _Stream:
    """The stream and the kill plan drawn from ``seed`` (the same for both acts)."""
    if keys <= 0 or not 0.0 <= duplicate_rate < 1.0:
        raise ValueError("keys must be > 0 and duplicate_rate in [0, 1)")
    if consumers <= 0 or (batch is not None and batch <= 0):
        raise ValueError("consumers and batch must be > 0")
    if kills is not None and kills < 0:
        raise ValueError("kills must be >= 0")
    rng = random.Random(seed)
    stream, retries = _publish(keys, duplicate_rate, rng)
    if batch is None:  # some 40 batches per consumer, 50..1000 messages each
        batch = max(50, min(1000, len(stream) // (40 * consumers)))
    n_kills = 4 * consumers if kills is None else kills
    sizes = [len(stream[p::consumers]) for p in range(consumers)]
    plan = _kill_plan(sizes, batch, n_kills, rng)
    return _Stream(keys, stream, retries, consumers, batch, sizes, plan)


def _supervise(
    run: _Stream,
    tmp: Path,
    target: Callable[..., None],
    extra: tuple[Any, ...],
    shared: Any,
    progress: Callable[[int, int, str], None] | None,
) -> tuple[dict[str, int], int]:
    """Runs a consumer process per partition, each restarted after it dies, until every
    partition is acknowledged to its end; returns the planned kills done, by
    point, and the consumers that died otherwise.

    ``target(partition, incarnation, tmp, shared, batch, plan, *extra)`` is
    the consumer; the partitions' messages are written to ``tmp`` here.
    """
    consumers = run.consumers
    for p in range(consumers):
        (tmp / f"partition-{p}").write_bytes(b"\n".join(run.stream[p::consumers]))
    # A consumer is forked by a fork server that imported dedupcore once (its
    # own process, started at the first use): a restart after a kill takes
    # milliseconds instead of a fresh interpreter's import of the package.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", *_CONSUMER_MODULES])
    procs: list[Any] = [None] * consumers
    incarnations = [0] * consumers
    killed = [0] * consumers  # planned kills seen done, per partition
    kill_counts = {name: 0 for name in KILL_POINTS.values()}
    crashes = 0

    def spawn(p: int) -> None:
        incarnations[p] += 1
        proc = ctx.Process(
            target=target,
            args=(p, incarnations[p], str(tmp), shared, run.batch, run.plan[p], *extra),
            name=f"dedupcore-demo-consumer-{p}",
            daemon=True,
        )
        proc.start()
        procs[p] = proc

    def acked() -> int:
        return sum(int(shared[p * _FIELDS + _COMMITTED]) for p in range(consumers))

    def unfinished(p: int) -> bool:
        return int(shared[p * _FIELDS + _COMMITTED]) < run.sizes[p]

    def count_kills(p: int) -> bool:
        """Counts the planned kills partition ``p`` did; False if it did none."""
        done = int(shared[p * _FIELDS + _KILLED])
        for _from_offset, point, _moment in run.plan[p][killed[p] : done]:
            kill_counts[KILL_POINTS[point]] += 1
        new, killed[p] = done > killed[p], done
        return new

    def note() -> str:
        return f"{sum(kill_counts.values())} consumers SIGKILLed"

    try:
        for p in range(consumers):
            spawn(p)
        total = len(run.stream)
        while True:
            done = acked()
            if progress is not None:
                progress(done, total, note())
            if done >= total:
                break
            for p in range(consumers):
                proc = procs[p]
                if not proc.is_alive() and unfinished(p):
                    proc.join()
                    planned = proc.exitcode == -signal.SIGKILL and count_kills(p)
                    if not planned:
                        crashes += 1
                        if crashes > 10 * consumers:
                            raise RuntimeError("consumers keep failing; see the errors above")
                    spawn(p)
            # until a consumer exits (or 50 ms pass, for the progress bar)
            multiprocessing.connection.wait([proc.sentinel for proc in procs], 0.05)
        for proc in procs:
            proc.join(60)
        for p in range(consumers):
            count_kills(p)
        if progress is not None:
            progress(total, total, note())
        return kill_counts, crashes
    finally:
        for proc in procs:
            if proc is not None and proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join()


def _start_daemon(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    socket_path = str(tmp / "sock" / "dedupcore.sock")
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 - handed to the subprocess
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dedupcore",
            "serve",
            "--data",
            str(tmp / "data"),
            "--socket",
            socket_path,
            "--log-level",
            "WARNING",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    from dedupcore.client import Client
    from dedupcore.errors import UnavailableError

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"dedupcore serve exited with {proc.returncode}: "
                + (tmp / "daemon.log").read_text(errors="replace")
            )
        try:
            with Client(socket_path, timeout=5.0, retries=0) as c:
                if c.ping():
                    return proc, socket_path
        except UnavailableError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("dedupcore serve did not answer within 60 s")


def _stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def simulate(
    *,
    keys: int,
    duplicate_rate: float,
    seed: int,
    consumers: int = 4,
    batch: int | None = None,
    kills: int | None = None,
    lease: float = 60.0,
    progress: Callable[[int, int, str], None] | None = None,
) -> DemoResult:
    """Runs act one (claim, effect, complete through ``dedupcore serve``; see the module
    docstring) and returns its accounting.

    ``batch`` messages are claimed at a time (default: from 50 to 1000, about
    40 batches per consumer). ``kills`` SIGKILLs are spread over the run
    (default: 4 per consumer), aimed in turn at each point of
    :data:`KILL_POINTS`: each consumer kills itself where the plan drawn
    from ``seed`` says (:func:`_kill_plan`), so the kills do not depend on
    timing. ``progress(done, total, note)`` is called as acknowledged
    messages advance.
    """
    run = _prepare(keys, duplicate_rate, seed, consumers, batch, kills)
    shared = RawArray("q", consumers * _FIELDS)
    tmp = Path(tempfile.mkdtemp(prefix="dcdemo"))
    daemon: subprocess.Popen[bytes] | None = None
    started = time.perf_counter()
    try:
        daemon, socket_path = _start_daemon(tmp)
        kill_counts, crashes = _supervise(
            run, tmp, _consumer, (socket_path, lease), shared, progress
        )
        from dedupcore.client import Client

        with Client(socket_path) as client:
            stats = client.stats()
        result = _account(tmp, consumers, keys, run.retries, len(run.stream), shared)
        result.kills = kill_counts
        result.planned_kills = run.planned_kills
        result.crashes = crashes
        result.lease_takeovers = int(stats.get("lease_takeovers", 0))
        result.elapsed = time.perf_counter() - started
        return result
    finally:
        if daemon is not None:
            _stop_daemon(daemon)
        shutil.rmtree(tmp, ignore_errors=True)


def simulate_transactional(
    *,
    keys: int,
    duplicate_rate: float,
    seed: int,
    consumers: int = 4,
    batch: int | None = None,
    kills: int | None = None,
    atomic: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
) -> DemoResult:
    """Runs act two (the dedup row and the effect in one SQLite transaction; see the module
    docstring) and returns its accounting.

    The stream and the kill plan are :func:`simulate`'s for the same
    arguments. ``atomic=False`` splits the transaction: the effect commits
    in a database of its own before the dedup row, and the effects counted
    twice show it.
    """
    from dedupcore.patterns.table import ensure_table

    run = _prepare(keys, duplicate_rate, seed, consumers, batch, kills)
    shared = RawArray("q", consumers * _FIELDS)
    tmp = Path(tempfile.mkdtemp(prefix="dcdemo"))
    started = time.perf_counter()
    try:
        _make_business_db(tmp / _BUSINESS_DB)
        with contextlib.closing(_connect(tmp / (_BUSINESS_DB if atomic else _DEDUP_DB))) as db:
            db.execute("PRAGMA journal_mode=WAL")
            ensure_table(db)
        kill_counts, crashes = _supervise(run, tmp, _table_consumer, (atomic,), shared, progress)
        result = _account_table(tmp / _BUSINESS_DB, run, shared)
        result.kills = kill_counts
        result.planned_kills = run.planned_kills
        result.crashes = crashes
        result.elapsed = time.perf_counter() - started
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_business_db(path: Path) -> None:
    """Act two's business tables: account balances, and one row per effect applied.

    ``effects`` has no unique key on purpose: an effect applied twice is two
    rows, for the count to find.
    """
    with contextlib.closing(_connect(path)) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL)")
        db.executemany("INSERT INTO accounts VALUES (?, 0)", [(a,) for a in range(ACCOUNTS)])
        db.execute(
            "CREATE TABLE effects (key BLOB NOT NULL, account INTEGER NOT NULL, "
            "amount INTEGER NOT NULL, consumer TEXT NOT NULL)"
        )
        db.commit()


# -- the accounting ---------------------------------------------------------------------------


class _Counters(TypedDict):
    deliveries: int
    redeliveries: int
    duplicates_suppressed: int
    redelivered_duplicates: int
    redelivered_new: int
    in_progress: int
    same_batch: int


def _counters(shared: Any, consumers: int) -> _Counters:
    """The stream figures both acts count, summed over the partitions."""

    def total(f: int) -> int:
        return sum(int(shared[p * _FIELDS + f]) for p in range(consumers))

    return {
        "deliveries": total(_DELIVERIES),
        "redeliveries": total(_REDELIVERIES),
        "duplicates_suppressed": total(_DUPLICATE),
        "redelivered_duplicates": total(_REDELIVERED_DUPLICATE),
        "redelivered_new": total(_REDELIVERED_NEW),
        "in_progress": total(_IN_PROGRESS),
        "same_batch": total(_SAME_BATCH),
    }


def _ids(keys: int) -> set[bytes]:
    return {b"order-%08d" % i for i in range(keys)}


def _account(
    tmp: Path, consumers: int, keys: int, retries: int, published: int, shared: Any
) -> DemoResult:
    """Act one: reads the effects files: every effect, and whether a completion preceded it."""
    # id -> [(written at, (partition, incarnation, step))]
    applied: dict[bytes, list[tuple[int, tuple[int, int, int]]]] = {}
    completed: dict[tuple[int, int, int], int] = {}  # step -> when its complete returned
    for p in range(consumers):
        path = tmp / f"effects-{p}"
        if not path.exists():
            continue
        for line in path.read_bytes().split(b"\n"):
            parts = line.split(b" ")
            if parts[0] == b"E" and len(parts) == 6 and parts[5] == b".":
                step = (p, int(parts[1]), int(parts[2]))
                applied.setdefault(parts[4], []).append((int(parts[3]), step))
            elif parts[0] == b"C" and len(parts) == 5 and parts[4] == b".":
                completed[(p, int(parts[1]), int(parts[2]))] = int(parts[3])
    window = unexplained = 0
    for apps in applied.values():
        if len(apps) == 1:
            continue
        apps.sort()
        for i in range(1, len(apps)):
            at = apps[i][0]
            # Was an earlier application of this id confirmed by a complete that had
            # returned before this one was applied? Then the claim should have been
            # DUPLICATE: a real double effect. Otherwise the earlier consumer died
            # between its effect and its complete: the known window.
            if any(completed.get(step, at + 1) < at for _, step in apps[:i]):
                unexplained += 1
            else:
                window += 1
    ids = _ids(keys)
    missing = len(ids - applied.keys())
    unexplained += len(applied.keys() - ids)
    return DemoResult(
        unique_messages=keys,
        producer_retries=retries,
        published=published,
        effects_applied=sum(len(a) for a in applied.values()),
        effects_twice_window=window,
        effects_twice_unexplained=unexplained,
        missing=missing,
        consumers=consumers,
        **_counters(shared, consumers),
    )


def _account_table(business: Path, run: _Stream, shared: Any) -> DemoResult:
    """Act two: counts the effects per id in the business database and checks the balances.

    With the effect and the dedup row in one transaction nothing explains an
    effect applied twice: every repeat counts as unexplained.
    """
    with contextlib.closing(sqlite3.connect(business)) as db:
        applied: dict[bytes, int] = dict(
            db.execute("SELECT key, count(*) FROM effects GROUP BY key").fetchall()
        )
        balances: dict[int, int] = dict(db.execute("SELECT id, balance FROM accounts").fetchall())
    ids = _ids(run.keys)
    expected = Counter[int]()
    for key in ids:
        account, amount = _ledger_entry(key)
        expected[account] += amount
    return DemoResult(
        unique_messages=run.keys,
        producer_retries=run.retries,
        published=len(run.stream),
        effects_applied=sum(applied.values()),
        effects_twice_window=0,
        effects_twice_unexplained=sum(n - 1 for n in applied.values())
        + sum(n for key, n in applied.items() if key not in ids),
        missing=len(ids - applied.keys()),
        consumers=run.consumers,
        transactional=True,
        balances_wrong=sum(balances.get(a, 0) != expected[a] for a in range(ACCOUNTS)),
        **_counters(shared, run.consumers),
    )


# -- the command ------------------------------------------------------------------------------


def run_demo(*, keys: int, duplicate_rate: float, seed: int) -> int:
    """Runs both acts and prints their accounting side by side; returns the exit code:
    0 when act one's only repeated effects are the effect/complete window's and
    act two has none."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    if keys <= 0 or not 0.0 <= duplicate_rate < 1.0:
        console.print("[red]--keys must be > 0 and --duplicate-rate in [0, 1)[/red]")
        return 2
    consumers = 4
    console.print(
        f"[bold]dedupcore demo[/bold]: {keys:,} messages, {duplicate_rate:.0%} of what the "
        f"producer publishes are retries; {consumers} consumer processes, SIGKILLed and "
        "restarted at the same planned places in both acts.\n"
        "  act one: claim -> effect -> complete through one `dedupcore serve`\n"
        "  act two: the dedup row and the effect in one SQLite transaction "
        "(dedupcore.patterns.table)"
    )
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        one = bar.add_task("act one acked", total=None, note="starting the daemon")
        two = bar.add_task("act two acked", total=None, note="", start=False)

        def progress_of(task: Any) -> Callable[[int, int, str], None]:
            def progress(done: int, total: int, note: str) -> None:
                bar.update(task, completed=done, total=total, note=note)

            return progress

        args: dict[str, Any] = {
            "keys": keys,
            "duplicate_rate": duplicate_rate,
            "seed": seed,
            "consumers": consumers,
        }
        try:
            r1 = simulate(**args, progress=progress_of(one))
            bar.start_task(two)
            r2 = simulate_transactional(**args, progress=progress_of(two))
        except (RuntimeError, OSError, sqlite3.Error) as exc:
            console.print(f"[red]demo failed: {exc}[/red]")
            return 1
        except KeyboardInterrupt:
            console.print("[yellow]interrupted; the daemon and consumers are stopped[/yellow]")
            return 130
    _print_acts(console, r1, r2)
    return 0 if r1.ok and r2.ok else 1


def _print_acts(console: Any, r1: DemoResult, r2: DemoResult) -> None:
    from rich.table import Table

    na = "[dim]-[/dim]"
    table = Table(title="the same at-least-once stream and the same SIGKILLs, twice")
    table.add_column("figure")
    table.add_column(
        f"act one\nclaim/complete\n(dedupcore serve)\n{r1.elapsed:.1f} s", justify="right"
    )
    table.add_column(f"act two\none transaction\n(SQLite)\n{r2.elapsed:.1f} s", justify="right")

    def row(label: str, a: str | int, b: str | int) -> None:
        table.add_row(label, *(f"{v:,}" if isinstance(v, int) else v for v in (a, b)))

    row("unique messages (business ids)", r1.unique_messages, r2.unique_messages)
    row("producer retries (an id published again)", r1.producer_retries, r2.producer_retries)
    row("messages on the broker", r1.published, r2.published)
    row("deliveries to consumers", r1.deliveries, r2.deliveries)
    row("  redeliveries after a kill (not yet acked)", r1.redeliveries, r2.redeliveries)
    for name in KILL_POINTS.values():
        row(f"SIGKILL {name}", r1.kills.get(name, 0), r2.kills.get(name, 0))
    if r1.crashes or r2.crashes:
        row("consumers that failed on their own", r1.crashes, r2.crashes)
    row("duplicates suppressed (DUPLICATE)", r1.duplicates_suppressed, r2.duplicates_suppressed)
    row(
        "  redelivered after complete, before the ack",
        r1.redelivered_duplicates,
        r2.redelivered_duplicates,
    )
    row("same id twice in a batch (claimed once)", r1.same_batch, na)
    row("IN_PROGRESS (another consumer held it; retried)", r1.in_progress, na)
    row("lease takeovers", r1.lease_takeovers, na)
    row(
        "effects applied",
        f"[bold]{r1.effects_applied:,}[/bold]",
        f"[bold]{r2.effects_applied:,}[/bold]",
    )
    row(
        "effects applied twice",
        f"[yellow]{r1.effects_twice:,}[/yellow]",
        f"[bold]{_flag(r2.effects_twice)}[/bold]",
    )
    row(
        "  died between effect and complete (the window)",
        f"[yellow]{r1.effects_twice_window:,}[/yellow]",
        "[dim]rolled back[/dim]" if r2.transactional else f"{r2.effects_twice_window:,}",
    )
    row(
        "  otherwise (must be 0)",
        _flag(r1.effects_twice_unexplained),
        _flag(r2.effects_twice_unexplained),
    )
    row("messages never applied (must be 0)", _flag(r1.missing), _flag(r2.missing))
    row("balances off the exactly-once sums (must be 0)", na, _flag(r2.balances_wrong))
    console.print(table)
    console.print(
        "Act one: a kill [bold]between complete and the ack[/bold] redelivers messages that "
        "are already completed: their claims answer DUPLICATE and the effect is not "
        "repeated -- the window dedupcore closes. A kill [bold]between the effect and "
        "complete[/bold] is different: the effect happened but the claim is still "
        "PROCESSING, so the restarted consumer gets its claim back and applies the effect "
        "again. No dedup store can know about an effect it was not told about.\n"
        "Act two has 0: the dedup row and the effect commit in one transaction (the "
        "transactional pattern), so a consumer killed before the commit leaves neither "
        "and the redelivery applies the effect once, and one killed after it leaves both "
        "and the redelivery is DUPLICATE."
    )
    for act, r in (("act one", r1), ("act two", r2)):
        if not r.all_kills_done:
            missed = {k: n - r.kills.get(k, 0) for k, n in r.planned_kills.items()}
            console.print(
                f"[yellow]{act}: planned kills not reached (too few messages after them): "
                + ", ".join(f"{n} {k}" for k, n in missed.items() if n)
                + "[/yellow]"
            )
    for act, r in (("act one", r1), ("act two", r2)):
        if r.ok and r.transactional:
            console.print(
                f"[green]{act}: effects ({r.effects_applied:,}) == unique messages "
                f"({r.unique_messages:,}), each applied exactly once[/green]"
            )
        elif r.ok:
            console.print(
                f"[green]{act}: effects ({r.effects_applied:,}) == unique messages "
                f"({r.unique_messages:,}) + effects re-applied in the effect/complete window "
                f"({r.effects_twice_window:,})[/green]"
            )
        else:
            console.print(
                f"[red]{act}: accounting does not add up: {r.effects_applied:,} effects for "
                f"{r.unique_messages:,} messages, {r.effects_twice_window:,} explained by the "
                f"effect/complete window, {r.effects_twice_unexplained:,} not, "
                f"{r.missing:,} missing, {r.balances_wrong:,} balances off[/red]"
            )


def _as_bytes(key: bytes | str) -> bytes:
    return key if isinstance(key, bytes) else key.encode()


def _flag(n: int) -> str:
    return f"[green]{n:,}[/green]" if n == 0 else f"[red]{n:,}[/red]"
