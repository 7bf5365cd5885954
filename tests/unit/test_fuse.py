"""FuseFilter: the static binary fuse filter (16-bit fingerprints) of the native core.

No false negatives, the false-positive rate and size, determinism, attaching
saved bodies, mixed probes with Bloom filters, and concurrent use
(docs/warm-tier.md, "The cold archive").
"""

from __future__ import annotations

import array
import ctypes
import mmap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedupcore import _core, hash64
from dedupcore.bloom import BloomFilter

FuseFilter = _core.FuseFilter
FPR = 2.0**-16

u64 = st.integers(min_value=0, max_value=2**64 - 1)


def u64s(values: list[int] | np.ndarray) -> memoryview:
    return memoryview(np.asarray(values, dtype=np.uint64))


def held(ff: _core.FuseFilter, hashes: np.ndarray) -> np.ndarray:
    return np.frombuffer(ff.contains_many(hashes), dtype=bool)


def random_hashes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**64, size=n, dtype=np.uint64)


@pytest.fixture(scope="module")
def million() -> tuple[np.ndarray, _core.FuseFilter]:
    keys = random_hashes(1_000_000, 1)
    return keys, FuseFilter.build(keys, 3)


M64 = 2**64 - 1


def model_mix(h: int, seed: int) -> int:
    """The key mixing of ext/dc_fuse.h (MurmurHash3's 64-bit finaliser of h + seed)."""
    x = (h + seed) & M64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


def model_slots(x: int, params: tuple[int, ...]) -> tuple[int, int, int]:
    _, sl, scl, _ = params
    h0 = (x * scl) >> 64
    return h0, (h0 + sl) ^ ((x >> 18) & (sl - 1)), (h0 + 2 * sl) ^ (x & (sl - 1))


def model_contains(body: bytes, params: tuple[int, ...], h: int) -> bool:
    """A pure-Python query of the layout (docs/warm-tier.md, "The cold archive")."""
    x = model_mix(h, params[0])
    v = 0
    for s in model_slots(x, params):
        v ^= int.from_bytes(body[2 * s : 2 * s + 2], "little")
    return v == (x ^ (x >> 32)) & 0xFFFF


# ------------------------------------------------------ no false negatives --


@settings(max_examples=300)
@given(st.lists(u64, max_size=200), u64)
def test_every_hash_is_held(values: list[int], seed: int) -> None:
    ff = FuseFilter.build(u64s(values), seed)
    assert ff.count == len(set(values)) == len(ff)
    assert all(ff.contains_hash(v) for v in values)
    assert all(ff.contains_many(u64s(values)))


@settings(max_examples=100)
@given(st.lists(u64, min_size=1, max_size=50), st.integers(1, 5), st.randoms())
def test_duplicates_and_order_do_not_change_the_filter(
    values: list[int], repeat: int, rnd: object
) -> None:
    once = FuseFilter.build(u64s(sorted(set(values))), 9)
    many = values * repeat
    rnd.shuffle(many)  # type: ignore[attr-defined]
    again = FuseFilter.build(u64s(many), 9)
    assert again.count == once.count == len(set(values))
    assert again.params == once.params
    assert bytes(memoryview(again)) == bytes(memoryview(once))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 12, 13, 31, 64, 100, 1000, 4097])
def test_small_sizes(n: int) -> None:
    for seed in range(20):
        keys = random_hashes(n, 1000 + seed)
        ff = FuseFilter.build(keys, seed)
        assert held(ff, keys).all()
        assert ff.count == n


def test_consecutive_small_integers() -> None:
    keys = np.arange(100_000, dtype=np.uint64)  # low-entropy input: the filter mixes it
    ff = FuseFilter.build(keys)
    assert held(ff, keys).all()
    assert held(ff, keys + np.uint64(100_000)).sum() < 20


def test_empty_filter_holds_nothing() -> None:
    ff = FuseFilter.build(u64s([]))
    assert ff.count == 0 and len(ff) == 0
    assert ff.nbytes > 0  # a body to save, all zero
    probe = random_hashes(100_000, 5)
    assert not held(ff, probe).any()
    assert not ff.contains_hash(0)
    assert len(ff.contains_many(u64s([]))) == 0


def test_a_million_keys(million: tuple[np.ndarray, _core.FuseFilter]) -> None:
    keys, ff = million
    assert ff.count == len(keys)
    assert held(ff, keys).all()
    assert all(ff.contains_hash(int(k)) for k in keys[:1000])


