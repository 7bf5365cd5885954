"""BloomRing: time-sliced filters with expiry, growth and persistence."""

from __future__ import annotations

import json
import math
import random
import tempfile
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dedupcore.ring as ring_module
from dedupcore import BloomRing, hash64
from dedupcore.errors import CorruptFileError
from dedupcore.ring import RING_FORMAT, SliceInfo

Keys = Callable[..., list[bytes]]


def shape(ring: BloomRing) -> list[tuple[int, int, int, int, bool]]:
    return [(s.bucket, s.count, s.capacity, s.subfilters, s.sealed) for s in ring.slices()]


def snapshot(ring: BloomRing) -> list[tuple[int, int, bytes]]:
    """Every sub-filter's bits: (bucket, index, body)."""
    return [
        (s.bucket, i, bytes(memoryview(f))) for s in ring._slices for i, f in enumerate(s.filters)
    ]


def files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# ---------------------------------------------------------------- expiry --


def test_key_lives_until_its_slice_end_plus_window(make_keys: Keys) -> None:
    ring = BloomRing(window=10.0, slice_seconds=2.0, slice_capacity=1000, error_rate=1e-4)
    keys = make_keys(100)
    ring.add_many(keys, now=5.0)  # bucket 2: the slice ends at 6.0, expires at 16.0
    assert ring.bucket_of(5.0) == 2
    assert [s.bucket for s in ring.slices()] == [2]
    assert ring.slices()[0].start == 4.0
    for now in (5.0, 6.0, 15.0, 15.999):
        assert ring.expire(now) == 0
        assert all(ring.contains_many(keys))
        assert all(k in ring for k in keys)
    assert ring.expire(16.0) == 1
    assert ring.slices() == []
    assert not any(ring.contains_many(keys))
    assert not any(ring.contains(k) for k in keys)
    assert len(ring) == 0


def test_expire_returns_number_dropped(make_keys: Keys) -> None:
    ring = BloomRing(window=10.0, slice_seconds=2.0, slice_capacity=1000, error_rate=1e-4)
    per_bucket = {b: make_keys(50, f"b{b}") for b in range(4)}
    for b, keys in per_bucket.items():
        ring.add_many(keys, now=2.0 * b + 1.0)
    assert [s.bucket for s in ring.slices()] == [0, 1, 2, 3]
    assert [s.sealed for s in ring.slices()] == [True, True, True, False]
    assert ring.expire(11.9) == 0
    assert ring.expire(14.0) == 2  # buckets 0 and 1: (b + 1) * 2 + 10 <= 14
    assert ring.expire(14.0) == 0
    assert [s.bucket for s in ring.slices()] == [2, 3]
    assert not any(ring.contains_many(per_bucket[0] + per_bucket[1]))
    assert all(ring.contains_many(per_bucket[2] + per_bucket[3]))
    assert ring.expire(1e9) == 2
    assert ring.expire(1e9) == 0


def test_new_head_expires_old_slices(make_keys: Keys) -> None:
    ring = BloomRing(window=4.0, slice_seconds=1.0, slice_capacity=100, error_rate=1e-4)
    old = make_keys(20, "old")
    ring.add_many(old, now=0.5)
    assert ring.add(b"later", now=100.0)
    assert [s.bucket for s in ring.slices()] == [100]
    assert not any(ring.contains_many(old))


def test_late_keys_go_to_the_head(make_keys: Keys) -> None:
    ring = BloomRing(window=10.0, slice_seconds=2.0, slice_capacity=1000, error_rate=1e-4)
    ring.add(b"head", now=10.0)  # bucket 5, expires at 22
    assert ring.add(b"late", now=1.0)  # bucket 0 < head: goes to bucket 5
    late = make_keys(30, "late")
    assert all(ring.add_many(late, now=0.0))
    assert [s.bucket for s in ring.slices()] == [5]
    assert ring.slices()[0].count == 32
    assert ring.expire(12.5) == 0  # bucket 0 would have expired at 12
    assert b"late" in ring and all(ring.contains_many(late))
    assert ring.expire(21.9) == 0
    assert ring.expire(22.0) == 1
    assert b"late" not in ring


def test_slices_fill_and_seal_in_order() -> None:
    ring = BloomRing(window=6.0, slice_seconds=3.0, slice_capacity=100)
    assert ring.max_slices == 3
    for now in (0.0, 3.0, 6.0):
        ring.add(b"k%f" % now, now)
    infos = ring.slices()
    assert all(isinstance(s, SliceInfo) for s in infos)
    assert [(s.bucket, s.start, s.sealed, s.count, s.subfilters) for s in infos] == [
        (0, 0.0, True, 1, 1),
        (1, 3.0, True, 1, 1),
        (2, 6.0, False, 1, 1),
    ]
    assert list(ring) == infos
    assert ring.count == len(ring) == 3
    assert ring.nbytes == sum(s.nbytes for s in infos)


# ---------------------------------------------------------------- growth --


