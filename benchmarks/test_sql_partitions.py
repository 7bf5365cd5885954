"""Insert cost of a day-partitioned SqlStore as partitions accumulate (docs/sql-partitions.md).

On the machine's PostgreSQL, two tables fed the same fresh keys in the same
run: one unpartitioned ``SqlStore`` and one ``SqlStore(partition="day")``.
Day after day (the store's clock moves a day, :meth:`ensure_partitions` runs
as a sweep would, nothing is dropped: the exact window is longer than the
run), ``KEYS`` fresh keys are claimed in batches of ``BATCH`` with event
times spread over the day (so a few near each boundary take edge locks),
then completed, then (after an untimed ``ANALYZE``, as autovacuum would)
claimed again (all DUPLICATE). Each day's claims are timed; the run prints
ns/key of both for the first, middle and last days of both tables.

Opt-in, like every benchmark here (``testpaths = ["tests"]``)::

    DEDUPCORE_BENCH_PART_DAYS=10 DEDUPCORE_BENCH_PART_KEYS=20000 \\
        PYTHONPATH=. .venv/bin/pytest benchmarks/test_sql_partitions.py -s -q

``DEDUPCORE_BENCH_PART_DAYS`` days (30), ``DEDUPCORE_BENCH_PART_KEYS`` keys
per day (100_000), ``DEDUPCORE_BENCH_PART_BATCH`` keys per batch (1000),
``DEDUPCORE_BENCH_PART_PG_URL`` the server. Only outcomes are asserted.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Iterator

import pytest

from dedupcore.api import Outcome
from dedupcore.config import Retention
from dedupcore.tiers.sql import SqlStore

from .conftest import _env_int

DAY = 86400
T0 = 1_764_547_200
DAYS = _env_int("DEDUPCORE_BENCH_PART_DAYS", 30)
KEYS = _env_int("DEDUPCORE_BENCH_PART_KEYS", 100_000)
BATCH = _env_int("DEDUPCORE_BENCH_PART_BATCH", 1000)
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


def test_insert_cost_as_day_partitions_accumulate(
    tables: tuple[SqlStore, SqlStore, _Clock],
) -> None:
    flat, parted, clock = tables
    rng = random.Random(20251201)
    rows: list[tuple[int, int, float, float, float, float]] = []
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
        rows.append((day + 1, len(parted.partitions()), *t_flat, *t_parted))
    print(f"\nPostgreSQL, {KEYS} keys per day, batches of {BATCH}, claim_many only timed")
    print("ns/key: fresh keys (flat, day-partitioned), the same keys again (flat, day)")
    print("day  partitions  fresh flat  fresh day  dup flat  dup day")
    shown = sorted({1, 2, max(1, DAYS // 2), DAYS})

    def ns(t: float, n: int = KEYS) -> str:
        return f"{t / n * 1e9:.0f}"

    for day, parts, f_new, f_dup, p_new, p_dup in rows:
        if day in shown:
            print(
                f"{day:>3}  {parts:>10}  {ns(f_new):>10}  {ns(p_new):>9}  "
                f"{ns(f_dup):>8}  {ns(p_dup):>7}"
            )
    total = [ns(sum(r[j] for r in rows), KEYS * DAYS) for j in (2, 4, 3, 5)]
    print(f"all  {rows[-1][1]:>10}  {total[0]:>10}  {total[1]:>9}  {total[2]:>8}  {total[3]:>7}")
