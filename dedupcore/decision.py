"""The claim decision, written once in Python: the reference every authority answers like.

Pure functions, no I/O; the clocks are passed in. ``decide_claim`` decides a
claim batch and ``decide_change`` a complete/release batch against the
current records, and return a plan: the answer per key and the records to
write. Nothing is written when the plan carries an error (a fingerprint
conflict, a stale token): a batch is checked whole before anything changes.

The embedded store runs the same decision natively (``ext/dc_engine.h``); a
differential test drives both side by side (tests/unit/test_engine.py). The
rules, in order, for each key of a claim batch (docs/architecture.md has the
table):

1. A live record (PROCESSING or PROCESSED) with a fingerprint, claimed with
   another fingerprint: conflict, the whole batch raises.
2. PROCESSED: DUPLICATE with the stored result.
3. PROCESSING held by the same ``owner``: NEW with the same token, the lease
   renewed (in memory: deadlines are not stored).
4. PROCESSING whose lease has not run out: IN_PROGRESS.
5. PROCESSING whose lease ran out: taken over, NEW with token + 1, keeping
   the first claim's fingerprint (unless one is given) and ``created``.
6. No record but a cold-slice hit: DUPLICATE, inexact.
7. No record, or a RELEASED tombstone: NEW with token 1 / token + 1.

A key repeated in a batch sees the records the batch staged before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dedupcore.errors import StaleTokenError
from dedupcore.record import State

__all__ = [
    "ERR_COMPLETED",
    "ERR_NOT_CLAIMED",
    "ERR_WRONG_TOKEN",
    "ChangePlan",
    "ClaimPlan",
    "Rec",
    "decide_change",
    "decide_claim",
    "decide_extend",
    "stale_token_error",
]

# Per-key answers of a claim (the native engine's codes).
NEW, DUPLICATE, IN_PROGRESS, NEW_TAKEOVER, DUPLICATE_COLD = range(5)
# Errors of a complete/release.
ERR_NOT_CLAIMED, ERR_WRONG_TOKEN, ERR_COMPLETED = 1, 2, 3


@dataclass(frozen=True, slots=True)
class Rec:
    """One key's record."""

    state: State
    ns_id: int
    token: int
    created: float
    updated: float
    lease: float
    deadline: float = 0.0  # monotonic, PROCESSING only
    owner: bytes | None = None
    fingerprint: bytes | None = None
    result: bytes | None = None


@dataclass
class ClaimPlan:
    """Answers (code, token, result) per key and the records to write (``logged``) or
    to keep in memory only (``renewed``); ``conflict`` is a key index or None."""

    answers: list[tuple[int, int, bytes | None]] = field(default_factory=list)
    logged: dict[bytes, Rec] = field(default_factory=dict)
    renewed: dict[bytes, Rec] = field(default_factory=dict)
    conflict: int | None = None


@dataclass
class ChangePlan:
    """Records to write, or the first bad item: (index, kind, current token)."""

    logged: dict[bytes, Rec] = field(default_factory=dict)
    error: tuple[int, int, int] | None = None


def decide_claim(
    lookup: Callable[[bytes], Rec | None],
    digests: Sequence[bytes],
    *,
    ns_id: int,
    lease: float,
    owner: bytes | None,
    fingerprints: Sequence[bytes | None] | None,
    cold: Sequence[bool] | None,
    now_w: float,
    now_m: float,
) -> ClaimPlan:
    """Decides a claim batch (see the module docstring)."""
    plan = ClaimPlan()
    staged: dict[bytes, Rec] = {}
    deadline = now_m + lease
    for i, d in enumerate(digests):
        r = staged.get(d) or lookup(d)
        fp = fingerprints[i] if fingerprints is not None else None
        takeover = False
        if r is not None and r.state is not State.RELEASED:
            if fp is not None and r.fingerprint is not None and fp != r.fingerprint:
                return ClaimPlan(conflict=i)
            if r.state is State.PROCESSED:
                plan.answers.append((DUPLICATE, r.token, r.result))
                continue
            if owner is not None and r.owner == owner:
                renewed = dataclasses.replace(r, deadline=deadline)
                staged[d] = renewed
                if d in plan.logged:
                    plan.logged[d] = renewed
                else:
                    plan.renewed[d] = renewed
                plan.answers.append((NEW, r.token, None))
                continue
            if r.deadline > now_m:
                plan.answers.append((IN_PROGRESS, r.token, None))
                continue
            takeover = True
        elif r is None and cold is not None and cold[i]:
            plan.answers.append((DUPLICATE_COLD, 0, None))
            continue
        assert takeover is False or r is not None
        new = Rec(
            State.PROCESSING,
            ns_id,
            1 if r is None else r.token + 1,
            r.created if takeover and r is not None else now_w,
            now_w,
            lease,
            deadline,
            owner,
            fp if fp is not None or not takeover or r is None else r.fingerprint,
            None,
        )
        staged[d] = new
        plan.renewed.pop(d, None)
        plan.logged[d] = new
        plan.answers.append((NEW_TAKEOVER if takeover else NEW, new.token, None))
    return plan


