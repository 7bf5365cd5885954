"""The arguments of a batch, checked once: :class:`ClaimBatch` and :class:`ChangeBatch`.

:class:`~dedupcore.api.contract.ClaimAPI` builds one per call, before the
backend sees anything (docs/architecture.md, "The contract"): the namespace,
the keys (natively, no per-key Python work), the lease, the owner, the
fingerprints, the tokens and the packed results, in that order, with the
exceptions and messages every store gave when each checked them itself.
The helpers the checks are made of stay public for the stores' own uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

import dedupcore._engine as _engine
import dedupcore.keys as _keys
from dedupcore._checks import checked_int
from dedupcore.config import check_lease
from dedupcore.errors import ConflictError, DedupError

__all__ = [
    "MAX_FINGERPRINT_BYTES",
    "MAX_OWNER_BYTES",
    "MAX_TOKEN",
    "ChangeBatch",
    "ClaimBatch",
    "ExtendBatch",
    "Limits",
    "change_items",
    "check_fingerprints",
    "check_owner",
    "check_token",
    "fingerprint_conflict",
    "pack_result",
    "result_refused",
    "unpack_result",
]

#: Fencing tokens are positive and fit a signed 64-bit integer everywhere they are stored.
MAX_TOKEN = (1 << 63) - 1


def check_token(token: object) -> int:
    """A fencing token: an int in 1..MAX_TOKEN (TypeError/ValueError otherwise)."""
    return checked_int("token", token, 1, MAX_TOKEN, "1..2**63-1")


MAX_OWNER_BYTES = 255
MAX_FINGERPRINT_BYTES = 255


def check_owner(owner: object) -> bytes | None:
    """An owner id as bytes (str as UTF-8), 1..255 bytes, or None."""
    if owner is None:
        return None
    if isinstance(owner, str):
        owner = owner.encode()
    if not isinstance(owner, bytes):
        raise TypeError(f"owner must be str or bytes, not {type(owner).__name__}")
    if not 1 <= len(owner) <= MAX_OWNER_BYTES:
        raise ValueError(f"owner must be 1..{MAX_OWNER_BYTES} bytes, got {len(owner)}")
    return owner


def check_fingerprints(fps: Sequence[bytes | None] | None, n: int) -> list[bytes | None]:
    """One fingerprint (bytes of 1..255, or None) per key of a batch of ``n``."""
    if fps is None:
        return [None] * n
    out = list(fps)
    if len(out) != n:
        raise ValueError(f"{len(out)} fingerprints for {n} keys")
    for fp in out:
        if fp is None:
            continue
        if not isinstance(fp, bytes):
            raise TypeError(f"fingerprint must be bytes, not {type(fp).__name__}")
        if not 1 <= len(fp) <= MAX_FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint must be 1..{MAX_FINGERPRINT_BYTES} bytes, got {len(fp)}")
    return out


def fingerprint_conflict(key: object, namespace: str) -> ConflictError:
    """The error for a key claimed again with another fingerprint than its first claim's."""
    return ConflictError(
        f"key {key!r} in namespace {namespace!r} was claimed with a different fingerprint "
        "(same idempotency key, another request)"
    )


def result_refused(exc: BaseException) -> bool:
    """Whether ``complete`` failed because the store cannot keep the result.

    That is a TypeError/ValueError about the result (not msgpack-serializable,
    over the store's limit), not one of the store's own answers such as
    :class:`StaleTokenError`: the work is done, so the key should be completed
    without the result rather than left to run again.
    """
    return isinstance(exc, (TypeError, ValueError)) and not isinstance(exc, DedupError)


def change_items(items: Iterable[Any], *, with_results: bool) -> list[tuple[Any, int, Any]]:
    """``(key, token[, result])`` items of complete_many/release_many, checked.

    Tuples or lists are accepted; a result is only allowed when completing.
    """
    sizes = (2, 3) if with_results else (2,)
    out = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) not in sizes:
            shape = "(key, token) or (key, token, result)" if with_results else "(key, token)"
            raise TypeError(f"each item must be {shape}, got {item!r:.80}")
        out.append((item[0], check_token(item[1]), item[2] if len(item) == 3 else None))
    return out


