"""pytest's hooks for the benchmark suites; what the suites share is in benchmarks/_support.py.

``benchmarks/`` is not collected by the test run (``testpaths = ["tests"]``): a suite
runs with ``./dev bench SUITE`` (benchmarks/README.md).
"""

from __future__ import annotations

import pytest

from benchmarks._support import QUICK, SEED, note_load_start


def pytest_report_header(config: pytest.Config) -> str:
    return f"dedupcore benchmarks: seed {SEED}" + (", quick sizes" if QUICK else "")


@pytest.fixture(autouse=True)
def _load_average() -> None:
    """The 1-minute load average when each benchmark starts (a noisy-machine hint)."""
    note_load_start()
