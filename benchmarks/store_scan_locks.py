"""The longest hold of the embedded store's lock by its scans of claims in flight.

Opens a store in a fresh directory, claims ``--keys`` keys (2,000,000) that stay
in flight, and times every hold of the store lock by the thread that runs:

- a checkpoint whose aged scan finds every claim held longer than half the
  front window (the store's clock is moved on by a front window),
- the sweep's search for abandoned claims when none is (``_release_abandoned``
  at the present),
- that search when every claim is (leases run out, past the exact window):
  every claim released, in as many steps as the scan takes.

Prints, per run, the longest and the median hold and the sum of holds in ms, and
their number.
Only relative figures of one run mean anything on a shared machine::

    .venv/bin/python -m benchmarks.store_scan_locks --keys 2000000 --runs 3
    .venv/bin/python -m benchmarks.store_scan_locks --switch-interval 0.0005
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

import dedupcore.store.maintenance as maintenance
from dedupcore.store import DedupStore


class TimedLock:
    """The store's RLock, timing each outermost hold by any thread."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.depth = threading.local()
        self.holds: list[float] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = bool(self.inner.acquire(blocking, timeout))
        if got:
            depth = getattr(self.depth, "n", 0)
            if depth == 0:
                self.depth.since = time.perf_counter()
            self.depth.n = depth + 1
        return got

    def release(self) -> None:
        self.depth.n -= 1
        if self.depth.n == 0:
            self.holds.append(time.perf_counter() - self.depth.since)
        self.inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def timed(store: DedupStore, run: Any) -> tuple[float, float, float, int]:
    """(longest hold ms, median hold ms, sum of holds ms, holds) of the store lock while
    ``run()`` runs."""
    inner = store._lock
    lock = TimedLock(inner)
    store._lock = lock  # type: ignore[assignment]
    try:
        run()
    finally:
        store._lock = inner
    holds = sorted(lock.holds)
    return holds[-1] * 1e3, holds[len(holds) // 2] * 1e3, sum(holds) * 1e3, len(holds)


def one_run(keys: int, batch: int) -> dict[str, tuple[float, float, float, int]]:
    root = Path(tempfile.mkdtemp(prefix="dc-scan-"))
    store = DedupStore.open(
        root / "store",
        durability="power-loss-unsafe",
        checkpoint_records=1 << 40,
        checkpoint_interval=1e9,
        sweep_interval=1e9,
        map_size=4 << 30,
    )
    try:
        for start in range(0, keys, batch):
            store.claim_many(
                [b"k%d" % i for i in range(start, min(keys, start + batch))],
                namespace="scan",
                lease=1.0,
            )
        store.checkpoint()  # the claims go to LMDB; they stay in the table (in flight)
        store.claim_many([b"one more"], namespace="scan")
        out: dict[str, tuple[float, float, float, int]] = {}
        ahead = maintenance.front_window(store.config)
        real = maintenance.time
        maintenance.time = types.SimpleNamespace(  # type: ignore[assignment]
            time=lambda: real.time() + ahead,
            monotonic=real.monotonic,
            sleep=real.sleep,
        )
        try:
            store._aged_scan = -float("inf")
            out["checkpoint, all aged"] = timed(store, store._checkpoint)
        finally:
            maintenance.time = real
        out["sweep scan, none abandoned"] = timed(
            store, lambda: store._release_abandoned(time.time())
        )
        time.sleep(1.1)  # every lease ran out
        later = time.time() + store.config.longest_exact_window() + 1
        out["sweep scan, all abandoned"] = timed(store, lambda: store._release_abandoned(later))
        return out
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=sys.getswitchinterval(),
        help="the GIL's switch interval (the daemon runs at 0.0005: smaller steps)",
    )
    args = parser.parse_args()
    sys.setswitchinterval(args.switch_interval)
    for run in range(args.runs):
        for what, (longest, median, total, holds) in one_run(args.keys, args.batch).items():
            print(
                f"run {run + 1}: {what:28} longest hold {longest:8.2f} ms, median "
                f"{median:6.2f} ms, holds {holds:5d}, sum {total:9.1f} ms"
            )


if __name__ == "__main__":
    main()
