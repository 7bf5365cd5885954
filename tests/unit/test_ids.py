"""dedupcore.ids: layout, text form, ordering, clock steps, overflow, threads, fork."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedupcore import ids
from dedupcore.ids import IdGenerator, IdParts
from tests.support.fakes import FakeClock

#: A wall clock reading in ms, where the fake clocks start.
START_MS = 1_700_000_000_000


regions = st.integers(0, ids.MAX_REGION)
times = st.integers(0, ids.MAX_TIME_MS)
seqs = st.integers(0, ids.MAX_SEQUENCE)
nodes = st.integers(0, ids.MAX_NODE)
fields = st.tuples(regions, times, seqs, nodes)


def test_layout_and_text_form() -> None:
    raw = ids.pack(0x0102, 0x030405060708, 0x090A0B0C, 0x0D0E0F10)
    assert raw == bytes(range(1, 17))
    text = ids.to_text(raw)
    assert text == "0102030405060708090a0b0c0d0e0f10"
    assert len(text) == ids.ID_TEXT_LENGTH
    assert ids.from_text(text) == raw
    assert ids.parse(text) == IdParts(0x0102, 0x030405060708, 0x090A0B0C, 0x0D0E0F10)
    assert ids.region_of(text) == 0x0102 and ids.time_of(raw) == 0x030405060708
    assert ids.sequence_of(raw) == 0x090A0B0C and ids.node_of(text) == 0x0D0E0F10


@pytest.mark.parametrize(
    "bad, exc",
    [
        ("0" * 31, ValueError),
        ("0" * 33, ValueError),
        ("G" * 32, ValueError),
        ("A" * 32, ValueError),  # the text form is lowercase only, so one id has one text
        (b"\0" * 15, ValueError),
        (12, TypeError),
    ],
)
def test_malformed_ids_are_refused(bad: object, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        ids.parse(bad)  # type: ignore[arg-type]


def test_field_bounds() -> None:
    with pytest.raises(ValueError):
        ids.pack(ids.MAX_REGION + 1, 0, 0, 0)
    with pytest.raises(ValueError):
        ids.pack(0, -1, 0, 0)
    with pytest.raises(ValueError):
        IdGenerator(70000)
    with pytest.raises(TypeError):
        IdGenerator(1, node=True)
    with pytest.raises(ValueError):
        IdGenerator(1, sequence_limit=0)


@given(fields)
def test_round_trip(f: tuple[int, int, int, int]) -> None:
    raw = ids.pack(*f)
    assert ids.parse(raw) == f
    assert ids.parse(ids.to_text(raw)) == f
    assert ids.from_text(ids.to_text(raw)) == raw


@given(fields, fields)
def test_byte_and_text_order_are_field_order(
    a: tuple[int, int, int, int], b: tuple[int, int, int, int]
) -> None:
    ra, rb = ids.pack(*a), ids.pack(*b)
    assert (ra < rb) == (a < b)
    assert (ids.to_text(ra) < ids.to_text(rb)) == (a < b)


@given(regions, st.lists(st.integers(-5_000, 5_000), min_size=1, max_size=300))
def test_ids_strictly_increase_whatever_the_clock_does(region: int, steps: list[int]) -> None:
    """A clock that jumps back and forth: ids still increase, their time never goes back
    and is never behind the clock reading it was issued at."""
    readings = []
    t = 1_700_000_000_000
    for s in steps:
        t = max(0, t + s)
        readings.append(t)
    gen = IdGenerator(region, node=7, clock=FakeClock(readings=iter(readings)))
    issued = [gen.next() for _ in readings]
    assert issued == sorted(issued) and len(set(issued)) == len(issued)
    high = 0
    for text, reading in zip(issued, readings, strict=True):
        p = ids.parse(text)
        assert p.region == region and p.node == 7
        assert p.time_ms >= reading
        high = max(high, reading)
        assert p.time_ms == high  # no overflow here: it stays on the highest reading
    behind = [r < max(readings[:i]) for i, r in enumerate(readings) if i]
    assert gen.stats()["backward_steps"] == sum(behind)


@given(
    st.integers(1, 4),
    st.lists(st.integers(-50, 3), min_size=1, max_size=300),
)
def test_bounds_hold_with_a_small_sequence_limit(limit: int, steps: list[int]) -> None:
    """Backward steps and overflows together: still strictly increasing, never behind the
    reading, and ahead of the highest reading by at most one ms per limit+1 ids."""
    readings = []
    t = 1_700_000_000_000
    for s in steps:
        t += s
        readings.append(t)
    gen = IdGenerator(1, node=1, clock=FakeClock(readings=iter(readings)), sequence_limit=limit)
    issued = [ids.parse(gen.next_bytes()) for _ in readings]
    pairs = [(p.time_ms, p.sequence) for p in issued]
    assert pairs == sorted(set(pairs))
    assert all(p.sequence <= limit for p in issued)
    for n, (p, reading) in enumerate(zip(issued, readings, strict=True), start=1):
        assert p.time_ms >= reading
        assert p.time_ms <= max(readings[:n]) + n // (limit + 1)


def test_threads_with_a_clock_that_keeps_stepping_back() -> None:
    state = {"now": 1_700_000_000_000}

    def clock() -> int:  # called under the generator's lock: one reading at a time
        state["now"] -= 1
        return state["now"]

    gen = IdGenerator(2, clock=clock, sequence_limit=1000)
    out: list[list[bytes]] = [[] for _ in range(6)]

    def work(i: int) -> None:
        for _ in range(1500):
            out[i].append(gen.next_bytes())

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [x for r in out for x in r]
    assert len(set(everything)) == len(everything) == 9000
    assert all(r == sorted(r) for r in out)
    assert gen.stats()["backward_steps"] == 8999 and gen.stats()["sequence_overflows"] == 8


def test_backward_step_continues_from_the_last_time() -> None:
    clock = FakeClock(START_MS)
    gen = IdGenerator(3, node=1, clock=clock)
    t0 = clock.now
    first = gen.next()
    clock.now = t0 - 1000  # an NTP step back of one second
    during = [gen.next() for _ in range(5)]
    assert [ids.time_of(i) for i in during] == [t0] * 5
    assert [ids.sequence_of(i) for i in during] == [1, 2, 3, 4, 5]
    assert first < during[0]
    assert gen.stats()["backward_steps"] == 5 and gen.stats()["max_backward_ms"] == 1000
    clock.now = t0 + 1  # the clock catches up: back to its own time, sequence from 0
    after = gen.next()
    assert ids.time_of(after) == t0 + 1 and ids.sequence_of(after) == 0 and after > during[-1]


def test_sequence_overflow_moves_to_the_next_millisecond() -> None:
    clock = FakeClock(START_MS)
    gen = IdGenerator(1, node=1, clock=clock, sequence_limit=3)
    t0 = clock.now
    got = [ids.parse(gen.next()) for _ in range(9)]
    assert [(p.time_ms - t0, p.sequence) for p in got] == [
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0),
    ]  # fmt: skip
    assert gen.stats()["sequence_overflows"] == 2
    # The wall clock reaching the borrowed millisecond does not repeat it.
    clock.now = t0 + 2
    nxt = ids.parse(gen.next())
    assert (nxt.time_ms - t0, nxt.sequence) == (2, 1)


def test_regions_never_collide_and_sort_apart() -> None:
    clock = FakeClock(START_MS)
    a = IdGenerator(1, node=5, clock=clock)
    b = IdGenerator(2, node=5, clock=clock)  # same node, same clock: only the region differs
    xs = [a.next() for _ in range(100)]
    ys = [b.next() for _ in range(100)]
    assert not set(xs) & set(ys)
    assert max(xs) < min(ys)  # the region is the prefix
    assert all(x.startswith("0001") for x in xs) and all(y.startswith("0002") for y in ys)


def test_many_threads_issue_no_duplicates() -> None:
    gen = IdGenerator(9, clock=FakeClock(START_MS))  # a frozen clock: everything is in one ms
    per_thread, n_threads = 2000, 8
    results: list[list[str]] = [[] for _ in range(n_threads)]
    barrier = threading.Barrier(n_threads)

    def work(i: int) -> None:
        barrier.wait()
        for _ in range(per_thread // 2):
            results[i].append(gen.next())
        results[i].extend(gen.next_many(per_thread // 2))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [x for r in results for x in r]
    assert len(set(everything)) == per_thread * n_threads
    for r in results:  # each thread sees increasing ids
        assert r == sorted(r)
    assert sorted(ids.sequence_of(x) for x in everything) == list(range(per_thread * n_threads))


def test_real_clock_ids_carry_the_wall_time() -> None:
    import time

    before = time.time_ns() // 1_000_000
    x = IdGenerator(0).next()
    after = time.time_ns() // 1_000_000
    assert before <= ids.time_of(x) <= after


def _child_ids(gen: IdGenerator, q: multiprocessing.Queue[object]) -> None:
    try:
        q.put(("ok", gen.next(), gen.node))
    except RuntimeError as exc:
        q.put(("refused", str(exc), gen.node))


def test_fork_draws_a_new_random_node_and_refuses_a_fixed_one() -> None:
    ctx = multiprocessing.get_context("fork")
    for fixed in (False, True):
        gen = IdGenerator(4, node=11 if fixed else None, clock=FakeClock(START_MS))
        parent_node = gen.node
        gen.next()
        q: multiprocessing.Queue[object] = ctx.Queue()
        p = ctx.Process(target=_child_ids, args=(gen, q))
        p.start()
        kind, value, child_node = q.get(timeout=60)  # type: ignore[misc]
        p.join(60)
        if fixed:
            assert kind == "refused" and "forked child" in value
        else:
            # Drawn again in the child, and never the parent's.
            assert kind == "ok" and child_node != parent_node
            assert ids.node_of(value) == child_node