# --------------------------------------------------------- fpr and size --


def test_false_positive_rate(million: tuple[np.ndarray, _core.FuseFilter]) -> None:
    keys, ff = million
    absent = np.setdiff1d(random_hashes(1_000_000, 2), keys)
    fpr = held(ff, absent).mean()
    print(f"\nfuse16 FPR at 1M keys: {fpr:.3g} ({fpr / FPR:.2f} x 2**-16)")
    assert fpr < 2.5 * FPR


@pytest.mark.parametrize("n", [1_000_000, 10_000_000])
def test_bytes_per_key(n: int) -> None:
    ff = FuseFilter.build(random_hashes(n, 7))
    per_key = ff.nbytes / n
    print(f"\nfuse16 at {n} keys: {per_key:.4f} bytes/key, params {ff.params}")
    assert ff.nbytes == ff.params[3] * 2
    assert per_key <= 2.4


# -------------------------------------------------------- determinism --


def test_same_input_and_seed_give_the_same_bytes() -> None:
    keys = random_hashes(50_000, 11)
    a, b = FuseFilter.build(keys, 42), FuseFilter.build(keys.copy(), 42)
    assert a.params == b.params
    assert bytes(memoryview(a)) == bytes(memoryview(b))
    assert a._checksum() == b._checksum()


def test_different_seeds_are_still_correct() -> None:
    keys = random_hashes(50_000, 12)
    bodies = set()
    for seed in (0, 1, 2**63, 2**64 - 1):
        ff = FuseFilter.build(keys, seed)
        assert held(ff, keys).all()
        bodies.add(bytes(memoryview(ff)))
    assert len(bodies) == 4


def test_checksum_is_xxh64_of_the_body() -> None:
    ff = FuseFilter.build(random_hashes(1000, 13))
    assert ff._checksum() == hash64(bytes(memoryview(ff)))


# --------------------------------------------------------- input types --


def test_accepted_hash_buffers() -> None:
    values = [1, 2, 3, 2**64 - 1]
    raw = np.asarray(values, dtype="<u8").tobytes()
    reference = bytes(memoryview(FuseFilter.build(u64s(values))))
    for buf in (
        raw,
        bytearray(raw),
        memoryview(raw),
        memoryview(raw).cast("Q"),
        array.array("Q", values),
        np.asarray(values, dtype=np.uint64),
    ):
        ff = FuseFilter.build(buf)
        assert bytes(memoryview(ff)) == reference
        assert all(ff.contains_many(buf))


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ("abc", TypeError, "not str"),
        ([1, 2, 3], TypeError, "not list"),
        (12345, TypeError, "not int"),
        (np.zeros(4, dtype=np.int64), TypeError, "format='l'|format='q'"),
        (np.zeros(4, dtype=np.uint32), TypeError, "format="),
        (np.zeros((2, 2), dtype=np.uint64), TypeError, "ndim=2"),
        (b"1234567", ValueError, "multiple of 8"),
        (np.zeros(8, dtype=np.uint64)[::2], ValueError, "C-contiguous"),
    ],
)
def test_rejected_hash_buffers(bad: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        FuseFilter.build(bad)  # type: ignore[arg-type]
    ff = FuseFilter.build(u64s([1]))
    with pytest.raises(error, match=match):
        ff.contains_many(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "0", True])
def test_rejected_seeds(seed: object) -> None:
    with pytest.raises((TypeError, OverflowError)):
        FuseFilter.build(u64s([1]), seed)  # type: ignore[arg-type]


def test_an_unbuilt_filter_refuses_use() -> None:
    ff = FuseFilter()
    for use in (
        lambda: ff.contains_hash(1),
        lambda: ff.contains_many(u64s([1])),
        lambda: ff.params,
        ff._checksum,
        lambda: memoryview(ff),
        lambda: _core.probe_many((ff,), u64s([1]), None, 0),
    ):
        with pytest.raises(ValueError, match="not initialised"):
            use()
    assert ff.count == 0 and ff.nbytes == 0


