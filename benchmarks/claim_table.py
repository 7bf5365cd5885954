"""The claim table alone (``_engine.ClaimTable``, no store, no log): fresh digests
claimed in batches, each batch timed in its three steps as the store makes them
(``missing``, the decision, ``apply``), then lookups of absent and of present
digests in the full table::

    .venv/bin/python -m benchmarks.claim_table --keys 2000000

Figures in docs/performance.md ("A tag byte per slot") and docs/engine.md
("Growing"). Seeded: every run claims the same digests.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from dedupcore import _engine

_LABELS = ("NEW", "DUPLICATE", "IN_PROGRESS")


def _claim(table: Any, digests: bytes, n: int, now_w: float, now_m: float) -> None:
    claims, *_rest = table.claim(
        digests, list(range(n)), "bench", 1, 30.0, None, None, None,
        now_w, now_m, lambda *a: a, _LABELS, lambda x: x,
    )  # fmt: skip
    if claims is None:
        raise AssertionError("a batch of fresh digests was refused")


def _lookup_ns(table: Any, digests: bytes, runs: int = 3) -> float:
    """The fastest of ``runs`` lookups of every digest, in ns per digest."""
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        table.missing(digests)
        best = min(best, time.perf_counter() - start)
    return best / (len(digests) // 16) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--lookups", type=int, default=1_000_000)
    args = parser.parse_args()
    n, batch = args.keys, args.batch
    rng = random.Random(5)
    digests = rng.randbytes(16 * n)
    table = _engine.ClaimTable()
    now_w, now_m = 1_700_000_000.0, 1000.0
    spent = [0.0, 0.0, 0.0]  # missing, the decision, apply
    for lsn, i in enumerate(range(0, n, batch), start=1):
        part = digests[16 * i : 16 * min(n, i + batch)]
        t0 = time.perf_counter()
        table.missing(part)
        t1 = time.perf_counter()
        _claim(table, part, len(part) // 16, now_w, now_m)
        t2 = time.perf_counter()
        table.apply(lsn)
        t3 = time.perf_counter()
        spent[0] += t1 - t0
        spent[1] += t2 - t1
        spent[2] += t3 - t2
    if len(table) != n:
        raise AssertionError(f"{len(table)} records held after {n} fresh claims")
    absent = rng.randbytes(16 * args.lookups)
    picks = rng.sample(range(n), min(n, args.lookups))
    present = b"".join(digests[16 * k : 16 * k + 16] for k in picks)
    missing, decide, apply = (x / n * 1e9 for x in spent)
    print(
        f"{n} fresh digests in batches of {batch}: missing {missing:.0f}, decision "
        f"{decide:.0f}, apply {apply:.0f}, all {missing + decide + apply:.0f} ns per key; "
        f"then lookups of absent digests {_lookup_ns(table, absent):.0f}, of present "
        f"{_lookup_ns(table, present):.0f} ns each"
    )


if __name__ == "__main__":
    main()
