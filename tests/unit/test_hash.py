"""hash64 / hash64_many: XXH64 exactly as the reference xxhash library computes it."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from dedupcore import _core, hash64
from dedupcore import keys as dkeys
from dedupcore._core import hash64_many

SEEDS = [0, 1, 2**32, 2**64 - 1]

_DATA = random.Random(1).randbytes(1024 + 16)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_length_up_to_1024_matches_xxhash(seed: int) -> None:
    for n in range(1025):
        key = _DATA[:n]
        assert hash64(key, seed) == xxhash.xxh64_intdigest(key, seed), (n, seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_unaligned_slices_match_xxhash(seed: int) -> None:
    buf = memoryview(_DATA)
    for offset in range(1, 8):
        for n in (0, 1, 3, 4, 7, 8, 9, 31, 32, 33, 63, 64, 65, 100, 1000):
            key = buf[offset : offset + n]
            assert hash64(key, seed) == xxhash.xxh64_intdigest(bytes(key), seed)


def test_default_seed_is_zero() -> None:
    assert hash64(b"order-42") == xxhash.xxh64_intdigest(b"order-42", 0)
    assert list(hash64_many([b"order-42"])) == [xxhash.xxh64_intdigest(b"order-42", 0)]


@pytest.mark.parametrize("seed", [0, 2**64 - 1])
def test_multi_megabyte_key(seed: int) -> None:
    key = os.urandom(5 * 1024 * 1024 + 13)
    assert hash64(key, seed) == xxhash.xxh64_intdigest(key, seed)
    assert list(hash64_many([key, key[1:]], seed)) == [
        xxhash.xxh64_intdigest(key, seed),
        xxhash.xxh64_intdigest(key[1:], seed),
    ]


@pytest.mark.parametrize("text", ["", "a", "order-42", "héllo wörld", "ключ", "鍵", "🔑🗝️", "\x00x"])
@pytest.mark.parametrize("seed", SEEDS)
def test_str_hashes_as_utf8(text: str, seed: int) -> None:
    expected = xxhash.xxh64_intdigest(text.encode("utf-8"), seed)
    assert hash64(text, seed) == expected
    assert list(hash64_many([text], seed)) == [expected]


@given(st.text(), st.sampled_from(SEEDS))
def test_str_hashes_as_utf8_property(text: str, seed: int) -> None:
    assert hash64(text, seed) == xxhash.xxh64_intdigest(text.encode("utf-8"), seed)


@given(st.binary(max_size=300), st.integers(0, 2**64 - 1))
def test_bytes_like_keys_equal_bytes_keys(data: bytes, seed: int) -> None:
    expected = xxhash.xxh64_intdigest(data, seed)
    assert hash64(data, seed) == expected
    assert hash64(bytearray(data), seed) == expected
    assert hash64(memoryview(data), seed) == expected
    padded = b"xy" + data + b"z"
    assert hash64(memoryview(padded)[2:-1], seed) == expected
    assert (
        list(hash64_many([data, bytearray(data), memoryview(data), memoryview(padded)[2:-1]], seed))
        == [expected] * 4
    )


def test_bytes_subclass_and_str_subclass_keys() -> None:
    class B(bytes):
        pass

    class S(str):
        pass

    assert hash64(B(b"abc")) == xxhash.xxh64_intdigest(b"abc", 0)
    assert hash64(S("abc")) == xxhash.xxh64_intdigest(b"abc", 0)
    assert list(hash64_many([B(b"abc"), S("abc")])) == [xxhash.xxh64_intdigest(b"abc", 0)] * 2


@given(
    st.lists(st.one_of(st.binary(max_size=80), st.text(max_size=40)), max_size=60),
    st.sampled_from(SEEDS),
)
def test_hash64_many_equals_per_key_hash64(keys: list[bytes | str], seed: int) -> None:
    many = hash64_many(keys, seed)
    assert many.format == "Q"
    assert len(many) == len(keys)
    assert list(many) == [hash64(k, seed) for k in keys]
    assert list(hash64_many(tuple(keys), seed)) == list(many)
    assert list(hash64_many(iter(keys), seed)) == list(many)


def test_hash64_many_empty() -> None:
    assert len(hash64_many([])) == 0
    assert len(hash64_many(())) == 0
    assert len(hash64_many(iter([]))) == 0


def test_hash64_many_of_prehashed_buffer_is_identity() -> None:
    arr = np.array([0, 1, 2**63, 2**64 - 1], dtype=np.uint64)
    assert list(hash64_many(arr)) == [int(x) for x in arr]


@pytest.mark.parametrize(
    ("bad", "name"), [(1, "int"), (None, "NoneType"), ([b"a"], "list"), (1.5, "float")]
)
def test_wrong_key_type_raises_type_error_naming_the_type(bad: object, name: str) -> None:
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        hash64(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "name"), [(1, "int"), (None, "NoneType"), ([b"a"], "list"), (1.5, "float")]
)
@pytest.mark.parametrize("index", [0, 2])
def test_wrong_key_type_in_batch_names_type_and_index(bad: object, name: str, index: int) -> None:
    keys: list[object] = [b"a", "b", b"c"]
    keys.insert(index, bad)
    with pytest.raises(TypeError, match=rf"index {index}\b.*\b{name}\b"):
        hash64_many(keys)  # type: ignore[arg-type]


def test_lone_surrogate_single_key_raises_unicode_encode_error() -> None:
    with pytest.raises(UnicodeEncodeError) as info:
        hash64("ok\ud800")
    assert info.value.encoding == "utf-8"


def test_lone_surrogate_in_batch_raises_value_error_with_index() -> None:
    with pytest.raises(ValueError, match=r"index 2\b.*UTF-8") as info:
        hash64_many(["a", b"b", "x\udfff"])
    assert info.type is ValueError  # not the UnicodeEncodeError subclass: the batch wraps it


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70])
def test_seed_out_of_range(seed: int) -> None:
    with pytest.raises((OverflowError, ValueError)):
        hash64(b"k", seed)
    with pytest.raises((OverflowError, ValueError)):
        hash64_many([b"k"], seed)


def test_seed_of_wrong_type() -> None:
    # A float seed must not be truncated silently to another seed (1.5 -> 1).
    with pytest.raises(TypeError):
        hash64(b"k", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        hash64_many([b"k"], 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        hash64(b"k", "1")  # type: ignore[arg-type]


def test_single_bytes_object_is_not_a_batch() -> None:
    for single in (b"abcdefgh", "abcdefgh", bytearray(b"abcdefgh")):
        with pytest.raises(TypeError, match="single"):
            hash64_many(single)  # type: ignore[arg-type]


def test_format_constants() -> None:
    assert _core.HASH_ALGORITHM_XXH64 == 1
    assert _core.BLOCK_BYTES == 64
    assert _core.LANES == 8
    assert _core.MAX_BLOCKS == 2**32 - 1


def test_key_hashes_are_the_front_hashes_of_the_digests() -> None:
    # A stack reads cold archives the embedded store wrote from digests.
    raw = [b"a", "ü".encode(), b"x" * 512, b"\x00"]
    assert list(dkeys.key_hashes(b"orders/billing", raw)) == list(
        dkeys.front_hashes(dkeys.digests(b"orders/billing", raw))
    )
    assert len(dkeys.key_hashes(b"ns", [])) == 0


def test_check_namespace_remembers_only_what_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Namespaces checked once are remembered (every claim checks one); a bad one
    # is refused every time, and a str subclass is always checked afresh. An empty
    # memory: the tests before this one in the process may have filled it.
    monkeypatch.setattr(dkeys, "_CHECKED_NAMESPACES", {})

    class Text(str):
        pass

    assert dkeys.check_namespace("orders.v1") == b"orders.v1"
    assert dkeys.check_namespace("orders.v1") == b"orders.v1"
    assert "orders.v1" in dkeys._CHECKED_NAMESPACES
    assert dkeys.check_namespace(Text("orders.v2")) == b"orders.v2"
    assert "orders.v2" not in dkeys._CHECKED_NAMESPACES
    for _ in range(2):
        with pytest.raises(ValueError, match="may only hold"):
            dkeys.check_namespace("bad namespace!")
        with pytest.raises(ValueError, match="must not be empty"):
            dkeys.check_namespace("")
        with pytest.raises(ValueError, match="ASCII"):
            dkeys.check_namespace("naïve")
        with pytest.raises(TypeError, match="must be str"):
            dkeys.check_namespace(b"orders")
    assert "bad namespace!" not in dkeys._CHECKED_NAMESPACES
    assert len(dkeys._CHECKED_NAMESPACES) <= dkeys._CHECKED_NAMESPACES_MAX