def test_body_is_exported_read_only() -> None:
    ff = FuseFilter.build(random_hashes(100, 14))
    view = memoryview(ff)
    assert view.readonly and view.nbytes == ff.nbytes and view.format == "B"
    with pytest.raises(ValueError):
        np.frombuffer(ff, dtype=np.uint8).setflags(write=True)
    with pytest.raises((BufferError, TypeError)):
        (ctypes.c_char * ff.nbytes).from_buffer(ff)


# ---------------------------------------------------------------- attach --


def attached(body: object, params: tuple[int, ...], count: int) -> _core.FuseFilter:
    ff = FuseFilter()
    ff._attach(body, params, count)  # type: ignore[arg-type]
    return ff


def test_attach_round_trip_via_bytes() -> None:
    keys = random_hashes(20_000, 15)
    ff = FuseFilter.build(keys, 5)
    copy = attached(bytes(memoryview(ff)), ff.params, ff.count)
    assert copy.params == ff.params and copy.count == ff.count and copy.nbytes == ff.nbytes
    assert held(copy, keys).all()
    probe = random_hashes(20_000, 16)
    assert bytes(copy.contains_many(probe)) == bytes(ff.contains_many(probe))
    assert copy._checksum() == ff._checksum()


def test_attach_round_trip_via_mmap(tmp_path: Path) -> None:
    keys = random_hashes(30_000, 17)
    ff = FuseFilter.build(keys, 6)
    path = tmp_path / "slice.fuse"
    head = b"H" * 128
    path.write_bytes(head + bytes(memoryview(ff)))
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    copy = attached(memoryview(mapped)[len(head) :], ff.params, ff.count)
    assert held(copy, keys).all()
    assert memoryview(copy).readonly
    # The filter keeps the map exported: it cannot be closed under it.
    with pytest.raises(BufferError):
        mapped.close()
    del copy
    mapped.close()


def test_attach_with_copy_keeps_no_reference_to_the_source(tmp_path: Path) -> None:
    keys = random_hashes(30_000, 19)
    ff = FuseFilter.build(keys, 7)
    path = tmp_path / "slice.fuse"
    path.write_bytes(bytes(memoryview(ff)))
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mapped)
    copy = FuseFilter()
    copy._attach(view, ff.params, ff.count, copy=True)
    view.release()
    mapped.close()  # nothing exported: the filter owns its body
    path.write_bytes(b"\0" * ff.nbytes)
    assert held(copy, keys).all()
    assert copy._checksum() == ff._checksum()
    source = bytearray(memoryview(ff))
    other = FuseFilter()
    other._attach(source, ff.params, ff.count, copy=True)
    source[:] = bytes(len(source))  # changing the source changes nothing
    assert bytes(memoryview(other)) == bytes(memoryview(ff))
    with pytest.raises(ValueError, match="bytes"):
        FuseFilter()._attach(source[:-2], ff.params, ff.count, copy=True)


def test_attach_an_empty_filter() -> None:
    ff = FuseFilter.build(b"")
    copy = attached(bytes(memoryview(ff)), ff.params, 0)
    assert not held(copy, random_hashes(1000, 18)).any()


def test_attach_twice_is_refused() -> None:
    ff = FuseFilter.build(random_hashes(100, 19))
    body = bytes(memoryview(ff))
    copy = attached(body, ff.params, ff.count)
    with pytest.raises(ValueError, match="already has a body"):
        copy._attach(body, ff.params, ff.count)
    with pytest.raises(ValueError, match="already has a body"):
        ff._attach(body, ff.params, ff.count)


def test_attach_rejects_wrong_lengths() -> None:
    ff = FuseFilter.build(random_hashes(1000, 20))
    body = bytes(memoryview(ff))
    for wrong in (body[:-2], body + b"\0\0", b"", body[:-1]):
        with pytest.raises(ValueError, match=f"body is {len(wrong)} bytes"):
            attached(wrong, ff.params, ff.count)


def _params_cases() -> list[tuple[tuple[object, ...], str]]:
    seed, sl, scl, al = 7, 128, 1152, 1408
    return [
        ((seed, sl, scl), "expected 4"),
        ((seed, sl, scl, al, 0), "expected 4"),
        ((seed, 0, scl, 1152), "power of two"),
        ((seed, 96, 96 * 12, 96 * 14), "power of two"),
        ((seed, 2**19, 2**19, 3 * 2**19), "power of two"),
        ((seed, sl, 0, 2 * sl), "positive multiple"),
        ((seed, sl, scl + 1, al + 1), "positive multiple"),
        ((seed, sl, scl, al + 128), "segment_count_length \\+ 2"),
        ((seed, sl, scl, al - 128), "segment_count_length \\+ 2"),
        ((seed, 4, 2**64 - 4, 4), "must be less than"),
        ((seed, 4, 2**32, 2**32 + 8), "at most"),
        ((-1, sl, scl, al), "0..2\\*\\*64-1"),
        ((2**64, sl, scl, al), "0..2\\*\\*64-1"),
    ]


