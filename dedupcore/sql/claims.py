"""A claim batch in one transaction: create the absent rows, lock the rest, decide, update.

The steps of ``SqlStore.claim_many`` on an unpartitioned table
(:func:`claim_flat`; a partitioned one: :mod:`dedupcore.sql.partitions`),
and the decision and batched updates both share (:func:`decide`):

1. the keys without a row are created with one multi-row insert-if-absent
   (``Dialect.insert_fresh``); a namespace whose recent batches found no
   row tries a plain INSERT first, whose duplicate-key error rolls the
   transaction back and runs it again the safe way (:class:`Fallback`);
2. the other rows are read and locked (``SELECT .. FOR UPDATE``, in key
   order); MariaDB cannot return the rows an INSERT created, so they carry
   the transaction's random nonce and are told apart by it;
3. :func:`dedupcore.decision.decide_claim` decides every key, and
   takeovers, tombstones claimed again and renewed leases are written with
   batched UPDATEs.

A namespace whose recent batches were mostly DUPLICATE (:class:`Habits`)
is read first, without locks and outside any transaction (where the
dialect has ``read_first``): a PROCESSED row is final, so a batch of
PROCESSED keys is answered from that read alone. Completions and releases
are :func:`change`: one locking read and one batched UPDATE.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dedupcore.api import Claim, Outcome, fingerprint_conflict, unpack_result
from dedupcore.decision import (
    DUPLICATE,
    ERR_COMPLETED,
    ERR_NOT_CLAIMED,
    ERR_WRONG_TOKEN,
    IN_PROGRESS,
    NEW,
    NEW_TAKEOVER,
    Rec,
    decide_claim,
    stale_token_error,
)
from dedupcore.record import State
from dedupcore.sql.dialects import Dialect
from dedupcore.sql.dialects.base import PROCESSED, PROCESSING, RELEASED, RowUpdate, SetList
from dedupcore.sql.transactions import Fallback, Retry, Transactions

__all__ = [
    "Batch",
    "Habits",
    "Row",
    "change",
    "claim_flat",
    "decide",
    "extend",
    "insert_absent",
]

#: A namespace's batches are read first while the exponential average of their
#: DUPLICATE share (weight of the newest batch ``SHARE_WEIGHT``) is above
#: ``READ_FIRST_ABOVE``; at most ``MAX_SHARES`` namespaces are followed.
READ_FIRST_ABOVE = 0.5
SHARE_WEIGHT = 0.5
#: Below this average share of keys that already had a row, a namespace's batch is
#: first tried as a plain multi-row INSERT (PostgreSQL: cheaper than ON CONFLICT).
PLAIN_BELOW = 0.001
MAX_SHARES = 10_000

#: The decision's answer codes (dedupcore/decision.py) as outcomes.
_OUTCOMES = {
    NEW: Outcome.NEW,
    NEW_TAKEOVER: Outcome.NEW,
    DUPLICATE: Outcome.DUPLICATE,
    IN_PROGRESS: Outcome.IN_PROGRESS,
}


def _maybe_bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


@dataclass(slots=True)
class Row:
    """An existing row, as a claim decides on it."""

    state: int
    token: int
    owner: bytes | None
    fingerprint: bytes | None
    live: bool
    result: bytes | None = None

    @classmethod
    def of(cls, s: Any, tok: Any, o: Any, f: Any, res: Any, live: Any) -> Row:
        """A row from ``(state, token, owner, fingerprint, result, live)`` as selected."""
        return cls(
            int(s), int(tok), _maybe_bytes(o), _maybe_bytes(f), bool(live), _maybe_bytes(res)
        )


@dataclass(slots=True)
class Batch:
    """A claim's checked arguments."""

    #: The keys as given (the claims name them), their bytes, their fingerprints.
    keys: list[Any]
    raw: list[bytes]
    fps: list[bytes | None]
    ns: str
    owner: bytes | None
    lease: float
    #: The first fingerprint of each distinct key; the distinct keys, sorted.
    first_fp: dict[bytes, bytes | None] = field(init=False)
    unique: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.first_fp = {}
        for k, fp in zip(self.raw, self.fps, strict=True):
            self.first_fp.setdefault(k, fp)
        self.unique = sorted(self.first_fp)

    def all_new(self) -> list[Claim]:
        """Every key NEW with token 1 (every row created by this batch, none repeated)."""
        return [Claim(key, self.ns, Outcome.NEW, 1) for key in self.keys]

    def duplicates(self, done: dict[bytes, tuple[Any, Any, Any]]) -> list[Claim]:
        """The keys that have a PROCESSED row in ``done`` (``k -> (token, fingerprint,
        result)``), DUPLICATE; ConflictError for one whose fingerprint differs."""
        claims: list[Claim] = []
        for key, k, fp in zip(self.keys, self.raw, self.fps, strict=True):
            hit = done.get(k)
            if hit is None:
                continue
            tok, f, res = hit
            if fp is not None and f is not None and fp != bytes(f):
                raise fingerprint_conflict(key, self.ns)  # before anything is written
            claims.append(Claim(key, self.ns, Outcome.DUPLICATE, int(tok), unpack_result(res)))
        return claims


