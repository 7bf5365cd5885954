"""SqlStore partitioned by event time, on the machine's PostgreSQL and MariaDB.

Every test gets tables of its own (a random name, dropped afterwards). Time
is the store's injected ``clock`` and the event times passed with the claims;
nothing sleeps. docs/sql-partitions.md describes what is checked here.
"""

from __future__ import annotations

import datetime
import multiprocessing
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.config import Retention
from dedupcore.errors import ConflictError, SchemaError, StaleTokenError
from dedupcore.ids import pack
from dedupcore.sql import PartitionDroppedError, SqlStore
from dedupcore.stack import TieredStore
from dedupcore.tiers.archive import ColdArchive
from tests.support.fakes import FakeClock
from tests.support.servers import SERVERS, require_server
from tests.support.stores import SqlTable

NS = "orders/billing"
DAY = 86400
T0 = 1_764_547_200  # 2025-12-01T00:00:00Z, a day boundary
WINDOW = Retention(exact_window=2 * DAY)


def partitioned(engine: SqlTable, clock: FakeClock, **options: Any) -> SqlStore:
    """A store on ``engine``'s table, partitioned by day, on the test's clock and window."""
    return engine.store(**{"partition": "day", "retention": WINDOW, "clock": clock, **options})


@pytest.fixture(params=("postgresql", "mysql"))
def engine(request: pytest.FixtureRequest) -> Iterator[SqlTable]:
    table = f"dedup_p_{uuid.uuid4().hex[:12]}"
    if request.param == "postgresql":
        require_server("postgresql")
        eng = SqlTable("postgresql", SERVERS.postgresql, table)
    else:
        require_server("mariadb")
        eng = SqlTable("mysql", SERVERS.mariadb, table)
    yield eng
    eng.drop()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0 + DAY / 2)


@pytest.fixture
def store(engine: SqlTable, clock: FakeClock) -> Iterator[SqlStore]:
    with partitioned(engine, clock) as s:
        s.init_schema()
        yield s


def test_init_creates_the_window_back_and_partitions_ahead(store: SqlStore) -> None:
    # The exact window (2 days) plus the tolerance back from the clock, 3 days ahead.
    assert store.partitions() == [T0 + i * DAY for i in range(-2, 4)]
    assert store.horizon() == T0 - 2 * DAY
    store.init_schema()  # idempotent
    assert store.partitions() == [T0 + i * DAY for i in range(-2, 4)]


def test_redelivery_on_a_later_day_stays_duplicate(store: SqlStore, clock: FakeClock) -> None:
    event = T0 + 3600
    c = store.claim("m1", namespace=NS, event_time=event)
    assert (c.outcome, c.token) == (Outcome.NEW, 1)
    store.complete("m1", c.token, namespace=NS, result={"ok": 1})
    clock.now = T0 + DAY + 7200  # redelivered the next day: same event time, same partition
    again = store.claim("m1", namespace=NS, event_time=event)
    assert (again.outcome, again.token, again.result) == (Outcome.DUPLICATE, 1, {"ok": 1})
    # An aware datetime is the same event time.
    as_dt = datetime.datetime.fromtimestamp(event, datetime.timezone.utc)
    assert store.claim("m1", namespace=NS, event_time=as_dt).outcome is Outcome.DUPLICATE
    rec = store.get("m1", namespace=NS)
    assert rec is not None and rec.result == {"ok": 1}


def test_the_time_inside_an_id_places_the_key(store: SqlStore, clock: FakeClock) -> None:
    key = pack(1, (T0 + DAY - 5) * 1000, 0, 7)  # 5 s before a boundary
    c = store.claim(key, namespace=NS)
    assert c.outcome is Outcome.NEW
    store.complete(key, c.token, namespace=NS)
    clock.now = T0 + 2 * DAY
    assert store.claim(key, namespace=NS).outcome is Outcome.DUPLICATE
    # Its text form is the same id, hence the same time (a different key, though).
    assert store.claim(key.hex(), namespace=NS).outcome is Outcome.NEW
    with pytest.raises(ValueError, match="no event time for key"):
        store.claim("not-an-id", namespace=NS)


