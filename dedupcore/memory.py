"""MemoryTable: the claim API in this process's memory, nothing persisted.

The write-behind store's default local table (dedupcore/writebehind.py) and
a store for tests; it decides with :mod:`dedupcore.decision`, the rules every
authority follows.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import dedupcore._engine as _engine
import dedupcore.decision as decision
import dedupcore.keys as _keys
from dedupcore.api import batches
from dedupcore.api.answers import Claim, KeyRecord, Outcome, namespace_counts
from dedupcore.api.contract import ClaimAPI
from dedupcore.config import check_lease
from dedupcore.record import State

__all__ = ["MemoryTable"]

_ANSWERS = {
    decision.NEW: (Outcome.NEW, False, True),
    decision.NEW_TAKEOVER: (Outcome.NEW, True, True),
    decision.DUPLICATE: (Outcome.DUPLICATE, False, True),
    decision.DUPLICATE_COLD: (Outcome.DUPLICATE, False, False),
    decision.IN_PROGRESS: (Outcome.IN_PROGRESS, False, True),
}


class MemoryTable(ClaimAPI):
    """A claim table in this process's memory: the claim API, nothing persisted.

    It decides with :mod:`dedupcore.decision` (the rules every authority
    follows: leases on this process's monotonic clock, owners, fencing
    tokens, fingerprints). Records are kept until the table is dropped; it
    is meant for a write-behind store's local table or for tests.
    """

    def __init__(
        self,
        *,
        lease: float = 30.0,
        max_key_bytes: int = 512,
        max_result_bytes: int = 65536,
    ) -> None:
        self.lease = check_lease(lease)
        self.max_key_bytes = max_key_bytes
        self.max_result_bytes = max_result_bytes
        self._recs: dict[bytes, decision.Rec] = {}
        self._ns_ids: dict[bytes, int] = {}
        self._lock = threading.Lock()
        #: Notified when a key is completed or released: wakes ``claim(wait=)``.
        self._changed = threading.Condition(self._lock)
        self._outcomes: dict[tuple[str, str], int] = {}

    def _ns_id(self, ns: bytes) -> int:
        return self._ns_ids.setdefault(ns, len(self._ns_ids) + 1)

    @property
    def limits(self) -> batches.Limits:  # type: ignore[override]
        """The keys' and results' limits it was made with."""
        return batches.Limits(
            max_key_bytes=self.max_key_bytes, max_result_bytes=self.max_result_bytes
        )

    def _claim_batch(self, batch: batches.ClaimBatch) -> list[Claim]:
        """Claims a batch of keys of one namespace (all or nothing on a fingerprint conflict)."""
        key_list = batch.keys
        namespace = batch.namespace
        digests = _engine.split_digests(batch.digests) if key_list else []
        lease_s = self.lease if batch.lease is None else batch.lease
        with self._lock:
            plan = decision.decide_claim(
                self._recs.get,
                digests,
                ns_id=self._ns_id(batch.ns),
                lease=lease_s,
                owner=batch.owner,
                fingerprints=batch.fingerprints,
                cold=None,
                now_w=time.time(),
                now_m=time.monotonic(),
            )
            if plan.conflict is not None:
                raise batches.fingerprint_conflict(key_list[plan.conflict], namespace)
            self._recs.update(plan.renewed)
            self._recs.update(plan.logged)
            out = []
            for k, (code, token, result) in zip(key_list, plan.answers, strict=True):
                outcome, takeover, exact = _ANSWERS[code]
                name = (namespace, outcome.value)
                self._outcomes[name] = self._outcomes.get(name, 0) + 1
                out.append(
                    Claim(
                        k,
                        namespace,
                        outcome,
                        token,
                        batches.unpack_result(result),
                        exact=exact,
                        takeover=takeover,
                    )
                )
        return out

    def _change_batch(self, batch: batches.ChangeBatch) -> None:
        """Completes or releases a batch; a stale token anywhere raises before anything
        changes."""
        if not batch.keys:
            return
        with self._lock:
            plan = decision.decide_change(
                self._recs.get,
                _engine.split_digests(batch.digests),
                batch.tokens,
                batch.results or [None] * len(batch),
                state=State.PROCESSED if batch.completing else State.RELEASED,
                now_w=time.time(),
            )
            self._apply(plan, batch, "released")
            self._changed.notify_all()

    def _wait_change(self, batch: batches.ClaimBatch, timeout: float, attempt: int) -> None:
        """Sleeps until a key of ``batch`` is completed or released, the first of their
        leases runs out, or ``timeout`` passes; at once if one is no longer held."""
        with self._lock:
            now = time.monotonic()
            wake = now + timeout
            for d in _engine.split_digests(batch.digests):
                r = self._recs.get(d)
                if r is None or r.state is not State.PROCESSING:
                    return
                wake = min(wake, r.deadline)
            if wake > now:
                self._changed.wait(wake - now)

    def _extend_batch(self, batch: batches.ExtendBatch) -> None:
        """Renews a batch's leases on this process's monotonic clock; a stale token
        anywhere raises before any is renewed."""
        if not batch.keys:
            return
        with self._lock:
            plan = decision.decide_extend(
                self._recs.get,
                _engine.split_digests(batch.digests),
                batch.tokens,
                lease=self.lease if batch.lease is None else batch.lease,
                now_m=time.monotonic(),
            )
            self._apply(plan, batch, "extended")

    def _apply(self, plan: decision.ChangePlan, batch: batches.ChangeBatch, action: str) -> None:
        """A change or extension plan's records, or its refusal (the lock held)."""
        if plan.error is not None:
            i, kind, current = plan.error
            raise decision.stale_token_error(
                kind, batch.keys[i], batch.tokens[i], current, batch.namespace, action
            )
        self._recs.update(plan.logged)

    def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        """The key's record, or None."""
        d = _keys.digest(ns, key)
        with self._lock:
            r = self._recs.get(d)
        if r is None:
            return None
        return KeyRecord(
            r.state,
            r.token,
            r.owner,
            r.fingerprint,
            batches.unpack_result(r.result),
            r.created,
            r.updated,
        )

    def stats(self) -> dict[str, Any]:
        """Records held and claims per namespace and outcome."""
        with self._lock:
            return {"records": len(self._recs), "namespaces": namespace_counts(self._outcomes)}

    def durability(self) -> str:
        return "memory: nothing survives the process"
