"""ClaimBatch and ChangeBatch: every argument checked once, with the exact exception."""

from __future__ import annotations

import re
from typing import Any

import pytest

from dedupcore import keys as _keys
from dedupcore.api import ChangeBatch, ClaimBatch, Limits

NS = "orders"

BAD_CLAIMS = [
    # the namespace
    ({"namespace": 5}, TypeError, "namespace must be str, not int"),
    ({"namespace": None}, TypeError, "namespace must be str, not NoneType"),
    ({"namespace": b"ns"}, TypeError, "namespace must be str, not bytes"),
    ({"namespace": ""}, ValueError, "namespace must not be empty"),
    ({"namespace": "x" * 129}, ValueError, "namespace is 129 bytes; the limit is 128"),
    ({"namespace": "a b"}, ValueError, "namespace may only hold [A-Za-z0-9._:/-], got 'a b'"),
    ({"namespace": "ü"}, ValueError, "namespace must be ASCII [A-Za-z0-9._:/-], got 'ü'"),
    # the keys
    ({"keys": [42]}, TypeError, "key must be bytes or str, not int"),
    ({"keys": ["a", None]}, TypeError, "key must be bytes or str, not NoneType"),
    ({"keys": [b""]}, ValueError, "key must not be empty"),
    ({"keys": [""]}, ValueError, "key must not be empty"),
    ({"keys": [b"x" * 513]}, ValueError, "key is 513 bytes; the limit is max_key_bytes=512"),
    ({"keys": ["é" * 257]}, ValueError, "key is 514 bytes; the limit is max_key_bytes=512"),
    ({"keys": ["\ud800"]}, ValueError, "key is not valid UTF-8"),
    # the lease
    ({"lease": "30"}, TypeError, "lease must be a number of seconds, not str"),
    ({"lease": True}, TypeError, "lease must be a number of seconds, not bool"),
    ({"lease": 0}, ValueError, "lease must be between"),
    ({"lease": float("nan")}, ValueError, "lease must be between"),
    # the owner
    ({"owner": 12}, TypeError, "owner must be str or bytes, not int"),
    ({"owner": ""}, ValueError, "owner must be 1..255 bytes, got 0"),
    ({"owner": "o" * 256}, ValueError, "owner must be 1..255 bytes, got 256"),
    # the fingerprints
    ({"fingerprints": [b"f"]}, ValueError, "1 fingerprints for 2 keys"),
    ({"fingerprints": ["text", None]}, TypeError, "fingerprint must be bytes, not str"),
    ({"fingerprints": [b"", None]}, ValueError, "fingerprint must be 1..255 bytes, got 0"),
    ({"fingerprints": [None, b"f" * 256]}, ValueError, "fingerprint must be 1..255 bytes, got 256"),
]


def claim_batch(**changes: Any) -> ClaimBatch:
    """A batch of two keys in NS, with ``changes`` to its arguments."""
    args: dict[str, Any] = {"keys": ["a", "b"], "namespace": NS, **changes}
    return ClaimBatch(args.pop("keys"), **args)


