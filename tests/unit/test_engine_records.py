"""Answers built natively: Claims whose slots the engine fills in (docs/engine.md, "Answers").

A Claim made this way must be indistinguishable from one made by calling
the class: equal, hashable the same way (not at all), picklable, copyable,
tracked by the garbage collector, holding one reference to each field. A
class that does not qualify is called as usual.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import pickle
import sys
from array import array
from dataclasses import dataclass, fields, make_dataclass
from pathlib import Path
from typing import Any

import pytest

import dedupcore._engine as _engine
from dedupcore.api import Claim, Outcome
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import FrameError
from dedupcore.store import DedupStore

NS = "rec/ns"
CLAIM_FIELDS = tuple(f.name for f in fields(Claim))
CODES = (Outcome.NEW, Outcome.DUPLICATE, Outcome.IN_PROGRESS)


@pytest.fixture(autouse=True)
def _claim_bound_again() -> Any:
    """Tests that bind another class leave Claim bound, as the package does."""
    yield
    assert _engine.bind_record_class(Claim, CLAIM_FIELDS)


def _columns(n: int, codes: bytes | None = None) -> dict[str, Any]:
    return {
        "o": codes if codes is not None else bytes(i % 3 for i in range(n)),
        "t": array("Q", range(1, n + 1)).tobytes(),
        "ri": [],
        "rv": [],
        "x": [],
        "k": [],
    }


def test_claim_is_bound_when_the_package_loads() -> None:
    assert _engine.bind_record_class(Claim, CLAIM_FIELDS) is True


def test_a_native_claim_is_the_claim_the_class_makes() -> None:
    keys = [os.urandom(16) for _ in range(50)] + [f"str-{i}" for i in range(50)]
    built = _engine.build_records(
        Claim,
        keys,
        NS,
        bytes(i % 3 for i in range(100)),
        array("Q", range(7, 107)).tobytes(),
        CODES,
    )
    called = [Claim(k, NS, CODES[i % 3], 7 + i) for i, k in enumerate(keys)]
    assert built == called
    for b, c in zip(built, called, strict=True):
        assert type(b) is Claim
        assert repr(b) == repr(c)
        assert dataclasses.asdict(b) == dataclasses.asdict(c)
        assert pickle.loads(pickle.dumps(b)) == c
        assert copy.copy(b) == c and copy.deepcopy(b) == c
        assert dataclasses.replace(b, token=99) == dataclasses.replace(c, token=99)
        assert gc.is_tracked(b)
        b.result = {"x": 1}  # the slots stay writable
        assert b.result == {"x": 1}
        with pytest.raises(TypeError):
            hash(b)


def test_native_claims_hold_one_reference_per_field_and_release_it() -> None:
    key = os.urandom(16)
    ns = "".join(["ref", "/ns"])  # not interned
    before = sys.getrefcount(key), sys.getrefcount(ns)
    built = _engine.build_records(
        Claim, [key] * 1000, ns, bytes(1000), array("Q", [5] * 1000).tobytes(), CODES
    )
    assert sys.getrefcount(key) == before[0] + 1000
    assert sys.getrefcount(ns) == before[1] + 1000
    del built
    gc.collect()
    assert (sys.getrefcount(key), sys.getrefcount(ns)) == before


def test_a_cycle_through_a_native_claim_is_collected() -> None:
    gc.collect()
    gc.disable()
    try:
        [c] = _engine.build_records(Claim, [b"k"], NS, bytes(1), array("Q", [1]).tobytes(), CODES)
        c.result = [c]  # a cycle only the garbage collector can free
        del c
        assert gc.collect() >= 2  # the claim and its list
    finally:
        gc.enable()


def test_build_records_refuses_what_does_not_match_its_keys() -> None:
    with pytest.raises(ValueError, match="one outcome and one token per key"):
        _engine.build_records(Claim, [b"a", b"b"], NS, bytes(1), bytes(16), CODES)
    with pytest.raises(ValueError, match="one outcome and one token per key"):
        _engine.build_records(Claim, [b"a"], NS, bytes(1), bytes(7), CODES)
    with pytest.raises(ValueError, match="unknown outcome code 3"):
        _engine.build_records(Claim, [b"a"], NS, b"\x03", bytes(8), CODES)
    with pytest.raises(TypeError):
        _engine.build_records(Claim, (b"a",), NS, bytes(1), bytes(8), CODES)  # type: ignore[arg-type]
    assert _engine.build_records(Claim, [], NS, b"", b"", CODES) == []


def test_a_client_reply_with_columns_that_do_not_match_is_a_frame_error() -> None:
    keys = [b"a", b"b"]
    for bad in (
        {**_columns(2), "t": bytes(15)},
        {**_columns(2), "o": bytes(3)},
        {**_columns(2), "o": "xx"},
        {**_columns(2), "o": b"\x00\x07"},
    ):
        with pytest.raises(FrameError):
            protocol.claims_from_columns(keys, NS, bad)
    claims = protocol.claims_from_columns(keys, NS, {**_columns(2), "ri": [1], "rv": ["r"]})
    assert claims == [Claim(b"a", NS, Outcome.NEW, 1), Claim(b"b", NS, Outcome.DUPLICATE, 2, "r")]


SEVEN = ("a", "b", "c", "d", "e", "f", "g")


def _changed(self: Any) -> None:
    self.a = "changed"


@dataclass(slots=True)
class _Base:
    z: Any = None


_Seven = make_dataclass("_Seven", SEVEN, slots=True)
_WithDict = make_dataclass("_WithDict", SEVEN)
_PostInit = make_dataclass("_PostInit", SEVEN, slots=True, namespace={"__post_init__": _changed})
_OnSlottedBase = make_dataclass(
    "_OnSlottedBase", [(n, Any, None) for n in SEVEN], bases=(_Base,), slots=True
)


@pytest.mark.parametrize(
    ("cls", "names"),
    [
        (_WithDict, SEVEN),  # instances have a __dict__
        (_PostInit, SEVEN),  # something runs after __init__
        (_OnSlottedBase, SEVEN),  # a base class has slots of its own
        (_Seven, ("b", "a", "c", "d", "e", "f", "g")),  # not the order of the slots
        (_Seven, SEVEN[:6]),  # not seven fields
        (int, SEVEN),
    ],
    ids=["dict", "post_init", "slotted_base", "order", "six", "int"],
)
def test_a_class_that_does_not_qualify_is_called_as_usual(cls: Any, names: tuple[str, ...]) -> None:
    assert _engine.bind_record_class(cls, names) is False
    if cls is int:
        return
    # Claim stays bound: a refused class never replaces it.
    [c] = _engine.build_records(Claim, [b"k"], NS, bytes(1), array("Q", [3]).tobytes(), CODES)
    assert c == Claim(b"k", NS, Outcome.NEW, 3)
    [r] = _engine.build_records(cls, [b"k"], NS, bytes(1), array("Q", [3]).tobytes(), CODES)
    assert type(r) is cls and dataclasses.astuple(r)[1:4] == (NS, Outcome.NEW, 3)
    if cls is _PostInit:
        assert r.a == "changed"  # called: its __post_init__ ran


def test_another_qualifying_class_is_built_natively_once_bound() -> None:
    assert _engine.bind_record_class(_Seven, SEVEN) is True
    [r] = _engine.build_records(_Seven, [b"k"], NS, b"\x01", array("Q", [9]).tobytes(), CODES)
    assert r == _Seven(b"k", NS, Outcome.DUPLICATE, 9, None, True, False)
    # Claim, no longer the bound class, is called: still the same answer.
    [c] = _engine.build_records(Claim, [b"k"], NS, b"\x01", array("Q", [9]).tobytes(), CODES)
    assert c == Claim(b"k", NS, Outcome.DUPLICATE, 9)


def test_the_store_answers_with_native_claims(tmp_path: Path) -> None:
    with DedupStore.open(tmp_path) as store:
        keys = [f"k{i}" for i in range(100)]
        first = store.claim_many(keys, namespace=NS)
        store.complete_many([(c.key, c.token, c.key.upper()) for c in first[:50]], namespace=NS)
        again = store.claim_many(keys, namespace=NS)
    assert all(type(c) is Claim and gc.is_tracked(c) for c in first + again)
    assert again[:50] == [
        Claim(k, NS, Outcome.DUPLICATE, c.token, k.upper())
        for k, c in zip(keys[:50], first[:50], strict=True)
    ]
    assert again[50:] == [
        Claim(k, NS, Outcome.IN_PROGRESS, c.token)
        for k, c in zip(keys[50:], first[50:], strict=True)
    ]


def test_a_batch_is_handed_to_the_gc_whole_while_collections_run_during_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claims stay out of the GC while their batch is built and are all tracked when it
    is returned: collections set off in the middle (here by unpacking each stored
    result) neither free nor walk the claims built so far."""
    import dedupcore.store.store as store_mod

    unpack = store_mod._unpack_stored
    calls = 0

    def collecting(raw: bytes | None) -> Any:
        nonlocal calls
        calls += 1
        gc.collect()
        return unpack(raw)

    with DedupStore.open(tmp_path) as store:
        keys = [f"k{i}" for i in range(300)]
        first = store.claim_many(keys, namespace=NS)
        store.complete_many([(c.key, c.token, [c.key]) for c in first], namespace=NS)
        monkeypatch.setattr(store_mod, "_unpack_stored", collecting)
        again = store.claim_many(keys, namespace=NS)
    assert calls == 300
    assert all(type(c) is Claim and gc.is_tracked(c) for c in again)
    assert again == [
        Claim(k, NS, Outcome.DUPLICATE, c.token, [k]) for k, c in zip(keys, first, strict=True)
    ]
    # A cycle made through an answer afterwards is the GC's to free, as for any claim.
    gc.collect()
    gc.disable()
    try:
        again[0].result.append(again[0])
        del again
        assert gc.collect() >= 2  # the claim and its result list
    finally:
        gc.enable()


