"""MemoryTable: the claim API in this process's memory, nothing persisted.

The write-behind store's default local table (dedupcore/writebehind.py) and
a store for tests; it decides with :mod:`dedupcore.decision`, the rules every
authority follows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import dedupcore.decision as decision
import dedupcore.keys as _keys
from dedupcore.api import (
    Claim,
    ClaimAPI,
    KeyRecord,
    Outcome,
    change_items,
    check_fingerprints,
    check_owner,
    fingerprint_conflict,
    namespace_counts,
    pack_result,
    unpack_result,
)
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
        self._outcomes: dict[tuple[str, str], int] = {}

    def _ns_id(self, ns: bytes) -> int:
        return self._ns_ids.setdefault(ns, len(self._ns_ids) + 1)

    def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[Claim]:
        """Claims a batch of keys of one namespace (all or nothing on a fingerprint conflict)."""
        key_list = list(keys)
        ns = _keys.check_namespace(namespace)
        raw = [_keys.check_key(k, self.max_key_bytes) for k in key_list]
        lease_s = self.lease if lease is None else check_lease(lease)
        owner_b = check_owner(owner)
        fps = check_fingerprints(fingerprints, len(raw))
        digests = _keys.digests(ns, raw) if raw else []
        with self._lock:
            plan = decision.decide_claim(
                self._recs.get,
                digests,
                ns_id=self._ns_id(ns),
                lease=lease_s,
                owner=owner_b,
                fingerprints=None if fingerprints is None else fps,
                cold=None,
                now_w=time.time(),
                now_m=time.monotonic(),
            )
            if plan.conflict is not None:
                raise fingerprint_conflict(key_list[plan.conflict], namespace)
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
                        unpack_result(result),
                        exact=exact,
                        takeover=takeover,
                    )
                )
        return out

    def complete_many(
        self,
        items: Iterable[tuple[bytes | str, int] | tuple[bytes | str, int, Any]],
        *,
        namespace: str,
    ) -> None:
        """Completes many claims; a stale token anywhere raises before anything changes."""
        self._change(items, namespace, State.PROCESSED)

    def release_many(self, items: Iterable[tuple[bytes | str, int]], *, namespace: str) -> None:
        """Releases many claims; a stale token anywhere raises before anything changes."""
        self._change(items, namespace, State.RELEASED)

    def _change(self, items: Iterable[Any], namespace: str, state: State) -> None:
        ns = _keys.check_namespace(namespace)
        parsed = change_items(items, with_results=state is State.PROCESSED)
        raw = [_keys.check_key(k, self.max_key_bytes) for k, _t, _r in parsed]
        results = [pack_result(r, self.max_result_bytes) for _k, _t, r in parsed]
        if not parsed:
            return
        digests = _keys.digests(ns, raw)
        with self._lock:
            plan = decision.decide_change(
                self._recs.get,
                digests,
                [t for _k, t, _r in parsed],
                results,
                state=state,
                now_w=time.time(),
            )
            if plan.error is not None:
                i, kind, current = plan.error
                raise decision.stale_token_error(
                    kind, parsed[i][0], parsed[i][1], current, namespace
                )
            self._recs.update(plan.logged)

    def get(self, key: bytes | str, *, namespace: str) -> KeyRecord | None:
        """The key's record, or None."""
        ns = _keys.check_namespace(namespace)
        d = _keys.digest(ns, _keys.check_key(key, self.max_key_bytes))
        with self._lock:
            r = self._recs.get(d)
        if r is None:
            return None
        return KeyRecord(
            r.state, r.token, r.owner, r.fingerprint, unpack_result(r.result), r.created, r.updated
        )

    def stats(self) -> dict[str, Any]:
        """Records held and claims per namespace and outcome."""
        with self._lock:
            return {"records": len(self._recs), "namespaces": namespace_counts(self._outcomes)}

    def durability(self) -> str:
        return "memory: nothing survives the process"