def test_producer_retry_across_a_boundary_within_tolerance(store: SqlStore) -> None:
    boundary = T0 + DAY
    first = store.claim("r1", namespace=NS, event_time=boundary - 10, owner="a")
    assert first.outcome is Outcome.NEW
    # The retry carries an event time 20 s later, in the next day's partition.
    assert store.claim("r1", namespace=NS, event_time=boundary + 10).outcome is Outcome.IN_PROGRESS
    store.complete("r1", first.token, namespace=NS, result="done")
    retry = store.claim("r1", namespace=NS, event_time=boundary + 10)
    assert (retry.outcome, retry.result) == (Outcome.DUPLICATE, "done")
    # The other way round, at the edge of the tolerance (300 s), in one batch with others.
    late = store.claim("r2", namespace=NS, event_time=boundary + 290)
    store.complete("r2", late.token, namespace=NS)
    got = store.claim_many(
        ["r2", "r3"], namespace=NS, event_times=[boundary - 10, boundary - 10], owner="w"
    )
    assert [c.outcome for c in got] == [Outcome.DUPLICATE, Outcome.NEW]
    # The owner gets its claim back across the boundary, and completes the one row.
    again = store.claim("r3", namespace=NS, event_time=boundary + 100, owner="w")
    assert (again.outcome, again.token) == (Outcome.NEW, got[1].token)
    store.complete("r3", again.token, namespace=NS, result=3)
    dup = store.claim("r3", namespace=NS, event_time=boundary - 100)
    assert (dup.outcome, dup.result) == (Outcome.DUPLICATE, 3)


def test_hour_partitions_and_a_sweep(engine: SqlTable, clock: FakeClock) -> None:
    hour = 3600
    with partitioned(engine, clock, partition="hour", partition_tolerance=60) as s:
        s.init_schema()
        # The window (2 days) plus the tolerance back, 3 hours ahead.
        assert s.partitions()[0] == T0 - 2 * DAY + 11 * hour
        assert s.partitions()[-1] == T0 + 15 * hour
        boundary = T0 + 11 * hour
        c = s.claim("h1", namespace=NS, event_time=boundary - 20)
        assert s.claim("h1", namespace=NS, event_time=boundary + 20).outcome is (
            Outcome.IN_PROGRESS
        )
        s.complete("h1", c.token, namespace=NS)
        assert s.claim("h1", namespace=NS, event_time=boundary + 20).outcome is (Outcome.DUPLICATE)
        # 100 s apart across the boundary: past the 60 s tolerance, another message.
        assert s.claim("h1", namespace=NS, event_time=boundary + 80).outcome is Outcome.NEW
        clock.now = T0 + 3 * DAY
        assert s.sweep(clock.now) == 2  # the two rows of h1 went with their hours
        assert s.horizon() == T0 + DAY - hour  # floor(3 d - 2 d - 60 s) in hours
        with pytest.raises(PartitionDroppedError):
            s.claim("h2", namespace=NS, event_time=T0 + DAY - hour - 1)
        assert s.claim("h2", namespace=NS, event_time=T0 + DAY).outcome is Outcome.NEW