@pytest.mark.parametrize(("params", "match"), _params_cases())
def test_attach_rejects_inconsistent_params(params: tuple[int, ...], match: str) -> None:
    al = params[3] if len(params) > 3 and isinstance(params[3], int) else 1408
    body = bytes(2 * al) if 0 <= al < 2**24 else b""
    with pytest.raises(ValueError, match=match):
        attached(body, params, 0)


def test_attach_rejects_a_count_beyond_the_slots() -> None:
    ff = FuseFilter.build(random_hashes(10, 21))
    with pytest.raises(ValueError, match="count"):
        attached(bytes(memoryview(ff)), ff.params, ff.params[3] + 1)
    with pytest.raises(ValueError, match="count"):
        attached(bytes(memoryview(ff)), ff.params, -1)


@pytest.mark.parametrize(
    ("body", "params", "match"),
    [
        ("x" * 24, (1, 4, 4, 12), "not str"),
        (12, (1, 4, 4, 12), "not int"),
        ([0] * 24, (1, 4, 4, 12), "not list"),
        (bytes(24), [1, 4, 4, 12], "tuple"),
        (bytes(24), (1, 4.0, 4, 12), "must be an int"),
        (bytes(24), (1, True, 4, 12), "must be an int"),
    ],
)
def test_attach_rejects_wrong_types(body: object, params: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        attached(body, params, 0)  # type: ignore[arg-type]


def test_attach_rejects_a_strided_body() -> None:
    strided = memoryview(bytes(48))[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        attached(strided, (1, 4, 4, 12), 0)


# ------------------------------------------------------------ probe_many --


def test_probe_many_mixes_bloom_and_fuse_filters() -> None:
    seed = 77
    keys = [b"key-%d" % i for i in range(6000)]
    bloom_a = BloomFilter(2000, 0.01, seed=seed)
    bloom_a.update(keys[:2000])
    bloom_b = BloomFilter(2000, 0.01, seed=seed)
    bloom_b.update(keys[2000:3000])
    fuse_a = FuseFilter.build(_core.hash64_many(keys[3000:4500], seed), 1)
    fuse_b = FuseFilter.build(_core.hash64_many(keys[4500:5000], seed), 2)
    probe = keys + [b"absent-%d" % i for i in range(20_000)]
    hashes = _core.hash64_many(probe, seed)
    filters = (fuse_a, bloom_a, fuse_b, bloom_b)
    expected = [
        bloom_a.contains_hash(h)
        or bloom_b.contains_hash(h)
        or fuse_a.contains_hash(h)
        or fuse_b.contains_hash(h)
        for h in hashes
    ]
    assert all(expected[:5000])
    for batch in (probe, tuple(probe), hashes):
        for order in (filters, filters[::-1]):
            assert list(_core.probe_many(order, batch, None, seed)) == expected
    # Fuse filters alone, and one with an empty fuse filter.
    empty = FuseFilter.build(b"")
    only = [fuse_a.contains_hash(h) or fuse_b.contains_hash(h) for h in hashes]
    assert list(_core.probe_many((fuse_a, empty, fuse_b), probe, None, seed)) == only
    assert list(_core.probe_many((empty,), hashes, None, seed)) == [False] * len(probe)
    # A long list crosses the chunks of the key-list path.
    assert (
        list(_core.probe_many((fuse_a,), probe * 2, None, seed))
        == [fuse_a.contains_hash(h) for h in hashes] * 2
    )


def test_probe_digests_probes_the_first_half_of_each_digest() -> None:
    # The store's lookups: concatenated 16-byte digests, keyed by their first 8
    # bytes in native order; the answer must be probe_many's over those hashes.
    seed = 5
    rng = np.random.default_rng(3)
    digests = rng.integers(0, 2**63, size=2 * 7000, dtype=np.uint64).tobytes()
    fronts = np.frombuffer(digests, dtype=np.uint64)[::2].copy()
    bloom = BloomFilter(3000, 0.01, seed=seed)
    bloom.update(u64s(fronts[:2500]))
    fuse = FuseFilter.build(u64s(fronts[2500:4000]), 9)
    empty = FuseFilter.build(b"")
    for filters in ((bloom, fuse, empty), (fuse,), (bloom,), ()):
        expected = list(_core.probe_many(filters, u64s(fronts), None, seed))
        assert list(_core.probe_digests(filters, digests, seed)) == expected  # crosses chunks
        assert list(_core.probe_digests(filters, digests[:160], seed)) == expected[:10]
    assert all(_core.probe_digests((bloom, fuse), digests, seed)[:4000])
    assert list(_core.probe_digests((bloom,), b"", seed)) == []
    # half=1: the second 8 bytes (the warm tier's slice filters).
    seconds = np.frombuffer(digests, dtype=np.uint64)[1::2].copy()
    for filters in ((bloom, fuse), ()):
        expected = list(_core.probe_many(filters, u64s(seconds), None, seed))
        assert list(_core.probe_digests(filters, digests, seed, 1)) == expected
    back = BloomFilter(3000, 0.01, seed=seed)
    back.update(u64s(seconds[:2500]))
    assert all(_core.probe_digests((back,), digests, seed, 1)[:2500])
    assert list(_core.probe_digests((back,), digests, seed, 1)) != list(
        _core.probe_digests((back,), digests, seed)
    )


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (((), bytes(17), 1), ValueError, "multiple of 16 bytes, got 17"),
        (((), bytearray(16), 1), TypeError, "bytearray"),
        (((), memoryview(bytes(16)), 1), TypeError, "memoryview"),
        (([], bytes(16), 1), TypeError, "list"),
        ((("x",), bytes(16), 1), TypeError, "BlockFilter, FuseFilter or FuseStack"),
        (((BloomFilter(10, 0.01, seed=2),), bytes(16), 1), ValueError, "share their hash seed"),
        (((BloomFilter(10, 0.01, seed=2),), b"", 1), ValueError, "share their hash seed"),
        ((("x",), b"", 1), TypeError, "BlockFilter, FuseFilter or FuseStack"),
        (((), bytes(16), 1, 2), ValueError, "half is 0 .* or 1 .*, got 2"),
        (((), bytes(16), 1, -1), ValueError, "got -1"),
        (((), bytes(16), 1, "1"), TypeError, "an integer is required"),
    ],
)
def test_probe_digests_rejects_bad_arguments(
    args: tuple[object, ...], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        _core.probe_digests(*args)  # type: ignore[arg-type]


def test_probe_many_refuses_bad_filters_and_a_fuse_target() -> None:
    bloom = BloomFilter(100, 0.01, seed=1)
    fuse = FuseFilter.build(_core.hash64_many([b"a"], 1))
    with pytest.raises(TypeError, match="cannot be the target"):
        _core.probe_many((), [b"a"], fuse, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="BlockFilter, FuseFilter or FuseStack"):
        _core.probe_many((fuse, "x"), [b"a"], bloom, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="BlockFilter, FuseFilter or FuseStack"):
        _core.probe_many((bloom, "x"), [b"a"], None, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="BlockFilter or None"):
        _core.probe_many((), [b"a"], "x", 1)  # type: ignore[arg-type]
    assert bloom.count == 0  # nothing was added


def test_probe_many_with_a_target_counts_fuse_filters_as_seen() -> None:
    # A key a fuse filter may hold was not new; it is still added to the target.
    seed = 4
    keys = [b"f%d" % i for i in range(3000)]
    fuse = FuseFilter.build(_core.hash64_many(keys[:1000], seed), 7)
    other = BloomFilter(2000, 0.01, seed=seed)
    other.update(keys[1000:1500])
    target = BloomFilter(4000, 0.01, seed=seed)
    hashes = _core.hash64_many(keys, seed)
    seen = [fuse.contains_hash(h) or other.contains_hash(h) for h in hashes]
    flags = list(_core.probe_many((fuse, other), keys, target, seed))
    assert not any(flags[:1500])  # held by the fuse or the other filter
    # The rest is new unless a filter's false positive says otherwise (or the key
    # repeats a target block's bits: a Bloom filter's own false positive).
    assert all(not (f and s) for f, s in zip(flags, seen, strict=True))
    assert sum(flags[1500:]) >= 1480
    assert all(k in target for k in keys)  # every key was added
    assert not any(_core.probe_many((fuse, other), keys, target, seed))  # now seen


def test_probe_many_bloom_only_is_unchanged() -> None:
    bloom = BloomFilter(1000, 0.01, seed=3)
    keys = [b"k%d" % i for i in range(500)]
    assert all(_core.probe_many((), keys, bloom, 3))
    assert not any(_core.probe_many((), keys, bloom, 3))
    assert all(_core.probe_many((bloom,), keys, None, 3))


# ----------------------------------------------------------- concurrency --


def test_concurrent_queries_and_builds() -> None:
    keys = random_hashes(200_000, 30)
    shared = FuseFilter.build(keys, 1)
    absent = random_hashes(200_000, 31)
    expected_absent = bytes(shared.contains_many(absent))
    errors: list[BaseException] = []
    stop = threading.Event()

    def query() -> None:
        try:
            for _ in range(30):
                assert held(shared, keys).all()
                assert bytes(shared.contains_many(absent)) == expected_absent
                assert list(_core.probe_many((shared,), keys[:1000], None, 0)) == [True] * 1000
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            stop.set()

    def build(seed: int) -> None:
        try:
            while not stop.is_set():
                mine = random_hashes(100_000, seed)
                ff = FuseFilter.build(mine, seed)
                assert held(ff, mine).all()
                assert held(shared, keys[:10_000]).all()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=query) for _ in range(3)]
    threads += [threading.Thread(target=build, args=(s,)) for s in (40, 41)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]