class Habits:
    """What each namespace's recent batches found, which picks how its next one starts."""

    def __init__(self, d: Dialect, counts: Counter[str]) -> None:
        self._d = d
        self._counts = counts
        self._dup_share: dict[str, float] = {}  # namespace -> average DUPLICATE share
        self._seen_share: dict[str, float] = {}  # namespace -> average share of existing rows

    def read_first(self, ns: str) -> bool:
        """Whether the batch is read first (its namespace's batches are mostly DUPLICATE)."""
        return self._d.read_first and self._dup_share.get(ns, 0.0) > READ_FIRST_ABOVE

    def plain(self, ns: str) -> bool:
        """Whether the batch is first inserted plain (its namespace's keys are fresh)."""
        return self._d.plain_insert and self._seen_share.get(ns, 0.0) < PLAIN_BELOW

    def count(self, ns: str, claims: list[Claim]) -> None:
        """Counts the outcomes and follows the namespace's share of DUPLICATE answers."""
        outcomes = Counter(c.outcome for c in claims)
        for outcome, n in outcomes.items():
            self._counts[outcome.value] += n
        self._counts["takeovers"] += sum(c.takeover for c in claims)
        dup = outcomes[Outcome.DUPLICATE]
        shares = self._dup_share
        if len(shares) >= MAX_SHARES and ns not in shares:
            shares.clear()  # too many namespaces: forget them (each starts insert-first again)
            self._seen_share.clear()
        old = shares.get(ns, 0.0)
        shares[ns] = old + SHARE_WEIGHT * (dup / len(claims) - old)

    def follow_seen(self, ns: str, seen: list[int], unique: int) -> None:
        """Follows the namespace's share of keys that had a row (the last attempt's)."""
        if seen:
            old = self._seen_share.get(ns, 0.0)
            self._seen_share[ns] = old + SHARE_WEIGHT * (seen[-1] / unique - old)


def insert_absent(
    d: Dialect,
    cur: Any,
    table: str,
    b: Batch,
    keys: list[bytes],
    nonce: bytes,
    parts: list[int] | None,
    plain: list[bool],
    seen: list[int],
) -> set[bytes] | None:
    """Creates the rows of ``keys`` that do not exist; the keys created (None: unknown).

    ``plain[0]`` (cleared here): a plain INSERT of every key, whose
    duplicate-key error means a row existed: counted in ``seen`` and raised
    as :class:`Fallback`, so that the transaction runs again at once.
    """
    fps = [b.first_fp[k] for k in keys]
    if not plain[0]:
        return d.insert_fresh(cur, table, b.ns, keys, fps, b.owner, b.lease, nonce, parts)
    plain[0] = False
    try:
        return d.insert_fresh(
            cur, table, b.ns, keys, fps, b.owner, b.lease, nonce, parts, plain=True
        )
    except d.error_classes() as exc:
        if not d.is_unique_violation(exc):
            raise
        seen.append(1)
        raise Fallback from exc


def locked_row(row: Sequence[Any], nonce: bytes | None) -> Row | None:
    """A row ``(state, token, owner, fingerprint, result, live)`` read after this
    transaction's insert: None when the insert created it (it carries ``nonce``,
    where the dialect cannot say which rows it created)."""
    s, tok, o, f, res, live = row
    res = _maybe_bytes(res)
    if nonce is not None and int(s) == PROCESSING and res == nonce:
        return None
    return Row.of(s, tok, o, f, res, live)


