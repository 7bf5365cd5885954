"""The contract as a template: a backend that implements only the four primitives
(``_claim_batch``, ``_change_batch``, ``_get_record``, ``stats``) gets every public
call from :class:`~dedupcore.api.ClaimAPI` and passes the conformance cases.

The backend below keeps its records in a dict; it checks nothing itself (the
batches arrive checked), so every bad-input case here is the contract's.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from dedupcore.api import (
    ChangeBatch,
    Claim,
    ClaimAPI,
    ClaimBatch,
    KeyRecord,
    Outcome,
    fingerprint_conflict,
    namespace_counts,
    unpack_result,
)
from dedupcore.errors import StaleTokenError
from dedupcore.record import State
from tests.conformance import test_parity as parity


class DictBackend(ClaimAPI):
    """The primitives over a dict: (namespace, key) -> record fields."""

    def __init__(self, lease: float = 30.0) -> None:
        self.lease = lease
        self.records: dict[tuple[bytes, bytes], dict[str, Any]] = {}
        self.outcomes: Counter[tuple[str, str]] = Counter()

    def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        now = time.monotonic()
        lease = self.lease if batch.lease is None else batch.lease
        staged: dict[tuple[bytes, bytes], dict[str, Any]] = {}
        claims = []
        for key, raw, fp in zip(batch.keys, batch.raw, batch.fingerprint_list(), strict=True):
            at = (batch.ns, raw)
            rec = staged.get(at) or self.records.get(at)
            state = None if rec is None else rec["state"]
            if (
                fp is not None
                and state not in (None, State.RELEASED)
                and rec["fp"] not in (None, fp)
            ):
                raise fingerprint_conflict(key, batch.namespace)
            if state is State.PROCESSED:
                claim = Claim(key, batch.namespace, Outcome.DUPLICATE, rec["token"])
                claim.result = unpack_result(rec["result"])
            elif (
                state is State.PROCESSING
                and batch.owner is not None
                and rec["owner"] == batch.owner
            ):
                claim = Claim(key, batch.namespace, Outcome.NEW, rec["token"])
            elif state is State.PROCESSING and rec["deadline"] > now:
                claim = Claim(key, batch.namespace, Outcome.IN_PROGRESS, rec["token"])
            else:
                takeover = state is State.PROCESSING
                token = 1 if rec is None else rec["token"] + 1
                staged[at] = {
                    "state": State.PROCESSING,
                    "token": token,
                    "owner": batch.owner,
                    "fp": fp if fp is not None or rec is None else rec["fp"],
                    "result": None,
                    "deadline": now + lease,
                    "created": time.time(),
                }
                claim = Claim(key, batch.namespace, Outcome.NEW, token, takeover=takeover)
            claims.append(claim)
        self.records.update(staged)
        for c in claims:
            self.outcomes[(batch.namespace, c.outcome.value)] += 1
        return claims

    def _change_batch(self, batch: ChangeBatch) -> None:
        results = batch.results or [None] * len(batch)
        changes = []
        for key, raw, token, result in zip(
            batch.keys, batch.raw, batch.tokens, results, strict=True
        ):
            rec = self.records.get((batch.ns, raw))
            if rec is None or rec["state"] is State.RELEASED:
                raise StaleTokenError(f"key {key!r} is not claimed")
            if rec["token"] != token:
                raise StaleTokenError(f"token of key {key!r} is not the key's current token")
            if rec["state"] is State.PROCESSED:
                if not batch.completing:
                    raise StaleTokenError(f"key {key!r} was already completed")
                continue  # a retried completion
            changes.append((rec, result))
        for rec, result in changes:
            rec["state"] = State.PROCESSED if batch.completing else State.RELEASED
            rec["result"] = result

    def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        rec = self.records.get((ns, key))
        if rec is None:
            return None
        return KeyRecord(
            rec["state"],
            rec["token"],
            rec["owner"],
            rec["fp"],
            unpack_result(rec["result"]),
            rec["created"],
            rec["created"],
        )

    def stats(self) -> dict[str, Any]:
        return {"namespaces": namespace_counts(self.outcomes)}


@pytest.fixture
def api() -> DictBackend:
    return DictBackend()


#: The conformance cases of tests/conformance/test_parity.py that speak of one store.
CASES = [
    "test_new_in_progress_duplicate_with_result",
    "test_tuple_result_comes_back_as_a_list",
    "test_str_and_bytes_keys_are_distinct_values_but_same_utf8_key",
    "test_release_lets_the_work_run_again_with_a_higher_token",
    "test_same_owner_gets_its_own_claim_back",
    "test_expired_lease_is_taken_over_and_the_late_owner_is_fenced",
    "test_takeover_of_an_expired_lease_by_the_same_owner_keeps_the_token",
    "test_fingerprint_mismatch_is_a_conflict",
    "test_conflict_in_batch_claims_nothing",
    "test_claim_many_batch_semantics",
    "test_claim_many_with_owner_repeated_key_is_the_same_claim",
    "test_claim_many_accepts_any_iterable_and_fingerprints",
    "test_complete_many_and_release_many",
    "test_a_stale_token_in_a_batch_changes_nothing",
    "test_complete_is_idempotent_for_the_same_token",
    "test_complete_or_release_without_claim",
    "test_namespaces_are_separate_keys",
    "test_processing_completes_on_success_and_releases_on_error",
    "test_processing_with_an_unstorable_result_completes_without_it",
    "test_processing_yields_duplicates_and_busy_keys_without_changing_them",
    "test_processing_after_lease_takeover_reraises_the_original_error",
    "test_idempotent_decorator_runs_once",
    "test_bad_claim_input_is_a_precise_error",
    "test_bad_token_is_a_precise_error",
    "test_bad_items_are_precise_errors",
    "test_release_with_a_result_is_a_type_error",
    "test_results_are_checked",
    "test_bad_get_input",
]

for _name in CASES:
    globals()[_name] = getattr(parity, _name)


def test_stats_count_outcomes_per_namespace(api: ClaimAPI, ns: str) -> None:
    parity.test_stats_count_outcomes_per_namespace(api, ns)  # the parity case runs per stack


def test_with_closes_and_the_default_declarations(api: DictBackend) -> None:
    with api as opened:
        assert opened is api
    assert api.failed is None
    assert api.durability().startswith("unknown")
    assert api.limits.max_key_bytes == 512 and api.limits.max_result_bytes == 65536


def test_a_backend_without_primitives_names_what_is_missing() -> None:
    class Bare(ClaimAPI):
        def stats(self) -> dict[str, Any]:
            return {}

    with pytest.raises(NotImplementedError, match="Bare does not implement _claim_batch"):
        Bare().claim("k", namespace="ns")
    with pytest.raises(NotImplementedError, match="_change_batch"):
        Bare().release("k", 1, namespace="ns")
    with pytest.raises(NotImplementedError, match="_get_record"):
        Bare().get("k", namespace="ns")
