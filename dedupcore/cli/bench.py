"""``dedupcore bench``: runs the benchmark suite of a source checkout and prints the comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def run_bench(*, quick: bool, daemon: bool, extra: Sequence[str]) -> int:
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks").is_dir():
        print(
            "dedupcore bench runs from a source checkout (benchmarks/ not found)", file=sys.stderr
        )
        return 2
    env = dict(os.environ)
    if quick:
        env.setdefault("DEDUPCORE_BENCH_N", "200000")
        env.setdefault("DEDUPCORE_BENCH_BIG", "2000000")
        env.setdefault("DEDUPCORE_BENCH_DAEMON_N", "50000")
        env.setdefault("DEDUPCORE_BENCH_DAEMON_SINGLE", "2000")
    # The daemon's comparison runs 8 client processes against one.
    env.setdefault("DEDUPCORE_BENCH_DAEMON_PROCS", "8")
    _note_redis(env.get("DEDUPCORE_BENCH_REDIS_URL", "redis://127.0.0.1:6379"))
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    out = results / ("daemon.json" if daemon else "bloom.json")
    suite = "benchmarks/test_daemon.py" if daemon else "benchmarks"
    cmd = [sys.executable, "-m", "pytest", suite, "-q", f"--benchmark-json={out}", *extra]
    rc = subprocess.call(cmd, cwd=root, env=env)
    if rc != 0:
        return rc
    if not daemon:
        rc = subprocess.call(
            [sys.executable, "-m", "benchmarks.report", "--json", str(out)], cwd=root, env=env
        )
        if rc != 0:
            return rc
    return subprocess.call(
        [sys.executable, "-m", "benchmarks.report_daemon", "--json", str(out)], cwd=root, env=env
    )


def _note_redis(url: str) -> None:
    """Says so when no Redis answers at ``url`` (its comparisons are then skipped)."""
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except Exception as exc:
        print(
            f"dedupcore bench: no Redis at {url} ({exc}); the comparisons with Redis are "
            "skipped: start redis-server or set DEDUPCORE_BENCH_REDIS_URL",
            file=sys.stderr,
        )