@pytest.mark.parametrize("hashed", [True, False], ids=["hashed", "unhashed"])
@pytest.mark.parametrize(("changes", "error", "message"), BAD_CLAIMS)
def test_a_bad_claim_argument_raises_its_exception(
    changes: dict[str, Any], error: type[Exception], message: str, hashed: bool
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        claim_batch(hashed=hashed, **changes)


def test_the_checks_go_in_order_namespace_keys_lease_owner_fingerprints() -> None:
    with pytest.raises(TypeError, match="namespace"):
        claim_batch(namespace=5, keys=[42], lease="x", owner=1, fingerprints=[1])
    with pytest.raises(TypeError, match="key must"):
        claim_batch(keys=[42], lease="x", owner=1, fingerprints=[1])
    with pytest.raises(TypeError, match="lease"):
        claim_batch(lease="x", owner=1, fingerprints=[1])
    with pytest.raises(TypeError, match="owner"):
        claim_batch(owner=1, fingerprints=[1])


def test_a_claim_batch_holds_its_arguments_checked() -> None:
    batch = claim_batch(keys=iter(["a", b"b", bytearray(b"c")]), lease=5, owner="w")
    assert batch.namespace == NS and batch.ns == b"orders"
    assert batch.keys == ["a", b"b", bytearray(b"c")] and len(batch) == 3
    assert batch.raw == [b"a", b"b", b"c"]
    assert batch.digests == b"".join(_keys.digests(b"orders", [b"a", b"b", b"c"]))
    assert batch.lease == 5.0 and isinstance(batch.lease, float)
    assert batch.owner == b"w"
    assert batch.fingerprints is None and batch.fingerprint_list() == [None] * 3
    fps = claim_batch(fingerprints=[b"f", None]).fingerprints
    assert fps == [b"f", None]


@pytest.mark.parametrize(
    "keys",
    [["a", b"b", "é"], ["a", bytearray(b"b")], [memoryview(b"m"), "n"], []],
    ids=["plain", "bytearray", "memoryview", "empty"],
)
def test_an_unhashed_batch_makes_the_same_digests_on_first_use(keys: list[Any]) -> None:
    hashed, unhashed = claim_batch(keys=keys), claim_batch(keys=keys, hashed=False)
    plain = all(type(k) in (bytes, str) for k in keys)
    assert hashed.plain is unhashed.plain is plain
    assert unhashed._digests is None
    assert unhashed.digests == hashed.digests
    assert unhashed.raw == hashed.raw
    first = claim_batch(keys=keys, hashed=False)
    part = first.subset(range(len(keys) // 2, len(keys)))
    assert first._digests is None and part._digests is None  # still made on first use
    assert part.digests == hashed.subset(range(len(keys) // 2, len(keys))).digests
    assert part.plain is plain


def test_unhashed_change_batches_make_the_same_digests_on_first_use() -> None:
    items = [("a", 1, "r"), (b"b", 2, None), (bytearray(b"c"), 3, [1])]
    hashed = ChangeBatch(items, namespace=NS, completing=True)
    unhashed = ChangeBatch(items, namespace=NS, completing=True, hashed=False)
    assert unhashed._digests is None and not unhashed.plain
    assert unhashed.digests == hashed.digests and unhashed.results == hashed.results
    assert unhashed.subset([2, 0]).digests == hashed.subset([2, 0]).digests


def test_an_empty_claim_batch_is_checked_but_its_keys() -> None:
    batch = claim_batch(keys=[])
    assert len(batch) == 0 and batch.digests == b"" and batch.raw == []
    with pytest.raises(ValueError, match="namespace must not be empty"):
        claim_batch(keys=[], namespace="")


def test_the_limits_bound_the_keys() -> None:
    limits = Limits(max_key_bytes=4)
    assert ClaimBatch(["abcd"], namespace=NS, limits=limits).raw == [b"abcd"]
    with pytest.raises(ValueError, match=re.escape("key is 5 bytes; the limit is max_key_bytes=4")):
        ClaimBatch(["abcde"], namespace=NS, limits=limits)


BAD_CHANGES = [
    ([("k",)], TypeError, "each item must be (key, token) or (key, token, result)"),
    (["k"], TypeError, "each item must be (key, token) or (key, token, result)"),
    ([("k", 1, None, None)], TypeError, "each item must be"),
    ([("k", "1")], TypeError, "token must be an int, not str"),
    ([("k", True)], TypeError, "token must be an int, not bool"),
    ([("k", 1.0)], TypeError, "token must be an int, not float"),
    ([("k", 0)], ValueError, "token must be in 1..2**63-1, got 0"),
    ([("k", 1 << 63)], ValueError, f"token must be in 1..2**63-1, got {1 << 63}"),
    ([(42, 1)], TypeError, "key must be bytes or str, not int"),
    ([("", 1)], ValueError, "key must not be empty"),
    ([(b"x" * 513, 1)], ValueError, "key is 513 bytes; the limit is max_key_bytes=512"),
    ([("k", 1, object())], TypeError, "result must be msgpack-serializable"),
    ([("k", 1, {1, 2})], TypeError, "result must be msgpack-serializable"),
    (
        [("k", 1, b"x" * 70000)],
        ValueError,
        "result is 70005 bytes encoded; the limit is max_result_bytes=65536",
    ),
]


@pytest.mark.parametrize("hashed", [True, False], ids=["hashed", "unhashed"])
@pytest.mark.parametrize(("items", "error", "message"), BAD_CHANGES)
def test_a_bad_completion_raises_its_exception(
    items: list[Any], error: type[Exception], message: str, hashed: bool
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        ChangeBatch(items, namespace=NS, completing=True, hashed=hashed)


def test_a_release_takes_no_result() -> None:
    with pytest.raises(TypeError, match=re.escape("each item must be (key, token), got")):
        ChangeBatch([("k", 1, "result")], namespace=NS, completing=False)


@pytest.mark.parametrize("namespace", [5, "", "a b"])
def test_a_change_batch_checks_its_namespace_first(namespace: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="namespace"):
        ChangeBatch([("k", 0)], namespace=namespace, completing=True)


def test_a_change_batch_holds_its_items_checked() -> None:
    done = ChangeBatch(iter([("a", 1, {"x": 1}), ["b", 2]]), namespace=NS, completing=True)
    assert done.keys == ["a", "b"] and done.tokens == [1, 2] and done.raw == [b"a", b"b"]
    assert done.results is not None and done.results[1] is None
    assert done.results[0] is not None and done.results[0].startswith(b"\x81")
    assert done.digests == b"".join(_keys.digests(b"orders", [b"a", b"b"]))
    released = ChangeBatch([("a", 1)], namespace=NS, completing=False)
    assert released.results is None and not released.completing
    empty = ChangeBatch([], namespace=NS, completing=True)
    assert len(empty) == 0 and empty.digests == b"" and empty.results == []


def test_an_int_subclass_token_is_taken() -> None:
    class Token(int):
        pass

    batch = ChangeBatch([("a", Token(3))], namespace=NS, completing=False)
    assert batch.tokens == [3]


def test_the_limits_bound_the_results() -> None:
    limits = Limits(max_result_bytes=8)
    ChangeBatch([("a", 1, b"12345")], namespace=NS, completing=True, limits=limits)
    with pytest.raises(ValueError, match="the limit is max_result_bytes=8"):
        ChangeBatch([("a", 1, b"123456789")], namespace=NS, completing=True, limits=limits)