# ---------------------------------------------------------------- layout --


def test_layout_matches_the_python_model() -> None:
    keys = random_hashes(5000, 50)
    for seed in (0, 5):
        ff = FuseFilter.build(keys, seed)
        body, params = bytes(memoryview(ff)), ff.params
        assert all(model_contains(body, params, int(k)) for k in keys)
        probe = random_hashes(20_000, 51 + seed)
        assert [model_contains(body, params, int(h)) for h in probe] == list(
            ff.contains_many(probe)
        )


def test_huge_array_addressing(tmp_path: Path) -> None:
    """A body of nearly 2**32 slots (8 GiB, a sparse file): slots past 2**31 and byte
    offsets past 2**32 are addressed right."""
    sl = 262144
    al = 2**32 - sl
    params = (123, sl, al - 2 * sl, al)
    path = tmp_path / "huge.fuse"
    chosen: list[int] = []
    rng = np.random.default_rng(52)
    with open(path, "wb") as fh:
        fh.truncate(2 * al)
        # Make some hashes held: write each one's fingerprint into its first slot
        # (the other two stay zero), choosing hashes whose slots lie high.
        while len(chosen) < 200:
            h = int(rng.integers(0, 2**64, dtype=np.uint64))
            x = model_mix(h, params[0])
            s0 = model_slots(x, params)[0]
            # Every other one in the last few segments, next to 2**32 slots.
            low = 2**32 - 4 * sl if len(chosen) % 2 else 2**31
            if s0 < low:
                continue
            fh.seek(2 * s0)
            fh.write(((x ^ (x >> 32)) & 0xFFFF).to_bytes(2, "little"))
            chosen.append(h)
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    mapped.madvise(mmap.MADV_RANDOM)  # no readahead around each probed hole
    ff = attached(memoryview(mapped), params, 100)
    try:
        assert ff.nbytes == 2 * al
        assert all(ff.contains_many(u64s(chosen)))
        assert all(ff.contains_hash(h) for h in chosen)
        probe = random_hashes(500, 53)
        assert [model_contains(mapped, params, int(h)) for h in probe] == list(  # type: ignore[arg-type]
            ff.contains_many(probe)
        )
    finally:
        del ff
        mapped.close()


