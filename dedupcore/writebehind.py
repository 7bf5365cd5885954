"""Write-behind claims: answered from a local table, pushed to the authority later.

**This trades safety for latency.** :class:`WriteBehindStore` answers every
claim from a local table (an in-memory :class:`MemoryTable`, or an embedded
:class:`~dedupcore.DedupStore` in a local directory) and pushes claims,
completions and releases to the authority (any :class:`~dedupcore.api.ClaimAPI`:
``RedisStore``, ``SqlStore``, a stack, a ``Client``) from a background thread,
in batches, every ``flush_interval`` seconds or as soon as ``flush_keys``
changes are waiting. ``flush()`` pushes now; ``close()`` flushes.

**The window.** A key answered NEW locally is unknown to the authority until
its claim is pushed. During that window:

- a second consumer asking the authority for the same key gets NEW too, and
  both run the work;
- this consumer answers NEW for a key that another consumer already claimed
  or processed at the authority, because it only asks its local table;
- a crash loses the changes not yet pushed (they live in this process's
  memory; an embedded local table keeps the local answers, but the authority
  never hears of them).

When the push finds the authority already holding a key this store answered
NEW, that is a **conflict**: the duplicate the window allowed. It is counted
(``stats()["write_behind"]["conflicts"]``), logged as a warning, kept in
:attr:`WriteBehindStore.conflicts` (the last 1000) and passed to
``on_conflict``; the key is then the other owner's at the authority and this
store pushes nothing more for it. A completion the authority refuses with a
stale token (the authority lease ran out and another consumer took the key
over) is a conflict too.

A renewal (``extend``) renews the local claim at once and the authority's
claim at the next push, with the same lease: between the two the authority
counts the lease from the last claim or renewal it saw.

**Where it is safe**: when no other consumer can see the same keys while
they are in the window, e.g. one consumer per Kafka partition whose keys are
only ever produced to that partition, fenced by its assignment, with a local
table that survives its restarts (an embedded store, ``durability="durable"``),
and which calls ``flush()`` (or ``close()``) before it gives the partition up.
A new owner of the partition does not know the keys its predecessor answered
from its own local table: a redelivery it has not seen is NEW locally and a
conflict at the push. docs/writebehind.md has the details and the measurements.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dedupcore.keys as _keys
from dedupcore.api.answers import Claim, KeyRecord, Outcome
from dedupcore.api.batches import ChangeBatch, ClaimBatch, ExtendBatch, Limits, result_refused
from dedupcore.api.contract import ClaimAPI
from dedupcore.errors import ConflictError, StaleTokenError
from dedupcore.memory import MemoryTable  # its home; still exported here
from dedupcore.record import State
from dedupcore.tiers.base import failure_of

__all__ = ["Conflict", "MemoryTable", "WriteBehindStore"]

log = logging.getLogger("dedupcore.writebehind")

_MAX_KEY_BYTES = 65536


@dataclass(frozen=True, slots=True)
class Conflict:
    """A key this store answered NEW locally that the authority gave to someone else.

    ``kind``: ``"claimed"`` (the authority answered ``authority_outcome``,
    DUPLICATE or IN_PROGRESS, to the pushed claim), ``"fingerprint"`` (the
    authority holds the key with another fingerprint) or ``"lease_lost"``
    (the authority's lease ran out before the completion or a renewal was
    pushed, and another consumer took the key over). ``window`` is how long
    the key was NEW locally before the authority answered (seconds).
    """

    namespace: str
    key: bytes | str
    kind: str
    authority_outcome: Outcome | None
    local_state: State
    window: float
    at: float


@dataclass(eq=False, slots=True)
class _Entry:
    namespace: str
    key: bytes | str
    local_token: int
    state: State
    lease: float | None
    owner: bytes | str | None
    fingerprint: bytes | None
    since: float  # clock() when answered NEW locally without an authority claim
    result: Any = None
    authority_token: int = 0  # 0: not claimed at the authority by this store
    version: int = 0
    renew: bool = False  # renewed locally: the authority claim is to be renewed too


class WriteBehindStore(ClaimAPI):
    """Claims answered from a local table, pushed to ``authority`` in the background.

    Read the module docstring first: a key answered NEW here and not yet
    pushed can be answered NEW by the authority to another consumer.

    - ``local``: None for a :class:`MemoryTable`; a path for an embedded
      :class:`~dedupcore.DedupStore` opened there (``local_options`` are its
      settings); or any claim API object. A table opened here is closed by
      :meth:`close`; one passed in, and the authority, are not.
    - ``flush_interval`` (seconds) and ``flush_keys``: a push starts when the
      oldest waiting change is that old, or that many keys are waiting.
    - ``on_conflict``: called with each :class:`Conflict` (from the pushing
      thread).
    - ``clock``: the monotonic clock the window is measured with.

    Claims are pushed with the owner they were made with, or else with an
    owner id of this store's own (``self.owner``), so that a push retried
    after a timeout gets its own claim back instead of a false conflict.
    """

    def __init__(
        self,
        authority: ClaimAPI,
        *,
        local: ClaimAPI | str | os.PathLike[str] | None = None,
        flush_interval: float = 0.05,
        flush_keys: int = 1000,
        on_conflict: Callable[[Conflict], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        local_options: dict[str, Any] | None = None,
    ) -> None:
        if not flush_interval > 0:
            raise ValueError(f"flush_interval must be > 0 seconds, got {flush_interval!r}")
        if isinstance(flush_keys, bool) or not isinstance(flush_keys, int) or flush_keys < 1:
            raise ValueError(f"flush_keys must be an int >= 1, got {flush_keys!r}")
        self.authority = authority
        self._owns_local = not isinstance(local, ClaimAPI)
        if local is None:
            self.local: ClaimAPI = MemoryTable(**(local_options or {}))
        elif isinstance(local, ClaimAPI):
            if local_options:
                raise TypeError("local_options only apply to a local table opened here")
            self.local = local
        else:
            from dedupcore.store import DedupStore

            self.local = DedupStore.open(local, **(local_options or {}))
        self.flush_interval = float(flush_interval)
        self.flush_keys = flush_keys
        self.on_conflict = on_conflict
        self.owner = f"writebehind-{secrets.token_hex(8)}"
        self._clock = clock
        self._lock = threading.Lock()  # entries, and each local call with its entry update
        self._wake = threading.Condition(self._lock)
        self._flush_lock = threading.Lock()  # one push at a time
        self._entries: dict[tuple[str, bytes], _Entry] = {}
        self._dirty: dict[tuple[str, bytes], None] = {}  # insertion-ordered set
        self._closed = False
        #: The last 1000 conflicts, oldest first.
        self.conflicts: deque[Conflict] = deque(maxlen=1000)
        self._counts = {
            "conflicts": 0,
            "pushed_claims": 0,
            "pushed_completions": 0,
            "pushed_releases": 0,
            "push_errors": 0,
            "flushes": 0,
            "results_dropped": 0,
        }
        self._max_window = 0.0
        self._last_error: str | None = None
        self._worker = threading.Thread(
            target=self._background, name="dedupcore-writebehind", daemon=True
        )
        self._worker.start()

    # -- answering from the local table ---------------------------------------

    @property
    def limits(self) -> Limits:  # type: ignore[override]
        """The local table's: every call is answered there first."""
        return self.local.limits

    def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        """Claims from the local table; NEW keys are queued for the authority."""
        fps = batch.fingerprint_list()
        with self._lock:
            self._check_open()
            claims = self.local.claim_many(
                batch.keys,
                namespace=batch.namespace,
                lease=batch.lease,
                owner=batch.owner,
                fingerprints=batch.fingerprints,
            )
            now = self._clock()
            for c, fp in zip(claims, fps, strict=True):
                if c.outcome is Outcome.NEW:
                    self._claimed(c, batch.lease, batch.owner, fp, now)
            if len(self._dirty) >= self.flush_keys:
                self._wake.notify_all()
        return claims

    def _claimed(
        self,
        c: Claim,
        lease: float | None,
        owner: bytes | str | None,
        fp: bytes | None,
        now: float,
    ) -> None:
        idx = (c.namespace, _keys.check_key(c.key, _MAX_KEY_BYTES))
        e = self._entries.get(idx)
        if e is not None and e.local_token == c.token and e.state is State.PROCESSING:
            return  # the same owner's claim again
        if e is not None and e.authority_token and e.state is not State.PROCESSED:
            # Still claimed at the authority by this store (a local takeover, or
            # a release not pushed yet): keep that claim, nothing to push.
            e.local_token = c.token
            e.state = State.PROCESSING
            e.version += 1
            self._dirty.pop(idx, None)
            return
        self._entries[idx] = _Entry(
            c.namespace, c.key, c.token, State.PROCESSING, lease, owner or self.owner, fp, now
        )
        self._dirty[idx] = None

    def _change_batch(self, batch: ChangeBatch) -> None:
        """Completes or releases in the local table; the change is queued for the authority."""
        parsed = batch.items()
        with self._lock:
            self._check_open()
            if batch.completing:
                self.local.complete_many(parsed, namespace=batch.namespace)
            else:
                self.local.release_many([(k, t) for k, t, _r in parsed], namespace=batch.namespace)
            self._changed(
                parsed, batch.namespace, State.PROCESSED if batch.completing else State.RELEASED
            )

    def _changed(self, parsed: list[tuple[Any, int, Any]], namespace: str, state: State) -> None:
        for key, token, result in parsed:
            idx = (namespace, _keys.check_key(key, _MAX_KEY_BYTES))
            e = self._entries.get(idx)
            if e is None or e.local_token != token or e.state is not State.PROCESSING:
                continue  # pushed and done already, or given up after a conflict
            e.state = state
            e.result = result
            e.version += 1
            self._dirty[idx] = None
        if len(self._dirty) >= self.flush_keys:
            self._wake.notify_all()

    def _extend_batch(self, batch: ExtendBatch) -> None:
        """Renews in the local table, which holds the claims. A claim already pushed is
        renewed at the authority by the next push (with this ``lease``); one not yet
        pushed is pushed with it."""
        pairs = list(zip(batch.keys, batch.tokens, strict=True))
        with self._lock:
            self._check_open()
            self.local.extend_many(pairs, namespace=batch.namespace, lease=batch.lease)
            for key, token in pairs:
                idx = (batch.namespace, _keys.check_key(key, _MAX_KEY_BYTES))
                e = self._entries.get(idx)
                if e is None or e.local_token != token or e.state is not State.PROCESSING:
                    continue  # given up after a conflict: the authority claim is another's
                if batch.lease is not None:
                    e.lease = batch.lease
                if e.authority_token:
                    e.renew = True
                    self._dirty[idx] = None
            if len(self._dirty) >= self.flush_keys:
                self._wake.notify_all()

    def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        """The local record of the key, or the authority's if the local table has none."""
        namespace = ns.decode()
        rec = self.local.get(key, namespace=namespace)
        if rec is not None:
            return rec
        return self.authority.get(key, namespace=namespace)

    # -- pushing to the authority ---------------------------------------------

    def _background(self) -> None:
        failed = False
        while True:
            with self._lock:
                # After a failed push, wait at least a second whatever is queued,
                # so that an authority that is down is not called (and logged)
                # in a loop.
                pause = max(self.flush_interval, 1.0) if failed else self.flush_interval
                deadline = time.monotonic() + pause
                while not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0 or (not failed and len(self._dirty) >= self.flush_keys):
                        break
                    self._wake.wait(left)
                if self._closed:
                    return
                if not self._dirty:
                    continue
            try:
                self.flush()
                failed = False
            except Exception:  # counted and logged by flush(); retried after the pause
                failed = True

    def flush(self) -> None:
        """Pushes every change made before the call to the authority.

        Raises the authority's error (the changes stay queued and are retried
        by the background thread) if it cannot be reached.
        """
        with self._flush_lock:
            for _ in range(8):  # a change made during a push is pushed by the next round
                with self._lock:
                    if not self._dirty:
                        return
                    work = [(self._entries[i], i) for i in self._dirty if i in self._entries]
                    self._dirty.clear()
                    snap = [(e, i, e.version, e.state, e.authority_token) for e, i in work]
                try:
                    self._push(snap)
                except Exception as exc:
                    with self._lock:
                        for e, i, *_ in snap:
                            if self._entries.get(i) is e:
                                self._dirty.setdefault(i, None)
                        self._counts["push_errors"] += 1
                        self._last_error = f"{type(exc).__name__}: {exc}"
                    log.warning(
                        "write-behind push to the authority failed (%s); %d keys stay queued",
                        self._last_error,
                        len(snap),
                    )
                    raise
                finally:
                    with self._lock:
                        self._counts["flushes"] += 1

    def _push(self, snap: list[tuple[_Entry, tuple[str, bytes], int, State, int]]) -> None:
        to_claim = [s for s in snap if s[4] == 0 and s[3] is not State.RELEASED]
        dropped = [s for s in snap if s[4] == 0 and s[3] is State.RELEASED]
        with self._lock:
            for e, i, version, _state, _at in dropped:
                # Claimed and released before the push: the authority never needs to know.
                if self._entries.get(i) is e and e.version == version:
                    del self._entries[i]
        groups: dict[tuple[str, float | None, Any], list[_Entry]] = {}
        for e, *_ in to_claim:
            groups.setdefault((e.namespace, e.lease, e.owner), []).append(e)
        for (namespace, lease, owner), entries in groups.items():
            self._push_claims(namespace, lease, owner, entries)
        self._push_renewals(snap)
        # Completions and releases: of keys claimed at the authority before this
        # push, or just now (their state is read again: it may have changed).
        with self._lock:
            ready = [
                (e, i, e.version, e.state, e.authority_token)
                for e, i, *_ in snap
                if self._entries.get(i) is e
                and e.authority_token
                and e.state is not State.PROCESSING
            ]
            for _e, i, *_ in ready:
                self._dirty.pop(i, None)
        by_ns: dict[tuple[str, State], list[tuple[_Entry, tuple[str, bytes], int, int]]] = {}
        for e, i, version, state, at in ready:
            by_ns.setdefault((e.namespace, state), []).append((e, i, version, at))
        for (namespace, change), group in by_ns.items():
            if change is State.PROCESSED:
                self._push_completions(namespace, group)
            else:
                self._push_releases(namespace, group)

    def _push_claims(
        self, namespace: str, lease: float | None, owner: Any, entries: list[_Entry]
    ) -> None:
        keys = [e.key for e in entries]
        fps = [e.fingerprint for e in entries]
        fingerprints = fps if any(fp is not None for fp in fps) else None
        try:
            answers: list[Claim | None] = list(
                self.authority.claim_many(
                    keys, namespace=namespace, lease=lease, owner=owner, fingerprints=fingerprints
                )
            )
        except ConflictError:
            # One key's fingerprint differs at the authority, which refuses the
            # whole batch: claim one by one to tell which.
            answers = []
            for e in entries:
                try:
                    answers.append(
                        self.authority.claim(
                            e.key,
                            namespace=namespace,
                            lease=lease,
                            owner=owner,
                            fingerprint=e.fingerprint,
                        )
                    )
                except ConflictError:
                    answers.append(None)
        now = self._clock()
        with self._lock:
            for e, a in zip(entries, answers, strict=True):
                window = max(0.0, now - e.since)
                self._max_window = max(self._max_window, window)
                if a is not None and a.outcome is Outcome.NEW:
                    e.authority_token = a.token
                    self._counts["pushed_claims"] += 1
                    continue
                self._conflict(
                    e,
                    "fingerprint" if a is None else "claimed",
                    None if a is None else a.outcome,
                    window,
                )

    def _push_renewals(self, snap: list[tuple[_Entry, tuple[str, bytes], int, State, int]]) -> None:
        """Renews at the authority the claims renewed locally since the last push."""
        groups: dict[tuple[str, float | None], list[_Entry]] = {}
        with self._lock:
            for e, i, *_ in snap:
                if self._entries.get(i) is e and e.renew and e.state is State.PROCESSING:
                    e.renew = False
                    groups.setdefault((e.namespace, e.lease), []).append(e)
        for (namespace, lease), entries in groups.items():
            try:
                self._renew(namespace, lease, entries)
            except Exception:
                with self._lock:
                    for e in entries:
                        e.renew = True  # the failed push queues the key again
                raise

    def _renew(self, namespace: str, lease: float | None, entries: list[_Entry]) -> None:
        try:
            self.authority.extend_many(
                [(e.key, e.authority_token) for e in entries], namespace=namespace, lease=lease
            )
            return
        except StaleTokenError:
            pass
        for e in entries:  # find the keys the authority gave to someone else, one by one
            try:
                self.authority.extend(e.key, e.authority_token, namespace=namespace, lease=lease)
            except StaleTokenError:
                with self._lock:
                    self._conflict(e, "lease_lost", None, 0.0)

    def _push_completions(
        self, namespace: str, group: list[tuple[_Entry, tuple[str, bytes], int, int]]
    ) -> None:
        items = [(e.key, at, e.result) for e, _i, _v, at in group]
        try:
            self.authority.complete_many(items, namespace=namespace)
            done = group
        except (StaleTokenError, TypeError, ValueError) as exc:
            if not isinstance(exc, StaleTokenError) and not result_refused(exc):
                raise
            done = []
            for g in group:  # find the keys the authority refuses, one by one
                e, _i, _v, at = g
                try:
                    self._complete_one(namespace, e, at)
                    done.append(g)
                except StaleTokenError:
                    with self._lock:
                        self._conflict(e, "lease_lost", None, 0.0)
        with self._lock:
            for e, i, _v, _at in done:
                self._counts["pushed_completions"] += 1
                if self._entries.get(i) is e:
                    del self._entries[i]

    def _complete_one(self, namespace: str, e: _Entry, at: int) -> None:
        try:
            self.authority.complete(e.key, at, namespace=namespace, result=e.result)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, StaleTokenError) or not result_refused(exc):
                raise
            # The authority cannot keep this result (a smaller size limit):
            # the work is done, so record the key as processed without it.
            self.authority.complete(e.key, at, namespace=namespace)
            with self._lock:
                self._counts["results_dropped"] += 1
            log.warning(
                "the authority refused the result of %r (%s); completed without", e.key, exc
            )

    def _push_releases(
        self, namespace: str, group: list[tuple[_Entry, tuple[str, bytes], int, int]]
    ) -> None:
        items = [(e.key, at) for e, _i, _v, at in group]
        try:
            self.authority.release_many(items, namespace=namespace)
        except StaleTokenError:
            for e, _i, _v, at in group:  # a key another consumer holds now: nothing to give back
                with contextlib.suppress(StaleTokenError):
                    self.authority.release(e.key, at, namespace=namespace)
        now = self._clock()
        with self._lock:
            for e, i, version, _at in group:
                self._counts["pushed_releases"] += 1
                if self._entries.get(i) is not e:
                    continue
                if e.version == version:
                    del self._entries[i]
                else:
                    # Claimed again locally while the release was on its way: the
                    # authority claim is gone, so the new claim must be pushed.
                    e.authority_token = 0
                    e.since = now
                    self._dirty[i] = None

    def _conflict(self, e: _Entry, kind: str, outcome: Outcome | None, window: float) -> None:
        # Under self._lock.
        c = Conflict(e.namespace, e.key, kind, outcome, e.state, window, time.time())
        self._counts["conflicts"] += 1
        self.conflicts.append(c)
        idx = (e.namespace, _keys.check_key(e.key, _MAX_KEY_BYTES))
        if self._entries.get(idx) is e:
            del self._entries[idx]
        self._dirty.pop(idx, None)
        log.warning(
            "write-behind conflict (%s): key %r in namespace %r was answered NEW locally but "
            "the authority gave it to another consumer%s; the work may have run twice",
            kind,
            e.key,
            e.namespace,
            f" (it answered {outcome.value})" if outcome is not None else "",
        )
        if self.on_conflict is not None:
            try:
                self.on_conflict(c)
            except Exception:
                log.exception("on_conflict raised")

    # -- state -----------------------------------------------------------------

    def window(self) -> tuple[int, float]:
        """Keys answered NEW locally and not yet claimed at the authority, and the
        age in seconds of the oldest of them (0.0 when there are none)."""
        now = self._clock()
        with self._lock:
            open_ = [
                e.since
                for e in self._entries.values()
                if not e.authority_token and e.state is not State.RELEASED
            ]
        return len(open_), (now - min(open_)) if open_ else 0.0

    def stats(self) -> dict[str, Any]:
        """``write_behind``: the window, pushes, conflicts; ``local``: the local table's."""
        n, oldest = self.window()
        with self._lock:
            wb: dict[str, Any] = dict(self._counts)
            wb.update(
                window_keys=n,
                oldest_window_seconds=oldest,
                max_window_seconds=self._max_window,
                queued=len(self._dirty),
                last_error=self._last_error,
            )
        return {"write_behind": wb, "local": self.local.stats()}

    def durability(self) -> str:
        return (
            "write-behind: a claim is answered from the local table before the authority has "
            f"it (up to {self.flush_interval} s or {self.flush_keys} keys); a crash loses the "
            "changes not yet pushed, and another consumer can be answered NEW for them. "
            f"Local table: {self.local.durability()}. Authority: {self.authority.durability()}"
        )

    @property
    def failed(self) -> BaseException | None:
        """The local table's failure, else the authority's (see
        :func:`~dedupcore.tiers.base.failure_of`)."""
        return failure_of(self.local) or failure_of(self.authority)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this WriteBehindStore is closed")

    def close(self) -> None:
        """Stops the background thread, flushes, and closes a local table opened here.

        If the final push fails, its error is raised after the local table is
        closed: the changes it held were not pushed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        self._worker.join()
        try:
            self.flush()
        finally:
            if self._owns_local:
                self.local.close()