def pack_result(result: Any, max_bytes: int) -> bytes | None:
    """A result as stored (msgpack); TypeError if it cannot be, ValueError if too large."""
    if result is None:
        return None
    try:
        packed: bytes = msgpack.packb(result, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            "result must be msgpack-serializable (None, bool, int of 64 bits, float, str, "
            f"bytes, list, dict): {exc}"
        ) from None
    if len(packed) > max_bytes:
        raise ValueError(
            f"result is {len(packed)} bytes encoded; the limit is max_result_bytes={max_bytes}"
        )
    return packed


def unpack_result(raw: bytes | None) -> Any:
    """A stored result (maps may have non-str keys, as the caller stored them)."""
    if not raw:
        return None
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a store accepts: one definition every store declares (``store.limits``).

    ``max_key_bytes``: a key's bytes (str as UTF-8); ``max_result_bytes``: a
    result's bytes as stored (msgpack); ``max_batch``: keys in one call, or
    None where the store sets no bound of its own (a daemon's frame bounds
    the client's batches, which it splits).
    """

    max_key_bytes: int = 512
    max_result_bytes: int = 65536
    max_batch: int | None = None


#: The limits of a store that declares none (the defaults of StoreConfig).
DEFAULT_LIMITS = Limits()


def digests_of(ns: bytes, keys: list[Any], max_key_bytes: int) -> bytes:
    """Concatenated record digests of keys, checked (natively; a key the native path
    refuses is checked again in Python, which names what is wrong)."""
    joined, bad = _engine.digest_keys(ns, keys, max_key_bytes, _keys.DIGEST_SEED_HI)
    if bad < 0:
        return joined
    raw = [_keys.check_key(k, max_key_bytes) for k in keys]  # raises for a bad key
    return b"".join(_keys.digests(ns, raw))  # bytearray and memoryview keys are fine


class _Batch:
    """What both batches hold: the namespace, the keys and their digests.

    A batch built with ``hashed=False`` (a client's, which sends its keys and
    never looks them up) has its keys checked at once and their digests made
    on first use.
    """

    __slots__ = ("_digests", "_key_limit", "_raw", "keys", "namespace", "ns", "plain")

    _digests: bytes | None
    _key_limit: int
    _raw: list[bytes] | None
    keys: list[Any]
    namespace: str
    ns: bytes
    #: Every key is exactly bytes or str (what the protocol carries as it is).
    plain: bool

    def __len__(self) -> int:
        return len(self.keys)

    def _take_keys(self, keys: list[Any], limits: Limits, hashed: bool) -> None:
        self.keys = keys
        self._key_limit = limit = limits.max_key_bytes
        self._raw = self._digests = None
        if hashed:
            joined, bad = _engine.digest_keys(self.ns, keys, limit, _keys.DIGEST_SEED_HI)
            if bad < 0:
                self._digests = joined
        else:
            bad = _engine.check_keys(keys, limit)
        self.plain = bad < 0
        if not self.plain:  # the Python check names what is wrong, or takes bytes-likes
            self._raw = [_keys.check_key(k, limit) for k in keys]

    def _share(self, sub: _Batch, indexes: Sequence[int]) -> None:
        """Gives ``sub`` the namespace, keys, digests and bytes of the keys at ``indexes``."""
        sub.ns, sub.namespace, sub._key_limit = self.ns, self.namespace, self._key_limit
        sub.plain = self.plain
        sub.keys = [self.keys[i] for i in indexes]
        sub._digests = None if self._digests is None else b"".join(map(self.digest, indexes))
        sub._raw = None if self._raw is None else [self._raw[i] for i in indexes]

    @property
    def digests(self) -> bytes:
        """The keys' concatenated 16-byte record digests (:func:`dedupcore.keys.digests`)."""
        if self._digests is None:
            # A batch that is not plain has its keys' bytes, checked, already.
            keys = self.keys if self._raw is None else self._raw
            self._digests = digests_of(self.ns, keys, self._key_limit)
        return self._digests

    def digest(self, i: int) -> bytes:
        """The record digest of the batch's key ``i``."""
        return self.digests[16 * i : 16 * i + 16]

    @property
    def raw(self) -> list[bytes]:
        """The keys as bytes (str as UTF-8), in the batch's order."""
        if self._raw is None:
            self._raw = [_keys.check_key(k, 1 << 62) for k in self.keys]
        return self._raw


class ClaimBatch(_Batch):
    """The arguments of ``claim_many``, checked once, in this order.

    The namespace (``ns``: its bytes), the keys (natively: ``digests`` holds
    their concatenated 16-byte record digests, :func:`dedupcore.keys.digests`),
    the lease (None: the store's default), the owner (bytes or None) and the
    fingerprints (None when none were given, else one per key). ``raw`` is
    the keys as bytes, made on first use by a backend that sends them.
    """

    __slots__ = ("fingerprints", "lease", "owner")

    def __init__(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
        limits: Limits = DEFAULT_LIMITS,
        hashed: bool = True,
    ) -> None:
        key_list = list(keys)
        self.ns = _keys.check_namespace(namespace)
        self.namespace = self.ns.decode()
        self._take_keys(key_list, limits, hashed)
        self.lease = None if lease is None else check_lease(lease)
        self.owner = check_owner(owner)
        self.fingerprints = (
            None if fingerprints is None else check_fingerprints(fingerprints, len(key_list))
        )

    def fingerprint_list(self) -> list[bytes | None]:
        """One fingerprint or None per key."""
        return [None] * len(self.keys) if self.fingerprints is None else self.fingerprints

    def subset(self, indexes: Sequence[int]) -> ClaimBatch:
        """The batch of the keys at ``indexes``, with the same namespace, lease, owner
        and fingerprints, checked already."""
        sub = ClaimBatch.__new__(ClaimBatch)
        self._share(sub, indexes)
        sub.lease, sub.owner = self.lease, self.owner
        fps = self.fingerprints
        sub.fingerprints = None if fps is None else [fps[i] for i in indexes]
        return sub


class ChangeBatch(_Batch):
    """The arguments of ``complete_many`` (``completing``) or ``release_many``, checked once.

    The namespace, the items' shapes and tokens (natively where they are
    plain, else by :func:`change_items`, which names what is wrong), the keys
    (``digests`` as in :class:`ClaimBatch`) and, when completing, the results
    packed (``results``: msgpack bytes or None per key; None when releasing)
    and as given (``values``, for a store that passes them on). An empty
    batch has no key to check.
    """

    __slots__ = ("completing", "results", "tokens", "values")

    def __init__(
        self,
        items: Iterable[Any],
        *,
        namespace: str,
        completing: bool,
        limits: Limits = DEFAULT_LIMITS,
        hashed: bool = True,
    ) -> None:
        self.ns = _keys.check_namespace(namespace)
        self.namespace = self.ns.decode()
        self.completing = completing
        item_list = items if type(items) is list else list(items)
        keys, tokens, given, bad = _engine.split_items(item_list, completing)
        if bad >= 0:  # the Python check names what is wrong (or takes int subclasses)
            parsed = change_items(item_list, with_results=completing)
            keys = [p[0] for p in parsed]
            tokens = [p[1] for p in parsed]
            given = [p[2] for p in parsed] if completing else None
        assert keys is not None and tokens is not None
        self.tokens: list[int] = tokens
        self.values: list[Any] | None = given if completing else None
        self._take_keys(keys, limits, hashed)
        if not keys:
            self.results: list[bytes | None] | None = [] if completing else None
            return
        max_result = limits.max_result_bytes
        self.results = (
            [None if r is None else pack_result(r, max_result) for r in given]
            if given is not None
            else None
        )

    def subset(self, indexes: Sequence[int]) -> ChangeBatch:
        """The batch of the items at ``indexes``, checked already."""
        sub = self.__class__.__new__(self.__class__)
        self._share(sub, indexes)
        sub.completing = self.completing
        sub.tokens = [self.tokens[i] for i in indexes]
        sub.values = None if self.values is None else [self.values[i] for i in indexes]
        sub.results = None if self.results is None else [self.results[i] for i in indexes]
        if isinstance(self, ExtendBatch) and isinstance(sub, ExtendBatch):
            sub.lease = self.lease
        return sub

    def items(self) -> list[tuple[Any, int, Any]]:
        """``(key, token, result as given)`` per item (None when releasing)."""
        values = self.values if self.values is not None else [None] * len(self.keys)
        return list(zip(self.keys, self.tokens, values, strict=True))


class ExtendBatch(ChangeBatch):
    """The arguments of ``extend_many``, checked once: ``(key, token)`` items as a
    release's are, and the ``lease`` (None: the store's default) each claim gets
    from now."""

    __slots__ = ("lease",)

    def __init__(
        self,
        items: Iterable[Any],
        *,
        namespace: str,
        lease: float | None = None,
        limits: Limits = DEFAULT_LIMITS,
        hashed: bool = True,
    ) -> None:
        super().__init__(items, namespace=namespace, completing=False, limits=limits, hashed=hashed)
        self.lease = None if lease is None else check_lease(lease)
