"""What instrument() costs per call: the embedded store bare and instrumented, same run.

Two calls, on a store with ``durability="power-loss-unsafe"`` (no fdatasync,
so the wrapper's cost is not lost in the disk's): one single-key claim of a
processed key (DUPLICATE, the cheapest answer: the worst case for a relative
overhead), and a ``claim_many`` of ``DEDUPCORE_BENCH_METRICS_BATCH`` fresh keys
(1000). ``python -m benchmarks.report metrics`` prints each call's median
time bare and instrumented, and the difference. Only sanity checks are
asserted, never timings.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from benchmarks._support import env_int, random_keys, record
from dedupcore.api import ClaimAPI, Outcome
from dedupcore.metrics import Metrics, instrument
from dedupcore.store import DedupStore

NS = "bench/metrics"
BATCH = env_int("DEDUPCORE_BENCH_METRICS_BATCH", 1000)


@pytest.fixture(params=["bare", "instrumented"])
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, ClaimAPI]]:
    store = DedupStore.open(tmp_path / "data", durability="power-loss-unsafe")
    wrapped: ClaimAPI = store
    if request.param == "instrumented":
        wrapped = instrument(store, Metrics(CollectorRegistry(), region="bench"))
    yield request.param, wrapped
    store.close()


def test_duplicate_claim(benchmark: Any, api: tuple[str, ClaimAPI]) -> None:
    library, store = api
    first = store.claim(b"k", namespace=NS)
    store.complete(b"k", first.token, namespace=NS)
    c = benchmark(store.claim, b"k", namespace=NS)
    assert c.outcome is Outcome.DUPLICATE
    record(
        benchmark,
        library=f"dedupcore {library}",
        operation="claim (duplicate)",
        n_keys=1,
        call="store.claim(k)",
    )


def test_claim_many_fresh(benchmark: Any, api: tuple[str, ClaimAPI]) -> None:
    library, store = api
    keys = random_keys(BATCH * 200, seed=7)
    batches = itertools.cycle(range(200))

    def setup() -> tuple[tuple[list[bytes]], dict[str, Any]]:
        i = next(batches)
        return (keys[i * BATCH : (i + 1) * BATCH],), {"namespace": f"{NS}/{i}"}

    claims = benchmark.pedantic(store.claim_many, setup=setup, rounds=200, iterations=1)
    assert len(claims) == BATCH
    record(
        benchmark,
        library=f"dedupcore {library}",
        operation=f"claim_many ({BATCH} keys)",
        n_keys=BATCH,
        call="store.claim_many(keys)",
    )
