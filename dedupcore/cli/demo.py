"""``dedupcore demo``: consumer processes, a daemon and SIGKILLs over an at-least-once stream.

What runs:

- ``dedupcore serve`` (a subprocess) on the embedded default store in a
  temporary directory;
- a producer that publishes ``keys`` business ids and, like a producer whose
  acknowledgement got lost, publishes some of them again
  (``duplicate_rate`` of everything published is such a retry);
- a broker stand-in: one partition per consumer and a committed offset per
  partition in shared memory. A batch is acknowledged (the offset moves)
  only after the consumer's ``complete`` returned; a consumer that dies is
  restarted and gets everything after the committed offset again;
- consumer processes (``multiprocessing`` spawn) doing, per batch:
  ``claim_many`` -> apply the effect of every NEW claim (append a line to an
  effects file) -> ``complete_many`` -> acknowledge. An id held by another
  consumer (IN_PROGRESS) is retried until it is DUPLICATE or NEW;
- consumers are SIGKILLed (and restarted) at planned places: after the
  claim, between the effect and ``complete``, between ``complete`` and the
  acknowledgement, and at a random moment of a batch. The plan is drawn from
  the seed before the run and each consumer SIGKILLs itself when it gets
  there, so every planned kill happens however loaded the machine is.

A kill between ``complete`` and the acknowledgement redelivers messages
whose claims are completed: they come back DUPLICATE and are suppressed --
the case dedupcore closes. A kill between the effect and ``complete``
redelivers messages whose effect happened but whose claim is still
PROCESSING under the dead consumer's owner id: the restarted consumer gets
its own claim back and applies the effect again. No dedup store can see an
effect it was not told about; only writing the effect and the completion
atomically (the transactional pattern: business row and dedup record in one
database transaction) closes that window. The demo counts those re-applied
effects on their own line instead of hiding them, and checks that every
other effect happened exactly once.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import RawArray
from pathlib import Path
from typing import Any

__all__ = ["DemoResult", "run_demo", "simulate"]

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
    """The accounting of one :func:`simulate` run."""

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
    crashes: int = 0
    lease_takeovers: int = 0
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        """Every message applied; the only extra effects are the effect/complete window's."""
        return (
            self.effects_applied == self.unique_messages + self.effects_twice_window
            and self.effects_twice_unexplained == 0
            and self.missing == 0
        )


# -- the consumer process ------------------------------------------------------------------


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