def test_beyond_tolerance_across_a_boundary_is_another_message(store: SqlStore) -> None:
    boundary = T0 + DAY
    c = store.claim("b1", namespace=NS, event_time=boundary - 10)
    store.complete("b1", c.token, namespace=NS)
    # 410 s apart across the boundary: [B + 100, B + 700] touches only the later day.
    other = store.claim("b1", namespace=NS, event_time=boundary + 400)
    assert (other.outcome, other.token) == (Outcome.NEW, 1)
    # A lookup is by partition, not by distance: from B + 10 both days are looked in,
    # and the processed row answers although it is now the in-progress one's twin.
    assert store.claim("b1", namespace=NS, event_time=boundary + 10).outcome is (Outcome.DUPLICATE)
    store.complete("b1", other.token, namespace=NS)
    c = store.claim("b3", namespace=NS, event_time=boundary - 400)
    store.complete("b3", c.token, namespace=NS)
    assert store.claim("b3", namespace=NS, event_time=boundary + 10).outcome is (
        Outcome.DUPLICATE
    )  # 410 s apart, but B + 10's interval reaches back into the earlier day
    # Within one partition the event time does not matter: one row per key and partition.
    c = store.claim("b2", namespace=NS, event_time=T0 + 100)
    store.complete("b2", c.token, namespace=NS)
    assert store.claim("b2", namespace=NS, event_time=T0 + DAY - 1000).outcome is (
        Outcome.DUPLICATE
    )


def test_a_renewal_finds_the_claim_in_progress_among_partitions(store: SqlStore) -> None:
    boundary = T0 + DAY
    c = store.claim("e1", namespace=NS, event_time=boundary - 400)
    store.complete("e1", c.token, namespace=NS)
    # Another message of the same key, in the next day's partition, with the same token.
    other = store.claim("e1", namespace=NS, event_time=boundary + 400, lease=0.2, owner="a")
    assert (other.outcome, other.token) == (Outcome.NEW, c.token)
    time.sleep(0.5)  # the first lease runs out on the server's clock (not a synchronization)
    store.extend("e1", other.token, namespace=NS, lease=600.0)
    # Renewed in its own partition: a claim there finds it held, not run out.
    busy = store.claim("e1", namespace=NS, event_time=boundary + 400, owner="b")
    assert busy.outcome is Outcome.IN_PROGRESS
    store.complete("e1", other.token, namespace=NS)
    with pytest.raises(StaleTokenError, match="cannot be extended"):
        store.extend("e1", other.token, namespace=NS)


def test_mostly_duplicate_batches_across_a_boundary(store: SqlStore) -> None:
    boundary = T0 + DAY
    keys = [f"d{i}" for i in range(20)]
    first = [boundary - 30.0 + i for i in range(20)]  # both sides of the boundary
    claims = store.claim_many(keys, namespace=NS, event_times=first, fingerprints=[b"f"] * 20)
    store.complete_many([(c.key, c.token, c.key) for c in claims], namespace=NS)
    retry = [t + 25 for t in first]  # retried with later event times, some across it
    for _ in range(3):  # DUPLICATE batches: the store switches to reading them first
        got = store.claim_many(keys, namespace=NS, event_times=retry)
        assert [(c.outcome, c.result) for c in got] == [(Outcome.DUPLICATE, k) for k in keys]
    assert store.stats()["duplicate"] == 60
    with pytest.raises(ConflictError):
        store.claim_many(keys, namespace=NS, event_times=retry, fingerprints=[b"g"] * 20)
    mixed = store.claim_many([*keys, "d-new"], namespace=NS, event_times=[*retry, boundary])
    assert [c.outcome for c in mixed] == [Outcome.DUPLICATE] * 20 + [Outcome.NEW]


def test_takeover_release_and_stale_tokens_in_a_partition(
    engine: SqlTable, store: SqlStore
) -> None:
    c = store.claim("t1", namespace=NS, event_time=T0 + 50)
    assert store.claim("t1", namespace=NS, event_time=T0 + 50).outcome is Outcome.IN_PROGRESS
    # The lease runs out: moved an hour back on the server.
    hour = "interval '1 hour'" if engine.name == "postgresql" else "INTERVAL 1 HOUR"
    engine.execute(f"UPDATE {engine.table} SET lease_until = lease_until - {hour}")
    taken = store.claim("t1", namespace=NS, event_time=T0 + 50)
    assert (taken.outcome, taken.token, taken.takeover) == (Outcome.NEW, 2, True)
    with pytest.raises(StaleTokenError):
        store.complete("t1", c.token, namespace=NS)
    store.release("t1", taken.token, namespace=NS)
    again = store.claim("t1", namespace=NS, event_time=T0 + 50)
    assert (again.outcome, again.token) == (Outcome.NEW, 3)


