"""BloomFilter: layout against the reference model, no false negatives, FPR, batches, API."""

from __future__ import annotations

import array
import ctypes
import math
import os
import pickle
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import refmodel
from hypothesis import given, settings
from hypothesis import strategies as st

from dedupcore import BloomFilter, _core, hash64
from dedupcore.bloom import blocks_for, split_block_fpr

NBLOCKS = [1, 2, 3, 5, 7, 64, 100, 257, 1000, 1023]

keys_st = st.lists(st.one_of(st.binary(max_size=64), st.text(max_size=32)), max_size=80)


def body(bf: _core.BlockFilter) -> bytes:
    return bytes(memoryview(bf))


# ---------------------------------------------------------------- layout --


def test_salts_are_the_specified_constants() -> None:
    assert tuple(_core.SALTS) == refmodel.SALT


@pytest.mark.parametrize("nblocks", NBLOCKS)
@pytest.mark.parametrize("seed", [0, 7, 2**64 - 1])
def test_add_matches_reference_model_bit_for_bit(
    block_filter: Callable[..., _core.BlockFilter],
    make_keys: Callable[..., list[bytes]],
    nblocks: int,
    seed: int,
) -> None:
    bf = block_filter(nblocks, seed)
    model = refmodel.RefFilter(nblocks, seed)
    assert body(bf) == model.body()  # starts empty
    keys: list[bytes | str] = [*make_keys(40 * nblocks), "str-key", "ключ", ""]
    for key in keys:
        assert bf.add(key) == model.add(key)
    assert body(bf) == model.body()
    assert bf.count == model.count