def test_overfilled_slice_grows_subfilters_single_adds(make_keys: Keys) -> None:
    ring = BloomRing(window=10.0, slice_seconds=10.0, slice_capacity=1000, error_rate=0.001)
    keys = make_keys(2500)
    for k in keys:
        ring.add(k, now=1.0)
    (info,) = ring.slices()
    assert info.subfilters == 2
    assert info.capacity == 1000 + 2000
    assert 2450 <= info.count <= 2500
    assert all(ring.contains_many(keys))


def test_overfilled_slice_grows_subfilters_in_one_batch(make_keys: Keys) -> None:
    ring = BloomRing(window=10.0, slice_seconds=10.0, slice_capacity=1000, error_rate=0.001)
    keys = make_keys(4000)
    flags = ring.add_many(keys, now=1.0)
    assert len(flags) == 4000
    assert sum(flags) >= 3990
    (info,) = ring.slices()
    assert info.subfilters == 3
    assert info.capacity == 1000 + 2000 + 4000
    assert all(ring.contains_many(keys))
    assert list(ring.add_many(keys, now=2.0)) == [False] * 4000


def test_insert_many_sets_the_same_bits_as_add_many(make_keys: Keys) -> None:
    """insert_many skips only the probe of the other slices: the ring it leaves
    (slices, sub-filters, counts, bits) is the one add_many leaves."""
    rings = [
        BloomRing(window=10.0, slice_seconds=1.0, slice_capacity=1000, error_rate=0.001)
        for _ in range(2)
    ]
    batches = [(make_keys(1500), 0.5), (make_keys(3000), 1.5), (make_keys(10), 1.7)]
    for keys, now in batches:
        rings[0].add_many(keys, now)
        assert rings[1].insert_many(keys, now) is None
    assert rings[0].slices() == rings[1].slices()
    assert [s.subfilters for s in rings[1].slices()] == [2, 2]  # both slices grew
    for a, b in zip(rings[0]._filters(), rings[1]._filters(), strict=True):
        assert a.to_bytes() == b.to_bytes()
    assert all(rings[1].contains_many([k for keys, _ in batches for k in keys]))


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_insert_many_in_steps_leaves_the_ring_one_step_leaves(
    make_keys: Keys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, step: int
) -> None:
    """An insert takes the lock a step of INSERT_STEP keys at a time; the ring it
    leaves (slices, sub-filters, counts, bits, the key log's hashes, in order) is
    the one a single step leaves."""
    rings = [
        BloomRing(
            window=10.0,
            slice_seconds=1.0,
            slice_capacity=1000,
            error_rate=0.001,
            path=tmp_path / name,
            key_logs=True,
        )
        for name in ("whole", "steps")
    ]
    batches = [(make_keys(1500), 0.5), (make_keys(3000), 1.5), (make_keys(0), 1.6)]
    for keys, now in batches:
        rings[0].insert_many(keys, now)
    monkeypatch.setattr(ring_module, "INSERT_STEP", step)
    for keys, now in batches:
        rings[1].insert_many(keys, now)
    assert rings[0].slices() == rings[1].slices()
    for a, b in zip(rings[0]._filters(), rings[1]._filters(), strict=True):
        assert a.to_bytes() == b.to_bytes()
    logged = [b"".join(bytes(p) for p in r._slices[-1].pending) for r in rings]
    assert logged[0] == logged[1] == np.array([hash64(k) for k in batches[1][0]], "<u8").tobytes()