def _consumer(
    partition: int,
    incarnation: int,
    socket_path: str,
    messages_file: str,
    effects_file: str,
    shared: Any,
    batch_size: int,
    lease: float,
    plan: list[Kill],
) -> None:
    """One consumer of one partition: claim, apply the effect, complete, acknowledge.

    It SIGKILLs itself where ``plan`` says (see :func:`_kill_plan`).
    """
    from dedupcore.api import Outcome
    from dedupcore.client import Client

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    try:
        base = partition * _FIELDS
        s = shared
        data = Path(messages_file).read_bytes()
        messages = data.split(b"\n") if data else []
        owner = f"consumer-{partition}"  # stable across restarts: a restart gets its claims back
        fd = os.open(effects_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        step = 0
        with Client(socket_path, timeout=60.0, retries=100, backoff=0.02) as client:
            client.ping()
            while True:
                offset = s[base + _COMMITTED]
                if offset >= len(messages):
                    return
                batch = messages[offset : offset + batch_size]
                end = offset + len(batch)
                high = s[base + _HIGH_WATER]
                redelivered = set(batch[: max(0, min(end, high) - offset)])
                s[base + _DELIVERIES] += len(batch)
                s[base + _REDELIVERIES] += max(0, min(end, high) - offset)
                s[base + _HIGH_WATER] = max(high, end)
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
                s[base + _COMMITTED] = end  # the ack
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
    """Runs the simulation (see the module docstring) and returns its accounting.

    ``batch`` messages are claimed at a time (default: from 50 to 1000, about
    40 batches per consumer). ``kills`` SIGKILLs are spread over the run
    (default: 4 per consumer), aimed in turn at each point of
    :data:`KILL_POINTS`: each consumer kills itself where the plan drawn
    from ``seed`` says (:func:`_kill_plan`), so the kills do not depend on
    timing. ``progress(done, total, note)`` is called as acknowledged
    messages advance.
    """
    if keys <= 0 or not 0.0 <= duplicate_rate < 1.0:
        raise ValueError("keys must be > 0 and duplicate_rate in [0, 1)")
    if consumers <= 0 or (batch is not None and batch <= 0):
        raise ValueError("consumers and batch must be > 0")
    rng = random.Random(seed)
    stream, retries = _publish(keys, duplicate_rate, rng)
    if batch is None:  # some 40 batches per consumer, 50..1000 messages each
        batch = max(50, min(1000, len(stream) // (40 * consumers)))
    n_kills = 4 * consumers if kills is None else kills
    sizes = [len(stream[p::consumers]) for p in range(consumers)]
    plan = _kill_plan(sizes, batch, n_kills, rng)

    ctx = multiprocessing.get_context("spawn")
    shared = RawArray("q", consumers * _FIELDS)
    tmp = Path(tempfile.mkdtemp(prefix="dcdemo"))
    daemon: subprocess.Popen[bytes] | None = None
    procs: list[Any] = [None] * consumers
    incarnations = [0] * consumers
    killed = [0] * consumers  # planned kills seen done, per partition
    kill_counts = {name: 0 for name in KILL_POINTS.values()}
    crashes = 0
    started = time.perf_counter()
    try:
        daemon, socket_path = _start_daemon(tmp)
        for p in range(consumers):
            (tmp / f"partition-{p}").write_bytes(b"\n".join(stream[p::consumers]))

        def spawn(p: int) -> None:
            incarnations[p] += 1
            proc = ctx.Process(
                target=_consumer,
                args=(
                    p,
                    incarnations[p],
                    socket_path,
                    str(tmp / f"partition-{p}"),
                    str(tmp / f"effects-{p}"),
                    shared,
                    batch,
                    lease,
                    plan[p],
                ),
                name=f"dedupcore-demo-consumer-{p}",
                daemon=True,
            )
            proc.start()
            procs[p] = proc

        def acked() -> int:
            return sum(int(shared[p * _FIELDS + _COMMITTED]) for p in range(consumers))

        def unfinished(p: int) -> bool:
            return int(shared[p * _FIELDS + _COMMITTED]) < sizes[p]

        def count_kills(p: int) -> bool:
            """Counts the planned kills partition ``p`` did; False if it did none."""
            done = int(shared[p * _FIELDS + _KILLED])
            for _from_offset, point, _moment in plan[p][killed[p] : done]:
                kill_counts[KILL_POINTS[point]] += 1
            new, killed[p] = done > killed[p], done
            return new

        for p in range(consumers):
            spawn(p)
        total = len(stream)
        while True:
            done = acked()
            if progress is not None:
                progress(done, total, f"{sum(kill_counts.values())} consumers SIGKILLed")
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
            time.sleep(0.02)
        for proc in procs:
            proc.join(60)
        for p in range(consumers):
            count_kills(p)
        if progress is not None:
            progress(total, total, f"{sum(kill_counts.values())} consumers SIGKILLed")

        from dedupcore.client import Client

        with Client(socket_path) as client:
            stats = client.stats()
        result = _account(tmp, consumers, keys, retries, len(stream), shared)
        result.kills = kill_counts
        result.crashes = crashes
        result.lease_takeovers = int(stats.get("lease_takeovers", 0))
        result.elapsed = time.perf_counter() - started
        return result
    finally:
        for proc in procs:
            if proc is not None and proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join()
        if daemon is not None:
            _stop_daemon(daemon)
        shutil.rmtree(tmp, ignore_errors=True)


def _account(
    tmp: Path, consumers: int, keys: int, retries: int, published: int, shared: Any
) -> DemoResult:
    """Reads the effects files: every effect, and whether a completion preceded it."""
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
    effects = sum(len(a) for a in applied.values())
    ids = {b"order-%08d" % i for i in range(keys)}
    missing = len(ids - applied.keys())
    unexplained += len(applied.keys() - ids)

    def total(f: int) -> int:
        return sum(shared[p * _FIELDS + f] for p in range(consumers))

    return DemoResult(
        unique_messages=keys,
        producer_retries=retries,
        published=published,
        deliveries=total(_DELIVERIES),
        redeliveries=total(_REDELIVERIES),
        duplicates_suppressed=total(_DUPLICATE),
        redelivered_duplicates=total(_REDELIVERED_DUPLICATE),
        redelivered_new=total(_REDELIVERED_NEW),
        in_progress=total(_IN_PROGRESS),
        same_batch=total(_SAME_BATCH),
        effects_applied=effects,
        effects_twice_window=window,
        effects_twice_unexplained=unexplained,
        missing=missing,
        consumers=consumers,
    )


# -- the command ------------------------------------------------------------------------------


def run_demo(*, keys: int, duplicate_rate: float, seed: int) -> int:
    """Runs the demo and prints its accounting; returns the process exit code."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    if keys <= 0 or not 0.0 <= duplicate_rate < 1.0:
        console.print("[red]--keys must be > 0 and --duplicate-rate in [0, 1)[/red]")
        return 2
    consumers = 4
    console.print(
        f"[bold]dedupcore demo[/bold]: {keys:,} messages, {duplicate_rate:.0%} of what the "
        f"producer publishes are retries; {consumers} consumer processes share one "
        "`dedupcore serve` and are SIGKILLed and restarted along the way."
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
        task = bar.add_task("acknowledged", total=None, note="starting the daemon")

        def progress(done: int, total: int, note: str) -> None:
            bar.update(task, completed=done, total=total, note=note)

        try:
            r = simulate(
                keys=keys,
                duplicate_rate=duplicate_rate,
                seed=seed,
                consumers=consumers,
                progress=progress,
            )
        except (RuntimeError, OSError) as exc:
            console.print(f"[red]demo failed: {exc}[/red]")
            return 1
        except KeyboardInterrupt:
            console.print("[yellow]interrupted; the daemon and consumers are stopped[/yellow]")
            return 130

    table = Table(title=f"at-least-once stream through dedupcore ({r.elapsed:.1f} s)")
    table.add_column("figure")
    table.add_column("count", justify="right")
    table.add_row("unique messages (business ids)", f"{r.unique_messages:,}")
    table.add_row("producer retries (an id published again)", f"{r.producer_retries:,}")
    table.add_row("messages on the broker", f"{r.published:,}")
    table.add_row("deliveries to consumers", f"{r.deliveries:,}")
    table.add_row("  redeliveries after a kill (not yet acked)", f"{r.redeliveries:,}")
    for name, n in r.kills.items():
        table.add_row(f"SIGKILL {name}", f"{n:,}")
    if r.crashes:
        table.add_row("consumers that failed on their own", f"{r.crashes:,}")
    table.add_row("duplicates suppressed (claim: DUPLICATE)", f"{r.duplicates_suppressed:,}")
    table.add_row(
        "  redelivered after complete, before the ack",
        f"{r.redelivered_duplicates:,}",
    )
    table.add_row("same id twice in a batch (claimed once)", f"{r.same_batch:,}")
    table.add_row("IN_PROGRESS (another consumer held it; retried)", f"{r.in_progress:,}")
    table.add_row("effects applied", f"[bold]{r.effects_applied:,}[/bold]")
    table.add_row("unique messages", f"[bold]{r.unique_messages:,}[/bold]")
    table.add_row(
        "effects applied twice: died between effect and complete",
        f"[yellow]{r.effects_twice_window:,}[/yellow]",
    )
    table.add_row("effects applied twice otherwise (must be 0)", _flag(r.effects_twice_unexplained))
    table.add_row("messages never applied (must be 0)", _flag(r.missing))
    table.add_row("lease takeovers", f"{r.lease_takeovers:,}")
    console.print(table)
    console.print(
        "A kill [bold]between complete and the ack[/bold] redelivers messages that are "
        "already completed: their claims answer DUPLICATE and the effect is not repeated "
        "-- the window dedupcore closes.\n"
        "A kill [bold]between the effect and complete[/bold] is different: the effect "
        "happened but the claim is still PROCESSING, so the restarted consumer gets its "
        "claim back and applies the effect again. No dedup store can know about an effect "
        "it was not told about; only an atomic business write closes that window -- "
        "record the completion in the same transaction as the effect (the transactional "
        "pattern), or make the effect itself idempotent."
    )
    if r.ok:
        console.print(
            f"[green]effects ({r.effects_applied:,}) == unique messages "
            f"({r.unique_messages:,}) + effects re-applied in the effect/complete window "
            f"({r.effects_twice_window:,})[/green]"
        )
        return 0
    console.print(
        f"[red]accounting does not add up: {r.effects_applied:,} effects for "
        f"{r.unique_messages:,} messages, {r.effects_twice_window:,} explained by the "
        f"effect/complete window, {r.effects_twice_unexplained:,} not, "
        f"{r.missing:,} missing[/red]"
    )
    return 1


def _as_bytes(key: bytes | str) -> bytes:
    return key if isinstance(key, bytes) else key.encode()


def _flag(n: int) -> str:
    return f"[green]{n:,}[/green]" if n == 0 else f"[red]{n:,}[/red]"