@pytest.mark.parametrize("nblocks", NBLOCKS)
def test_add_many_keys_matches_reference_model(
    block_filter: Callable[..., _core.BlockFilter],
    make_keys: Callable[..., list[bytes]],
    nblocks: int,
) -> None:
    bf = block_filter(nblocks, 3)
    model = refmodel.RefFilter(nblocks, 3)
    keys = make_keys(30 * nblocks)
    keys = keys + keys[: len(keys) // 3]  # some repeats inside the batch
    flags = bf.add_many(keys)
    assert list(flags) == model.add_many(keys)
    assert body(bf) == model.body()
    assert bf.count == model.count == sum(flags)


@pytest.mark.parametrize("nblocks", NBLOCKS)
def test_add_many_prehashed_numpy_matches_reference_model(
    block_filter: Callable[..., _core.BlockFilter], rng: np.random.Generator, nblocks: int
) -> None:
    bf = block_filter(nblocks, 0)
    model = refmodel.RefFilter(nblocks, 0)
    hashes = rng.integers(0, 2**64, size=25 * nblocks, dtype=np.uint64, endpoint=False)
    hashes = np.concatenate([hashes, hashes[:5], np.array([0, 2**64 - 1], dtype=np.uint64)])
    flags = bf.add_many(hashes)
    assert list(flags) == [model.add_hash(int(h)) for h in hashes]
    assert body(bf) == model.body()
    probes = rng.integers(0, 2**64, size=500, dtype=np.uint64)
    assert list(bf.contains_many(probes)) == [model.contains_hash(int(h)) for h in probes]
    assert [bf.contains_hash(int(h)) for h in probes] == [
        model.contains_hash(int(h)) for h in probes
    ]


@pytest.mark.parametrize(("capacity", "error_rate"), [(1, 0.5), (1000, 0.01), (5000, 0.001)])
def test_bloomfilter_matches_reference_model(
    make_keys: Callable[..., list[bytes]], capacity: int, error_rate: float
) -> None:
    bf = BloomFilter(capacity, error_rate, seed=99)
    assert bf.nblocks == blocks_for(capacity, error_rate)
    model = refmodel.RefFilter(bf.nblocks, 99)
    keys = make_keys(capacity)
    half = len(keys) // 2
    assert list(bf.add_many(keys[:half])) == model.add_many(keys[:half])
    for k in keys[half:]:
        assert bf.add(k) == model.add(k)
    hashed = np.array([refmodel.xxh64(k, 99) for k in make_keys(50, "h")], dtype=np.uint64)
    assert list(bf.add_many(hashed)) == [model.add_hash(int(h)) for h in hashed]
    assert body(bf) == model.body()
    assert bf.nbytes == bf.nblocks * 64 == len(model.body())


def test_add_hash_equals_add_of_key(make_keys: Callable[..., list[bytes]]) -> None:
    a = BloomFilter(1000, 0.01, seed=5)
    b = BloomFilter(1000, 0.01, seed=5)
    for k in make_keys(300):
        assert a.add(k) == b.add_hash(hash64(k, 5))
    assert a == b
    assert all(b.contains_hash(hash64(k, 5)) for k in make_keys(300))


# ---------------------------------------------------- no false negatives --


@given(keys_st, st.integers(0, 2**64 - 1))
def test_no_false_negatives(keys: list[bytes | str], seed: int) -> None:
    bf = BloomFilter(max(1, len(keys)), 0.01, seed=seed)
    half = len(keys) // 2
    bf.add_many(keys[:half])
    for k in keys[half:]:
        bf.add(k)
    assert all(k in bf for k in keys)
    assert all(bf.contains_many(keys))
    assert all(bf.contains_many(np.array([hash64(k, seed) for k in keys], dtype=np.uint64)))
    assert all(bf.contains_many([k.encode() if isinstance(k, str) else k for k in keys]))
    assert all(bf.contains_many([bytearray(refmodel.key_bytes(k)) for k in keys]))


@given(keys_st, st.booleans())
@settings(max_examples=40)
def test_no_false_negatives_after_save_and_open(keys: list[bytes | str], use_mmap: bool) -> None:
    bf = BloomFilter(100, 0.01, seed=11)
    bf.update(keys)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.bloom"
        bf.save(path)
        opened = BloomFilter.open(path, mmap=use_mmap)
        assert opened.readonly is use_mmap
        assert all(k in opened for k in keys)
        assert all(opened.contains_many(keys))
        assert opened == bf
        del opened


@given(keys_st)
def test_no_false_negatives_after_bytes_copy_and_pickle(keys: list[bytes | str]) -> None:
    bf = BloomFilter(100, 0.01, seed=3)
    bf.update(keys)
    for other in (BloomFilter.from_bytes(bf.to_bytes()), bf.copy(), pickle.loads(pickle.dumps(bf))):
        assert all(k in other for k in keys)
        assert all(other.contains_many(keys))
        assert other == bf


@given(keys_st, keys_st)
def test_no_false_negatives_after_union(
    a_keys: list[bytes | str], b_keys: list[bytes | str]
) -> None:
    a = BloomFilter(100, 0.01, seed=1)
    b = BloomFilter(100, 0.01, seed=1)
    a.update(a_keys)
    b.update(b_keys)
    union = a | b
    assert all(union.contains_many(a_keys + b_keys))
    a_before = body(a)
    a |= b
    assert all(a.contains_many(a_keys + b_keys))
    assert a == union
    assert body(a) == bytes(x | y for x, y in zip(a_before, body(b), strict=True))


def test_union_is_bitwise_or(make_keys: Callable[..., list[bytes]]) -> None:
    a = BloomFilter(2000, 0.01)
    b = BloomFilter(2000, 0.01)
    a.update(make_keys(1000, "a"))
    b.update(make_keys(1000, "b"))
    a_body, b_body = body(a), body(b)
    union = a | b
    assert body(a) == a_body  # | does not modify its operands
    assert body(b) == b_body
    assert body(union) == bytes(x | y for x, y in zip(a_body, b_body, strict=True))
    assert union.count >= max(a.count, b.count)
    a |= b
    assert a == union


# ---------------------------------------------------- false-positive rate --


def _absent_keys(n: int) -> list[bytes]:
    # 16 seeded random bytes: never equal to a "present-..." key, and reproducible.
    data = random.Random(n).randbytes(16 * n)
    return [data[i : i + 16] for i in range(0, 16 * n, 16)]


@pytest.mark.parametrize("error_rate", [0.001, 0.01])
def test_measured_fpr_within_bound(
    make_keys: Callable[..., list[bytes]], error_rate: float
) -> None:
    capacity = 1_000_000
    n_probe = 1_000_000
    bf = BloomFilter(capacity, error_rate)
    present = make_keys(capacity, "present")
    flags = bf.add_many(present)
    assert sum(flags) == bf.count
    assert all(bf.contains_many(present))
    positives = bytes(bf.contains_many(_absent_keys(n_probe))).count(1)
    measured = positives / n_probe
    se = math.sqrt(error_rate * (1 - error_rate) / n_probe)
    assert measured <= error_rate * 1.1 + 4 * se, (measured, error_rate)
    # The filter's own estimates agree with what was measured.
    assert abs(bf.estimated_fpr - measured) <= 0.1 * measured + 4 * se
    assert abs(bf.expected_fpr - measured) <= 0.1 * measured + 4 * se
    assert bf.expected_fpr <= error_rate * 1.01


def test_bits_per_key_at_one_in_a_thousand() -> None:
    bf = BloomFilter(1_000_000, 0.001)
    assert bf.bits_per_key <= 16
    assert bf.bits_per_key == bf.nbytes * 8 / bf.capacity
    assert split_block_fpr(bf.capacity / bf.nblocks) <= 0.001


def test_fill_ratio_and_estimates_on_empty_filter() -> None:
    bf = BloomFilter(1000, 0.01)
    assert bf.fill_ratio == 0.0
    assert bf.estimated_fpr == 0.0
    assert bf.expected_fpr == 0.0
    assert not any(bf.contains_many(_absent_keys(1000)))


# ------------------------------------------------------------- batches --


def test_duplicates_in_batch_are_new_only_first_time() -> None:
    bf = BloomFilter(1000, 0.001)
    flags = bf.add_many([b"a", b"b", b"a", "a", b"c", b"b", bytearray(b"c")])
    assert list(flags) == [True, True, False, False, True, False, False]
    assert len(flags) == 7
    assert flags[0] is True and flags[2] is False
    assert flags[-1] is False
    assert sum(flags) == 3 == bf.count == len(bf)
    assert list(bf.add_many([b"a", b"d"])) == [False, True]
    assert list(bf.contains_many([b"a", b"b", b"c", b"d", b"zzz-absent"])) == [
        True,
        True,
        True,
        True,
        False,
    ]


def test_empty_batches() -> None:
    bf = BloomFilter(1000, 0.01)
    before = body(bf)
    for empty in ([], (), iter([]), np.array([], dtype=np.uint64)):
        assert len(bf.add_many(empty)) == 0
    assert len(bf.contains_many([])) == 0
    assert sum(bf.add_many([])) == 0
    assert bf.update([]) == 0
    assert body(bf) == before and bf.count == 0


def test_generator_tuple_and_list_inputs_agree(make_keys: Callable[..., list[bytes]]) -> None:
    keys = make_keys(500)
    by_list, by_tuple, by_gen = (BloomFilter(1000, 0.01) for _ in range(3))
    f1 = by_list.add_many(keys)
    f2 = by_tuple.add_many(tuple(keys))
    f3 = by_gen.add_many(k for k in keys)
    assert list(f1) == list(f2) == list(f3)
    assert by_list == by_tuple == by_gen
    assert list(by_list.contains_many(k for k in keys)) == [True] * 500
    assert by_list.contains_many(tuple(keys)).tolist() == [True] * 500


def test_mixed_key_types_in_one_batch() -> None:
    bf = BloomFilter(1000, 0.001)
    batch = [b"alpha", "beta", bytearray(b"gamma"), memoryview(b"delta"), "ключ"]
    assert list(bf.add_many(batch)) == [True] * 5
    same = [memoryview(b"alpha"), b"beta", "gamma", bytearray(b"delta"), "ключ".encode()]
    assert list(bf.contains_many(same)) == [True] * 5
    assert all(k in bf for k in [*batch, *same])
    assert list(bf.add_many(same)) == [False] * 5
    model = refmodel.RefFilter(bf.nblocks, 0)
    model.add_many(batch)
    assert body(bf) == model.body()


@pytest.mark.parametrize("index", [0, 3, 999])
@pytest.mark.parametrize(("bad", "name"), [(5, "int"), (None, "NoneType"), (2.5, "float")])
def test_bad_key_in_batch_raises_with_index_and_changes_nothing(
    make_keys: Callable[..., list[bytes]], index: int, bad: object, name: str
) -> None:
    bf = BloomFilter(5000, 0.01)
    bf.update(make_keys(100, "pre"))
    before, count = body(bf), bf.count
    keys: list[object] = list(make_keys(1000))
    keys[index] = bad
    with pytest.raises(TypeError, match=rf"index {index}\b.*\b{name}\b"):
        bf.add_many(keys)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"index {index}\b"):
        bf.add_many(tuple(keys))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"index {index}\b"):
        bf.update(iter(keys))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"index {index}\b"):
        bf.contains_many(keys)  # type: ignore[arg-type]
    assert body(bf) == before
    assert bf.count == count