def test_a_lookup_that_waits_for_an_insert_goes_between_two_steps(
    make_keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup that finds the lock held by an insert says so; the insert lets the
    lock go after its step and pauses, and the lookup is answered before the next
    step (a checkpoint's insert into the front does not hold a claim's lookup for
    the whole batch)."""
    ring = BloomRing(window=10.0, slice_seconds=10.0, slice_capacity=10_000)
    keys = make_keys(3000)
    monkeypatch.setattr(ring_module, "INSERT_STEP", 1000)
    order: list[str] = []
    answered = threading.Event()
    lookups: list[bool] = []

    def lookup() -> None:
        lookups.extend(ring.contains_many(keys[:1]))
        order.append("lookup")
        answered.set()

    add_hashes = ring._add_hashes
    waiter = threading.Thread(target=lookup)

    def step(*args: Any) -> Any:
        order.append("step")
        if len(order) == 1:
            waiter.start()  # it finds the lock held by this step
            deadline = time.monotonic() + 30
            while not ring._lookup.waiting:
                assert time.monotonic() < deadline, "the lookup never waited for the lock"
                time.sleep(0.001)
        return add_hashes(*args)

    def pause(seconds: float) -> None:
        assert seconds == ring_module.INSERT_PAUSE
        order.append("pause")
        # The lock is free during the pause: the lookup gets it now.
        assert answered.wait(30), "the lookup did not get the lock during the pause"

    monkeypatch.setattr(ring, "_add_hashes", step)
    monkeypatch.setattr(ring_module, "time", types.SimpleNamespace(sleep=pause))
    ring.insert_many(keys, now=1.0)
    waiter.join(30)
    assert order == ["step", "pause", "lookup", "step", "step"]
    assert lookups == [True]  # the first step's keys were in
    assert ring._lookup.waiting is False
    assert all(ring.contains_many(keys))


def test_ring_fpr_with_every_slice_overfilled_4x() -> None:
    error_rate = 0.01
    slice_capacity = 25_000
    ring = BloomRing(
        window=3.0, slice_seconds=1.0, slice_capacity=slice_capacity, error_rate=error_rate
    )
    present: list[bytes] = []
    for bucket in range(4):
        keys = [b"present-%d-%d" % (bucket, i) for i in range(4 * slice_capacity)]
        ring.add_many(keys, now=bucket + 0.5)
        present += keys
    infos = ring.slices()
    assert len(infos) == ring.max_slices == 4
    # The first slice grows sub-filters; later ones are sized from the rate it saw.
    assert infos[0].subfilters >= 3
    assert all(s.capacity >= 4 * slice_capacity for s in infos)
    assert all(ring.contains_many(present))
    n_probe = 1_000_000
    data = random.Random(4).randbytes(16 * n_probe)
    absent = [data[i : i + 16] for i in range(0, len(data), 16)]
    measured = bytes(ring.contains_many(absent)).count(1) / n_probe
    se = math.sqrt(error_rate * (1 - error_rate) / n_probe)
    assert measured <= error_rate * 1.1 + 4 * se, measured
    assert ring.estimated_fpr <= error_rate * 1.1
    assert abs(ring.estimated_fpr - measured) <= 0.1 * measured + 4 * se


def test_a_slice_started_with_its_expected_count_is_one_filter_with_most_of_the_budget(
    make_keys: Keys,
) -> None:
    """A caller that knows what a slice will hold (a warm-tier drop) gets one
    filter of that size: no sub-filters, nine tenths of the slice's budget,
    and so fewer bytes per key than the rate-based guess that doubles."""
    keys = make_keys(40_000)
    sized = BloomRing(window=10.0, slice_seconds=10.0, slice_capacity=1000, error_rate=0.001)
    guessed = BloomRing(window=10.0, slice_seconds=10.0, slice_capacity=1000, error_rate=0.001)
    for i in range(0, len(keys), 5000):
        sized.insert_many(keys[i : i + 5000], now=1.0, expected=len(keys))
        guessed.insert_many(keys[i : i + 5000], now=1.0)
    (info,) = sized.slices()
    assert info.subfilters == 1
    assert len(keys) <= info.capacity <= len(keys) * 1.05 + 1
    (only,) = sized._filters()
    assert only.error_rate == pytest.approx(sized.slice_error_rate * 0.9)
    assert all(sized.contains_many(keys))
    assert sized.estimated_fpr <= sized.error_rate
    assert guessed.slices()[0].subfilters == 6
    assert sized.nbytes * 1.5 < guessed.nbytes
    # Only the call that starts a slice sizes it; later ones leave it as it is.
    sized.insert_many(make_keys(10), now=2.0, expected=10**9)
    assert sized.slices()[0].capacity == info.capacity


def test_a_slice_past_its_expected_count_grows_from_the_reserve_before_and_after_reopening(
    make_keys: Keys, tmp_path: Path
) -> None:
    """More keys than expected still keep the slice's rate: the grown
    sub-filters share the tenth kept back, read from the first filter's own
    header, so a reopened ring grows the same way."""
    args: dict[str, float] = {"window": 10.0, "slice_seconds": 10.0, "error_rate": 0.001}
    keys = make_keys(4000)
    rings = [
        BloomRing(slice_capacity=100, path=tmp_path / "a", **args),  # type: ignore[arg-type]
        BloomRing(slice_capacity=100, path=tmp_path / "b", **args),  # type: ignore[arg-type]
    ]
    for ring in rings:
        ring.insert_many(keys[:1000], now=1.0, expected=1000)
        ring.save()
    rings[1] = BloomRing.open(tmp_path / "b")
    for ring in rings:
        ring.insert_many(keys[1000:], now=1.0)
    budgets = [[f.error_rate for f in ring._filters()] for ring in rings]
    assert budgets[0] == budgets[1]
    e = rings[0].slice_error_rate
    assert budgets[0] == pytest.approx([0.9 * e, 0.05 * e, 0.025 * e])
    assert sum(budgets[0]) <= e
    assert [f.capacity for f in rings[0]._filters()][1:] == [
        2 * rings[0]._filters()[0].capacity,
        4 * rings[0]._filters()[0].capacity,
    ]
    assert all(all(ring.contains_many(keys)) for ring in rings)


@pytest.mark.parametrize(
    ("expected", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_expected_must_be_a_count(
    make_keys: Keys, expected: object, error: type[Exception]
) -> None:
    ring = BloomRing(window=10.0, slice_seconds=1.0, slice_capacity=100)
    with pytest.raises(error, match="expected"):
        ring.insert_many(make_keys(3), now=1.0, expected=expected)  # type: ignore[arg-type]
    assert ring.count == 0 and ring.slices() == []


# --------------------------------------------------------- keys and batches --


# (key, time step) pairs; negative steps make late keys.
ops_st = st.lists(
    st.tuples(
        st.one_of(st.binary(max_size=24), st.text(max_size=12)),
        st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 3.5, -1.0, -3.0]),
    ),
    min_size=1,
    max_size=60,
)


def _live_keys(ring: BloomRing, ops: list[tuple[bytes | str, float]]) -> tuple[list[object], float]:
    """Plays ops; returns the keys whose own time bucket is still live at the end, and the end."""
    now, added = 0.0, []
    for key, step in ops:
        now += step
        if len(added) % 3 == 2:
            ring.add_many([key], now=now)
        else:
            ring.add(key, now=now)
        added.append((key, now))
    end = max(t for _, t in added)
    ring.expire(end)
    live = [k for k, t in added if (ring.bucket_of(t) + 1) * ring.slice_seconds + ring.window > end]
    return live, end


@given(ops_st)
def test_no_false_negatives_within_window(ops: list[tuple[bytes | str, float]]) -> None:
    ring = BloomRing(window=4.0, slice_seconds=1.0, slice_capacity=8, error_rate=0.01)
    live, _ = _live_keys(ring, ops)
    assert all(ring.contains(k) for k in live)
    assert all(ring.contains_many(live))


@given(ops_st)
@settings(max_examples=30)
def test_no_false_negatives_within_window_after_reopen(
    ops: list[tuple[bytes | str, float]],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ring = BloomRing(window=4.0, slice_seconds=1.0, slice_capacity=8, error_rate=0.01, path=tmp)
        live, _ = _live_keys(ring, ops)
        ring.save()
        reopened = BloomRing.open(tmp)
        assert shape(reopened) == shape(ring)
        assert all(reopened.contains_many(live))
        del reopened, ring


def test_was_new_across_slices() -> None:
    ring = BloomRing(window=10.0, slice_seconds=1.0, slice_capacity=1000, error_rate=1e-4)
    assert ring.add(b"k", now=0.0)
    assert not ring.add(b"k", now=0.0)
    assert not ring.add(b"k", now=5.0)  # held by the older, live slice
    assert list(ring.add_many([b"k", b"k2", b"k2", "k3", b"k3"], now=6.0)) == [
        False,
        True,
        False,
        True,
        False,
    ]
    assert not ring.add(b"k2", now=7.0)
    assert list(ring.add_many([b"k2", b"k4"], now=8.0)) == [False, True]


def test_contains_many_equals_contains(make_keys: Keys) -> None:
    ring = BloomRing(window=5.0, slice_seconds=1.0, slice_capacity=200, error_rate=0.05)
    for t in range(5):
        ring.add_many(make_keys(300, f"t{t}"), now=float(t))
    probes: list[bytes | str] = [*make_keys(2000, "t2"), *make_keys(2000, "absent"), "str", ""]
    assert list(ring.contains_many(probes)) == [ring.contains(k) for k in probes]
    assert list(ring.contains_many(tuple(probes))) == [k in ring for k in probes]
    assert list(ring.contains_many(k for k in probes)) == [k in ring for k in probes]
    hashes = np.array([hash64(k, ring.seed) for k in probes], dtype=np.uint64)
    assert list(ring.contains_many(hashes)) == [k in ring for k in probes]
    assert list(ring.contains_many(hashes[::2])) == [k in ring for k in probes[::2]]


def test_prehashed_batches(make_keys: Keys) -> None:
    ring = BloomRing(window=5.0, slice_seconds=1.0, slice_capacity=100, error_rate=0.001, seed=42)
    keys = make_keys(450)
    hashes = np.array([hash64(k, 42) for k in keys], dtype=np.uint64)
    flags = ring.add_many(hashes[::2], now=0.0)  # non-contiguous, overflows the slice
    assert len(flags) == 225
    assert ring.slices()[0].subfilters >= 2
    assert all(ring.contains_many(keys[::2]))
    assert not any(ring.add_many(keys[::2], now=1.0))


def test_empty_ring_and_empty_batch() -> None:
    ring = BloomRing(window=5.0, slice_seconds=1.0, slice_capacity=100)
    assert list(ring.contains_many([b"a", b"b"])) == [False, False]
    assert b"a" not in ring
    assert len(ring.contains_many([])) == 0
    assert len(ring.add_many([], now=0.0)) == 0
    assert ring.count == 0


def test_ring_batch_with_bad_key_changes_nothing(make_keys: Keys) -> None:
    ring = BloomRing(window=10.0, slice_seconds=1.0, slice_capacity=10, error_rate=0.01)
    ring.add_many(make_keys(5, "pre"), now=0.0)
    before, count = snapshot(ring), ring.count
    keys: list[object] = list(make_keys(25))
    keys[15] = 5  # past the head's free room: the batch spans two sub-filters
    with pytest.raises(TypeError, match=r"index 15\b.*\bint\b"):
        ring.add_many(keys, now=0.0)  # type: ignore[arg-type]
    assert snapshot(ring) == before
    assert ring.count == count
    assert not any(ring.contains_many(make_keys(15)))


def test_rejected_batch_at_later_time_does_not_expire_slices(make_keys: Keys) -> None:
    ring = BloomRing(window=2.0, slice_seconds=1.0, slice_capacity=100, error_rate=0.01)
    keys = make_keys(10)
    ring.add_many(keys, now=0.0)
    before = shape(ring)
    with pytest.raises(TypeError, match=r"index 1\b"):
        ring.add_many([b"ok", None], now=50.0)  # type: ignore[list-item]
    assert shape(ring) == before
    assert all(ring.contains_many(keys))
    with pytest.raises(TypeError):
        ring.add(None, now=50.0)  # type: ignore[arg-type]
    assert shape(ring) == before


def test_single_key_as_batch_raises() -> None:
    ring = BloomRing(window=5.0, slice_seconds=1.0, slice_capacity=100)
    for single in (b"abc", "abc", bytearray(b"abc")):
        with pytest.raises(TypeError, match="single"):
            ring.add_many(single, now=0.0)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="single"):
            ring.contains_many(single)  # type: ignore[arg-type]


# ------------------------------------------------------------- arguments --


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"window": 0}, ValueError),
        ({"window": -1.0}, ValueError),
        ({"window": math.nan}, ValueError),
        ({"window": math.inf}, ValueError),
        ({"window": True}, TypeError),
        ({"window": "10"}, TypeError),
        ({"slice_seconds": 0.0}, ValueError),
        ({"slice_seconds": math.nan}, ValueError),
        ({"slice_seconds": False}, TypeError),
        ({"slice_capacity": 0}, ValueError),
        ({"slice_capacity": 1.5}, TypeError),
        ({"slice_capacity": True}, TypeError),
        ({"error_rate": 0.0}, ValueError),
        ({"error_rate": 1.0}, ValueError),
        ({"error_rate": math.nan}, ValueError),
        ({"seed": -1}, ValueError),
        ({"seed": 2**64}, ValueError),
        ({"seed": 1.0}, TypeError),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else v.__name__,
)
def test_constructor_validation(kwargs: dict[str, object], error: type[Exception]) -> None:
    args: dict[str, object] = {"window": 10.0, "slice_seconds": 1.0, "slice_capacity": 100}
    args.update(kwargs)
    name = next(iter(kwargs)).removeprefix("slice_")  # slice_capacity: "capacity ..."
    with pytest.raises(error, match=name):
        BloomRing(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("now", "error"),
    [
        (math.nan, ValueError),
        (math.inf, ValueError),
        (-math.inf, ValueError),
        (True, TypeError),
        (False, TypeError),
        ("1", TypeError),
        (None, TypeError),
    ],
)
def test_bad_time(now: object, error: type[Exception]) -> None:
    ring = BloomRing(window=10.0, slice_seconds=1.0, slice_capacity=100)
    ring.add(b"x", now=0.0)
    before = shape(ring)
    with pytest.raises(error, match="now"):
        ring.add(b"k", now=now)  # type: ignore[arg-type]
    with pytest.raises(error, match="now"):
        ring.add_many([b"k"], now=now)  # type: ignore[arg-type]
    with pytest.raises(error, match="now"):
        ring.expire(now)  # type: ignore[arg-type]
    assert shape(ring) == before
    assert b"k" not in ring


def test_save_without_path_raises() -> None:
    ring = BloomRing(window=10.0, slice_seconds=1.0, slice_capacity=100)
    with pytest.raises(ValueError, match="path"):
        ring.save()


# ----------------------------------------------------------- persistence --


def _persisted_ring(path: Path, make_keys: Keys) -> tuple[BloomRing, list[bytes]]:
    ring = BloomRing(
        window=10.0, slice_seconds=2.0, slice_capacity=500, error_rate=0.001, seed=5, path=path
    )
    keys: list[bytes] = []
    for now, n in ((0.0, 700), (3.0, 200), (5.5, 1200)):  # buckets 0, 1, 2; 0 and 2 grow
        batch = make_keys(n, f"t{now}")
        ring.add_many(batch, now=now)
        keys += batch
    return ring, keys


def test_save_and_open_give_same_answers(tmp_path: Path, make_keys: Keys) -> None:
    ring, keys = _persisted_ring(tmp_path, make_keys)
    ring.save()
    reopened = BloomRing.open(tmp_path)
    assert shape(reopened) == shape(ring)
    assert [s.nbytes for s in reopened.slices()] == [s.nbytes for s in ring.slices()]
    assert (
        reopened.window,
        reopened.slice_seconds,
        reopened.slice_capacity,
        reopened.error_rate,
        reopened.seed,
    ) == (10.0, 2.0, 500, 0.001, 5)
    probes = keys + make_keys(5000, "absent")
    assert list(reopened.contains_many(probes)) == list(ring.contains_many(probes))
    assert all(reopened.contains_many(keys))
    assert snapshot(reopened) == snapshot(ring)
    # Sealed slices come back memory-mapped and read-only, the head writable.
    for s in reopened._slices:
        assert all(f.readonly is s.sealed for f in s.filters)
    assert [s.sealed for s in reopened.slices()] == [True, True, False]
    # The reopened ring keeps working: head adds, a rollover, expiry.
    assert reopened.add(b"after-reopen", now=5.9)
    assert not reopened.add(keys[0], now=5.9)
    assert reopened.add(b"next-bucket", now=6.5)
    assert reopened.slices()[-1].bucket == 3
    assert all(reopened.contains_many([*keys, b"after-reopen", b"next-bucket"]))
    reopened.save()
    again = BloomRing.open(tmp_path)
    assert shape(again) == shape(reopened)
    assert all(again.contains_many([*keys, b"after-reopen", b"next-bucket"]))


def test_lookups_go_on_while_a_save_writes_and_changes_wait(
    tmp_path: Path, make_keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save holds what changes take, not what lookups take: while its manifest is
    being written, lookups are answered, and an add waits until the save is done (a
    checkpoint's save of the store's front does not stall every claim's lookup)."""
    ring, keys = _persisted_ring(tmp_path, make_keys)
    writing, release = threading.Event(), threading.Event()
    plain_write = ring_module.atomic_write

    def slow_write(path: Any, chunks: Any) -> None:
        writing.set()
        assert release.wait(60), "the test never let the save finish"
        plain_write(path, chunks)

    monkeypatch.setattr(ring_module, "atomic_write", slow_write)
    saver = threading.Thread(target=ring.save)
    saver.start()
    added: list[bool] = []
    adder = threading.Thread(target=lambda: added.append(ring.add(b"during-save", now=5.9)))
    try:
        assert writing.wait(60)
        answers: list[list[bool]] = []
        looker = threading.Thread(
            target=lambda: answers.append(list(ring.contains_many([keys[0], b"absent"])))
        )
        looker.start()
        looker.join(60)
        assert not looker.is_alive(), "a lookup waited for the save"
        assert answers == [[True, False]]
        adder.start()
        adder.join(0.2)
        assert adder.is_alive(), "an add changed the ring while it was being saved"
        assert added == []
    finally:
        release.set()
        saver.join(60)
        if adder.is_alive() or adder.ident is not None:
            adder.join(60)
    assert added == [True]
    reopened = BloomRing.open(tmp_path)
    assert all(reopened.contains_many(keys))


def test_open_without_verify(tmp_path: Path, make_keys: Keys) -> None:
    ring, keys = _persisted_ring(tmp_path, make_keys)
    ring.save()
    assert all(BloomRing.open(tmp_path, verify=False).contains_many(keys))


def test_sealed_slices_are_saved_when_sealed(tmp_path: Path, make_keys: Keys) -> None:
    ring = BloomRing(window=10.0, slice_seconds=1.0, slice_capacity=100, path=tmp_path)
    ring.add_many(make_keys(150), now=0.0)  # two sub-filters in bucket 0
    assert "slice-0-0.bloom" not in files(tmp_path)
    ring.add(b"x", now=1.0)  # seals bucket 0
    assert {"slice-0-0.bloom", "slice-0-1.bloom"} <= set(files(tmp_path))
    assert not [n for n in files(tmp_path) if n.endswith(".tmp")]


def test_reopen_after_rollover_without_save_accepts_late_keys(
    tmp_path: Path, make_keys: Keys
) -> None:
    ring = BloomRing(window=10.0, slice_seconds=1.0, slice_capacity=100, path=tmp_path)
    keys = make_keys(50)
    ring.add_many(keys, now=0.0)
    ring.add(b"in-bucket-1", now=1.5)  # seals bucket 0; the new head is not saved
    del ring
    reopened = BloomRing.open(tmp_path)
    assert all(reopened.contains_many(keys))
    assert reopened.add(b"late", now=0.5)  # a late key must be accepted, not fail read-only
    assert b"late" in reopened


def test_manifest_never_names_a_missing_file(tmp_path: Path, make_keys: Keys) -> None:
    ring = BloomRing(window=10.0, slice_seconds=1.0, slice_capacity=100, path=tmp_path)
    kept = make_keys(20, "kept")
    ring.add_many(make_keys(20, "a"), now=0.0)
    ring.add_many(kept, now=5.0)
    ring.add(b"c", now=12.0)  # seals bucket 5, expires bucket 0, rewrites the manifest
    manifest = json.loads((tmp_path / "ring.json").read_bytes())
    for entry in manifest["slices"]:
        for i in range(entry["subfilters"]):
            assert f"slice-{entry['bucket']}-{i}.bloom" in files(tmp_path), manifest
    reopened = BloomRing.open(tmp_path)
    assert all(reopened.contains_many(kept))


def test_expired_slice_files_are_deleted(tmp_path: Path, make_keys: Keys) -> None:
    ring = BloomRing(
        window=4.0, slice_seconds=2.0, slice_capacity=100, error_rate=1e-4, path=tmp_path
    )
    ring.add_many(make_keys(150, "b0"), now=0.0)  # bucket 0 grows a second sub-filter
    ring.add_many(make_keys(10, "b1"), now=2.0)
    ring.add_many(make_keys(10, "b2"), now=4.0)
    ring.save()
    assert files(tmp_path) == [
        "ring.json",
        "slice-0-0.bloom",
        "slice-0-1.bloom",
        "slice-1-0.bloom",
        "slice-2-0.bloom",
    ]
    assert ring.expire(6.0) == 1  # bucket 0: (0 + 1) * 2 + 4 <= 6
    assert files(tmp_path) == ["ring.json", "slice-1-0.bloom", "slice-2-0.bloom"]
    assert [s.bucket for s in BloomRing.open(tmp_path).slices()] == [1, 2]
    ring.add(b"x", now=12.0)  # rolls over: buckets 1 and 2 expire
    assert [s.bucket for s in ring.slices()] == [6]
    assert not [n for n in files(tmp_path) if n.startswith(("slice-1-", "slice-2-"))]
    assert not [n for n in files(tmp_path) if n.endswith(".tmp")]
    ring.save()
    assert files(tmp_path) == ["ring.json", "slice-6-0.bloom"]
    assert shape(BloomRing.open(tmp_path)) == shape(ring)


def test_deleted_slice_file(tmp_path: Path, make_keys: Keys) -> None:
    ring, _ = _persisted_ring(tmp_path, make_keys)
    ring.save()
    for name in ("slice-1-0.bloom", "slice-2-1.bloom"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / name).unlink()
        with pytest.raises(CorruptFileError, match="missing"):
            BloomRing.open(tmp_path)
        (tmp_path / name).write_bytes(data)
    BloomRing.open(tmp_path)


@pytest.mark.parametrize("name", ["slice-0-0.bloom", "slice-2-0.bloom"])
def test_corrupted_slice_file(tmp_path: Path, make_keys: Keys, name: str) -> None:
    ring, _ = _persisted_ring(tmp_path, make_keys)
    ring.save()
    data = bytearray((tmp_path / name).read_bytes())
    data[-5] ^= 0x20
    (tmp_path / name).write_bytes(bytes(data))
    with pytest.raises(CorruptFileError):
        BloomRing.open(tmp_path)
    (tmp_path / name).write_bytes(bytes(data[:100]))
    with pytest.raises(CorruptFileError):
        BloomRing.open(tmp_path, verify=False)


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(CorruptFileError, match="missing"):
        BloomRing.open(tmp_path)


@pytest.mark.parametrize(
    "raw",
    [b"", b"{not json", b"\xff\xfe\x00", b"[]", b"null", b"42", b'"ring"', b"{}"],
    ids=["empty", "garbage", "binary", "list", "null", "number", "string", "empty-object"],
)
def test_garbage_manifest(tmp_path: Path, make_keys: Keys, raw: bytes) -> None:
    ring, _ = _persisted_ring(tmp_path, make_keys)
    ring.save()
    (tmp_path / "ring.json").write_bytes(raw)
    with pytest.raises(CorruptFileError):
        BloomRing.open(tmp_path)


@pytest.mark.parametrize(
    "field", ["format", "window", "slice_seconds", "slice_capacity", "error_rate", "seed", "slices"]
)
def test_manifest_missing_field(tmp_path: Path, make_keys: Keys, field: str) -> None:
    ring, _ = _persisted_ring(tmp_path, make_keys)
    ring.save()
    manifest = json.loads((tmp_path / "ring.json").read_bytes())
    del manifest[field]
    (tmp_path / "ring.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptFileError):
        BloomRing.open(tmp_path)


@pytest.mark.parametrize("field", ["bucket", "subfilters", "sealed"])
def test_manifest_slice_missing_field(tmp_path: Path, make_keys: Keys, field: str) -> None:
    ring, _ = _persisted_ring(tmp_path, make_keys)
    ring.save()
    manifest = json.loads((tmp_path / "ring.json").read_bytes())
    del manifest["slices"][1][field]
    (tmp_path / "ring.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptFileError):
        BloomRing.open(tmp_path)


# Each case: (top-level field or slice field, value); slice fields apply to the head slice.
WRONG_MANIFEST_VALUES = [
    ("format", "1"),
    ("format", None),
    ("window", "10"),
    ("window", -10.0),
    ("slice_seconds", None),
    ("slice_capacity", 500.5),
    ("slice_capacity", "500"),
    ("error_rate", "0.001"),
    ("error_rate", 2.0),
    ("seed", "5"),
    ("seed", -5),
    ("seed", 6),  # differs from the slice files' seed
    ("slices", 5),
    ("slices", {"bucket": 0}),
    ("slices", [5]),
    ("slice.bucket", "2"),
    ("slice.bucket", 2.5),
    ("slice.bucket", None),
    ("slice.subfilters", "2"),
    ("slice.subfilters", 0),
    ("slice.subfilters", -1),
    ("slice.subfilters", None),
    ("slice.sealed", "false"),
    ("slice.sealed", 0),
    ("slice.sealed", None),
]


@pytest.mark.parametrize(("field", "value"), WRONG_MANIFEST_VALUES, ids=repr)
def test_manifest_with_wrong_types_or_values(
    tmp_path: Path, make_keys: Keys, field: str, value: object
) -> None:
    ring, _ = _persisted_ring(tmp_path, make_keys)
    ring.save()
    manifest = json.loads((tmp_path / "ring.json").read_bytes())
    if field.startswith("slice."):
        manifest["slices"][-1][field.removeprefix("slice.")] = value
    else:
        manifest[field] = value
    (tmp_path / "ring.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptFileError):
        BloomRing.open(tmp_path)


@pytest.mark.parametrize("change", ["reversed", "duplicate-bucket"])
def test_manifest_with_inconsistent_slices(tmp_path: Path, make_keys: Keys, change: str) -> None:
    # The ring takes the manifest's last slice for its head and names files by bucket, so
    # slices out of order or listed twice would later overwrite or shadow a slice's file.
    ring, _ = _persisted_ring(tmp_path, make_keys)
    ring.save()
    manifest = json.loads((tmp_path / "ring.json").read_bytes())
    if change == "reversed":
        manifest["slices"].reverse()
    else:
        manifest["slices"].append(dict(manifest["slices"][-1]))
    (tmp_path / "ring.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptFileError):
        BloomRing.open(tmp_path)


def test_manifest_from_newer_format(tmp_path: Path, make_keys: Keys) -> None:
    from dedupcore.errors import UnsupportedFormatError

    ring, _ = _persisted_ring(tmp_path, make_keys)
    ring.save()
    manifest = json.loads((tmp_path / "ring.json").read_bytes())
    manifest["format"] = RING_FORMAT + 1
    (tmp_path / "ring.json").write_text(json.dumps(manifest))
    with pytest.raises(UnsupportedFormatError):
        BloomRing.open(tmp_path)


def test_new_slices_are_sized_for_the_observed_rate() -> None:
    ring = BloomRing(window=10.0, slice_seconds=1.0, slice_capacity=100, error_rate=0.01)
    ring.add_many([b"a%d" % i for i in range(1000)], now=0.5)
    first = ring.slices()[-1]
    assert first.subfilters > 1  # the configured capacity was too small: it grew
    ring.add_many([b"b%d" % i for i in range(1000)], now=1.5)
    second = ring.slices()[-1]
    assert second.subfilters == 1  # sized from the first slice's 1000 keys
    assert second.capacity >= 1000
    assert second.nbytes < first.nbytes  # one right-sized filter beats a grown chain
    absent = [b"z%d" % i for i in range(200_000)]
    assert sum(ring.contains_many(absent)) / len(absent) <= 0.01 * 1.3


def test_the_kept_tuple_of_live_filters_follows_every_change(
    make_keys: Keys, tmp_path: Path
) -> None:
    """The ring keeps the tuple of its live filters between probes; a new slice, a
    grown sub-filter, a sealed (reopened, mapped) slice, an expiry and a reopen each
    change it, and a probe after any of them sees exactly the live filters."""

    def check(ring: BloomRing) -> None:
        live = tuple(f for s in ring._slices for f in s.filters)
        kept = ring._filters()
        assert len(kept) == len(live) and all(a is b for a, b in zip(kept, live, strict=True))

    ring = BloomRing(window=2.0, slice_seconds=1.0, slice_capacity=100, path=tmp_path / "r")
    keys = make_keys(1000)
    ring.add_many(keys[:50], now=0.5)  # the first slice
    check(ring)
    ring.add_many(keys[50:400], now=0.6)  # grows sub-filters
    check(ring)
    ring.add_many(keys[400:450], now=1.5)  # a new head; the old one sealed and mapped
    check(ring)
    assert all(ring.contains_many(keys[:450]))
    ring.add_many(keys[450:500], now=4.5)  # the first slices expire
    check(ring)
    assert ring.contains_many(keys[450:500]).tolist() == [True] * 50
    ring.save()
    reopened = BloomRing.open(tmp_path / "r")
    check(reopened)
    assert all(reopened.contains_many(keys[450:500]))
    assert reopened.expire(100.0) >= 1
    check(reopened)
    assert not any(reopened.contains_many(keys[:500]))
