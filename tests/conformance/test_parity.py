"""One suite of claim-API semantics, run against every front end and every store stack.

Every test takes ``api``: the same assertions must hold for the embedded
store in this process, for :class:`dedupcore.Client` talking to ``dedupcore
serve`` (a real subprocess), for Redis and each SQL engine as the authority
(the machine's real servers), for a stack with a front filter, a Redis cache
and a cold archive over PostgreSQL, and for a store sharded over Redis and
SQLite — including the exception classes (the fixtures are in conftest.py).
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from dedupcore.api import ClaimAPI, InProgressError, Outcome
from dedupcore.client import Client
from dedupcore.errors import ConflictError, DedupError, StaleTokenError
from dedupcore.record import State
from dedupcore.store import DedupStore
from tests.support.stores import SERVER_APIS

RESULTS = [
    pytest.param(b"\x00\xffbytes", id="bytes"),
    pytest.param("text ü ✓", id="str"),
    pytest.param(0, id="zero"),
    pytest.param(-(2**63), id="int-min"),
    pytest.param(2**64 - 1, id="uint-max"),
    pytest.param(1.5, id="float"),
    pytest.param(True, id="bool"),
    pytest.param({"charged": 100, "items": [1, b"x"], "nested": {"a": None}}, id="dict"),
    pytest.param({b"raw": "key"}, id="dict-bytes-key"),
    pytest.param([1, "two", b"3", None, [4.0]], id="list"),
    pytest.param([], id="empty-list"),
    pytest.param(None, id="none"),
]


@pytest.mark.parametrize("result", RESULTS)
def test_new_in_progress_duplicate_with_result(api: ClaimAPI, ns: str, result: Any) -> None:
    c = api.claim("order-42", namespace=ns)
    assert c.outcome is Outcome.NEW and c.token == 1 and c.exact and not c.takeover
    assert c.key == "order-42" and c.namespace == ns
    busy = api.claim("order-42", namespace=ns)
    assert busy.outcome is Outcome.IN_PROGRESS
    api.complete("order-42", c.token, namespace=ns, result=result)
    dup = api.claim("order-42", namespace=ns)
    assert dup.outcome is Outcome.DUPLICATE and dup.exact
    assert dup.result == result and type(dup.result) is type(result)
    rec = api.get("order-42", namespace=ns)
    assert rec is not None and rec.state is State.PROCESSED and rec.result == result


def test_tuple_result_comes_back_as_a_list(api: ClaimAPI, ns: str) -> None:
    c = api.claim(b"k", namespace=ns)
    api.complete(b"k", c.token, namespace=ns, result=(1, "a"))
    assert api.claim(b"k", namespace=ns).result == [1, "a"]


def test_dict_result_with_int_keys_round_trips_or_is_refused_at_complete(
    api: ClaimAPI, ns: str
) -> None:
    """msgpack can carry {1: "x"}; either it is refused up front, or it reads back.

    It must never be stored and then make every later claim of the key fail.
    """
    c = api.claim("k", namespace=ns)
    try:
        api.complete("k", c.token, namespace=ns, result={1: "x"})
    except (TypeError, ValueError):
        api.complete("k", c.token, namespace=ns, result="fallback")
        assert api.claim("k", namespace=ns).result == "fallback"
        return
    assert api.claim("k", namespace=ns).result == {1: "x"}


def test_str_and_bytes_keys_are_distinct_values_but_same_utf8_key(api: ClaimAPI, ns: str) -> None:
    c = api.claim("é", namespace=ns)
    assert c.outcome is Outcome.NEW
    # The key is its UTF-8 bytes: the bytes form is the same dedup key.
    assert api.claim("é".encode(), namespace=ns).outcome is Outcome.IN_PROGRESS
    assert api.claim(bytearray(b"\xc3\xa9"), namespace=ns).outcome is Outcome.IN_PROGRESS


def test_release_lets_the_work_run_again_with_a_higher_token(api: ClaimAPI, ns: str) -> None:
    c = api.claim(b"k", namespace=ns)
    api.release(b"k", c.token, namespace=ns)
    rec = api.get(b"k", namespace=ns)
    assert rec is not None and rec.state is State.RELEASED
    again = api.claim(b"k", namespace=ns)
    assert again.outcome is Outcome.NEW and again.token == c.token + 1
    with pytest.raises(StaleTokenError):
        api.complete(b"k", c.token, namespace=ns)
    with pytest.raises(StaleTokenError):
        api.release(b"k", c.token, namespace=ns)
    api.complete(b"k", again.token, namespace=ns, result="second")
    assert api.claim(b"k", namespace=ns).result == "second"


def test_same_owner_gets_its_own_claim_back(api: ClaimAPI, ns: str) -> None:
    c = api.claim("k", namespace=ns, owner="worker-1")
    again = api.claim("k", namespace=ns, owner="worker-1")
    assert again.outcome is Outcome.NEW and again.token == c.token
    # An owner is its bytes: str and UTF-8 bytes are the same owner.
    assert api.claim("k", namespace=ns, owner=b"worker-1").outcome is Outcome.NEW
    assert api.claim("k", namespace=ns, owner="worker-2").outcome is Outcome.IN_PROGRESS
    assert api.claim("k", namespace=ns).outcome is Outcome.IN_PROGRESS
    rec = api.get("k", namespace=ns)
    assert rec is not None and rec.owner == b"worker-1" and rec.state is State.PROCESSING
    api.complete("k", c.token, namespace=ns)
    assert api.claim("k", namespace=ns, owner="worker-1").outcome is Outcome.DUPLICATE


def test_expired_lease_is_taken_over_and_the_late_owner_is_fenced(api: ClaimAPI, ns: str) -> None:
    first = api.claim("k", namespace=ns, lease=0.2, owner="a")
    held = api.claim("held", namespace=ns, lease=600.0, owner="a")
    time.sleep(0.6)
    assert api.claim("held", namespace=ns, owner="b").outcome is Outcome.IN_PROGRESS
    second = api.claim("k", namespace=ns, owner="b")
    assert second.outcome is Outcome.NEW and second.takeover
    assert second.token == first.token + 1
    assert api.claim("k", namespace=ns, owner="c").outcome is Outcome.IN_PROGRESS
    with pytest.raises(StaleTokenError):
        api.complete("k", first.token, namespace=ns, result="late")
    with pytest.raises(StaleTokenError):
        api.release("k", first.token, namespace=ns)
    api.complete("k", second.token, namespace=ns, result="b did it")
    dup = api.claim("k", namespace=ns, owner="a")
    assert dup.outcome is Outcome.DUPLICATE and dup.result == "b did it"
    api.release("held", held.token, namespace=ns)


def test_takeover_of_an_expired_lease_by_the_same_owner_keeps_the_token(
    api: ClaimAPI, ns: str
) -> None:
    first = api.claim("k", namespace=ns, lease=0.1, owner="a")
    time.sleep(0.3)
    again = api.claim("k", namespace=ns, owner="a")
    assert again.outcome is Outcome.NEW and again.token == first.token
    api.complete("k", first.token, namespace=ns)


def test_fingerprint_mismatch_is_a_conflict(api: ClaimAPI, ns: str) -> None:
    c = api.claim("k", namespace=ns, fingerprint=b"body-a")
    with pytest.raises(ConflictError):
        api.claim("k", namespace=ns, fingerprint=b"body-b")  # while PROCESSING
    assert api.claim("k", namespace=ns, fingerprint=b"body-a").outcome is Outcome.IN_PROGRESS
    api.complete("k", c.token, namespace=ns, result=b"first")
    assert api.claim("k", namespace=ns, fingerprint=b"body-a").result == b"first"
    assert api.claim("k", namespace=ns).outcome is Outcome.DUPLICATE  # no fingerprint: no check
    with pytest.raises(ConflictError) as info:
        api.claim("k", namespace=ns, fingerprint=b"body-b")
    assert isinstance(info.value, ValueError) and isinstance(info.value, DedupError)
    rec = api.get("k", namespace=ns)
    assert rec is not None and rec.fingerprint == b"body-a"


def test_conflict_in_batch_claims_nothing(api: ClaimAPI, ns: str) -> None:
    api.claim("k", namespace=ns, fingerprint=b"one")
    with pytest.raises(ConflictError):
        api.claim_many(["fresh", "k"], namespace=ns, fingerprints=[None, b"two"])
    assert api.claim("fresh", namespace=ns).outcome is Outcome.NEW


def test_claim_many_batch_semantics(api: ClaimAPI, ns: str) -> None:
    assert api.claim_many([], namespace=ns) == []
    keys = [b"a", b"b", b"a", "c", b"a"]
    claims = api.claim_many(keys, namespace=ns)
    assert [c.outcome for c in claims] == [
        Outcome.NEW,
        Outcome.NEW,
        Outcome.IN_PROGRESS,
        Outcome.NEW,
        Outcome.IN_PROGRESS,
    ]
    assert [c.key for c in claims] == keys
    assert all(c.namespace == ns for c in claims)
    api.complete_many(
        [(c.key, c.token, i) for i, c in enumerate(claims) if c.outcome is Outcome.NEW],
        namespace=ns,
    )
    again = api.claim_many(keys, namespace=ns)
    assert all(c.outcome is Outcome.DUPLICATE for c in again)
    assert [c.result for c in again] == [0, 1, 0, 3, 0]


def test_claim_many_with_owner_repeated_key_is_the_same_claim(api: ClaimAPI, ns: str) -> None:
    claims = api.claim_many(["x", "x", "y"], namespace=ns, owner="w")
    assert [c.outcome for c in claims] == [Outcome.NEW] * 3
    assert claims[0].token == claims[1].token


def test_claim_many_accepts_any_iterable_and_fingerprints(api: ClaimAPI, ns: str) -> None:
    claims = api.claim_many(
        (f"g{i}" for i in range(3)), namespace=ns, fingerprints=[b"f0", None, b"f2"]
    )
    assert [c.key for c in claims] == ["g0", "g1", "g2"]
    assert all(c.outcome is Outcome.NEW for c in claims)
    rec = api.get("g2", namespace=ns)
    assert rec is not None and rec.fingerprint == b"f2"
    with pytest.raises(ValueError):
        api.claim_many(["h0", "h1"], namespace=ns, fingerprints=[b"only-one"])


def test_complete_many_and_release_many(api: ClaimAPI, ns: str) -> None:
    claims = api.claim_many([f"k{i}" for i in range(10)], namespace=ns)
    done = claims[:5]
    api.complete_many(
        [(c.key, c.token) if i % 2 else (c.key, c.token, {"i": i}) for i, c in enumerate(done)],
        namespace=ns,
    )
    api.release_many([(c.key, c.token) for c in claims[5:]], namespace=ns)
    again = api.claim_many([f"k{i}" for i in range(10)], namespace=ns)
    assert [c.outcome for c in again] == [Outcome.DUPLICATE] * 5 + [Outcome.NEW] * 5
    assert [c.result for c in again[:5]] == [{"i": 0}, None, {"i": 2}, None, {"i": 4}]
    assert [c.token for c in again[5:]] == [c.token + 1 for c in claims[5:]]
    api.complete_many([], namespace=ns)
    api.release_many([], namespace=ns)


# A sharded batch is not atomic across shards (ShardedStore's docstring);
# tests/authorities/test_stack.py checks what it does instead.
@pytest.mark.parametrize(
    "api", ["store", "client", *(a for a in SERVER_APIS if a != "sharded")], indirect=True
)
def test_a_stale_token_in_a_batch_changes_nothing(api: ClaimAPI, ns: str) -> None:
    a, b = api.claim_many(["a", "b"], namespace=ns)
    with pytest.raises(StaleTokenError):
        api.complete_many([("a", a.token, "ra"), ("b", b.token + 7, "rb")], namespace=ns)
    assert api.claim("a", namespace=ns).outcome is Outcome.IN_PROGRESS
    with pytest.raises(StaleTokenError):
        api.release_many([("a", a.token), ("never", 1)], namespace=ns)
    assert api.claim("a", namespace=ns).outcome is Outcome.IN_PROGRESS
    api.complete_many([("a", a.token, "ra"), ("b", b.token, "rb")], namespace=ns)
    assert [c.result for c in api.claim_many(["a", "b"], namespace=ns)] == ["ra", "rb"]


def test_complete_is_idempotent_for_the_same_token(api: ClaimAPI, ns: str) -> None:
    c = api.claim("k", namespace=ns)
    api.complete("k", c.token, namespace=ns, result=1)
    api.complete("k", c.token, namespace=ns, result=1)  # a retry after a lost reply
    with pytest.raises(StaleTokenError):
        api.release("k", c.token, namespace=ns)
    with pytest.raises(StaleTokenError):
        api.complete("k", c.token + 1, namespace=ns)


def test_complete_or_release_without_claim(api: ClaimAPI, ns: str) -> None:
    with pytest.raises(StaleTokenError, match="not claimed"):
        api.complete("never", 1, namespace=ns)
    with pytest.raises(StaleTokenError, match="not claimed"):
        api.release("never", 1, namespace=ns)


def test_namespaces_are_separate_keys(api: ClaimAPI, ns: str) -> None:
    api.claim("k", namespace=ns + "-a")
    assert api.claim("k", namespace=ns + "-b").outcome is Outcome.NEW


def test_get(api: ClaimAPI, ns: str) -> None:
    assert api.get("nothing", namespace=ns) is None
    before = time.time()
    c = api.claim("k", namespace=ns, owner=b"w", fingerprint=b"fp")
    rec = api.get("k", namespace=ns)
    assert rec is not None
    assert (rec.state, rec.token, rec.owner, rec.fingerprint, rec.result, rec.exact) == (
        State.PROCESSING,
        c.token,
        b"w",
        b"fp",
        None,
        True,
    )
    assert isinstance(rec.created, float) and abs(rec.created - before) < 3600
    api.complete("k", c.token, namespace=ns, result=[1, 2])
    rec2 = api.get(b"k", namespace=ns)
    assert rec2 is not None and rec2.state is State.PROCESSED and rec2.result == [1, 2]
    # A finished record may be read back from LMDB, which stores times in whole ms.
    assert abs(rec2.created - rec.created) < 0.002 and rec2.updated >= rec.updated - 0.002
    # get() claims nothing.
    assert api.get("other", namespace=ns) is None
    assert api.claim("other", namespace=ns).outcome is Outcome.NEW


def test_processing_completes_on_success_and_releases_on_error(api: ClaimAPI, ns: str) -> None:
    with api.processing("ok", namespace=ns) as c:
        assert c.outcome is Outcome.NEW
        c.result = {"done": True}
    assert api.claim("ok", namespace=ns).result == {"done": True}

    class BusinessError(Exception):
        pass

    with pytest.raises(BusinessError), api.processing("fails", namespace=ns) as c:
        assert c.outcome is Outcome.NEW
        raise BusinessError("business write failed")
    rec = api.get("fails", namespace=ns)
    assert rec is not None and rec.state is State.RELEASED
    assert api.claim("fails", namespace=ns).outcome is Outcome.NEW


def test_processing_with_an_unstorable_result_completes_without_it(api: ClaimAPI, ns: str) -> None:
    # The work ran: a redelivery must not run it again because its result
    # could not be stored.
    with pytest.raises(TypeError), api.processing("obj", namespace=ns) as c:
        c.result = object()
    with pytest.raises(ValueError), api.processing("big", namespace=ns) as c:
        c.result = b"x" * (1 << 20)
    for key in ("obj", "big"):
        dup = api.claim(key, namespace=ns)
        assert dup.outcome is Outcome.DUPLICATE and dup.result is None


def test_processing_yields_duplicates_and_busy_keys_without_changing_them(
    api: ClaimAPI, ns: str
) -> None:
    with api.processing("ok", namespace=ns) as c:
        c.result = "first"
    with api.processing("ok", namespace=ns) as c:
        assert c.outcome is Outcome.DUPLICATE and c.result == "first"
        c.result = "ignored"
    assert api.claim("ok", namespace=ns).result == "first"
    held = api.claim("busy", namespace=ns)
    with pytest.raises(KeyError), api.processing("busy", namespace=ns) as c:
        assert c.outcome is Outcome.IN_PROGRESS
        raise KeyError("not released: it is not ours")
    assert api.claim("busy", namespace=ns).outcome is Outcome.IN_PROGRESS
    api.complete("busy", held.token, namespace=ns)


def test_processing_after_lease_takeover_reraises_the_original_error(
    api: ClaimAPI, ns: str
) -> None:
    with (
        pytest.raises(RuntimeError, match="slow"),
        api.processing("k", namespace=ns, lease=0.1, owner="slow"),
    ):
        time.sleep(0.3)
        assert api.claim("k", namespace=ns, owner="fast").outcome is Outcome.NEW
        raise RuntimeError("slow worker failed")
    assert api.claim("k", namespace=ns, owner="other").outcome is Outcome.IN_PROGRESS


def test_idempotent_decorator_runs_once(api: ClaimAPI, ns: str) -> None:
    calls: list[str] = []

    @api.idempotent(namespace=ns, key=lambda msg: msg["id"])
    def handle(msg: dict[str, Any]) -> dict[str, Any]:
        calls.append(msg["id"])
        if msg.get("fail"):
            raise ValueError("downstream refused")
        return {"amount": msg["amount"] * 2}

    assert handle({"id": "t1", "amount": 5}) == {"amount": 10}
    assert handle({"id": "t1", "amount": 5}) == {"amount": 10}
    assert calls == ["t1"]
    assert handle.__name__ == "handle"
    with pytest.raises(ValueError, match="downstream"):
        handle({"id": "t2", "amount": 1, "fail": True})
    assert handle({"id": "t2", "amount": 1}) == {"amount": 2}  # released, so it runs again
    assert calls == ["t1", "t2", "t2"]
    api.claim("busy", namespace=ns)
    with pytest.raises(InProgressError) as info:
        handle({"id": "busy", "amount": 1})
    assert isinstance(info.value, DedupError)
    assert calls == ["t1", "t2", "t2"]


# RedisStore and SqlStore count outcomes per store, not per namespace.
@pytest.mark.parametrize("api", ["store", "client", "tiered", "sharded"], indirect=True)
def test_stats_count_outcomes_per_namespace(api: ClaimAPI, ns: str) -> None:
    api.claim_many(["a", "b", "a"], namespace=ns)
    c = api.claim("c", namespace=ns)
    api.complete("c", c.token, namespace=ns)
    api.claim("c", namespace=ns)
    counts = api.stats()["namespaces"][ns]
    assert (counts["new"], counts["in_progress"], counts["duplicate"]) == (3, 1, 1)
    assert math.isclose(counts["duplicate_rate"], 1 / 5)


# -- bad input: the same exception class on both ------------------------------------------------

BAD_CLAIMS = [
    pytest.param({"key": b""}, ValueError, id="empty-key"),
    pytest.param({"key": ""}, ValueError, id="empty-str-key"),
    pytest.param({"key": b"x" * 513}, ValueError, id="oversized-key"),
    pytest.param({"key": "é" * 257}, ValueError, id="oversized-utf8-key"),
    pytest.param({"key": "\ud800"}, ValueError, id="unencodable-key"),
    pytest.param({"key": 42}, TypeError, id="int-key"),
    pytest.param({"key": None}, TypeError, id="none-key"),
    pytest.param({"key": 4.2}, TypeError, id="float-key"),
    pytest.param({"key": ["a"]}, TypeError, id="list-key"),
    pytest.param({"namespace": ""}, ValueError, id="empty-ns"),
    pytest.param({"namespace": "a b"}, ValueError, id="space-ns"),
    pytest.param({"namespace": "ü"}, ValueError, id="non-ascii-ns"),
    pytest.param({"namespace": "x" * 129}, ValueError, id="long-ns"),
    pytest.param({"namespace": 5}, TypeError, id="int-ns"),
    pytest.param({"namespace": None}, TypeError, id="none-ns"),
    pytest.param({"lease": 0}, ValueError, id="lease-0"),
    pytest.param({"lease": -1.0}, ValueError, id="lease-negative"),
    pytest.param({"lease": float("nan")}, ValueError, id="lease-nan"),
    pytest.param({"lease": float("inf")}, ValueError, id="lease-inf"),
    pytest.param({"lease": "30"}, TypeError, id="lease-str"),
    pytest.param({"lease": True}, TypeError, id="lease-bool"),
    pytest.param({"fingerprint": "text"}, TypeError, id="fingerprint-str"),
    pytest.param({"fingerprint": b""}, ValueError, id="fingerprint-empty"),
    pytest.param({"fingerprint": b"f" * 256}, ValueError, id="fingerprint-long"),
    pytest.param({"owner": 12}, TypeError, id="owner-int"),
    pytest.param({"owner": ""}, ValueError, id="owner-empty"),
    pytest.param({"owner": "o" * 256}, ValueError, id="owner-long"),
]


@pytest.mark.parametrize(("kwargs", "error"), BAD_CLAIMS)
def test_bad_claim_input_is_a_precise_error(
    api: ClaimAPI, ns: str, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    args = {"key": b"ok", "namespace": ns, **kwargs}
    key = args.pop("key")
    with pytest.raises(error):
        api.claim(key, **args)
    batch_args = dict(args)
    if "fingerprint" in batch_args:
        batch_args["fingerprints"] = [None, batch_args.pop("fingerprint")]
    with pytest.raises(error):
        api.claim_many([b"first", key], **batch_args)
    assert api.claim(b"ok", namespace=ns).outcome is Outcome.NEW  # nothing was claimed
    assert api.claim(b"first", namespace=ns).outcome is Outcome.NEW


@pytest.mark.parametrize(
    ("token", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (2**63, ValueError),
        ("1", TypeError),
        (b"1", TypeError),
        (1.0, TypeError),
        (None, TypeError),
        (True, TypeError),
        ([1], TypeError),
    ],
    ids=["zero", "negative", "over-63-bits", "str", "bytes", "float", "none", "bool", "list"],
)
def test_bad_token_is_a_precise_error(api: ClaimAPI, ns: str, token: Any, error: Any) -> None:
    c = api.claim("k", namespace=ns)
    with pytest.raises(error):
        api.complete("k", token, namespace=ns)
    with pytest.raises(error):
        api.release("k", token, namespace=ns)
    with pytest.raises(error):
        api.complete_many([("k", c.token), ("k", token)], namespace=ns)
    assert api.claim("k", namespace=ns).outcome is Outcome.IN_PROGRESS
    api.complete("k", c.token, namespace=ns)


@pytest.mark.parametrize(
    ("items", "error"),
    [
        pytest.param([("k",)], TypeError, id="1-tuple"),
        pytest.param([("k", 1, None, "extra")], TypeError, id="4-tuple"),
        pytest.param([(42, 1)], TypeError, id="int-key"),
        pytest.param([(b"", 1)], ValueError, id="empty-key"),
        pytest.param([(b"x" * 513, 1)], ValueError, id="oversized-key"),
    ],
)
def test_bad_items_are_precise_errors(
    api: ClaimAPI, ns: str, items: list[Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        api.complete_many(items, namespace=ns)
    with pytest.raises(error):
        api.release_many([i[:2] if len(i) == 3 else i for i in items], namespace=ns)


def test_release_with_a_result_is_a_type_error(api: ClaimAPI, ns: str) -> None:
    c = api.claim("k", namespace=ns)
    with pytest.raises(TypeError):
        api.release_many([("k", c.token, "result")], namespace=ns)  # type: ignore[list-item]
    assert api.claim("k", namespace=ns).outcome is Outcome.IN_PROGRESS


def test_results_are_checked(api: ClaimAPI, ns: str) -> None:
    c = api.claim("k", namespace=ns)
    with pytest.raises(TypeError):
        api.complete("k", c.token, namespace=ns, result=object())
    with pytest.raises(TypeError):
        api.complete("k", c.token, namespace=ns, result={1, 2})
    with pytest.raises(ValueError, match="max_result_bytes"):
        api.complete("k", c.token, namespace=ns, result=b"x" * 70000)
    assert api.claim("k", namespace=ns).outcome is Outcome.IN_PROGRESS
    api.complete("k", c.token, namespace=ns, result=b"fits")
    assert api.claim("k", namespace=ns).result == b"fits"


@pytest.mark.parametrize(
    ("key", "namespace", "error"),
    [
        pytest.param(b"", "n", ValueError, id="empty-key"),
        pytest.param(7, "n", TypeError, id="int-key"),
        pytest.param(b"x" * 600, "n", ValueError, id="oversized-key"),
        pytest.param(b"k", "bad ns", ValueError, id="bad-ns"),
        pytest.param(b"k", 3, TypeError, id="int-ns"),
    ],
)
def test_bad_get_input(api: ClaimAPI, key: Any, namespace: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        api.get(key, namespace=namespace)


# -- the same answer, side by side, for inputs at the edges -----------------------------------


def _outcome(call: Any) -> tuple[str, Any]:
    try:
        value = call()
    except Exception as exc:
        return "raises", type(exc)
    return "returns", value


EDGE_CASES: list[Any] = [
    pytest.param(lambda a, ns: a.claim("k", namespace=ns.encode()).outcome, id="bytes-namespace"),
    pytest.param(lambda a, ns: a.claim(memoryview(b"k"), namespace=ns).outcome, id="memoryview"),
    pytest.param(lambda a, ns: a.claim("k", namespace=ns, lease=1e-9).outcome, id="tiny-lease"),
    pytest.param(lambda a, ns: a.claim("k", namespace=ns, lease=1e39).outcome, id="huge-lease"),
    pytest.param(lambda a, ns: a.complete("k", 2**64, namespace=ns), id="token-2**64"),
    pytest.param(lambda a, ns: a.complete("k", 2**63, namespace=ns), id="token-2**63"),
    pytest.param(
        lambda a, ns: a.complete("k", a.claim("k", namespace=ns).token, namespace=ns, result=2**64),
        id="result-2**64",
    ),
    pytest.param(
        lambda a, ns: a.complete_many([["k", a.claim("k", namespace=ns).token]], namespace=ns),
        id="items-as-lists",
    ),
    pytest.param(
        lambda a, ns: a.claim_many(["k"], namespace=ns, fingerprints=(b"f",))[0].outcome,
        id="fingerprints-tuple",
    ),
    pytest.param(
        lambda a, ns: a.claim_many(["k"], namespace=ns, fingerprints=[b"f", b"g"]),
        id="too-many-fingerprints",
    ),
]


@pytest.mark.parametrize("call", EDGE_CASES)
def test_edge_inputs_get_the_same_answer_from_store_and_client(
    store: DedupStore, client: Client, ns: str, call: Any
) -> None:
    """Whatever the store does with an odd input, the client does too (a raise of the
    same class, or the same return value)."""
    expected = _outcome(lambda: call(store, ns))
    actual = _outcome(lambda: call(client, ns))
    message = f"store: {expected}, client: {actual}"
    if expected[0] == "raises" and actual[0] == "raises":
        assert issubclass(actual[1], expected[1]), message
    else:
        assert actual == expected, message
