"""Insert cost of a day-partitioned SqlStore as partitions accumulate (docs/sql-partitions.md).

On the machine's PostgreSQL, two tables fed the same fresh keys in the same
run: one unpartitioned ``SqlStore`` and one ``SqlStore(partition="day")``.
Day after day (the store's clock moves a day, :meth:`ensure_partitions` runs
as a sweep would, nothing is dropped: the exact window is longer than the
run), ``KEYS`` fresh keys are claimed in batches of ``BATCH`` with event
times spread over the day (so a few near each boundary take edge locks),
then completed, then (after an untimed ``ANALYZE``, as autovacuum would)
claimed again (all DUPLICATE). Each day's claims are timed and kept in
``extra_info``; ``python -m benchmarks.report sql-partitions`` prints ns/key of
both tables for the first, middle and last days.

Opt-in, like every benchmark here: ``DEDUPCORE_BENCH_PART_DAYS=10
DEDUPCORE_BENCH_PART_KEYS=20000 ./dev bench sql-partitions``.
``DEDUPCORE_BENCH_PART_DAYS`` days (30; ``--quick`` 3), ``DEDUPCORE_BENCH_PART_KEYS``
keys per day (100_000; 2_000), ``DEDUPCORE_BENCH_PART_BATCH`` keys per batch
(1000), ``DEDUPCORE_BENCH_PART_PG_URL`` the server. Only outcomes are asserted.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks._support import env_int, record
from dedupcore.api import Outcome
from dedupcore.config import Retention
from dedupcore.sql import SqlStore

DAY = 86400
T0 = 1_764_547_200
DAYS = env_int("DEDUPCORE_BENCH_PART_DAYS", 30, quick=3)
KEYS = env_int("DEDUPCORE_BENCH_PART_KEYS", 100_000, quick=2_000)
BATCH = env_int("DEDUPCORE_BENCH_PART_BATCH", 1000)
PG_URL = os.environ.get("DEDUPCORE_BENCH_PART_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
NS = "bench/parts"


class _Clock:
    def __init__(self) -> None:
        self.t = float(T0 + 3600)

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def tables() -> Iterator[tuple[SqlStore, SqlStore, _Clock]]:
    try:
        import psycopg

        psycopg.connect(PG_URL, connect_timeout=2).close()
    except Exception as exc:
        pytest.skip(f"PostgreSQL at {PG_URL}: {exc}")
    name = f"dcbench_{uuid.uuid4().hex[:10]}"
    clock = _Clock()
    retention = Retention(exact_window=DAY)  # no drop runs: partitions accumulate
    flat = SqlStore.from_url(PG_URL, table=f"{name}_flat", retention=retention, timeout=60)
    parted = SqlStore.from_url(
        PG_URL,
        table=f"{name}_day",
        retention=retention,
        partition="day",
        clock=clock,
        timeout=60,
    )
    flat.init_schema()
    parted.init_schema()
    yield flat, parted, clock
    flat.close()
    parted.close()
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        for suffix in ("_flat", "_day", "_day_parts", "_day_edge"):
            conn.execute(f'DROP TABLE IF EXISTS "{name}{suffix}" CASCADE')


def _analyze(table: str) -> None:
    """What autovacuum does after a while; a new table's plans depend on it."""
    import psycopg

    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'ANALYZE "{table}"')


def _day(store: SqlStore, keys: list[bytes], times: list[float] | None) -> tuple[float, float]:
    """Seconds to claim ``keys`` fresh (then completed, untimed) and again (all DUPLICATE).

    Between the two the table is analysed (untimed), as autovacuum would.
    """
    spent = [0.0, 0.0]
    for again in (False, True):
        if again:
            _analyze(store.table)
        for i in range(0, len(keys), BATCH):
            batch = keys[i : i + BATCH]
            start = time.perf_counter()
            claims = store.claim_many(
                batch, namespace=NS, event_times=None if times is None else times[i : i + BATCH]
            )
            spent[again] += time.perf_counter() - start
            want = Outcome.DUPLICATE if again else Outcome.NEW
            assert all(c.outcome is want for c in claims)
            if not again:
                store.complete_many([(c.key, c.token) for c in claims], namespace=NS)
    return spent[0], spent[1]


def _days(flat: SqlStore, parted: SqlStore, clock: _Clock) -> list[dict[str, Any]]:
    """Every day of the run: the partitions, and the seconds of each table's claims."""
    rng = random.Random(20251201)
    rows: list[dict[str, Any]] = []
    for day in range(DAYS):
        clock.t = T0 + day * DAY + 3600
        parted.ensure_partitions()  # what a sweep does each day
        keys = [rng.randbytes(16) for _ in range(KEYS)]
        times = [T0 + day * DAY + rng.random() * DAY for _ in keys]
        # Alternate which table goes first, so neither always meets a warmer cache.
        if day % 2:
            t_parted = _day(parted, keys, times)
            t_flat = _day(flat, keys, None)
        else:
            t_flat = _day(flat, keys, None)
            t_parted = _day(parted, keys, times)
        rows.append(
            {
                "day": day + 1,
                "partitions": len(parted.partitions()),
                "fresh_flat_s": t_flat[0],
                "duplicate_flat_s": t_flat[1],
                "fresh_day_s": t_parted[0],
                "duplicate_day_s": t_parted[1],
            }
        )
    return rows


def test_insert_cost_as_day_partitions_accumulate(
    benchmark: Any, tables: tuple[SqlStore, SqlStore, _Clock]
) -> None:
    """One round of DAYS days (the whole run is timed; the report reads each day's claims)."""
    benchmark.group = "sql_partitions"
    days = benchmark.pedantic(_days, args=tables, rounds=1, iterations=1)
    record(
        benchmark,
        library="dedupcore-postgresql",
        operation="sql_partitions",
        n_keys=KEYS * DAYS,
        call="SqlStore.claim_many(keys[i:i+B]) (flat) vs SqlStore(partition='day') "
        "with event_times",
        keys_per_day=KEYS,
        batch=BATCH,
        days=days,
    )