# -- stacks: filters of one geometry side by side -----------------------------------

FuseStack = _core.FuseStack


def stacked(sizes: list[int], seed: int = 9) -> tuple[list[np.ndarray], list[FuseFilter]]:
    """Key sets of ``sizes`` and their filters, all in the geometry of the largest
    (the sets are fixed, and every build's first internal seed works for them)."""
    sets = [random_hashes(size, 100 + i) for i, size in enumerate(sizes)]
    like = FuseFilter.build(sets[int(np.argmax(sizes))], seed).params
    filters = [FuseFilter.build(keys, seed, like) for keys in sets]
    assert all(ff.params == like for ff in filters)
    return sets, filters


def stack_of(filters: list[FuseFilter], width: int | None = None) -> _core.FuseStack:
    stack = FuseStack(filters[0].params, width or len(filters))
    for column, ff in enumerate(filters):
        stack.put(column, ff)
        stack.set_live(column)
    return stack


def test_build_like_shares_a_geometry_that_fits_and_refuses_one_that_does_not() -> None:
    small, large = random_hashes(9_000, 1), random_hashes(10_000, 2)
    own_small = FuseFilter.build(small, 4)
    big = FuseFilter.build(large, 4)
    assert own_small.params[3] < big.params[3]
    like_big = FuseFilter.build(small, 4, big.params)
    assert like_big.params == big.params  # more slots than its own: taken
    assert held(like_big, small).all()
    # Fewer slots than the keys need, or another segment length: their own geometry.
    assert FuseFilter.build(large, 4, own_small.params).params == big.params
    tiny = FuseFilter.build(random_hashes(100, 3), 4)
    assert FuseFilter.build(small, 4, tiny.params).params == own_small.params
    seg, scl, slots = _core.fuse_geometry(10_000)
    assert big.params[1:] == (seg, scl, slots)
    with pytest.raises(ValueError, match="segment_length"):
        FuseFilter.build(small, 4, (4, 3, 300, 306))