def claim_flat(tx: Transactions, table: str, b: Batch, habits: Habits) -> list[Claim]:
    """A claim batch on an unpartitioned table (see the module docstring)."""
    d = tx.dialect
    ns, unique = b.ns, b.unique
    read_first = habits.read_first(ns)
    final: dict[bytes, Row | None] = {}
    existing: set[bytes] = set()
    if read_first:
        # One unlocked read, outside any write transaction. A PROCESSED row is final:
        # only purge changes it, by deleting it, and a processed key that retention
        # drops in the meantime is answered DUPLICATE as if the purge came later.
        done: dict[bytes, tuple[Any, ...]] = {}
        for row in tx.run(lambda cur: d.read_rows(cur, table, ns, unique), write=False):
            if row[1] == PROCESSED:
                done[bytes(row[0])] = row
            else:
                existing.add(bytes(row[0]))  # not final: inserted-if-absent and locked below
        claims = b.duplicates({k: (r[2], r[4], r[5]) for k, r in done.items()})
        if len(claims) == len(b.raw):  # every key PROCESSED: no write transaction at all
            habits.count(ns, claims)
            return claims
        for k, (_, _, tok, o, f, res) in done.items():
            final[k] = Row.of(PROCESSED, tok, o, f, res, False)
    rest = [k for k in unique if k not in final] if final else unique
    absent = [k for k in rest if k not in existing] if existing else rest
    # A row read as existing that has vanished by the SELECT .. FOR UPDATE (purged):
    # the transaction runs again and then inserts every non-final key.
    insert_all = [False]
    plain = [not read_first and habits.plain(ns)]
    seen: list[int] = []

    def body(cur: Any) -> list[Claim]:
        nonce = os.urandom(16)
        write = rest if insert_all[0] else absent
        created: set[bytes] | None = set()
        if write or plain[0]:
            created = insert_absent(d, cur, table, b, write, nonce, None, plain, seen)
        if created is not None and not read_first:
            seen.append(len(unique) - len(created))
            if len(created) == len(unique) == len(b.raw):  # all fresh, none repeated
                return b.all_new()
        current: dict[bytes, Row | None] = dict(final)
        current.update((k, None) for k in created or ())
        lock = rest if created is None else [k for k in rest if k not in created]
        mark = nonce if created is None else None
        for k, *row in d.select_rows(cur, table, ns, lock) if lock else ():
            current[bytes(k)] = locked_row(row, mark)
        if len(current) != len(unique):
            insert_all[0] = True
            raise Retry  # a row was purged between the read or INSERT and the SELECT
        return decide(d, cur, table, b, current)

    claims = tx.run(body)
    habits.count(ns, claims)
    habits.follow_seen(ns, seen, len(unique))
    return claims


def decide(
    d: Dialect,
    cur: Any,
    table: str,
    b: Batch,
    current: dict[bytes, Row | None],
    parts: dict[bytes, int] | None = None,
) -> list[Claim]:
    """The outcomes (:func:`dedupcore.decision.decide_claim`), then the batch's UPDATEs.

    ``current``: each key's row (None: created by this transaction);
    ``parts``: each key's partition (a partitioned table), written as the
    second value of each UPDATE row.
    """

    def at(k: bytes) -> list[Any]:
        return [k] if parts is None else [k, parts[k]]

    # The rows as decision records; lease deadlines are the server's, so only
    # "still running" (deadline 1 > now 0) or "ran out" (0) is passed on.
    recs: dict[bytes, Rec | None] = {
        k: None
        if r is None
        else Rec(
            State(r.state),
            0,
            r.token,
            0.0,
            0.0,
            b.lease,
            1.0 if r.live else 0.0,
            r.owner,
            r.fingerprint,
            r.result,
        )
        for k, r in current.items()
    }
    plan = decide_claim(
        recs.__getitem__,
        b.raw,
        ns_id=0,
        lease=b.lease,
        owner=b.owner,
        fingerprints=b.fps,
        cold=None,
        now_w=0.0,
        now_m=0.0,
    )
    if plan.conflict is not None:
        # The transaction is rolled back: nothing changes.
        raise fingerprint_conflict(b.keys[plan.conflict], b.ns)
    claims = [
        Claim(
            key,
            b.ns,
            _OUTCOMES[code],
            token,
            unpack_result(result) if code == DUPLICATE else None,
            takeover=code == NEW_TAKEOVER,
        )
        for key, (code, token, result) in zip(b.keys, plan.answers, strict=True)
    ]
    # key -> [key, token, fingerprint, owner]: expired leases taken over (the first
    # claim's created stays) and released tombstones claimed again (a fresh record);
    # the rows this transaction created are written already.
    reclaim: dict[bytes, list[Any]] = {}
    restart: dict[bytes, list[Any]] = {}
    for k, rec in plan.logged.items():
        was = current[k]
        if was is not None:
            rows = restart if was.state == RELEASED else reclaim
            rows[k] = [*at(k), rec.token, rec.fingerprint, rec.owner]
    renew = {k: at(k) for k in plan.renewed if current[k] is not None}
    lease_sql = d.lease_until(b.lease)
    claimed: SetList = [
        ("state", str(PROCESSING)),
        ("token", 0),
        ("fingerprint", 1),
        ("owner", 2),
        ("result", "NULL"),
        ("lease_until", lease_sql),
        ("updated", d.now),
    ]
    parted = parts is not None
    for rows, sets in ((reclaim, claimed), (restart, [*claimed, ("created", d.now)])):
        if rows:
            types = ["bigint", "bytea", "bytea"]
            d.update_rows(cur, table, b.ns, RowUpdate(sets, types, list(rows.values()), parted))
    if renew:
        sets = [("lease_until", lease_sql), ("updated", d.now)]
        d.update_rows(cur, table, b.ns, RowUpdate(sets, [], list(renew.values()), parted))
    return claims


