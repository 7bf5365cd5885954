"""Shared keys and sizes of the Bloom benchmarks.

Every benchmark of one run probes the same keys, generated once per session
from fixed seeds, so that dedupcore and its peers are compared on identical
input in the same run (this machine is shared and noisy: only ratios taken
within one run are meaningful).

Sizes come from the environment:

``DEDUPCORE_BENCH_N``      keys per batch benchmark and filter capacity (10_000_000)
``DEDUPCORE_BENCH_BIG``    pre-hashed uint64 keys of the memory-bound benchmark (100_000_000)
``DEDUPCORE_BENCH_PURE_N`` keys for the pure-Python pybloom-live (200_000)
``DEDUPCORE_BENCH_FPR_N``  absent keys of the false-positive measurement (1_000_000)
``DEDUPCORE_BENCH_SEED``   seed of every generated key set (20240601)
"""

from __future__ import annotations

import os
import random
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULTS_DIR.mkdir(exist_ok=True)

KEY_BYTES = 16
ERROR_RATE = 0.001


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").replace("_", "").strip()
    if not raw:
        return default
    value = int(raw)
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


@dataclass(frozen=True)
class BenchConfig:
    n: int
    big: int
    pure_n: int
    fpr_n: int
    seed: int
    error_rate: float = ERROR_RATE
    key_bytes: int = KEY_BYTES


CONFIG = BenchConfig(
    n=_env_int("DEDUPCORE_BENCH_N", 10_000_000),
    big=_env_int("DEDUPCORE_BENCH_BIG", 100_000_000),
    pure_n=_env_int("DEDUPCORE_BENCH_PURE_N", 200_000),
    fpr_n=_env_int("DEDUPCORE_BENCH_FPR_N", 1_000_000),
    seed=_env_int("DEDUPCORE_BENCH_SEED", 20240601),
)


def random_keys(count: int, seed: int) -> list[bytes]:
    """``count`` random 16-byte keys, the same for the same seed."""
    buf = random.Random(seed).randbytes(KEY_BYTES * count)
    return [buf[i : i + KEY_BYTES] for i in range(0, KEY_BYTES * count, KEY_BYTES)]


def pytest_report_header(config: pytest.Config) -> str:
    return "dedupcore bench: " + ", ".join(f"{k}={v}" for k, v in asdict(CONFIG).items())


def pytest_benchmark_update_json(config, benchmarks, output_json):  # type: ignore[no-untyped-def]
    output_json["dedupcore_bench"] = asdict(CONFIG)


@pytest.fixture(scope="session")
def cfg() -> BenchConfig:
    return CONFIG


@pytest.fixture(scope="session")
def keys(cfg: BenchConfig) -> list[bytes]:
    """N keys that are added to every filter (the present keys)."""
    return random_keys(cfg.n, cfg.seed)


@pytest.fixture(scope="session")
def absent_keys(cfg: BenchConfig) -> list[bytes]:
    """N keys never added (a different seed; a 128-bit collision is not a concern)."""
    return random_keys(cfg.n, cfg.seed + 1)


@pytest.fixture(scope="session")
def fpr_keys(cfg: BenchConfig) -> list[bytes]:
    """The absent keys of the false-positive-rate measurement."""
    return random_keys(cfg.fpr_n, cfg.seed + 2)


# -- what every store/daemon/tier benchmark records beside its figures ------------------

REPO = Path(__file__).resolve().parent.parent
_LOAD_AT_START: list[float] = []


@pytest.fixture(autouse=True)
def _load_average() -> None:
    """The 1-minute load average when each benchmark starts (a noisy-machine hint)."""
    _LOAD_AT_START[:] = [os.getloadavg()[0]]


def git_provenance() -> dict[str, Any]:
    """The commit measured and the files of dedupcore/ and ext/ changed since it."""
    info: dict[str, Any] = {}
    try:
        info["git_rev"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "dedupcore", "ext"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        info["git_dirty"] = sorted(line[3:] for line in dirty if line.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def record_info(
    benchmark: Any, *, library: str, operation: str, n_keys: int, call: str, **extra: Any
) -> dict[str, Any]:
    """Writes what identifies a benchmark into its extra_info (with the load average
    at its start and end); returns the dict for the caller's own figures."""
    info: dict[str, Any] = benchmark.extra_info
    info.update(
        library=library,
        operation=operation,
        n_keys=n_keys,
        call=call,
        loadavg_1min=[*_LOAD_AT_START, os.getloadavg()[0]],
        **extra,
    )
    return info
