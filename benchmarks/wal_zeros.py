"""What the zeros the write-ahead log writes ahead of its appends save: one durable
claim at a time on the embedded store, in rounds that alternate between the log as
it is and the log with its zero fill turned off (``Segments.zero_ahead`` a no-op, so
every commit extends the file), each round on a fresh store (dedupcore/wal/__init__.py,
"The zero-filled tail")::

    .venv/bin/python -m benchmarks.wal_zeros --rounds 6

Prints each round's p50 and p99 of one ``store.claim`` (fresh keys, ``durable``:
each claim waits for its ``fdatasync``), then the medians of the rounds of each form.
The disk is the machine's; run it on a quiet machine (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

from benchmarks._support import TMP_DIR
from dedupcore import DedupStore
from dedupcore.wal.segments import Segments

ZERO_AHEAD: Callable[[Segments, int], None] = Segments.zero_ahead


def _no_zeros(self: Segments, n: int) -> None:
    """The zero fill turned off: every commit extends the file."""


def one_round(zeros: bool, n: int) -> tuple[float, float]:
    """(p50, p99) in µs of ``n`` durable single claims on a fresh store."""
    Segments.zero_ahead = ZERO_AHEAD if zeros else _no_zeros  # type: ignore[method-assign]
    try:
        with (
            tempfile.TemporaryDirectory(prefix="dcz", dir=TMP_DIR) as root,
            DedupStore.open(root + "/data") as store,
        ):
            for i in range(200):  # warm: the first commits, the first slot pages
                store.claim(b"warm-%d" % i, namespace="zeros")
            took = []
            for i in range(n):
                key = b"k-%012d" % i
                start = time.perf_counter()
                store.claim(key, namespace="zeros")
                took.append(time.perf_counter() - start)
    finally:
        Segments.zero_ahead = ZERO_AHEAD  # type: ignore[method-assign]
    took.sort()
    return took[n // 2] * 1e6, took[int(n * 0.99)] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each form (6)")
    parser.add_argument("--claims", type=int, default=2000, help="claims per round (2000)")
    args = parser.parse_args()
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for r in range(args.rounds):
        for zeros in (False, True):
            p50, p99 = one_round(zeros, args.claims)
            results[zeros].append((p50, p99))
            form = "zeros ahead" if zeros else "extending  "
            print(f"round {r + 1} {form}: p50 {p50:7.1f} µs  p99 {p99:7.1f} µs", flush=True)
    for zeros in (False, True):
        p50s = [p for p, _ in results[zeros]]
        p99s = [p for _, p in results[zeros]]
        form = "zeros ahead" if zeros else "extending  "
        print(
            f"{form}: p50 median {statistics.median(p50s):.1f} µs "
            f"(spread {min(p50s):.1f}-{max(p50s):.1f}), p99 median "
            f"{statistics.median(p99s):.1f} µs (spread {min(p99s):.1f}-{max(p99s):.1f})"
        )


if __name__ == "__main__":
    main()
