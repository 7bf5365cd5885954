"""The engine's helpers over batches of concatenated 16-byte digests, against plain
Python, and the warm tier's lookups built on them (docs/warm-tier.md, "Lookups")."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

import dedupcore._engine as _engine

digest = st.binary(min_size=16, max_size=16)
batches = st.lists(st.one_of(digest, st.sampled_from([b"\x00" * 16, b"\xff" * 16])), max_size=60)


def _split(joined: bytes) -> list[bytes]:
    return [joined[i : i + 16] for i in range(0, len(joined), 16)]


@given(batches, st.data())
def test_gather_select_sort_split_match_plain_python(ds: list[bytes], data: st.DataObject) -> None:
    joined = b"".join(ds)
    idx = data.draw(st.lists(st.integers(0, len(ds) - 1), max_size=40)) if ds else []
    flags = bytes(data.draw(st.lists(st.integers(0, 3), min_size=len(ds), max_size=len(ds))))
    assert _engine.gather_digests(joined, idx) == b"".join(ds[i] for i in idx)
    assert _engine.select_digests(joined, flags) == b"".join(
        d for d, f in zip(ds, flags, strict=True) if f
    )
    assert _engine.select_digests(joined, memoryview(flags).cast("?")) == b"".join(
        d for d, f in zip(ds, flags, strict=True) if f
    )
    assert _engine.sort_digests(joined) == b"".join(sorted(ds))
    assert _engine.split_digests(joined) == ds
    hits = bytes(data.draw(st.lists(st.integers(0, 2), min_size=len(idx), max_size=len(idx))))
    want = bytearray(len(ds) + 3)
    for i, hit in zip(idx, hits, strict=True):
        want[i] = hit != 0
    assert _engine.scatter_flags(len(ds) + 3, idx, hits) == (want if any(hits) else None)


@pytest.mark.parametrize("n", [31, 32, 33, 1000, 70_000])
def test_sort_digests_by_buckets_and_where_they_are_not_spread_evenly(n: int) -> None:
    """Digests are dealt into buckets by their top bits, each bucket sorted on its
    own: batches of every size class, and digests that crowd into one bucket
    (one shared top half, then the bottom of the range) sort as sorted() does."""
    rng = random.Random(n)
    spread = [rng.randbytes(16) for _ in range(n)]
    crowded = [b"\x42" * 8 + rng.randbytes(8) for _ in range(n // 2 + 40)]
    low = [bytes(14) + rng.randbytes(2) for _ in range(n // 3 + 40)]
    repeats = spread[: n // 10] * 2
    for ds in (spread, crowded + low, spread + crowded + repeats):
        assert _engine.sort_digests(b"".join(ds)) == b"".join(sorted(ds))


@given(batches, st.data())
def test_drop_found_leaves_what_a_lookup_did_not_find(ds: list[bytes], data: st.DataObject) -> None:
    todo = _engine.sort_digests(b"".join(ds))
    order = _split(todo)
    keep = data.draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
    found = _engine.pack_records([(d, b"v") for d, k in zip(order, keep, strict=True) if not k])
    assert _engine.drop_found(todo, found) == b"".join(
        d for d, k in zip(order, keep, strict=True) if k
    )


def test_the_helpers_refuse_what_is_not_a_batch_of_digests() -> None:
    two = os.urandom(32)
    a, b = sorted([os.urandom(16), os.urandom(16)])
    for bad in (
        lambda: _engine.gather_digests(b"x" * 17, []),
        lambda: _engine.select_digests(b"x" * 15, b""),
        lambda: _engine.sort_digests(b"x" * 31),
        lambda: _engine.split_digests(b"x"),
        lambda: _engine.select_digests(two, b"\x01"),  # one flag for two digests
        lambda: _engine.scatter_flags(4, [0, 1], b"\x01"),
        lambda: _engine.drop_found(two[:31], _engine.pack_records([])),
        # a record not among them; records not in their order
        lambda: _engine.drop_found(two, _engine.pack_records([(os.urandom(16), b"")])),
        lambda: _engine.drop_found(a + b, _engine.pack_records([(b, b""), (a, b"")])),
    ):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(IndexError):
        _engine.gather_digests(two, [2])
    with pytest.raises(IndexError):
        _engine.gather_digests(two, [-1])
    with pytest.raises(IndexError):
        _engine.scatter_flags(2, [2], b"\x01")
    with pytest.raises(TypeError):
        _engine.gather_digests(two, ["0"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        _engine.select_digests(two, [True, False])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _engine.drop_found(two, [(two[:16], b"")])  # type: ignore[arg-type]


def test_packed_records_refuse_pairs_that_are_not_digest_and_bytes() -> None:
    value = _engine.encode_value(b"d" * 16, 2, 1, 1, 1.0, 1.0, 30.0, None, None, None)
    for bad, exc in (
        ([b"d" * 16], TypeError),
        ([(b"d" * 16,)], TypeError),
        ([(b"d" * 16, bytearray(value))], TypeError),
        ([[b"d" * 16, value]], TypeError),
        ([(b"d" * 15, value)], ValueError),
    ):
        with pytest.raises(exc):
            _engine.pack_records(bad)  # type: ignore[arg-type]
    for packed, n in (
        (b"d" * 16 + b"\x05\x00\x00\x00abcd", 1),  # a value cut short
        (b"d" * 16 + b"\x00\x00\x00", 1),  # a length cut short
        (b"d" * 16 + b"\x00\x00\x00\x00" + b"e", 1),  # bytes after the last record
        (b"", 1),
        (b"", -1),
    ):
        with pytest.raises(ValueError):
            _engine.PackedRecords(packed, n)
    with pytest.raises(TypeError):
        _engine.ClaimTable().load([(b"d" * 16, value)], 0.0)  # type: ignore[arg-type]


def test_load_stops_at_a_damaged_record_and_names_it() -> None:
    table = _engine.ClaimTable()
    value = _engine.encode_value(b"d" * 16, 2, 1, 1, 1.0, 1.0, 30.0, None, None, None)
    damaged = [(b"e" * 16, value[:-1] + b"\x00"), (b"f" * 16, b"")]  # a checksum off; empty
    for bad in damaged:
        records = _engine.pack_records([(b"d" * 16, value), bad, (b"g" * 16, value)])
        assert list(records) == [(b"d" * 16, value), bad, (b"g" * 16, value)]
        assert table.load(records, 0.0) == 1
        assert table.read_records(records, 0.0) == 1
    assert len(table) == 1  # the first is loaded, nothing at or after the damaged one


@pytest.mark.parametrize("order", ["sorted", "reversed", "shuffled", "two runs"])
def test_settled_records_read_in_any_order_are_found_beside_the_table(order: str) -> None:
    """``read_records`` keeps the PROCESSED records it reads beside the table, sorted
    by digest for the claim's search: records as one slice gives them (in digest
    order) are taken as they are, any other order is sorted (docs/engine.md,
    "Records read for a claim")."""
    rng = random.Random(order)
    digests = sorted({os.urandom(16) for _ in range(300)})
    if order == "reversed":
        digests.reverse()
    elif order == "shuffled":
        rng.shuffle(digests)
    elif order == "two runs":  # two slices' parts, each sorted, joined
        digests = digests[1::2] + digests[::2]
    pairs = [
        (d, _engine.encode_value(d, 2, 1, 7, 1.0, 2.0, 30.0, None, None, None)) for d in digests
    ]
    table = _engine.ClaimTable()
    side = table.read_records(_engine.pack_records(pairs), 0.0)
    assert isinstance(side, _engine.ReadRecords)
    assert len(side) == len(digests) and len(table) == 0
    joined = b"".join(digests)
    assert table.missing(joined, side) == []
    absent = b"".join(os.urandom(16) for _ in range(50))
    assert table.missing(absent, side) == list(range(50))
