"""Where a single claim waits while big batches load the daemon: a trace.

``python -m benchmarks.trace_daemon`` runs the scene of the benchmark
``test_latency_under_batches`` (four processes sending 100k-key claim batches,
one client timing single claims one at a time) against a daemon that records

- every event-loop callback that ran longer than ``--slow-ms`` (default 4 ms),
  with the coroutine chain of a task's step and the thread's CPU time in it;
- every wait for, and every hold of, the store lock and the front filter's
  lock longer than 2 ms, with the thread and the function that took it;
- every garbage collection over 2 ms on the event-loop thread;
- every commit of the log on the native commit thread (its bytes, from its
  start to the loop's recording of its end), whatever its length.

It prints the single claims' p50/p90/p99, a summary of the trace (counts,
median and maximum per kind) and the commits' percentiles, apart for those
under and over COMMIT_LARGE bytes (a claim whose record is queued behind a
large commit waits for it); the trace file stays for reading. A hold that
spans a ``Condition.wait`` on the same lock (the store's background thread
idling between checkpoints) is counted whole: read ``_background`` holds so. The
daemon runs on asyncio, not uvloop (uvloop's callbacks cannot be timed from
Python), and the timing costs a little: compare runs of this tool with each
other, not with the benchmark. docs/daemon.md, "Latency under load".
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.events
import gc
import multiprocessing
import random
import re
import runpy
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

SLOW_LOCK = 0.002  # seconds: lock waits and holds at least this long are traced
COMMIT_LARGE = 256 << 10  # bytes: the commits summed up apart
NS = "bench/daemon"


class _TimedLock:
    """Wraps a lock: writes waits and holds over SLOW_LOCK to the trace."""

    def __init__(self, inner: Any, name: str, out: TextIO) -> None:
        self._inner = inner
        self._name = name
        self._out = out
        self._taken: dict[int, list[tuple[float, str]]] = {}

    def _where(self) -> str:
        f = sys._getframe(2)
        while f.f_code.co_name in ("__enter__", "acquire") and f.f_back is not None:
            f = f.f_back
        return f"{f.f_code.co_name}:{f.f_lineno}"

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t0 = time.perf_counter()
        ok = self._inner.acquire(blocking, timeout)
        t1 = time.perf_counter()
        where = self._where()
        if t1 - t0 > SLOW_LOCK:
            self._write("WAIT", t1 - t0, where)
        if ok:
            self._taken.setdefault(threading.get_ident(), []).append((t1, where))
        return ok

    def release(self) -> None:
        held = self._taken[threading.get_ident()]
        t1, where = held.pop()
        if not held and time.perf_counter() - t1 > SLOW_LOCK:
            self._write("HOLD", time.perf_counter() - t1, where)
        self._inner.release()

    def _write(self, kind: str, seconds: float, where: str) -> None:
        thread = threading.current_thread().name
        self._out.write(
            f"{time.time():.4f} {kind} {self._name} {seconds * 1000:.1f}ms {thread} {where}\n"
        )

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return bool(self._inner._is_owned())


def _serve_traced(trace: str, slow: float, argv: list[str]) -> None:
    """In the daemon's process: installs the probes, then runs ``dedupcore serve``."""
    out = open(trace, "w", buffering=1)  # noqa: SIM115 - open for the process's life
    sys.modules["uvloop"] = None  # type: ignore[assignment]  # serve falls back to asyncio
    handle_run = asyncio.events.Handle._run

    def timed_run(self: asyncio.events.Handle) -> None:
        t0 = time.perf_counter()
        c0 = time.thread_time()
        handle_run(self)
        took = time.perf_counter() - t0
        cpu = time.thread_time() - c0
        if took <= slow:
            return
        callback = self._callback
        task = getattr(callback, "__self__", None)
        if isinstance(task, asyncio.Task):
            chain = []
            coro: Any = task.get_coro()
            while coro is not None and getattr(coro, "cr_frame", None) is not None:
                frame = coro.cr_frame
                chain.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                coro = coro.cr_await
            what = "task " + ">".join(chain)
        else:
            what = getattr(callback, "__qualname__", repr(callback))[:120]
        step = f"STEP loop {took * 1000:.1f}ms {what} [cpu {cpu * 1000:.1f}ms]"
        out.write(f"{time.time():.4f} {step}\n")

    asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif threading.current_thread() is threading.main_thread():
            took = time.perf_counter() - started[0]
            if took > SLOW_LOCK:
                out.write(f"{time.time():.4f} GC gen{info['generation']} {took * 1000:.1f}ms\n")

    gc.callbacks.append(on_gc)
    _trace_commits(out)
    import dedupcore.store as store_module

    init = store_module.DedupStore.__init__

    def traced_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._lock = _TimedLock(self._lock, "store", out)
        self._front._lock = _TimedLock(self._front._lock, "front", out)

    store_module.DedupStore.__init__ = traced_init  # type: ignore[method-assign]
    sys.argv = ["dedupcore", *argv]
    runpy.run_module("dedupcore", run_name="__main__")


