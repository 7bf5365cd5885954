"""Stacked and sharded stores: the order of the tiers, and routing across shards.

:class:`TieredStore` puts the front filter, an optional cache and an
optional cold archive around one authority (see :mod:`dedupcore.tiers.base`)::

    claim_many(keys)
      front filter   "definitely never seen here"  -> straight to the authority's
                                                       atomic create, no reads
      cache          PROCESSED hit                 -> DUPLICATE, authority not asked
      cold archive   hit, authority has no record   -> DUPLICATE, exact=False
      authority      everything else: NEW / DUPLICATE / IN_PROGRESS, atomically

The front and cache only ever save work: the front is an in-process filter
of keys this process has seen, so when another host claimed a key, the
authority's create still finds it (its create is the atomic step). A cache
or front that fails is skipped with a counter and a log line; an authority
that fails raises :class:`~dedupcore.errors.UnavailableError`.

:class:`ShardedStore` routes keys over N stores by jump consistent hash of
``hash64(namespace \\0 key, SHARD_SEED)``, one call per shard, run
concurrently. :func:`dedupcore.factory.open_store` builds either from URLs,
and returns the authority itself when no tier would be added to it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

import dedupcore.keys as _keys
from dedupcore._core import hash64, hash64_many, jump_hash, shard_many
from dedupcore.api.answers import Claim, KeyRecord, Outcome, namespace_counts
from dedupcore.api.batches import (
    ChangeBatch,
    ClaimBatch,
    ExtendBatch,
    Limits,
    fingerprint_conflict,
    pack_result,
    unpack_result,
)
from dedupcore.api.contract import ClaimAPI
from dedupcore.config import Retention, policies
from dedupcore.errors import ConflictError, DedupError, StaleTokenError
from dedupcore.record import State
from dedupcore.ring import BloomRing
from dedupcore.tiers.archive import ColdArchive
from dedupcore.tiers.base import (
    Authority,
    Cached,
    CacheTier,
    check_retention,
    durability_report,
    failure_of,
)

__all__ = ["SHARD_SEED", "ShardedStore", "TieredStore"]

log = logging.getLogger("dedupcore")

T = TypeVar("T")

#: NEW claims whose fingerprint this process remembers until they are completed.
_MAX_REMEMBERED = 1_000_000
_MISSING = object()
#: Purge calls per sweep at most (a backlog is worked off over several sweeps).
_MAX_PURGE_ROUNDS = 100
#: Seed of the XXH64 hash that routes a key to its shard (see :class:`ShardedStore`):
#: not 0, the seed of the hash that picks a RedisStore's bucket.
SHARD_SEED = 0x5348415244  # b"SHARD"


class TieredStore(ClaimAPI):
    """Front filter, optional cache and cold archive around one authority.

    ``authority``: an :class:`~dedupcore.tiers.base.Authority` (the store it
    wraps is closed with it). ``cache``: a :class:`CacheTier` such as
    :class:`~dedupcore.tiers.cache.RedisCache`; entries live for the
    namespace's ``hot_window``. ``front``: True for an in-memory front ring,
    False for none, or a :class:`BloomRing` of your own. ``archive``: a
    :class:`ColdArchive` or a directory for one; keys the authority demotes
    (:meth:`sweep`) go there. ``retention``/``namespaces`` give the hot and
    cold windows per namespace (the authority keeps its own exact window).
    """

    def __init__(
        self,
        authority: Authority,
        *,
        cache: CacheTier | None = None,
        front: bool | BloomRing = True,
        archive: ColdArchive | str | os.PathLike[str] | None = None,
        retention: Retention | None = None,
        namespaces: dict[str, Retention] | None = None,
        max_key_bytes: int = 512,
        max_result_bytes: int = 65536,
        front_error_rate: float = 0.01,
        front_slice_capacity: int = 1_000_000,
        cache_retry_after: float = 1.0,
    ) -> None:
        if not isinstance(authority, Authority):
            raise TypeError(
                "authority must be a claim API (dedupcore.api.ClaimAPI), "
                f"not {type(authority).__name__}"
            )
        if cache is not None and not isinstance(cache, CacheTier):
            raise TypeError(f"cache must be a CacheTier, not {type(cache).__name__}")
        self.authority = authority
        self.cache = cache
        # Bounded windows: the hot one is the cache's TTL, sent to its server.
        self.retention, self.namespaces = check_retention(retention, namespaces)
        self.max_key_bytes = max_key_bytes
        self.max_result_bytes = max_result_bytes
        self.cache_retry_after = cache_retry_after
        if isinstance(front, BloomRing):
            self.front: BloomRing | None = front
        elif front is True:
            window = max(p.exact_window for p in policies(self.retention, self.namespaces))
            self.front = BloomRing(window, window / 8, front_slice_capacity, front_error_rate)
        elif front is False:
            self.front = None
        else:
            raise TypeError(f"front must be a bool or a BloomRing, not {type(front).__name__}")
        if archive is None or isinstance(archive, ColdArchive):
            self.archive = archive
        else:
            cold = [p.cold_window for p in policies(self.retention, self.namespaces)]
            self.archive = ColdArchive(Path(archive), cold)
        self._lock = threading.Lock()
        self._fps: OrderedDict[tuple[bytes, bytes], bytes | None] = OrderedDict()
        self._counts: Counter[str] = Counter()
        self._outcomes: Counter[tuple[str, str]] = Counter()
        self._cache_down_until = 0.0
        self._closed = False

    def __repr__(self) -> str:
        parts = [f"authority={type(self.authority).__name__}"]
        if self.cache is not None:
            parts.append(f"cache={type(self.cache).__name__}")
        parts.append(f"front={'on' if self.front is not None else 'off'}")
        parts.append(f"archive={'on' if self.archive is not None else 'off'}")
        return f"TieredStore({', '.join(parts)})"

    def close(self) -> None:
        """Closes the authority and the cache."""
        if self._closed:
            return
        self._closed = True
        try:
            self.authority.close()
        finally:
            if self.cache is not None:
                self.cache.close()

    def _policy(self, namespace: str) -> Retention:
        return self.namespaces.get(namespace, self.retention)

    def durability(self) -> str:
        """The authority's: the cache and the archive only ever repeat what it acknowledged."""
        return self.durability_report()[1]

    def durability_report(self) -> tuple[int, str]:
        return durability_report(self.authority)

    @property
    def failed(self) -> BaseException | None:
        """The authority's failure (see :func:`~dedupcore.tiers.base.failure_of`)."""
        return failure_of(self.authority)

    def _check_open(self) -> None:
        if self._closed:
            raise DedupError("the store is closed")

    # -- the cache, skipped while it fails ---------------------------------------

    def _cache_call(self, what: str, call: Callable[[], T]) -> T | None:
        if self.cache is None or time.monotonic() < self._cache_down_until:
            return None
        self._counts[f"cache_{what}"] += 1
        try:
            return call()
        except self.cache.unavailable as exc:
            self._counts["cache_errors"] += 1
            self._cache_down_until = time.monotonic() + self.cache_retry_after
            log.warning(
                "cache %s failed (%s); skipping it for %.1f s",
                self.cache.name,
                exc,
                self.cache_retry_after,
            )
            return None

    def _cache_entry(
        self, k: bytes, token: int, result: Any, fp: object = _MISSING
    ) -> tuple[bytes, Cached] | None:
        """A PROCESSED record as the cache holds it; None if its result cannot be kept there."""
        try:
            packed = pack_result(result, self.max_result_bytes)
        except (TypeError, ValueError):
            return None  # the authority accepted it under its own limit
        if fp is _MISSING:
            return k, Cached(token, packed)  # fingerprint unknown: claims with one go on
        return k, Cached(token, packed, cast("bytes | None", fp), True)

    def _write_through(
        self, ns: bytes, namespace: str, entries: list[tuple[bytes, Cached]]
    ) -> None:
        if entries and self.cache is not None:
            cache = self.cache
            ttl = self._policy(namespace).hot_window
            self._cache_call("writes", lambda: cache.put_many(ns, entries, ttl))

    def _remember(self, ns: bytes, k: bytes, fp: bytes | None) -> None:
        with self._lock:
            self._fps[(ns, k)] = fp
            self._fps.move_to_end((ns, k))
            while len(self._fps) > _MAX_REMEMBERED:
                self._fps.popitem(last=False)

    def _forget(self, ns: bytes, k: bytes) -> object:
        with self._lock:
            return self._fps.pop((ns, k), _MISSING)

    # -- the claim API -------------------------------------------------------------

    @property
    def limits(self) -> Limits:  # type: ignore[override]
        """Its keys' limit; results as the authority keeps them (the cache keeps what fits)."""
        authority = self.authority
        kept = authority.limits.max_result_bytes if isinstance(authority, ClaimAPI) else 16 << 20
        return Limits(max_key_bytes=self.max_key_bytes, max_result_bytes=kept)

    def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        """Claims a batch of keys; see the module docstring for the order of the tiers."""
        self._check_open()
        key_list = batch.keys
        namespace = batch.namespace
        ns = batch.ns
        raw = batch.raw
        fps = batch.fingerprint_list()
        n = len(raw)
        if not n:
            return []
        hashes = _keys.key_hashes(ns, raw)
        out: list[Claim | None] = [None] * n
        seen = list(self.front.contains_many(hashes)) if self.front is not None else [True] * n
        self._counts["front_negative"] += seen.count(False)

        # Cache: only for keys the front has seen; hits are PROCESSED records.
        hinted = [i for i in range(n) if seen[i]]
        if hinted and self.cache is not None:
            cache = self.cache
            found = self._cache_call("reads", lambda: cache.get_many(ns, [raw[i] for i in hinted]))
            for i, entry in zip(hinted, found or (), strict=False):
                if entry is None:
                    continue
                fp = fps[i]
                if fp is not None and not entry.fingerprint_known:
                    continue  # the authority has to check the fingerprint
                if fp is not None and entry.fingerprint is not None and fp != entry.fingerprint:
                    raise fingerprint_conflict(key_list[i], namespace)
                out[i] = Claim(
                    key_list[i],
                    namespace,
                    Outcome.DUPLICATE,
                    entry.token,
                    unpack_result(entry.result),
                )
                self._counts["cache_hits"] += 1

        # Cold archive: a key demoted from the authority is DUPLICATE (inexact)
        # unless the authority holds a record for it again.
        if self.archive is not None:
            window = self._policy(namespace).cold_window
            cold = self.archive.contains_many(window, hashes)
            for i in range(n):
                if cold[i] and out[i] is None:
                    self._counts["authority_gets"] += 1
                    if self.authority.get(key_list[i], namespace=namespace) is None:
                        out[i] = Claim(key_list[i], namespace, Outcome.DUPLICATE, 0, exact=False)
                        self._counts["cold_hits"] += 1

        rest = [i for i in range(n) if out[i] is None]
        fills: list[tuple[bytes, Cached]] = []
        if rest:
            self._counts["authority_claims"] += 1
            decided = self.authority.claim_many(
                [key_list[i] for i in rest],
                namespace=namespace,
                lease=batch.lease,
                owner=batch.owner,
                fingerprints=None if batch.fingerprints is None else [fps[i] for i in rest],
            )
            if len(decided) != len(rest):
                raise DedupError(f"authority answered {len(decided)} claims for {len(rest)} keys")
            for i, c in zip(rest, decided, strict=True):
                out[i] = c
                if c.outcome is Outcome.NEW:
                    self._remember(ns, raw[i], fps[i])
                elif c.outcome is Outcome.DUPLICATE and c.exact and self.cache is not None:
                    fill = self._cache_entry(raw[i], c.token, c.result)
                    if fill is not None:
                        fills.append(fill)
        self._write_through(ns, namespace, fills)
        if self.front is not None:
            self.front.add_many(hashes, time.time())
        claims = [c for c in out if c is not None]
        assert len(claims) == n
        for c in claims:
            self._outcomes[(namespace, c.outcome.value)] += 1
        return claims

    def _change_batch(self, batch: ChangeBatch) -> None:
        """Completes at the authority, then writes the PROCESSED records through to the
        cache; releases at the authority (the cache never holds a claim that can be
        released)."""
        self._check_open()
        ns, namespace = batch.ns, batch.namespace
        if not batch.completing:
            self.authority.release_many(
                list(zip(batch.keys, batch.tokens, strict=True)), namespace=namespace
            )
            for k in batch.raw:
                self._forget(ns, k)
            return
        checked = batch.items()
        self.authority.complete_many(checked, namespace=namespace)
        entries: list[tuple[bytes, Cached]] = []
        for k, (_key, token, result) in zip(batch.raw, checked, strict=True):
            fp = self._forget(ns, k)
            if self.cache is not None:
                entry = self._cache_entry(k, token, result, fp)
                if entry is not None:
                    entries.append(entry)
        self._write_through(ns, namespace, entries)

    def _extend_batch(self, batch: ExtendBatch) -> None:
        """Renews at the authority, which holds every claim (the tiers hold none)."""
        self._check_open()
        self.authority.extend_many(
            list(zip(batch.keys, batch.tokens, strict=True)),
            namespace=batch.namespace,
            lease=batch.lease,
        )

    def _get_record(self, ns: bytes, k: bytes) -> KeyRecord | None:
        """The authority's record, or an inexact PROCESSED record from the cold archive."""
        self._check_open()
        namespace = ns.decode()
        rec = self.authority.get(k, namespace=namespace)
        if rec is not None or self.archive is None:
            return rec
        hashes = _keys.key_hashes(ns, [k])
        if self.archive.contains_many(self._policy(namespace).cold_window, hashes)[0]:
            return KeyRecord(State.PROCESSED, 0, None, None, None, 0.0, 0.0, exact=False)
        return None

    def sweep(self, now: float | None = None, *, limit: int = 10_000) -> int:
        """Copies records the authority is about to drop into the cold archive; returns how many.

        SQL authority: expired rows are added to the archive (written and
        fsynced) before they are deleted. Redis authority: PROCESSED keys
        whose TTL ends within two sweep periods are added before Redis
        expires them. Without an archive, the SQL authority is purged only.
        """
        self._check_open()
        now_w = time.time() if now is None else float(now)
        archive = self.archive
        moved = 0

        def add(namespace: str, keys: list[bytes]) -> None:
            nonlocal moved
            if archive is None or not keys:
                return
            window = self._policy(namespace).cold_window
            hashes = _keys.key_hashes(_keys.check_namespace(namespace), keys)
            moved += archive.add_many(window, hashes, now_w)

        purge = getattr(self.authority, "purge", None)
        expiring = getattr(self.authority, "expiring", None)
        if purge is not None:
            # Each call deletes at most ``limit`` rows per retention policy.
            for _ in range(_MAX_PURGE_ROUNDS):
                if purge(limit=limit, before_delete=add) < limit:
                    break
        elif expiring is not None and archive is not None:
            # Every namespace configured or claimed through this stack.
            claimed = {ns for ns, _ in list(self._outcomes)}
            for namespace in sorted({*self.namespaces, *claimed}):
                add(namespace, expiring(namespace, 2 * self.sweep_interval, count=limit))
        if archive is not None:
            archive.expire(now_w)
            archive.compact()  # sealed slices rebuilt as fuse filters
        self._counts["demoted"] += moved
        return moved

    #: How often :meth:`sweep` is expected to run (seconds); Redis keys expiring
    #: within two periods are archived ahead of their expiry.
    sweep_interval = 60.0

    def stats(self) -> dict[str, Any]:
        """Counters of each tier's calls and answers, and the tiers' own figures."""
        out: dict[str, Any] = {
            "namespaces": namespace_counts(self._outcomes),
            "counts": dict(self._counts),
            "authority": self.authority.stats(),
        }
        if self.front is not None:
            out["front"] = {
                "keys": self.front.count,
                "nbytes": self.front.nbytes,
                "estimated_fpr": self.front.estimated_fpr,
            }
        if self.cache is not None:
            out["cache"] = {
                "name": self.cache.name,
                "skipped_until": max(0.0, self._cache_down_until - time.monotonic()),
                **self.cache.stats(),
            }
        if self.archive is not None:
            out["archive"] = self.archive.stats()
        return out


