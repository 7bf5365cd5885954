"""Lease takeovers, owner re-claims, releases and stale tokens: one answer from every authority.

The decision is written once in dedupcore/decision.py (the table is in
docs/engine.md). On a takeover the first claim's fingerprint and ``created``
stay, while the token, owner, lease and ``updated`` move; a claim with
another fingerprint is a ConflictError before any takeover; a claim after a
release starts a fresh record. Leases are short and every wait polls the
authority (whose clock decides) with a generous bound.
"""

from __future__ import annotations

import time

import pytest

from dedupcore.api import ClaimAPI, Outcome
from dedupcore.errors import ConflictError, StaleTokenError
from dedupcore.record import State
from dedupcore.stack import ShardedStore
from tests.support.procs import wait_until
from tests.support.stores import take_over

LEASE = 0.2


def _lease_passed(started: float) -> None:
    """Sleeps until ``LEASE`` (plus a margin) has passed since ``started`` on this host."""
    left = started + LEASE + 0.3 - time.monotonic()
    if left > 0:
        time.sleep(left)


def test_takeover_without_a_fingerprint_keeps_the_first_one_and_created(
    api: ClaimAPI, ns: str
) -> None:
    started = time.monotonic()
    first = api.claim("k", namespace=ns, lease=LEASE, owner="a", fingerprint=b"body-a")
    before = api.get("k", namespace=ns)
    assert before is not None and before.fingerprint == b"body-a"
    _lease_passed(started)
    second = take_over(api, "k", ns, owner="b")
    assert second.outcome is Outcome.NEW and second.takeover
    assert second.token == first.token + 1
    after = api.get("k", namespace=ns)
    assert after is not None
    assert after.state is State.PROCESSING
    assert after.fingerprint == b"body-a"
    assert after.created == before.created
    assert after.updated > before.updated
    assert after.token == second.token and after.owner == b"b"
    # The kept fingerprint still guards the key, and the new owner holds it.
    with pytest.raises(ConflictError):
        api.claim("k", namespace=ns, fingerprint=b"body-b")
    assert api.claim("k", namespace=ns, owner="c").outcome is Outcome.IN_PROGRESS
    api.complete("k", second.token, namespace=ns, result="b did it")
    done = api.get("k", namespace=ns)
    assert done is not None and done.fingerprint == b"body-a"
    # A finished record may be read back from LMDB, which stores times in whole ms.
    assert abs(done.created - before.created) < 0.002


def test_takeover_with_another_fingerprint_is_a_conflict_and_takes_nothing_over(
    api: ClaimAPI, ns: str
) -> None:
    started = time.monotonic()
    first = api.claim("k", namespace=ns, lease=LEASE, owner="a", fingerprint=b"body-a")
    before = api.get("k", namespace=ns)
    _lease_passed(started)
    with pytest.raises(ConflictError):
        api.claim("k", namespace=ns, owner="b", fingerprint=b"body-b")
    with pytest.raises(ConflictError):
        api.claim_many(["other", "k"], namespace=ns, owner="b", fingerprints=[None, b"body-b"])
    after = api.get("k", namespace=ns)
    assert after == before  # same token, owner, fingerprint and times
    if not isinstance(api, ShardedStore):
        # (A sharded batch is not atomic across shards: ShardedStore's docstring.)
        assert api.get("other", namespace=ns) is None
    # The same fingerprint takes the expired lease over.
    second = take_over(api, "k", ns, owner="b", fingerprint=b"body-a")
    assert second.takeover and second.token == first.token + 1


def test_takeover_with_a_fingerprint_records_it_where_there_was_none(
    api: ClaimAPI, ns: str
) -> None:
    started = time.monotonic()
    first = api.claim("k", namespace=ns, lease=LEASE, owner="a")
    before = api.get("k", namespace=ns)
    assert before is not None and before.fingerprint is None
    _lease_passed(started)
    second = take_over(api, "k", ns, owner="b", fingerprint=b"body-c")
    assert second.takeover and second.token == first.token + 1
    after = api.get("k", namespace=ns)
    assert after is not None
    assert after.fingerprint == b"body-c"
    assert after.created == before.created
    assert after.owner == b"b"
    with pytest.raises(ConflictError):
        api.claim("k", namespace=ns, fingerprint=b"body-d")
    api.complete("k", second.token, namespace=ns)
    with pytest.raises(ConflictError):
        api.claim("k", namespace=ns, fingerprint=b"body-d")
    assert api.claim("k", namespace=ns, fingerprint=b"body-c").outcome is Outcome.DUPLICATE


def test_takeover_in_a_batch_keeps_each_keys_fingerprint(api: ClaimAPI, ns: str) -> None:
    started = time.monotonic()
    api.claim_many(["a", "b"], namespace=ns, lease=LEASE, fingerprints=[b"fa", None])
    _lease_passed(started)

    def both_taken() -> bool:
        got = api.claim_many(["a", "b"], namespace=ns, owner="w", fingerprints=[None, b"fb"])
        return all(c.outcome is Outcome.NEW for c in got)

    wait_until(both_taken, "both leases taken over")
    a, b = api.get("a", namespace=ns), api.get("b", namespace=ns)
    assert a is not None and a.fingerprint == b"fa"
    assert b is not None and b.fingerprint == b"fb"