# A row is compared in groups of eight lanes: one group up to 8 columns, four at 32.
@pytest.mark.parametrize("width", [5, 8, 12, 20, 25, 32])
def test_a_stack_answers_as_its_filters_do(width: int) -> None:
    sets, filters = stacked([20_000, 19_000, 15_000, 20_000, 12_000])
    stack = stack_of(filters, width)
    for column in range(5, width):  # the further columns hold the same filters again
        stack.put(column, filters[column % 5])
        stack.set_live(column)
    assert stack.width == width and stack.live == tuple(range(width))
    assert stack.count == sum(filters[column % 5].count for column in range(width))
    assert stack.nbytes == width * filters[0].nbytes
    for keys in sets:
        assert np.frombuffer(stack.contains_many(keys), dtype=bool).all()
    probe = random_hashes(400_000, 77)
    separate = np.frombuffer(_core.probe_many(tuple(filters), u64s(probe), None, 0), dtype=bool)
    together = np.frombuffer(stack.contains_many(probe), dtype=bool)
    assert (separate == together).all()  # the very same false positives
    assert together.mean() < 5 * FPR * 2
    assert [stack.contains_hash(int(h)) for h in probe[:2000]] == list(together[:2000])
    mixed = _core.probe_many((stack, BloomFilter(100, 0.01)), u64s(sets[2][:500]), None, 0)
    assert all(mixed)


def test_a_column_answers_only_while_live() -> None:
    sets, filters = stacked([5_000, 5_000, 5_000])
    stack = FuseStack(filters[0].params, 3)
    stack.put(1, filters[1])
    assert stack.live == () and not stack.contains_many(sets[1]).tobytes().strip(b"\0")
    assert _core.probe_many((stack,), u64s(sets[1][:10]), None, 0).tolist() == [False] * 10
    stack.set_live(1)
    assert np.frombuffer(stack.contains_many(sets[1]), dtype=bool).all()
    stack.drop(1)
    assert stack.live == () and stack.count == 0
    assert np.frombuffer(stack.contains_many(sets[1]), dtype=bool).mean() < 0.01
    stack.put(1, filters[2])  # a dropped column takes another filter
    stack.set_live(1)
    assert np.frombuffer(stack.contains_many(sets[2]), dtype=bool).all()
    assert np.frombuffer(stack.contains_many(sets[1]), dtype=bool).mean() < 0.01


@pytest.mark.parametrize("column", [7, 8, 17, 31])
def test_a_column_of_any_lane_group_answers_only_while_live(column: int) -> None:
    # Each of the filters in a column of its own, in the first, second, third or last
    # group of eight lanes, next to dead columns that still hold another filter.
    sets, filters = stacked([5_000, 5_000])
    stack = FuseStack(filters[0].params, 32)
    for c in range(32):
        stack.put(c, filters[1])
    stack.put(column, filters[0])
    stack.set_live(column)
    assert stack.live == (column,)
    assert np.frombuffer(stack.contains_many(sets[0]), dtype=bool).all()
    assert all(stack.contains_hash(int(h)) for h in sets[0][:200])
    assert np.frombuffer(stack.contains_many(sets[1]), dtype=bool).mean() < 0.01
    stack.drop(column)
    assert not stack.contains_many(sets[0]).tobytes().strip(b"\0")


