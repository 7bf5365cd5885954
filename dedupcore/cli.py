"""Command line: ``dedupcore demo``, ``dedupcore bench`` (also ``python -m dedupcore``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedupcore",
        description="Idempotent consumers: exactly-once effect over at-least-once delivery.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the demo on the embedded default")
    demo.add_argument(
        "--keys",
        type=int,
        default=1_000_000,
        help="unique messages in the simulated stream (default 1000000)",
    )
    demo.add_argument(
        "--duplicate-rate",
        type=float,
        default=0.2,
        help="fraction of deliveries that are redeliveries (default 0.2)",
    )
    demo.add_argument("--seed", type=int, default=7, help="random seed (default 7)")

    bench = sub.add_parser("bench", help="run the benchmark suite and print the comparison")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (seconds, not minutes); figures are indicative only",
    )
    bench.add_argument("pytest_args", nargs="*", help="extra arguments for pytest")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dedupcore`` command."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from dedupcore.demo import run_demo

        return run_demo(keys=args.keys, duplicate_rate=args.duplicate_rate, seed=args.seed)
    if args.command == "bench":
        return _bench(quick=args.quick, extra=args.pytest_args)
    raise AssertionError(args.command)


def _bench(*, quick: bool, extra: Sequence[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks").is_dir():
        print(
            "dedupcore bench runs from a source checkout (benchmarks/ not found)", file=sys.stderr
        )
        return 2
    env = dict(os.environ)
    if quick:
        env.setdefault("DEDUPCORE_BENCH_N", "200000")
        env.setdefault("DEDUPCORE_BENCH_BIG", "2000000")
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    out = results / "bloom.json"
    cmd = [sys.executable, "-m", "pytest", "benchmarks", "-q", f"--benchmark-json={out}", *extra]
    rc = subprocess.call(cmd, cwd=root, env=env)
    if rc != 0:
        return rc
    return subprocess.call(
        [sys.executable, "-m", "benchmarks.report", "--json", str(out)], cwd=root, env=env
    )
