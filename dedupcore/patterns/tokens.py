"""Idempotency tokens: issued to a caller, redeemed once, over any claim store.

A server hands out a token (``issue``) before the caller starts an operation
that must happen at most once -- a payment form, a "create order" button, an
RPC that the caller may retry after a timeout. The caller sends the token with
every attempt; the server runs the operation inside ``redeem``::

    tokens = Tokens(store, secret=SECRET)            # any ClaimAPI store
    token = tokens.issue()                           # no store round trip
    ...
    receipt = tokens.redeem(token, fingerprint=sha256(body).digest(),
                            fn=lambda: charge(order))

``redeem`` runs ``fn`` once and stores what it returns as the claim result;
every retry with the same token gets that first result back instead of running
``fn`` again. While the first attempt still runs, a retry raises
:class:`~dedupcore.api.InProgressError` (answer "try again later"). A retry with
another ``fingerprint`` raises :class:`~dedupcore.errors.ConflictError` (the
token was used for a different request). If ``fn`` raises, the token is
released and a retry runs ``fn`` again: a failed attempt is never recorded.

Tokens are self-verifying, so issuing needs no store round trip and any
process that knows the secret can check one::

    urlsafe-base64( version:1 | expires_ms:8 | id:15 | mac:24 )   -> 64 characters

``mac`` is HMAC-SHA256 (truncated to 192 bits) over the namespace and the
first 24 bytes under ``secret``. A token that does not verify raises
:class:`InvalidTokenError`; one whose expiry (wall clock of the redeeming
host) has passed raises :class:`ExpiredTokenError` -- unless it was already
redeemed and its record is still stored, in which case the first result is
still replayed (a late retry of a completed operation learns its outcome,
it never runs again). The dedup key of a token is its id (30 hex digits) in
``namespace``. ``previous_secrets`` keeps verifying tokens issued before a
secret rotation.

Results. What ``fn`` returns is stored with msgpack: ``None``, ``bool``,
``int`` (64 bits), ``float``, ``str``, ``bytes``, ``list``/``tuple`` and
``dict`` of these, at most the store's ``max_result_bytes`` (64 KiB by
default) once encoded -- store an id or a small receipt, not a document.
Every caller, the first included, gets the value as it reads back from the
store (tuples come back as lists), so the first attempt and a retry see the
same thing. A result that cannot be stored is not a reason to run ``fn``
twice: the token is completed with a note instead, the first caller gets
:class:`UnstoredResultError` (with the value in ``.result``) and every retry
gets :class:`UnstoredResultError` without it.

Retention. A redeemed token must be remembered for as long as it can be
retried, so the store must keep exact records of ``namespace`` for at least
the token ``ttl`` (plus the lease). :class:`Tokens` refuses a ``ttl`` longer
than the exact window when the store says what it is (``DedupStore``,
``RedisStore``); for the daemon ``Client`` it is the daemon's setting. Give
the tokens' namespace ``Retention(exact_window >= ttl, cold_window=0)``: a
cold Bloom archive can only answer "probably used" without the result, and
for a fresh token such an answer is a false positive, reported here as
:class:`UnstoredResultError` rather than run.

Leases. ``fn`` must finish within the claim lease (``lease=``, default the
store's, 30 s): after that another retry takes the token over and runs ``fn``
again, and the late first attempt fails to complete with
:class:`~dedupcore.errors.StaleTokenError`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from dedupcore.api import (
    ClaimAPI,
    InProgressError,
    Outcome,
    pack_result,
    result_refused,
    unpack_result,
)
from dedupcore.errors import (
    ConflictError,
    ExpiredTokenError,
    InvalidTokenError,
    StaleTokenError,
    UnstoredResultError,
)
from dedupcore.keys import check_namespace
from dedupcore.record import State

__all__ = [
    "DEFAULT_TTL",
    "ExpiredTokenError",
    "InvalidTokenError",
    "TokenInfo",
    "Tokens",
    "UnstoredResultError",
    "issue_token",
    "redeem",
]

log = logging.getLogger("dedupcore")

R = TypeVar("R")

#: Default lifetime of a token: one day (the default exact window is 7 days).
DEFAULT_TTL = 86400.0
#: Length of every token string: 48 bytes (head, id, mac) in base64, no padding.
TOKEN_CHARS = 64
MIN_SECRET_BYTES = 16

_VERSION = 1
_HEAD = struct.Struct(">BQ")  # version, expiry in ms since the epoch
_ID_BYTES = 15
_MAC_BYTES = 24
_SIGNED = _HEAD.size + _ID_BYTES
_ALPHABET = re.compile(r"[A-Za-z0-9_-]*\Z")
_MAC_CONTEXT = b"dedupcore.tokens.v1\x00"
_FP_CONTEXT = b"dedupcore.tokens.fingerprint\x00"

# Stored results are an envelope, so that "no result" is never mistaken for one.
_STORED = 1  # [1, value]
_UNSTORED = 0  # [0, why]


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """What a verified token says: its dedup ``key`` and ``expires`` (unix seconds)."""

    key: str
    expires: float


def _check_secret(secret: object, name: str = "secret") -> bytes:
    if not isinstance(secret, bytes):
        raise TypeError(f"{name} must be bytes, not {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{name} must be at least {MIN_SECRET_BYTES} random bytes, got {len(secret)}"
        )
    return secret


def _check_ttl(ttl: object) -> float:
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise TypeError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if not 0 < ttl < 1e10:
        raise ValueError(f"ttl must be > 0 seconds (and finite), got {ttl!r}")
    return float(ttl)


def _exact_window(store: object, namespace: str) -> float | None:
    """How long the store keeps exact records of ``namespace``, when it says so."""
    config = getattr(store, "config", None)
    retention_for = getattr(config, "retention_for", None)
    if callable(retention_for):
        return float(retention_for(namespace).exact_window)
    retention = getattr(store, "retention", None)
    namespaces = getattr(store, "namespaces", None)
    if retention is not None and isinstance(namespaces, dict):
        return float(namespaces.get(namespace, retention).exact_window)
    return None


class Tokens:
    """Issues and redeems idempotency tokens over ``store`` (see the module docstring).

    - ``namespace``: the dedup namespace of the tokens (default ``"tokens"``);
      a token verifies only in the namespace it was issued for.
    - ``secret``: at least 16 random bytes, shared by every process that
      issues or redeems; ``previous_secrets`` still verify (rotation).
    - ``ttl``: default token lifetime in seconds; at most the store's exact
      window for ``namespace`` when the store reports it (ValueError
      otherwise). None: one day, or the exact window if that is shorter.
    - ``lease``: seconds ``fn`` may run before a retry may take over (the
      store's default when None).
    """

    def __init__(
        self,
        store: ClaimAPI,
        *,
        namespace: str = "tokens",
        secret: bytes,
        previous_secrets: Sequence[bytes] = (),
        ttl: float | None = None,
        lease: float | None = None,
    ) -> None:
        if not isinstance(store, ClaimAPI):
            raise TypeError(
                f"store must be a ClaimAPI store (DedupStore, Client, RedisStore, ...), not "
                f"{type(store).__name__}"
            )
        self.store = store
        self.namespace = check_namespace(namespace).decode()
        self._secrets = [_check_secret(secret)] + [
            _check_secret(s, "previous_secrets item") for s in previous_secrets
        ]
        self._window = _exact_window(store, self.namespace)
        if ttl is None:
            ttl = DEFAULT_TTL if self._window is None else min(DEFAULT_TTL, self._window)
        self.ttl = self._checked_ttl(ttl)
        self.lease = lease
        self._result_limit = store.limits.max_result_bytes

    def __repr__(self) -> str:
        return f"<Tokens namespace={self.namespace!r} ttl={self.ttl}>"

    def _checked_ttl(self, ttl: object) -> float:
        value = _check_ttl(ttl)
        if self._window is not None and value > self._window:
            raise ValueError(
                f"ttl of {value} s exceeds the store's exact window of {self._window} s for "
                f"namespace {self.namespace!r}: a redeemed token would be forgotten while it "
                "can still be retried; raise the namespace's Retention.exact_window"
            )
        return value

    def _mac(self, secret: bytes, signed: bytes) -> bytes:
        msg = _MAC_CONTEXT + self.namespace.encode() + b"\x00" + signed
        return hmac.new(secret, msg, hashlib.sha256).digest()[:_MAC_BYTES]

    # -- issuing and verifying ------------------------------------------------------

    def issue(self, ttl: float | None = None) -> str:
        """A new token valid for ``ttl`` seconds (default: the ``ttl`` given at construction)."""
        lifetime = self.ttl if ttl is None else self._checked_ttl(ttl)
        expires_ms = int((time.time() + lifetime) * 1000)
        signed = _HEAD.pack(_VERSION, expires_ms) + os.urandom(_ID_BYTES)
        raw = signed + self._mac(self._secrets[0], signed)
        return base64.urlsafe_b64encode(raw).decode("ascii")

    def verify(self, token: object, *, allow_expired: bool = False) -> TokenInfo:
        """Checks a token's shape and signature (and expiry unless ``allow_expired``).

        TypeError if it is not a str; :class:`InvalidTokenError` (a
        ValueError) naming what is wrong with its length, alphabet, version
        or signature; :class:`ExpiredTokenError` when it has expired.
        """
        if not isinstance(token, str):
            raise TypeError(f"token must be str, not {type(token).__name__}")
        if len(token) != TOKEN_CHARS:
            raise InvalidTokenError(
                f"token must be {TOKEN_CHARS} characters, got {len(token)}"
                + (" (it contains whitespace)" if token != token.strip() else "")
            )
        if not _ALPHABET.match(token):
            pos, char = next((i, c) for i, c in enumerate(token) if not _ALPHABET.match(c))
            raise InvalidTokenError(
                f"token has {char!r} at position {pos}, outside the URL-safe base64 alphabet"
            )
        try:
            raw = base64.b64decode(token, altchars=b"-_", validate=True)
        except (binascii.Error, ValueError):
            raise InvalidTokenError("token is not valid URL-safe base64") from None
        version, expires_ms = _HEAD.unpack_from(raw)
        if version != _VERSION:
            raise InvalidTokenError(f"token version {version} is not supported (expected 1)")
        signed, mac = raw[:_SIGNED], raw[_SIGNED:]
        if not any(hmac.compare_digest(mac, self._mac(s, signed)) for s in self._secrets):
            raise InvalidTokenError(
                f"token was not issued with this secret for namespace {self.namespace!r} "
                "(forged, garbled or foreign)"
            )
        info = TokenInfo(raw[_HEAD.size : _SIGNED].hex(), expires_ms / 1000.0)
        if not allow_expired and info.expires <= time.time():
            raise ExpiredTokenError(f"token expired at {info.expires:.3f} (unix time)")
        return info

    # -- redeeming ---------------------------------------------------------------------

    def redeem(self, token: str, fingerprint: bytes | None, fn: Callable[[], R]) -> R:
        """Runs ``fn`` once for ``token``; retries get its first result.

        ``fingerprint`` (bytes of any length, e.g. the request body or a hash
        of it, or None to skip the check) identifies the request: a retry
        with a different one raises ConflictError. Raises
        :class:`InvalidTokenError`/:class:`ExpiredTokenError` for bad
        tokens, :class:`~dedupcore.api.InProgressError` while the first
        attempt runs and :class:`UnstoredResultError` when the result cannot
        be (or is no longer) stored. If ``fn`` raises, the token is released
        and the exception propagates.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        fp = self._fingerprint(fingerprint)
        info = self.verify(token, allow_expired=True)
        if info.expires <= time.time():
            return self._redeem_expired(info, fp)  # type: ignore[no-any-return]
        claim = self.store.claim(
            info.key, namespace=self.namespace, lease=self.lease, fingerprint=fp
        )
        if claim.outcome is Outcome.DUPLICATE:
            if not claim.exact:
                raise UnstoredResultError(
                    f"the store's cold archive reports token {info.key} as used (exact=False), "
                    "which for a token within its ttl is a Bloom false positive; keep the tokens' "
                    "namespace out of the cold archive (Retention(cold_window=0))"
                )
            return self._replay(info.key, claim.result)  # type: ignore[no-any-return]
        if claim.outcome is Outcome.IN_PROGRESS:
            raise InProgressError(
                f"token {info.key} is being redeemed by another attempt; retry later"
            )
        try:
            result = fn()
        except BaseException:
            try:
                self.store.release(info.key, claim.token, namespace=self.namespace)
            except StaleTokenError:
                log.warning("could not release token %s: its lease was taken over", info.key)
            raise
        return self._complete(info.key, claim.token, result)  # type: ignore[no-any-return]

    def _fingerprint(self, fingerprint: object) -> bytes | None:
        if fingerprint is None:
            return None
        if not isinstance(fingerprint, bytes):
            raise TypeError(f"fingerprint must be bytes or None, not {type(fingerprint).__name__}")
        return hashlib.sha256(_FP_CONTEXT + fingerprint).digest()

    def _complete(self, key: str, token: int, result: Any) -> Any:
        envelope = [_STORED, result]
        try:
            packed = pack_result(envelope, self._result_limit)
        except (TypeError, ValueError) as exc:
            return self._complete_unstored(key, token, result, exc)
        try:
            self.store.complete(key, token, namespace=self.namespace, result=envelope)
        except (TypeError, ValueError) as exc:
            if not result_refused(exc):
                raise
            # The store's own limit (a daemon's) was lower than the one known here.
            return self._complete_unstored(key, token, result, exc)
        return unpack_result(packed)[1]

    def _complete_unstored(self, key: str, token: int, result: Any, exc: Exception) -> Any:
        why = f"the result of token {key} could not be stored: {exc}"
        self.store.complete(key, token, namespace=self.namespace, result=[_UNSTORED, why])
        raise UnstoredResultError(
            why + "; the operation ran once and will not run again for this token", result
        ) from exc

    def _replay(self, key: str, stored: Any) -> Any:
        if isinstance(stored, list) and len(stored) == 2:
            if stored[0] == _STORED:
                return stored[1]
            if stored[0] == _UNSTORED:
                raise UnstoredResultError(f"{stored[1]}; the operation ran once already")
        raise UnstoredResultError(
            f"token {key} was redeemed, but the store holds no result for it (a record "
            "written by something else, or one past its exact window)"
        )

    def _redeem_expired(self, info: TokenInfo, fp: bytes | None) -> Any:
        """An expired token still replays a stored result; it never runs ``fn``."""
        record = self.store.get(info.key, namespace=self.namespace)
        if record is not None and record.state is State.PROCESSED and record.exact:
            # Same check as a claim would make, so an expired token cannot leak
            # another request's result.
            if fp is not None and record.fingerprint is not None and fp != record.fingerprint:
                raise ConflictError(
                    f"token {info.key} was redeemed with a different fingerprint "
                    "(same token, another request)"
                )
            return self._replay(info.key, record.result)
        if record is not None and record.state is State.PROCESSING:
            raise InProgressError(
                f"token {info.key} is being redeemed by another attempt; retry later"
            )
        raise ExpiredTokenError(
            f"token {info.key} expired at {info.expires:.3f} (unix time) without being redeemed "
            "(or its record is no longer kept)"
        )


def issue_token(
    store: ClaimAPI, *, secret: bytes, namespace: str = "tokens", ttl: float | None = None
) -> str:
    """One-off form of :meth:`Tokens.issue`."""
    return Tokens(store, namespace=namespace, secret=secret, ttl=ttl).issue()


def redeem(
    store: ClaimAPI,
    token: str,
    fingerprint: bytes | None,
    fn: Callable[[], R],
    *,
    secret: bytes,
    namespace: str = "tokens",
    lease: float | None = None,
) -> R:
    """One-off form of :meth:`Tokens.redeem`."""
    return Tokens(store, namespace=namespace, secret=secret, lease=lease).redeem(
        token, fingerprint, fn
    )
