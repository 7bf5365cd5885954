"""Shared fixtures of dedupcore's tests."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# The shared base of every suite (tests/support/): its fixtures are seen everywhere, and
# its asserts are rewritten as in test modules.
pytest.register_assert_rewrite("tests.support")
pytest_plugins = [
    "tests.support.servers",
    "tests.support.daemon",
    "tests.support.stores",
]

# Correctness only: no per-example deadline (the machine is shared and timing drifts).
settings.register_profile(
    "dedupcore",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("dedupcore")


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded numpy generator, so a failure reproduces."""
    return np.random.default_rng(20240601)


@pytest.fixture
def make_keys() -> Callable[..., list[bytes]]:
    """``make_keys(n, prefix="k")`` -> n distinct bytes keys ``prefix-0 .. prefix-(n-1)``."""

    def make(n: int, prefix: str = "k", start: int = 0) -> list[bytes]:
        head = prefix.encode() + b"-"
        return [head + b"%d" % i for i in range(start, start + n)]

    return make


@pytest.fixture
def block_filter() -> Callable[..., object]:
    """``block_filter(nblocks, seed=0)`` -> an empty native filter of exactly nblocks blocks."""
    from dedupcore import _core

    def make(nblocks: int, seed: int = 0) -> _core.BlockFilter:
        bf = _core.BlockFilter()
        bf._allocate(nblocks, seed, max(1, nblocks * 8), 0.01)
        return bf

    return make
