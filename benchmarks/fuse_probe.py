"""What a probe of the cold archive's sealed slices costs out of cache: separate fuse
filters against one stack of the same filters, by the number of columns::

    .venv/bin/python -m benchmarks.fuse_probe --keys 100000000 --widths 1,2,4,7,8,16,24,32

A probe's cost does not depend on how a body was built, so the bodies are random
fingerprints of one geometry (the geometry of ``--keys`` keys, about 1.125 slots a
key), put into columns as a ring's sealed slices are; the probed hashes are random
too (nearly every probe a miss, as a fresh key's is). Prints the median of
``--rounds`` batches of ``--batch`` hashes, in ns per key (docs/performance.md, "100
million keys, and a billion in the cold archive"; docs/warm-tier.md, "Stacked fuse
slices").
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

import dedupcore._core as _core


def random_filter(params: tuple[int, ...], rng: np.random.Generator) -> _core.FuseFilter:
    body = rng.integers(0, 2**16, size=params[3], dtype=np.uint16)
    fuse = _core.FuseFilter.__new__(_core.FuseFilter)
    fuse._attach(body, params, params[3], copy=True)
    return fuse


def ns_per_key(probe: Callable[[np.ndarray], object], hashes: list[np.ndarray]) -> float:
    """Median ns per key of ``probe(batch)`` over the batches."""
    times = []
    for batch in hashes:
        started = time.perf_counter_ns()
        probe(batch)
        times.append((time.perf_counter_ns() - started) / len(batch))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000_000, help="keys of the geometry")
    parser.add_argument("--widths", default="1,2,4,7,8,16")
    parser.add_argument("--separate", type=int, default=7, help="separate filters probed")
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    rng = np.random.default_rng(1)
    segment, segment_count_length, slots = _core.fuse_geometry(args.keys)
    params = (1, segment, segment_count_length, slots)
    filters = [random_filter(params, rng) for _ in range(max(*widths, args.separate))]
    hashes = [rng.integers(0, 2**64, size=args.batch, dtype=np.uint64) for _ in range(args.rounds)]
    mib = slots * 2 / 2**20
    print(f"{slots:,} slots ({mib:.0f} MiB a filter), batches of {args.batch:,}")
    one = ns_per_key(filters[0].contains_many, hashes)
    print(f"one filter: {one:.1f} ns/key")
    if args.separate:
        separate = tuple(filters[: args.separate])

        def probe_separate(batch: np.ndarray) -> object:
            return _core.probe_many(separate, memoryview(batch), None, 0)

        took = ns_per_key(probe_separate, hashes)
        print(f"{args.separate} separate filters: {took:.1f} ns/key")
    for width in widths:
        stack = _core.FuseStack(params, width)
        for column in range(width):
            stack.put(column, filters[column])
            stack.set_live(column)
        took = ns_per_key(stack.contains_many, hashes)
        print(f"a stack of {width} columns: {took:.1f} ns/key")
        del stack


if __name__ == "__main__":
    main()