def test_a_claim_after_a_release_starts_a_fresh_record(api: ClaimAPI, ns: str) -> None:
    first = api.claim("k", namespace=ns, owner="a", fingerprint=b"body-a")
    before = api.get("k", namespace=ns)
    assert before is not None
    api.release("k", first.token, namespace=ns)
    time.sleep(0.05)  # the new record's created must be a later clock reading
    again = api.claim("k", namespace=ns, owner="b", fingerprint=b"body-b")
    assert again.outcome is Outcome.NEW and not again.takeover
    assert again.token == first.token + 1
    rec = api.get("k", namespace=ns)
    assert rec is not None
    assert rec.state is State.PROCESSING
    assert rec.fingerprint == b"body-b"
    assert rec.owner == b"b"
    assert rec.created > before.created
    # Released again and claimed without a fingerprint: none is recorded.
    api.release("k", again.token, namespace=ns)
    third = api.claim("k", namespace=ns)
    assert third.outcome is Outcome.NEW and third.token == first.token + 2
    rec = api.get("k", namespace=ns)
    assert rec is not None and rec.fingerprint is None and rec.owner is None


def test_the_owner_gets_its_claim_back_unchanged(api: ClaimAPI, ns: str) -> None:
    first = api.claim("k", namespace=ns, owner="w", fingerprint=b"fp")
    before = api.get("k", namespace=ns)
    again = api.claim("k", namespace=ns, owner="w")
    assert again.outcome is Outcome.NEW and again.token == first.token and not again.takeover
    with_fp = api.claim("k", namespace=ns, owner="w", fingerprint=b"fp")
    assert with_fp.outcome is Outcome.NEW and with_fp.token == first.token
    with pytest.raises(ConflictError):
        api.claim("k", namespace=ns, owner="w", fingerprint=b"other")
    rec = api.get("k", namespace=ns)
    assert before is not None and rec is not None
    assert (rec.state, rec.token, rec.owner, rec.fingerprint, rec.created) == (
        State.PROCESSING,
        first.token,
        b"w",
        b"fp",
        before.created,
    )
    api.complete("k", first.token, namespace=ns, result=1)
    assert api.claim("k", namespace=ns, owner="w").result == 1


def test_stale_tokens_are_refused(api: ClaimAPI, ns: str) -> None:
    # An old token after a takeover.
    started = time.monotonic()
    old = api.claim("taken", namespace=ns, lease=LEASE, owner="a")
    _lease_passed(started)
    new = take_over(api, "taken", ns, owner="b")
    with pytest.raises(StaleTokenError):
        api.complete("taken", old.token, namespace=ns, result="late")
    with pytest.raises(StaleTokenError):
        api.release("taken", old.token, namespace=ns)
    rec = api.get("taken", namespace=ns)
    assert rec is not None and rec.state is State.PROCESSING and rec.token == new.token
    # A complete after a release.
    c = api.claim("released", namespace=ns)
    api.release("released", c.token, namespace=ns)
    with pytest.raises(StaleTokenError):
        api.complete("released", c.token, namespace=ns)
    rec = api.get("released", namespace=ns)
    assert rec is not None and rec.state is State.RELEASED
    # A release after a complete.
    c = api.claim("done", namespace=ns)
    api.complete("done", c.token, namespace=ns, result="kept")
    with pytest.raises(StaleTokenError):
        api.release("done", c.token, namespace=ns)
    assert api.claim("done", namespace=ns).result == "kept"


def test_a_key_repeated_in_a_batch_is_checked_against_its_first_copy(
    api: ClaimAPI, ns: str
) -> None:
    with pytest.raises(ConflictError):
        api.claim_many(["k", "k"], namespace=ns, fingerprints=[b"x", b"y"])
    assert api.get("k", namespace=ns) is None
    first, second = api.claim_many(["k", "k"], namespace=ns, fingerprints=[None, b"y"])
    assert (first.outcome, second.outcome) == (Outcome.NEW, Outcome.IN_PROGRESS)
    rec = api.get("k", namespace=ns)
    assert rec is not None and rec.fingerprint is None


def test_a_takeover_in_a_batch_records_the_fingerprint_its_later_copies_are_checked_against(
    api: ClaimAPI, ns: str
) -> None:
    started = time.monotonic()
    first = api.claim("k", namespace=ns, lease=LEASE, owner="a")
    before = api.get("k", namespace=ns)
    _lease_passed(started)

    def conflicted() -> bool:
        # Before the lease has passed on the authority's clock both copies are
        # IN_PROGRESS and nothing changes; after, the first copy would take the
        # key over with fingerprint y, so the second's z is a conflict.
        try:
            claims = api.claim_many(["k", "k"], namespace=ns, owner="c", fingerprints=[b"y", b"z"])
        except ConflictError:
            return True
        assert [c.outcome for c in claims] == [Outcome.IN_PROGRESS] * 2
        return False

    wait_until(conflicted, "the batch's takeover seen as a conflict")
    assert api.get("k", namespace=ns) == before
    second = take_over(api, "k", ns, owner="c", fingerprint=b"y")
    assert second.takeover and second.token == first.token + 1