def test_grown_keeps_every_column() -> None:
    sets, filters = stacked([10_000, 10_000, 10_000])
    stack = stack_of(filters[:2])
    stack.drop(0)
    wider = stack.grown(3)
    assert wider.width == 3 and wider.live == (1,)
    wider.put(2, filters[2])
    wider.set_live(2)
    assert np.frombuffer(wider.contains_many(sets[1]), dtype=bool).all()
    assert np.frombuffer(wider.contains_many(sets[2]), dtype=bool).all()
    assert np.frombuffer(wider.contains_many(sets[0]), dtype=bool).mean() < 0.01
    assert stack.grown(2).live == (1,)
    with pytest.raises(ValueError, match="at least 2"):
        stack.grown(1)


def test_a_released_filter_keeps_its_figures_and_refuses_queries() -> None:
    ff = FuseFilter.build(random_hashes(3_000, 5), 1)
    params, count, nbytes = ff.params, ff.count, ff.nbytes
    ff._release()
    assert (ff.params, ff.count, ff.nbytes) == (params, count, nbytes)
    with pytest.raises(ValueError, match="not initialised"):
        ff.contains_hash(1)
    with pytest.raises(ValueError, match="not initialised"):
        memoryview(ff)
    with pytest.raises(ValueError, match="not initialised"):
        _core.probe_many((ff,), u64s([1]), None, 0)
    ff._release()  # twice is nothing


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (((1, 4, 8, 16), 0), ValueError, r"width must be in 1\.\.32"),
        (((1, 4, 8, 16), 33), ValueError, r"width must be in 1\.\.32"),
        (((1, 4, 8, 16), True), TypeError, "width must be an int"),
        (((1, 4, 8, 16), "2"), TypeError, "width must be an int"),
        (((1, 4, 8), 2), ValueError, "expected 4 fuse filter parameters"),
        (((1, 3, 8, 14), 2), ValueError, "segment_length must be a power of two"),
        (([1, 4, 8, 16], 2), TypeError, "params must be a tuple"),
    ],
)
def test_stack_rejects_bad_arguments(
    args: tuple[object, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        FuseStack(*args)  # type: ignore[arg-type]


def test_stack_put_refuses_what_does_not_fit() -> None:
    _, filters = stacked([4_000, 4_000])
    stack = stack_of(filters[:1], width=2)
    other = FuseFilter.build(random_hashes(40_000, 8), 9)
    with pytest.raises(ValueError, match="params"):
        stack.put(1, other)
    with pytest.raises(ValueError, match="column 0 is live"):
        stack.put(0, filters[1])
    with pytest.raises(ValueError, match=r"column must be in 0\.\.1"):
        stack.put(2, filters[1])
    with pytest.raises(ValueError, match=r"column must be in 0\.\.1"):
        stack.drop(-1)
    with pytest.raises(TypeError, match="column must be an int"):
        stack.set_live(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="column 1 holds no filter"):
        stack.set_live(1)
    with pytest.raises(TypeError):
        stack.put(1, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="are not the stack's"):
        stack.put(1, FuseFilter.build(b"", 9))
    empty = FuseFilter()
    empty._attach(bytes(stack.params[3] * 2), stack.params, 0)
    with pytest.raises(ValueError, match="no keys"):
        stack.put(1, empty)
    released = FuseFilter.build(random_hashes(4_000, 100 + 1), 9, filters[0].params)
    released._release()
    with pytest.raises(ValueError, match="not initialised"):
        stack.put(1, released)
    assert stack.live == (0,)


def test_concurrent_probes_while_a_column_is_put() -> None:
    sets, filters = stacked([50_000, 50_000])
    stack = stack_of(filters[:1], width=2)
    errors: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            if not np.frombuffer(stack.contains_many(sets[0]), dtype=bool).all():
                errors.append("a live column lost a key while another was put")

    threads = [threading.Thread(target=probe) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(20):
            stack.put(1, filters[1])
            stack.drop(1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