def test_drop_copies_processed_keys_first_and_refuses_old_event_times(
    engine: SqlTable, store: SqlStore, clock: FakeClock
) -> None:
    old = store.claim_many(["o1", "o2", "o3"], namespace=NS, event_times=[T0 - DAY + 5] * 3)
    store.complete_many([("o1", old[0].token), ("o2", old[1].token)], namespace=NS)  # o3 open
    live = store.claim("l1", namespace=NS, event_time=T0 + DAY + 5)
    store.complete("l1", live.token, namespace=NS)
    seen: list[tuple[str, list[bytes], list[int]]] = []

    def copy(namespace: str, keys: list[bytes]) -> None:
        # Called before the drop: the partition is still there.
        seen.append((namespace, sorted(keys), store_partitions()))

    def store_partitions() -> list[int]:
        with partitioned(engine, clock) as other:
            return other.partitions()

    clock.now = T0 + 3 * DAY + 3600  # T0 - 1 day is now past 2 days + 300 s
    assert store.drop_partitions(before_delete=copy) == 3  # the rows of the dropped partitions
    # The days ahead were made, T0 - 2 d (empty) went; T0 - 1 d was there during its copy.
    assert seen == [(NS, [b"o1", b"o2"], [T0 + i * DAY for i in range(-1, 7)])]
    assert store.horizon() == T0 + DAY
    assert store.partitions() == [T0 + i * DAY for i in range(1, 7)]
    assert store.stats()["partitions_dropped"] == 3
    with pytest.raises(PartitionDroppedError, match="dropped partition"):
        store.claim("o1", namespace=NS, event_time=T0 - DAY + 5)
    with pytest.raises(PartitionDroppedError):  # a new key there has nowhere to go either
        store.claim("o9", namespace=NS, event_time=T0 - DAY + 5)
    assert store.claim("l1", namespace=NS, event_time=T0 + DAY + 5).outcome is (Outcome.DUPLICATE)
    assert store.drop_partitions(before_delete=copy) == 0  # nothing more to drop
    assert len(seen) == 1


def test_a_failed_copy_keeps_the_partition_for_the_next_drop(
    store: SqlStore, clock: FakeClock
) -> None:
    c = store.claim("f1", namespace=NS, event_time=T0 - DAY + 5)
    store.complete("f1", c.token, namespace=NS)
    clock.now = T0 + 3 * DAY

    def fail(namespace: str, keys: list[bytes]) -> None:
        raise OSError("archive disk full")

    with pytest.raises(OSError, match="disk full"):
        store.drop_partitions(before_delete=fail)
    assert T0 - DAY in store.partitions()  # still there, frozen behind the horizon
    # Its processed key still answers, and the event time is refused for new work.
    # A lookup from the live neighbour still finds its processed key.
    assert store.claim("f1", namespace=NS, event_time=T0 + 5).outcome is Outcome.DUPLICATE
    copied: list[bytes] = []
    store.drop_partitions(before_delete=lambda ns, keys: copied.extend(keys))
    assert copied == [b"f1"]
    assert T0 - DAY not in store.partitions()


def test_a_stack_with_an_archive_answers_dropped_keys(engine: SqlTable, clock: FakeClock) -> None:
    authority = partitioned(engine, clock)
    authority.init_schema()
    retention = Retention(exact_window=2 * DAY, cold_window=30 * DAY)
    stack = TieredStore(authority, archive=ColdArchive(None, [30 * DAY]), retention=retention)
    key = pack(1, (T0 - DAY + 60) * 1000, 0, 1)
    c = stack.claim(key, namespace=NS)
    stack.complete(key, c.token, namespace=NS)
    clock.now = T0 + 3 * DAY
    assert stack.sweep(now=clock.now) == 1  # copied into the archive, partition dropped
    hit = stack.claim(key, namespace=NS)
    assert (hit.outcome, hit.exact) == (Outcome.DUPLICATE, False)
    other = pack(1, (T0 - DAY + 60) * 1000, 1, 1)  # same time, never claimed
    with pytest.raises(PartitionDroppedError):
        stack.claim(other, namespace=NS)
    stack.close()