def test_surrogate_key_in_batch_changes_nothing() -> None:
    bf = BloomFilter(1000, 0.01)
    with pytest.raises(ValueError, match=r"index 1\b"):
        bf.add_many(["fine", "bad\ud800"])
    assert body(bf) == bytes(bf.nbytes) and bf.count == 0
    with pytest.raises(UnicodeEncodeError):
        bf.add("bad\ud800")
    assert body(bf) == bytes(bf.nbytes) and bf.count == 0


@pytest.mark.parametrize("single", [b"abcdefgh", "abcdefgh", bytearray(b"abcdefgh")])
def test_single_key_passed_as_batch_raises(single: object) -> None:
    bf = BloomFilter(1000, 0.01)
    with pytest.raises(TypeError, match="single"):
        bf.add_many(single)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="single"):
        bf.contains_many(single)  # type: ignore[arg-type]
    assert bf.count == 0


@pytest.mark.parametrize(
    "buf",
    [
        array.array("I", [1, 2, 3]),
        np.arange(4, dtype=np.int32),
        np.arange(4, dtype=np.uint32),
        np.arange(4, dtype=np.int64),
        np.arange(4, dtype=np.float64),
        np.zeros((2, 2), dtype=np.uint64),
        memoryview(b"12345678"),
    ],
    ids=["array-I", "int32", "uint32", "int64", "float64", "2d-uint64", "bytes-view"],
)
def test_wrong_prehashed_buffer_raises_type_error(buf: object) -> None:
    bf = BloomFilter(1000, 0.01)
    with pytest.raises(TypeError, match="uint64"):
        bf.add_many(buf)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="uint64"):
        bf.contains_many(buf)  # type: ignore[arg-type]
    assert bf.count == 0 and body(bf) == bytes(bf.nbytes)


