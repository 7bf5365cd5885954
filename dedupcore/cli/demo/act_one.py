"""The demo's act one: ``claim -> effect -> complete`` through ``dedupcore serve``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dedupcore.cli.demo.broker as broker
from dedupcore.cli.demo.summary import (
    DemoResult,
    _counters,
    _finished,
    _ids,
)


@broker._consumer_process
def _consumer(
    partition: int,
    incarnation: int,
    tmp_dir: str,
    shared: Any,
    batch_size: int,
    plan: list[broker.Kill],
    socket_path: str,
    lease: float,
) -> None:
    """Act one's consumer of one partition: claim, apply the effect, complete, acknowledge.

    It SIGKILLs itself where ``plan`` says (see :func:`_kill_plan`).
    """
    from dedupcore.api import Outcome
    from dedupcore.client import Client

    base, tmp, messages = broker._partition(tmp_dir, partition)
    s = shared
    owner = f"consumer-{partition}"  # stable across restarts: a restart gets its claims back
    fd = os.open(tmp / f"effects-{partition}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    step = 0
    with Client(socket_path, timeout=60.0, retries=100, backoff=0.02) as client:
        client.ping()
        while (delivery := broker._deliver(s, base, messages, batch_size)) is not None:
            offset, batch, redelivered = delivery
            broker._kill_point(s, base, plan, offset, broker.BEFORE_CLAIM)
            # An id twice in one batch is claimed once.
            todo: list[bytes | str] = list(dict.fromkeys(batch))
            s[base + broker._SAME_BATCH] += len(batch) - len(todo)
            first = True
            while todo:
                claims = client.claim_many(
                    todo, namespace=broker.NAMESPACE, owner=owner, lease=lease
                )
                broker._kill_point(s, base, plan, offset, broker.AFTER_CLAIM)
                new = [c for c in claims if c.outcome is Outcome.NEW]
                waiting = [c.key for c in claims if c.outcome is Outcome.IN_PROGRESS]
                dup = [c for c in claims if c.outcome is Outcome.DUPLICATE]
                s[base + broker._DUPLICATE] += len(dup)
                s[base + broker._IN_PROGRESS] += len(waiting)
                if first and redelivered:
                    s[base + broker._REDELIVERED_DUPLICATE] += sum(
                        c.key in redelivered for c in dup
                    )
                    s[base + broker._REDELIVERED_NEW] += sum(c.key in redelivered for c in new)
                if new:
                    step += 1
                    # The business effect: one write for the batch's new messages.
                    # (Each write starts a new line, and a line counts only with its
                    # final " .", so a write torn by a SIGKILL is not an effect.)
                    t = time.monotonic_ns()
                    effect = b"\n" + b"".join(
                        b"E %d %d %d %s .\n" % (incarnation, step, t, _as_bytes(c.key)) for c in new
                    )
                    if broker._due(s, base, plan, offset, broker.MID_EFFECT):
                        os.write(fd, effect[: len(effect) // 2])  # a torn effect
                        broker._die(s, base)
                    os.write(fd, effect)
                    broker._kill_point(s, base, plan, offset, broker.AFTER_EFFECT)
                    client.complete_many(
                        [(c.key, c.token) for c in new], namespace=broker.NAMESPACE
                    )
                    t = time.monotonic_ns()
                    os.write(fd, b"\nC %d %d %d .\n" % (incarnation, step, t))
                if waiting:
                    time.sleep(0.005)  # held by another consumer: nack, retry shortly
                todo = waiting
                first = False
            broker._kill_point(s, base, plan, offset, broker.AFTER_COMPLETE)
            s[base + broker._COMMITTED] = offset + len(batch)  # the ack


def _start_daemon(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    socket_path = str(tmp / "sock" / "dedupcore.sock")
    root = str(Path(__file__).resolve().parents[3])
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
    run = broker._prepare(keys, duplicate_rate, seed, consumers, batch, kills)
    shared, tmp = broker._stage(run)
    daemon: subprocess.Popen[bytes] | None = None
    started = time.perf_counter()
    try:
        daemon, socket_path = _start_daemon(tmp)
        kill_counts, crashes = broker._supervise(
            run, tmp, _consumer, (socket_path, lease), shared, progress
        )
        from dedupcore.client import Client

        with Client(socket_path) as client:
            stats = client.stats()
        result = _account(tmp, consumers, keys, run.retries, len(run.stream), shared)
        result.lease_takeovers = int(stats.get("lease_takeovers", 0))
        return _finished(result, run, kill_counts, crashes, started)
    finally:
        if daemon is not None:
            _stop_daemon(daemon)
        shutil.rmtree(tmp, ignore_errors=True)


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


def _as_bytes(key: bytes | str) -> bytes:
    return key if isinstance(key, bytes) else key.encode()