def _refusal(state: int, current: int, token: int) -> int:
    """Why ``token`` does not hold a row of ``state`` and ``current`` token (0: it does)."""
    if state == RELEASED:
        return ERR_NOT_CLAIMED
    if current != token:
        return ERR_WRONG_TOKEN
    return ERR_COMPLETED if state == PROCESSED else 0


def _locked(
    d: Dialect, cur: Any, table: str, ns: str, wanted_tokens: list[tuple[bytes, int]], parted: bool
) -> tuple[dict[bytes, tuple[int, int]], dict[bytes, int]]:
    """The ``(state, token)`` of each key's row, locked (no entry: no row), and on a
    partitioned table each key's partition. ``wanted_tokens``: ``(key bytes, token)``."""
    unique = sorted({k for k, _ in wanted_tokens})
    wanted: dict[bytes, int] = {}
    for k, token in wanted_tokens:
        wanted.setdefault(k, token)
    current: dict[bytes, tuple[int, int]] = {}
    part_of: dict[bytes, int] = {}
    if parted:
        # Every live partition: the row whose token is the one given, else the
        # claim in progress, else the newest (docs/sql-partitions.md).
        horizon = d.part_guard(cur, table, False)
        for k, part, s, tok, *_ in d.select_rows(cur, table, ns, unique, (horizon, None)):
            k, rank = bytes(k), (int(tok) == wanted[bytes(k)], int(s) == PROCESSING)
            have = current.get(k)
            if have is None or rank >= (have[1] == wanted[k], have[0] == PROCESSING):
                current[k], part_of[k] = (int(s), int(tok)), int(part)
    else:
        current = {
            bytes(k): (int(s), int(tok)) for k, s, tok, *_ in d.select_rows(cur, table, ns, unique)
        }
    return current, part_of


def change(
    d: Dialect,
    cur: Any,
    table: str,
    ns: str,
    items: Sequence[tuple[Any, bytes, int, bytes | None]],
    state: int,
    parted: bool,
) -> None:
    """Completes (``state`` PROCESSED) or releases (RELEASED) ``items`` in one transaction.

    ``items``: ``(key, key bytes, token, packed result)``. Every item is
    checked against the locked rows first: a stale token raises and the
    transaction is rolled back; a retried completion is a no-op.
    """
    completing = state == PROCESSED
    current, part_of = _locked(d, cur, table, ns, [(k, token) for _, k, token, _ in items], parted)
    writes: dict[bytes, list[Any]] = {}
    for key, k, token, packed in items:
        s, tok = current.get(k, (RELEASED, 0))
        kind = _refusal(s, tok, token)
        if kind == ERR_COMPLETED and completing:
            continue  # a retried completion: already done
        if kind:
            raise stale_token_error(kind, key, token, tok, ns)
        current[k] = (state, tok)
        at = [k, part_of[k]] if parted else [k]
        writes[k] = [*at, packed] if completing else at
    if not writes:
        return
    if completing:
        sets: SetList = [("state", str(PROCESSED)), ("result", 0), ("updated", d.now)]
        types = ["bytea"]
    else:
        sets = [("state", str(RELEASED)), ("result", "NULL"), ("updated", d.now)]
        types = []
    d.update_rows(cur, table, ns, RowUpdate(sets, types, list(writes.values()), parted))


def extend(
    d: Dialect,
    cur: Any,
    table: str,
    ns: str,
    items: Sequence[tuple[Any, bytes, int]],
    lease: float,
    parted: bool,
) -> None:
    """Renews the leases of ``items`` (``(key, key bytes, token)``) in one transaction:
    each claim held ``lease`` seconds from now on the server's clock.

    Every item is checked against the locked rows first: a token that does not
    hold its key (not claimed, another token, completed) raises and the
    transaction is rolled back. A claim whose lease ran out is renewed while
    its token is the key's current one.
    """
    current, part_of = _locked(d, cur, table, ns, [(k, token) for _, k, token in items], parted)
    renew: dict[bytes, list[Any]] = {}
    for key, k, token in items:
        s, tok = current.get(k, (RELEASED, 0))
        kind = _refusal(s, tok, token)
        if kind:
            raise stale_token_error(kind, key, token, tok, ns, "extended")
        renew[k] = [k, part_of[k]] if parted else [k]
    if renew:
        sets: SetList = [("lease_until", d.lease_until(lease))]
        d.update_rows(cur, table, ns, RowUpdate(sets, [], list(renew.values()), parted))