def test_non_contiguous_uint64_slice(rng: np.random.Generator) -> None:
    hashes = rng.integers(0, 2**64, size=2000, dtype=np.uint64)
    strided = hashes[::3]
    assert not strided.flags.c_contiguous
    a = BloomFilter(2000, 0.01)
    b = BloomFilter(2000, 0.01)
    assert list(a.add_many(strided)) == list(b.add_many(np.ascontiguousarray(strided)))
    assert a == b
    assert all(a.contains_many(strided))
    assert list(a.contains_many(hashes[1::3])) == [a.contains_hash(int(h)) for h in hashes[1::3]]


def test_other_uint64_buffers(rng: np.random.Generator) -> None:
    hashes = [int(x) for x in rng.integers(0, 2**64, size=300, dtype=np.uint64)]
    ref = BloomFilter(1000, 0.01)
    for h in hashes:
        ref.add_hash(h)
    for buf in (
        array.array("Q", hashes),
        memoryview(array.array("Q", hashes).tobytes()).cast("Q"),  # read-only buffer
        np.array(hashes, dtype="<u8"),
        (ctypes.c_uint64 * len(hashes))(*hashes),  # exports format "<Q"
    ):
        bf = BloomFilter(1000, 0.01)
        assert sum(bf.add_many(buf)) == ref.count
        assert bf == ref


def test_update_returns_number_new(make_keys: Callable[..., list[bytes]]) -> None:
    bf = BloomFilter(10_000, 0.001)
    assert bf.update(make_keys(1000)) == 1000
    assert bf.update(make_keys(1000)) == 0
    assert bf.update(k for k in make_keys(1500)) == 500
    assert len(bf) == bf.count == 1500