def decide_change(
    lookup: Callable[[bytes], Rec | None],
    digests: Sequence[bytes],
    tokens: Sequence[int],
    results: Sequence[bytes | None] | None,
    *,
    state: State,
    now_w: float,
) -> ChangePlan:
    """Decides a complete (``state`` PROCESSED) or release (RELEASED) batch."""
    plan = ChangePlan()
    for i, d in enumerate(digests):
        r = plan.logged.get(d) or lookup(d)
        kind = _refusal(r, tokens[i])
        if kind == ERR_COMPLETED and state is State.PROCESSED:
            continue  # a retried completion: already done
        if kind:
            return ChangePlan(error=(i, kind, 0 if r is None else r.token))
        assert r is not None
        result = results[i] if results is not None and state is State.PROCESSED else None
        plan.logged[d] = dataclasses.replace(
            r, state=state, updated=now_w, deadline=0.0, result=result
        )
    return plan


def decide_extend(
    lookup: Callable[[bytes], Rec | None],
    digests: Sequence[bytes],
    tokens: Sequence[int],
    *,
    lease: float,
    now_m: float,
) -> ChangePlan:
    """Decides an extension: every item's claim is renewed to ``now_m + lease``, or none.

    A claim is renewed while its token is the key's current one and the key is
    PROCESSING, its lease run out or not (nobody took it over); like an
    owner's re-claim, the renewal is kept in memory only (docs/reliability.md,
    "Heartbeats"). ``logged`` holds the renewed records; ``error`` the first
    item that cannot be renewed (a completed key is ERR_COMPLETED).
    """
    plan = ChangePlan()
    deadline = now_m + lease
    for i, d in enumerate(digests):
        r = plan.logged.get(d) or lookup(d)
        kind = _refusal(r, tokens[i])
        if kind:
            return ChangePlan(error=(i, kind, 0 if r is None else r.token))
        assert r is not None
        plan.logged[d] = dataclasses.replace(r, lease=lease, deadline=deadline)
    return plan


def _refusal(r: Rec | None, token: int) -> int:
    """Why ``token`` cannot change the record ``r`` (0: it can, the key is PROCESSING by
    it): ERR_NOT_CLAIMED, ERR_WRONG_TOKEN, or ERR_COMPLETED."""
    if r is None or r.state is State.RELEASED:
        return ERR_NOT_CLAIMED
    if r.token != token:
        return ERR_WRONG_TOKEN
    return ERR_COMPLETED if r.state is State.PROCESSED else 0


def stale_token_error(
    kind: int, key: object, token: int, current: int, namespace: str, action: str = "released"
) -> StaleTokenError:
    """The one set of messages for a complete/release/extend refused with ``kind``
    (ERR_NOT_CLAIMED, ERR_WRONG_TOKEN, ERR_COMPLETED); ``action`` is what a
    completed key cannot be ("released", "extended")."""
    if kind == ERR_NOT_CLAIMED:
        return StaleTokenError(
            f"key {key!r} in namespace {namespace!r} is not claimed (never claimed, "
            "released, or expired from the store)"
        )
    if kind == ERR_WRONG_TOKEN:
        return StaleTokenError(
            f"token {token} of key {key!r} is not the key's current token "
            f"{current} (a stale owner whose lease was taken over, or a wrong token)"
        )
    return StaleTokenError(f"key {key!r} was already completed; it cannot be {action}")