class ShardedStore(ClaimAPI):
    """Routes keys over N stores by jump consistent hash; one concurrent call per shard.

    The shard of a key is ``jump_hash(hash64(namespace + b"\\0" + key,
    SHARD_SEED), N)``: stable across processes, hosts and versions, and adding
    a shard moves only ``1/(N+1)`` of the keys. A batch is not atomic across
    shards: when one shard fails (or raises :class:`ConflictError`), the NEW
    claims the other shards made for the batch are released before the error
    is raised, so nothing stays claimed by a caller that never saw the claim.

    **Why a seed of its own.** A :class:`~dedupcore.redis.RedisStore`
    puts each key in a hash-tag bucket (a Redis Cluster slot) by
    ``jump_hash(hash64(namespace + b"\\0" + key, 0), buckets)``. Jump hashes
    of one 64-bit value into N and into 16 agree whenever the second is
    below N, so routing shards by that same hash left shard ``s`` only the
    buckets ``{s}`` and ``N..15``: with 16 sharded Redis servers every key of
    a namespace on a server was in one slot. The shard hash is therefore
    XXH64 with :data:`SHARD_SEED`, independent of the bucket hash. The bucket
    is what decides where an existing key lives inside Redis (and in every
    unsharded Redis deployment), so it stays as it was; the routing is what
    changed. A sharded deployment whose shards already hold keys routed by
    the seed-0 hash must be drained (or its keys left to expire) before it
    is opened with this routing: most of its keys now route to another shard.
    """

    def __init__(self, shards: Sequence[ClaimAPI], *, max_key_bytes: int = 512) -> None:
        shards = list(shards)
        if not shards:
            raise ValueError("a sharded store needs at least one shard")
        for s in shards:
            if not isinstance(s, ClaimAPI):
                raise TypeError(f"each shard must be a claim API store, not {type(s).__name__}")
        self.shards = shards
        self.max_key_bytes = max_key_bytes
        self._pool = ThreadPoolExecutor(max_workers=len(shards), thread_name_prefix="dedup-shard")
        self._outcomes: Counter[tuple[str, str]] = Counter()
        self._closed = False

    def __repr__(self) -> str:
        return f"ShardedStore({len(self.shards)} shards)"

    def close(self) -> None:
        """Closes every shard."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        errors = []
        for s in self.shards:
            try:
                s.close()
            except Exception as exc:  # close the others anyway
                errors.append(exc)
        if errors:
            raise errors[0]

    @property
    def failed(self) -> BaseException | None:
        """The first failure of a shard (see :func:`~dedupcore.tiers.base.failure_of`)."""
        return next((f for f in map(failure_of, self.shards) if f is not None), None)

    def durability(self) -> str:
        """The weakest shard's (each key lives on one shard), naming it."""
        return self.durability_report()[1]

    def durability_report(self) -> tuple[int, str]:
        reports = [durability_report(s) for s in self.shards]
        level, said = min(reports, key=lambda r: r[0])
        if len(self.shards) == 1:
            return level, said
        weakest = reports.index((level, said))
        return level, f"shard {weakest} of {len(self.shards)} (the weakest): {said}"

    def shard_of(self, key: bytes | str, *, namespace: str) -> int:
        """The index of the shard that holds ``key``."""
        ns = _keys.check_namespace(namespace)
        return self._shard(ns + b"\x00" + _keys.check_key(key, self.max_key_bytes))

    def _shard(self, joined: bytes) -> int:
        return int(jump_hash(hash64(joined, SHARD_SEED), len(self.shards)))

    def _route(self, ns: bytes, raw: list[bytes]) -> dict[int, list[int]]:
        """Positions of a batch's checked keys, grouped by shard."""
        prefix = ns + b"\x00"
        joined = [prefix + k for k in raw]
        groups: dict[int, list[int]] = {}
        if not joined:
            return groups
        for i, s in enumerate(shard_many(hash64_many(joined, SHARD_SEED), len(self.shards))):
            groups.setdefault(s, []).append(i)
        return groups

    def _each(self, calls: dict[int, Callable[[], T]]) -> dict[int, T | BaseException]:
        """Runs one call per shard concurrently; a single shard runs inline."""
        if self._closed:
            raise DedupError("the store is closed")
        if len(calls) == 1:
            ((s, call),) = calls.items()
            try:
                return {s: call()}
            except Exception as exc:
                return {s: exc}
        futures = {s: self._pool.submit(call) for s, call in calls.items()}
        out: dict[int, T | BaseException] = {}
        for s, f in futures.items():
            try:
                out[s] = f.result()
            except Exception as exc:
                out[s] = exc
        return out

    def _each_or_raise(self, calls: dict[int, Callable[[], None]]) -> None:
        """:meth:`_each`, then the first failure raised (after every shard ran its call)."""
        failed = [r for r in self._each(calls).values() if isinstance(r, BaseException)]
        if failed:
            raise _first(failed)

    @property
    def limits(self) -> Limits:  # type: ignore[override]
        """Its keys' limit (the routing); results as the most lenient shard keeps them
        (each shard checks its own)."""
        kept = max(s.limits.max_result_bytes for s in self.shards)
        return Limits(max_key_bytes=self.max_key_bytes, max_result_bytes=kept)

    def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        key_list = batch.keys
        namespace = batch.namespace
        fps = batch.fingerprint_list()
        lease, owner, fingerprints = batch.lease, batch.owner, batch.fingerprints
        if not key_list:
            return []
        groups = self._route(batch.ns, batch.raw)

        def call(s: int, idx: list[int]) -> Callable[[], list[Claim]]:
            shard = self.shards[s]
            return lambda: shard.claim_many(
                [key_list[i] for i in idx],
                namespace=namespace,
                lease=lease,
                owner=owner,
                fingerprints=None if fingerprints is None else [fps[i] for i in idx],
            )

        results = self._each({s: call(s, idx) for s, idx in groups.items()})
        failed = [r for r in results.values() if isinstance(r, BaseException)]
        if failed:
            for s, r in results.items():
                if isinstance(r, BaseException):
                    continue
                made = [(c.key, c.token) for c in r if c.outcome is Outcome.NEW and owner is None]
                if made:
                    try:
                        self.shards[s].release_many(made, namespace=namespace)
                    except Exception as exc:
                        log.warning(
                            "could not release %d claims on shard %d: %s", len(made), s, exc
                        )
            raise _first(failed)
        out: list[Claim | None] = [None] * len(key_list)
        for s, idx in groups.items():
            answered = results[s]
            assert isinstance(answered, list)
            for i, c in zip(idx, answered, strict=True):
                out[i] = c
                self._outcomes[(namespace, c.outcome.value)] += 1
        return [c for c in out if c is not None]

    def _change_batch(self, batch: ChangeBatch) -> None:
        """Completes or releases on each shard; a shard's error is raised after the
        others applied theirs."""
        checked = batch.items()
        namespace, complete = batch.namespace, batch.completing
        groups = self._route(batch.ns, batch.raw)

        def call(s: int, idx: list[int]) -> Callable[[], None]:
            shard = self.shards[s]
            if complete:
                part: list[Any] = [checked[i] for i in idx]
                return lambda: shard.complete_many(part, namespace=namespace)
            pairs = [(checked[i][0], checked[i][1]) for i in idx]
            return lambda: shard.release_many(pairs, namespace=namespace)

        self._each_or_raise({s: call(s, idx) for s, idx in groups.items()})

    def _extend_batch(self, batch: ExtendBatch) -> None:
        """Renews on each shard. Each shard's renewal is all or nothing, the batch is
        not: a shard that refuses (a stale token) or fails raises after the other
        shards renewed theirs, as a completion across shards does."""
        namespace, lease = batch.namespace, batch.lease
        groups = self._route(batch.ns, batch.raw)

        def call(s: int, idx: list[int]) -> Callable[[], None]:
            shard = self.shards[s]
            pairs = [(batch.keys[i], batch.tokens[i]) for i in idx]
            return lambda: shard.extend_many(pairs, namespace=namespace, lease=lease)

        self._each_or_raise({s: call(s, idx) for s, idx in groups.items()})

    def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        return self.shards[self._shard(ns + b"\x00" + key)].get(key, namespace=ns.decode())

    def stats(self) -> dict[str, Any]:
        """Claims per namespace through this store, and each shard's own figures."""
        return {
            "namespaces": namespace_counts(self._outcomes),
            "shards": [s.stats() for s in self.shards],
        }

    def sweep(self, now: float | None = None) -> int:
        """Runs each shard's ``sweep`` (where it has one); returns the total demoted."""
        total = 0
        for s in self.shards:
            sweep = getattr(s, "sweep", None)
            if sweep is not None:
                total += int(sweep(now))
        return total


def _first(errors: list[BaseException]) -> BaseException:
    """The error to raise for a batch: input errors before unavailability."""
    for kind in (ConflictError, StaleTokenError, TypeError, ValueError):
        for e in errors:
            if isinstance(e, kind):
                return e
    return errors[0]


# -- names that moved away (docs/compatibility.md, "Moved and removed names") ----------


def __getattr__(name: str) -> Any:
    """Deprecated aliases of names that moved out of this module: each warns, then answers."""
    if name == "open_store":
        warnings.warn(
            "dedupcore.stack.open_store moved to dedupcore.factory.open_store (also "
            "dedupcore.open_store); the old name will be removed in 0.3.0",
            DeprecationWarning,
            stacklevel=2,
        )
        from dedupcore.factory import open_store

        return open_store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