def _trace_commits(out: TextIO) -> None:
    """Writes every commit of the log on its native thread to the trace: its bytes
    and its time from the start to the recording of its end."""
    from dedupcore.wal.log import WriteAheadLog

    start_commit = WriteAheadLog.start_commit
    finish_native = WriteAheadLog._finish_native
    started: dict[int, tuple[float, int]] = {}

    def timed_start(self: WriteAheadLog) -> bool:
        size = self.commit_bytes
        ok = start_commit(self)
        if ok and self._native is not None:
            started[id(self)] = (time.perf_counter(), size)
        return ok

    def timed_finish(self: WriteAheadLog) -> None:
        finish_native(self)
        if self._native is None and id(self) in started:
            t0, size = started.pop(id(self))
            took = time.perf_counter() - t0
            out.write(f"{time.time():.4f} COMMIT native {took * 1000:.2f}ms {size}\n")

    WriteAheadLog.start_commit = timed_start  # type: ignore[method-assign]
    WriteAheadLog._finish_native = timed_finish  # type: ignore[method-assign]


def _commit_summary(lines: list[str]) -> None:
    """The commits' percentiles, apart for those under and over COMMIT_LARGE bytes."""
    small: list[float] = []
    large: list[float] = []
    for line in lines:
        parts = line.split(" ")
        if len(parts) == 5 and parts[1] == "COMMIT":
            (large if int(parts[4]) > COMMIT_LARGE else small).append(float(parts[3][:-2]))
    for name, times in (("commits", small), ("large commits", large)):
        if not times:
            continue
        times.sort()
        n = len(times)
        over = sum(t > 5 for t in times)
        print(
            f"{n:6d} {name} ({'over' if times is large else 'up to'} {COMMIT_LARGE >> 10} KiB): "
            f"p50 {times[n // 2]:.1f} ms, p90 {times[int(n * 0.9)]:.1f}, "
            f"p99 {times[int(n * 0.99)]:.1f}, max {times[-1]:.1f}; {over} over 5 ms, "
            f"{sum(times) / 1000:.2f} s in all"
        )


def _summary(lines: list[str]) -> None:
    """Counts, median and maximum per kind of trace line; for the loop's steps also
    the median of the thread's CPU time in them (a step much longer than its CPU
    time waited for a core, the GIL or I/O)."""
    kinds: Counter[str] = Counter()
    slowest: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    for line in lines:
        parts = line.split(" ", 4)
        if len(parts) < 4:
            continue
        ms = float(parts[3].rstrip("ms"))
        rest = parts[4] if len(parts) > 4 else ""
        cpu = re.search(r" \[cpu ([0-9.]+)ms\]$", rest)
        if cpu:
            rest = rest[: cpu.start()]
        kind = f"{parts[1]} {parts[2]} {re.sub(r':[0-9]+', '', rest)}"
        if parts[1] in ("GC", "COMMIT"):
            kind = f"{parts[1]} {parts[2]}"
        kinds[kind] += 1
        slowest.setdefault(kind, []).append(ms)
        if cpu:
            cpus.setdefault(kind, []).append(float(cpu.group(1)))
    for kind, n in kinds.most_common(12):
        times = sorted(slowest[kind])
        on_cpu = sorted(cpus.get(kind, []))
        cpu_note = f", CPU median {on_cpu[len(on_cpu) // 2]:.1f}" if on_cpu else ""
        print(
            f"{n:6d} x {kind[:110]}  (median {times[len(times) // 2]:.1f} ms, "
            f"max {times[-1]:.1f}{cpu_note})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--loaders", type=int, default=4)
    parser.add_argument("--slow-ms", type=float, default=4.0)
    parser.add_argument("--durability", default="durable")
    parser.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--trace", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        _serve_traced(args.trace, args.slow_ms / 1000, args.serve)
        return

    from benchmarks._support import Daemon, loader
    from dedupcore.client import Client

    trace = Path(tempfile.mkdtemp(prefix="dctrace")) / "trace.txt"
    cmd = [sys.executable, "-m", "benchmarks.trace_daemon", "--slow-ms", str(args.slow_ms)]
    cmd += ["--trace", str(trace), "--serve"]
    daemon = Daemon(args.durability, command=cmd)
    ctx = multiprocessing.get_context("spawn")
    stop, started, results = ctx.Event(), ctx.Semaphore(0), ctx.Queue()
    procs: list[Any] = []
    try:
        procs = [
            ctx.Process(
                target=loader,
                args=(daemon.socket, "dedupcore", 100 + i, started, stop, results, NS),
                daemon=True,
            )
            for i in range(args.loaders)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            started.acquire(timeout=60)
        time.sleep(1.0)
        rng = random.Random(5)
        latencies = []
        with Client(daemon.socket, timeout=60) as c:
            for _ in range(args.calls):
                key = rng.randbytes(16)
                t0 = time.perf_counter()
                c.claim(key, namespace=NS)
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.001)
    finally:
        stop.set()
        loads = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(60)
        daemon.stop()
    lat = sorted(latencies)
    n = len(lat)
    batches = sum(load["batches"] for load in loads)
    print(
        f"single claims: p50 {lat[n // 2] * 1e3:.2f} ms, p90 {lat[int(n * 0.9)] * 1e3:.2f} ms, "
        f"p99 {lat[int(n * 0.99)] * 1e3:.2f} ms, max {lat[-1] * 1e3:.2f} ms; "
        f"{batches} loader batches meanwhile"
    )
    lines = trace.read_text().splitlines()
    _summary(lines)
    _commit_summary(lines)
    print(f"trace: {trace}")


if __name__ == "__main__":
    main()