def test_list_subclass_batch_is_hashed_correctly() -> None:
    # Run in a child: if the batch loop reads a list subclass with tuple accessors it
    # reads wild pointers, which may crash the interpreter.
    code = (
        "from dedupcore import BloomFilter\n"
        "class L(list): pass\n"
        "keys = [b'k%d' % i for i in range(100)]\n"
        "a = BloomFilter(1000, 0.01); b = BloomFilter(1000, 0.01)\n"
        "fa = list(a.add_many(L(keys))); fb = list(b.add_many(keys))\n"
        "assert fa == fb, 'flags differ'\n"
        "assert a == b, 'bodies differ'\n"
        "assert list(a.contains_many(L(keys))) == [True] * 100\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# ------------------------------------------------------------ construction --


@pytest.mark.parametrize("capacity", [0, -1, -(2**40)])
def test_capacity_must_be_positive(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity") as info:
        BloomFilter(capacity, 0.01)
    assert info.type is ValueError


@pytest.mark.parametrize("capacity", [1.0, 10.5, "100", None, True, False])
def test_capacity_must_be_an_int(capacity: object) -> None:
    with pytest.raises(TypeError, match=rf"capacity.*\b{type(capacity).__name__}\b") as info:
        BloomFilter(capacity, 0.01)  # type: ignore[arg-type]
    assert info.type is TypeError


@pytest.mark.parametrize("error_rate", [0, 0.0, 1, 1.0, -0.1, 1.5, math.nan, math.inf, -math.inf])
def test_error_rate_must_be_in_open_unit_interval(error_rate: float) -> None:
    with pytest.raises(ValueError, match="error_rate") as info:
        BloomFilter(1000, error_rate)
    assert info.type is ValueError


@pytest.mark.parametrize("error_rate", ["0.01", None, True])
def test_error_rate_must_be_a_number(error_rate: object) -> None:
    with pytest.raises(TypeError, match="error_rate") as info:
        BloomFilter(1000, error_rate)  # type: ignore[arg-type]
    assert info.type is TypeError


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_seed_out_of_range(seed: int) -> None:
    with pytest.raises(ValueError, match="seed") as info:
        BloomFilter(1000, 0.01, seed=seed)
    assert info.type is ValueError


@pytest.mark.parametrize("seed", [1.0, "1", True])
def test_seed_of_wrong_type(seed: object) -> None:
    with pytest.raises(TypeError, match="seed") as info:
        BloomFilter(1000, 0.01, seed=seed)  # type: ignore[arg-type]
    assert info.type is TypeError


def test_capacity_beyond_layout_limit() -> None:
    with pytest.raises(ValueError, match="blocks") as info:
        BloomFilter(10**13, 0.0001)
    assert info.type is ValueError


def test_properties_of_new_filter() -> None:
    bf = BloomFilter(12_345, 0.002, seed=77)
    assert (bf.capacity, bf.error_rate, bf.seed, bf.count, len(bf)) == (12_345, 0.002, 77, 0, 0)
    assert bf.nblocks == blocks_for(12_345, 0.002)
    assert not bf.readonly
    assert body(bf) == bytes(bf.nblocks * 64)
    assert "12345" in repr(bf)


# -------------------------------------------------------- set operations --


def test_union_rejects_other_geometry_or_seed() -> None:
    a = BloomFilter(1000, 0.01, seed=1)
    for other in (BloomFilter(100_000, 0.01, seed=1), BloomFilter(1000, 0.01, seed=2)):
        with pytest.raises(ValueError, match="geometry and seed"):
            a | other
        with pytest.raises(ValueError, match="geometry and seed"):
            a |= other
    assert a.count == 0


@pytest.mark.parametrize("other", [5, None, {b"a"}, b"a"])
def test_union_rejects_non_filters(other: object) -> None:
    a = BloomFilter(1000, 0.01)
    with pytest.raises(TypeError):
        a | other  # type: ignore[operator]
    with pytest.raises(TypeError):
        a |= other  # type: ignore[operator]


def test_union_of_saturated_filters() -> None:
    # A filter far over its capacity (every bit set) is legal; combining it must work.
    a = BloomFilter(1, 0.5)
    a.update([b"%d" % i for i in range(20_000)])
    assert a.fill_ratio == 1.0
    b = a.copy()
    union = a | b
    assert union == a
    assert union.count >= a.count
    a |= b
    assert a.count >= b.count


def test_equality(make_keys: Callable[..., list[bytes]]) -> None:
    keys = make_keys(200)
    a = BloomFilter(1000, 0.01)
    b = BloomFilter(1000, 0.01)
    a.update(keys)
    b.update(reversed(keys))
    assert a == b
    assert (a != b) is False
    b.add(b"extra")
    assert a != b
    c = BloomFilter(1000, 0.01, seed=1)
    c.update(keys)
    assert a != c
    assert BloomFilter(1000, 0.01) == BloomFilter(1000, 0.01)
    assert BloomFilter(1000, 0.01) != BloomFilter(1000, 0.01, seed=3)
    assert BloomFilter(1000, 0.01) != BloomFilter(100_000, 0.01)
    assert (a == 5) is False
    assert (a == body(a)) is False
    with pytest.raises(TypeError):
        hash(a)


def test_copy_is_independent(make_keys: Callable[..., list[bytes]]) -> None:
    a = BloomFilter(1000, 0.01, seed=9)
    a.update(make_keys(300))
    c = a.copy()
    assert c == a
    assert (c.capacity, c.error_rate, c.seed, c.count, c.nblocks) == (
        a.capacity,
        a.error_rate,
        a.seed,
        a.count,
        a.nblocks,
    )
    c.add(b"only-in-copy")
    assert b"only-in-copy" in c
    assert c != a
    assert c.count == a.count + 1


def test_pickle_round_trip(make_keys: Callable[..., list[bytes]]) -> None:
    a = BloomFilter(3000, 0.003, seed=2**63)
    a.update(make_keys(1000))
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        b = pickle.loads(pickle.dumps(a, protocol=protocol))
        assert isinstance(b, BloomFilter)
        assert b == a
        assert (b.capacity, b.error_rate, b.seed, b.count, b.nblocks) == (
            a.capacity,
            a.error_rate,
            a.seed,
            a.count,
            a.nblocks,
        )
        assert not b.readonly
        assert b.add(b"new-after-pickle")


def test_to_bytes_from_bytes_round_trip(make_keys: Callable[..., list[bytes]]) -> None:
    a = BloomFilter(3000, 0.01, seed=12)
    a.update(make_keys(2000))
    data = a.to_bytes()
    assert len(data) == 128 + a.nbytes
    for src in (data, bytearray(data), memoryview(data)):
        b = BloomFilter.from_bytes(src)
        assert b == a and b.count == a.count and not b.readonly


# --------------------------------------------------------------- read-only --


def test_read_only_mmap_filter(tmp_path: Path, make_keys: Callable[..., list[bytes]]) -> None:
    a = BloomFilter(1000, 0.01)
    keys = make_keys(500)
    a.update(keys)
    a.save(tmp_path / "ro.bloom")
    ro = BloomFilter.open(tmp_path / "ro.bloom", mmap=True)
    assert ro.readonly
    before = body(ro)
    with pytest.raises(ValueError, match="read-only"):
        ro.add(b"x")
    with pytest.raises(ValueError, match="read-only"):
        ro.add_many([b"x", b"y"])
    with pytest.raises(ValueError, match="read-only"):
        ro.add_many(np.array([1, 2], dtype=np.uint64))
    with pytest.raises(ValueError, match="read-only"):
        ro.add_hash(1)
    with pytest.raises(ValueError, match="read-only"):
        ro.update([b"x"])
    with pytest.raises(ValueError, match="read-only"):
        ro |= a
    assert body(ro) == before and ro.count == a.count
    assert all(k in ro for k in keys)
    assert all(ro.contains_many(keys))
    assert memoryview(ro).readonly
    # Derived filters are writable.
    for writable in (ro.copy(), ro | a, pickle.loads(pickle.dumps(ro))):
        assert not writable.readonly
        assert writable == a
        writable.add(b"x")