def test_a_batch_given_up_while_built_frees_its_untracked_claims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error in the middle of building a batch's answer drops the claims built so
    far (untracked) without a crash or a leak, and claims nothing."""
    import dedupcore.store.store as store_mod

    unpack = store_mod._unpack_stored
    calls = 0

    def failing(raw: bytes | None) -> Any:
        nonlocal calls
        calls += 1
        if calls == 10:
            raise RuntimeError("unpack failed")
        return unpack(raw)

    with DedupStore.open(tmp_path) as store:
        keys = [os.urandom(16) for _ in range(100)]
        fresh = [os.urandom(16) for _ in range(100)]
        first = store.claim_many(keys, namespace=NS)
        store.complete_many([(c.key, c.token, b"r") for c in first], namespace=NS)
        before = [sys.getrefcount(k) for k in keys + fresh]
        monkeypatch.setattr(store_mod, "_unpack_stored", failing)
        with pytest.raises(RuntimeError, match="unpack failed"):
            store.claim_many(keys + fresh, namespace=NS)
        gc.collect()
        assert [sys.getrefcount(k) for k in keys + fresh] == before
        monkeypatch.setattr(store_mod, "_unpack_stored", unpack)
        assert [c.outcome for c in store.claim_many(fresh, namespace=NS)] == [Outcome.NEW] * 100
