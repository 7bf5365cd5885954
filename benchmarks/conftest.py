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
from dataclasses import asdict, dataclass
from pathlib import Path

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
