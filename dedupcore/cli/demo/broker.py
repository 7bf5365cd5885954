"""The demo's broker stand-in: the stream, its partitions, the kill plan, the supervisor.

Both acts (docs/demo.md) run what is here: the producer's stream, one partition
per consumer with a committed offset in shared memory, the kill plan drawn from
the seed, and the supervisor that restarts each consumer after it dies.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.sharedctypes import RawArray
from pathlib import Path
from typing import Any

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


def _partition(tmp_dir: str, partition: int) -> tuple[int, Path, list[bytes]]:
    """A consumer's partition: its row in the shared counters, the act's directory and
    the partition's messages (written there by :func:`_supervise`)."""
    tmp = Path(tmp_dir)
    data = (tmp / f"partition-{partition}").read_bytes()
    return partition * _FIELDS, tmp, data.split(b"\n") if data else []


def _consumer_process(target: Callable[..., None]) -> Callable[..., None]:
    """A consumer as its process runs it: Ctrl-C is the supervisor's to handle, and an
    error is printed before the process dies of it."""

    @functools.wraps(target)
    def run(*args: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            target(*args)
        except BaseException:
            traceback.print_exc()
            raise

    return run


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


def _stage(run: _Stream) -> tuple[Any, Path]:
    """What an act of ``run`` needs besides: the shared counters, zero, and a new
    temporary directory (the act removes it)."""
    return RawArray("q", run.consumers * _FIELDS), Path(tempfile.mkdtemp(prefix="dcdemo"))


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
