"""Sharding: jump consistent hash of the stable key hash."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import xxhash

from dedupcore import shard_many, shard_of
from dedupcore._core import hash64_many, jump_hash

MASK64 = (1 << 64) - 1


def jump_reference(key: int, num_buckets: int) -> int:
    """Lamping & Veach, "A Fast, Minimal Memory, Consistent Hash Algorithm" (2014), Figure 1."""
    b, j = -1, 0
    while j < num_buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & MASK64
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


BUCKET_COUNTS = [1, 2, 3, 7, 10, 16, 100, 1000, 1023, 65_536, 1_000_003, 2**31 - 1]


def _sample_keys() -> list[int]:
    rnd = random.Random(7)
    keys = [0, 1, 2, 2**32, 2**63, MASK64, MASK64 - 1, 0x9E3779B97F4A7C15]
    keys += [rnd.getrandbits(64) for _ in range(400)]
    keys += [rnd.getrandbits(16) for _ in range(50)]  # small keys: high bits all zero
    return keys


@pytest.mark.parametrize("n", BUCKET_COUNTS)
def test_jump_hash_matches_published_algorithm(n: int) -> None:
    for key in _sample_keys():
        assert jump_hash(key, n) == jump_reference(key, n), (key, n)


def test_jump_hash_every_bucket_count_up_to_300() -> None:
    rnd = random.Random(3)
    for n in range(1, 301):
        for _ in range(10):
            key = rnd.getrandbits(64)
            assert jump_hash(key, n) == jump_reference(key, n)


@pytest.mark.parametrize("n", [1, 2, 5, 10, 97, 4096])
def test_shard_of_is_jump_of_xxh64_seed_0(make_keys: Callable[..., list[bytes]], n: int) -> None:
    for key in [*make_keys(300), b"", "order-42", "ключ", bytearray(b"x"), memoryview(b"yz")]:
        raw = key.encode() if isinstance(key, str) else bytes(key)
        expected = jump_reference(xxhash.xxh64_intdigest(raw, 0), n)
        assert shard_of(key, n) == expected
        assert 0 <= expected < n


# XXH64 (seed 0) of the key, then the published jump consistent hash.
# These decide which shard holds a key on every deployment: they must never change.
STABILITY_VECTORS = [
    (b"", 1, 0),
    (b"", 2, 1),
    (b"order-42", 10, 2),
    ("order-42", 10, 2),
    (b"transfer-0001", 3, 1),
    (b"request-id-7f3a", 100, 71),
    ("ключ-1", 16, 14),
    (b"user:1234567", 1000, 837),
    (b"a", 65_536, 37_982),
    (b"\x00\xff", 7, 0),
    (b"order-42", 2**31 - 1, 2_047_905_874),
    (b"billing/orders:99", 1024, 612),
]


@pytest.mark.parametrize(("key", "n", "shard"), STABILITY_VECTORS)
def test_stability_vectors(key: bytes | str, n: int, shard: int) -> None:
    assert shard_of(key, n) == shard
    assert list(shard_many([key], n)) == [shard]


def test_balance_over_ten_shards() -> None:
    n_keys, n = 1_000_000, 10
    keys = [b"balance-%d" % i for i in range(n_keys)]
    shards = np.frombuffer(shard_many(keys, n), dtype=np.uint32)
    counts = np.bincount(shards, minlength=n)
    assert len(counts) == n
    expected = n_keys / n
    # sd of one count is ~300 keys; 2% is ~6.7 sd.
    assert np.all(np.abs(counts - expected) <= 0.02 * expected), counts.tolist()


@pytest.mark.parametrize("n", [1, 2, 3, 9, 10, 63, 500])
def test_growing_moves_keys_only_to_the_new_shard(n: int, rng: np.random.Generator) -> None:
    hashes = rng.integers(0, 2**64, size=200_000, dtype=np.uint64)
    before = np.frombuffer(shard_many(hashes, n), dtype=np.uint32)
    after = np.frombuffer(shard_many(hashes, n + 1), dtype=np.uint32)
    moved = before != after
    assert np.all(after[moved] == n)
    assert np.all(after[~moved] == before[~moved])
    # About 1/(n+1) of the keys move.
    share = moved.mean()
    expected = 1 / (n + 1)
    assert abs(share - expected) <= 4 * np.sqrt(expected * (1 - expected) / len(hashes))


def test_shard_many_equals_shard_of(make_keys: Callable[..., list[bytes]]) -> None:
    keys: list[bytes | str] = [*make_keys(2000), "str-key", "ключ", b""]
    for n in (1, 2, 13, 1000):
        many = shard_many(keys, n)
        assert many.format == "I"
        assert len(many) == len(keys)
        assert list(many) == [shard_of(k, n) for k in keys]
        assert list(shard_many(tuple(keys), n)) == list(many)
        assert list(shard_many(iter(keys), n)) == list(many)


def test_shard_many_accepts_uint64_buffer(make_keys: Callable[..., list[bytes]]) -> None:
    keys = make_keys(3000)
    hashes = np.frombuffer(hash64_many(keys, 0), dtype=np.uint64)
    for n in (1, 7, 256):
        by_buffer = list(shard_many(hashes, n))
        assert by_buffer == list(shard_many(keys, n))
        assert by_buffer == [jump_reference(int(h), n) for h in hashes]
        strided = hashes[::2]
        assert list(shard_many(strided, n)) == by_buffer[::2]


def test_shard_many_empty() -> None:
    assert len(shard_many([], 5)) == 0
    assert len(shard_many(np.array([], dtype=np.uint64), 5)) == 0


@pytest.mark.parametrize("n", [0, -1, -(2**31)])
def test_non_positive_shard_count_raises(n: int) -> None:
    with pytest.raises(ValueError, match=str(n)):
        shard_of(b"k", n)
    with pytest.raises(ValueError, match=str(n)):
        shard_many([b"k"], n)
    with pytest.raises(ValueError):
        jump_hash(1, n)


def test_shard_count_of_wrong_type() -> None:
    # A float count must not be truncated silently to another shard count.
    with pytest.raises(TypeError):
        shard_of(b"k", 10.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        shard_many([b"k"], 10.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        shard_of(b"k", "10")  # type: ignore[arg-type]


def test_bad_keys_raise_type_error() -> None:
    with pytest.raises(TypeError, match="int"):
        shard_of(42, 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"index 1\b.*NoneType"):
        shard_many([b"a", None], 10)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="single"):
        shard_many(b"abc", 10)  # type: ignore[arg-type]