def test_bad_arguments_raise(engine: SqlTable, clock: FakeClock, store: SqlStore) -> None:
    for bad, exc in (
        ({"partition": "week"}, ValueError),
        ({"partition_tolerance": -1}, ValueError),
        ({"partition_tolerance": DAY}, ValueError),
        ({"partition_tolerance": "5"}, TypeError),
        ({"partitions_ahead": 0}, ValueError),
        ({"key_time": 3}, TypeError),
        ({"clock": 3}, TypeError),
    ):
        with pytest.raises(exc):
            partitioned(engine, clock, **bad)
    with pytest.raises(ValueError, match="not partitioned"):
        SqlStore.from_url("sqlite:///unused.db", partition="day")
    for value, exc in (
        ("1764547200", TypeError),
        (True, TypeError),
        (-1.0, ValueError),
        (float("nan"), ValueError),
        (datetime.datetime(2025, 12, 1), ValueError),  # naive
    ):
        with pytest.raises(exc):
            store.claim("x", namespace=NS, event_time=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 values for 1 keys"):
        store.claim_many(["x"], namespace=NS, event_times=[T0, T0])
    with pytest.raises(TypeError):
        store.claim_many(["x"], namespace=NS, event_times=T0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ahead of the store's clock"):
        store.claim("x", namespace=NS, event_time=T0 + 30 * DAY)
    with pytest.raises(ValueError, match="not partitioned"):
        SqlStore.from_url(engine.url, table=engine.table).drop_partitions()
    for call, exc in (
        (lambda: store.ensure_partitions("tomorrow"), TypeError),  # type: ignore[arg-type]
        (lambda: store.ensure_partitions(-5.0), ValueError),
        (lambda: store.drop_partitions(limit=0), ValueError),
        (lambda: store.drop_partitions(before_delete=5), TypeError),  # type: ignore[arg-type]
        (lambda: store.drop_partitions(now=float("inf")), ValueError),
    ):
        with pytest.raises(exc):
            call()
    assert store.horizon() == T0 - 2 * DAY  # nothing moved
    assert store.get("x", namespace=NS) is None  # nothing was claimed


def test_a_store_with_another_span_or_kind_is_refused(engine: SqlTable, clock: FakeClock) -> None:
    with partitioned(engine, clock) as s:
        s.init_schema()
    with (
        partitioned(engine, clock, partition="hour") as s,
        pytest.raises(SchemaError, match="86400"),
    ):
        s.init_schema()
    with (
        partitioned(engine, clock, partition=None) as s,
        pytest.raises(SchemaError, match="exists with"),
    ):
        s.init_schema()
    flat = f"{engine.table}_flat"
    with SqlStore.from_url(engine.url, table=flat) as s:
        s.init_schema()
    try:
        with (
            partitioned(engine, clock, table=flat) as s,
            pytest.raises(SchemaError, match="without"),
        ):
            s.init_schema()
    finally:
        engine.execute(f"DROP TABLE IF EXISTS {flat}")
        engine.execute(f"DROP TABLE IF EXISTS {flat}_parts")
        engine.execute(f"DROP TABLE IF EXISTS {flat}_edge")


def test_an_unpartitioned_table_ignores_event_times(engine: SqlTable, clock: FakeClock) -> None:
    with SqlStore.from_url(engine.url, table=engine.table) as s:
        s.init_schema()
        c = s.claim("u1", namespace=NS, event_time=T0)
        assert s.claim("u1", namespace=NS, event_time=T0 + 5 * DAY).outcome is (Outcome.IN_PROGRESS)
        s.complete("u1", c.token, namespace=NS)
        with pytest.raises(TypeError):
            s.claim("u1", namespace=NS, event_time="now")  # type: ignore[arg-type]


# -- races between real processes -----------------------------------------------------


def _claimer(
    url: str, table: str, keys: list[str], times: list[float], now: float, start: Any, q: Any
) -> None:
    """Claims and completes ``keys`` in batches; puts (NEW keys, errors)."""
    store = SqlStore.from_url(
        url, table=table, partition="day", retention=WINDOW, clock=lambda: now
    )
    new: list[str] = []
    errors: list[str] = []
    start.wait(60)
    for i in range(0, len(keys), 50):
        try:
            claims = store.claim_many(keys[i : i + 50], namespace=NS, event_times=times[i : i + 50])
            done = [(c.key, c.token) for c in claims if c.outcome is Outcome.NEW]
            store.complete_many(done, namespace=NS)
            new += [str(k) for k, _ in done]
        except Exception as exc:  # reported to the test, which fails on any
            errors.append(f"{type(exc).__name__}: {exc}")
    q.put((new, errors))
    store.close()


def test_processes_across_a_boundary_get_one_new_per_key(
    engine: SqlTable, clock: FakeClock
) -> None:
    with partitioned(engine, clock) as s:
        s.init_schema()
    boundary = T0 + DAY
    keys = [f"x{i}" for i in range(1500)]
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    start = ctx.Barrier(2)
    # Each message's two deliveries carry event times 10 s apart across the boundary.
    sides = ([boundary - 5] * len(keys), [boundary + 5] * len(keys))
    procs = [
        ctx.Process(
            target=_claimer,
            args=(engine.url, engine.table, order, side, clock.now, start, q),
        )
        for order, side in ((keys, sides[0]), (keys[::-1], sides[1]))
    ]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [e for _, e in results] == [[], []]
    winners = [k for new, _ in results for k in new]
    assert sorted(winners) == sorted(keys)  # exactly one NEW per key
    with partitioned(engine, clock) as s:
        got = s.claim_many(keys, namespace=NS, event_times=sides[1])
        assert {c.outcome for c in got} == {Outcome.DUPLICATE}


def test_dropping_while_another_process_claims_loses_nothing(
    engine: SqlTable, clock: FakeClock
) -> None:
    with partitioned(engine, clock) as s:
        s.init_schema()
        # Old partitions full of processed keys, to be dropped.
        for day in (-2, -1):
            ks = [f"old{day}-{i}" for i in range(500)]
            claims = s.claim_many(ks, namespace=NS, event_times=[T0 + day * DAY + 60.0] * 500)
            s.complete_many([(c.key, c.token) for c in claims], namespace=NS)
    clock.now = T0 + 2 * DAY + 600  # T0 - 2 d and T0 - 1 d are past the window
    # Live keys: a third just after the new horizon (their lookups reach into the
    # partition being dropped), the rest in the middle of a live day.
    keys = [f"live{i}" for i in range(1500)]
    times = [T0 + float(i % 200) if i % 3 == 0 else T0 + DAY + i for i in range(len(keys))]
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    start = ctx.Barrier(2)
    proc = ctx.Process(
        target=_claimer, args=(engine.url, engine.table, keys, times, clock.now, start, q)
    )
    proc.start()
    copied: list[bytes] = []
    with partitioned(engine, clock) as dropper:
        start.wait(60)  # the claimer is connected and about to start
        dropped = dropper.drop_partitions(before_delete=lambda ns, ks: copied.extend(ks), limit=100)
    new, errors = q.get(timeout=300)
    proc.join(60)
    assert proc.exitcode == 0
    assert errors == []
    assert dropped == 1000 and len(copied) == 1000
    assert sorted(new) == sorted(keys)
    with partitioned(engine, clock) as s:
        assert s.horizon() == T0
        got = s.claim_many(keys, namespace=NS, event_times=times)
        assert {c.outcome for c in got} == {Outcome.DUPLICATE}
