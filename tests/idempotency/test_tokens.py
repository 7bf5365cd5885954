"""Idempotency tokens over every kind of store: once-only, replay, races, bad tokens."""

from __future__ import annotations

import base64
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from dedupcore import DedupStore
from dedupcore.api import ClaimAPI, InProgressError
from dedupcore.config import Retention
from dedupcore.errors import ConflictError, DedupError
from dedupcore.patterns import tokens as tokens_mod
from dedupcore.patterns.tokens import (
    TOKEN_CHARS,
    ExpiredTokenError,
    InvalidTokenError,
    Tokens,
    UnstoredResultError,
    issue_token,
    redeem,
)
from dedupcore.record import State

SECRET = b"s" * 32
OTHER_SECRET = b"o" * 32


def fresh_ns() -> str:
    return f"tokens/{uuid.uuid4().hex}"


class Counter:
    """Counts calls of an operation (thread-safe) and returns a distinct result per call."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self) -> dict[str, Any]:
        with self.lock:
            self.calls += 1
            n = self.calls
        return {"call": n, "tuple": (1, 2), "blob": b"\x00\xff"}


@pytest.fixture
def tokens(any_store: ClaimAPI) -> Tokens:
    return Tokens(any_store, namespace=fresh_ns(), secret=SECRET)


def test_runs_once_and_replays_the_first_result(tokens: Tokens) -> None:
    op = Counter()
    token = tokens.issue()
    assert len(token) == TOKEN_CHARS
    first = tokens.redeem(token, b"body", op)
    # Every caller sees the value as stored (tuples read back as lists).
    assert first == {"call": 1, "tuple": [1, 2], "blob": b"\x00\xff"}
    for _ in range(3):
        assert tokens.redeem(token, b"body", op) == first
    assert tokens.redeem(token, None, op) == first  # no fingerprint: no check
    assert op.calls == 1
    other = tokens.issue()
    assert other != token
    assert tokens.redeem(other, b"body", op)["call"] == 2
    assert op.calls == 2
    rec = tokens.store.get(tokens.verify(token).key, namespace=tokens.namespace)
    assert rec is not None and rec.state is State.PROCESSED


def test_none_result_is_replayed_as_none(tokens: Tokens) -> None:
    calls = []
    token = tokens.issue()
    assert tokens.redeem(token, None, lambda: calls.append(1)) is None
    assert tokens.redeem(token, None, lambda: calls.append(1)) is None
    assert calls == [1]


def test_fingerprint_conflict(tokens: Tokens) -> None:
    op = Counter()
    token = tokens.issue()
    tokens.redeem(token, b"pay 10 to alice", op)
    with pytest.raises(ConflictError):
        tokens.redeem(token, b"pay 99 to mallory", op)
    # Any length of fingerprint works (it is hashed before it is stored).
    big = tokens.issue()
    tokens.redeem(big, b"x" * 100_000, op)
    with pytest.raises(ConflictError):
        tokens.redeem(big, b"x" * 99_999, op)
    assert op.calls == 2


def test_conflict_while_the_first_attempt_runs(tokens: Tokens) -> None:
    token = tokens.issue()
    started, finish = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def slow() -> str:
        started.set()
        assert finish.wait(60)
        return "done"

    def first() -> None:
        try:
            tokens.redeem(token, b"a", slow)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=first)
    t.start()
    try:
        assert started.wait(60)
        with pytest.raises(ConflictError):
            tokens.redeem(token, b"b", lambda: "never")
    finally:
        finish.set()
        t.join(60)
    assert not errors


@pytest.mark.parametrize("retries", [6])
def test_concurrent_retries_while_the_first_runs(tokens: Tokens, retries: int) -> None:
    token = tokens.issue()
    op = Counter()
    started, finish = threading.Event(), threading.Event()

    def slow() -> dict[str, Any]:
        started.set()
        assert finish.wait(60)
        return op()

    outcomes: list[Any] = []
    lock = threading.Lock()

    def attempt(fn: Any) -> None:
        try:
            value: Any = tokens.redeem(token, b"same", fn)
        except BaseException as exc:
            value = exc
        with lock:
            outcomes.append(value)

    first = threading.Thread(target=attempt, args=(slow,))
    first.start()
    assert started.wait(60)
    barrier = threading.Barrier(retries)

    def retry() -> None:
        barrier.wait(60)
        attempt(op)

    threads = [threading.Thread(target=retry) for _ in range(retries)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    busy = list(outcomes)
    finish.set()
    first.join(60)
    assert len(busy) == retries
    assert all(isinstance(o, InProgressError) for o in busy), busy
    assert len(outcomes) == retries + 1
    result = outcomes[-1]
    assert isinstance(result, dict) and result["call"] == 1
    assert tokens.redeem(token, b"same", op) == result
    assert op.calls == 1


def test_racing_first_attempts_run_once(tokens: Tokens) -> None:
    """Many threads redeem one fresh token at once: one runs, the rest wait or replay."""
    token = tokens.issue()
    op = Counter()
    n = 8
    barrier = threading.Barrier(n)
    results: list[Any] = []
    lock = threading.Lock()

    def go() -> None:
        barrier.wait(60)
        try:
            value: Any = tokens.redeem(token, b"same", op)
        except InProgressError as exc:
            value = exc
        with lock:
            results.append(value)

    threads = [threading.Thread(target=go) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == n
    assert op.calls == 1
    done = [r for r in results if not isinstance(r, InProgressError)]
    assert done and all(r == done[0] for r in done)
    assert tokens.redeem(token, b"same", op) == done[0]


def test_failed_attempt_frees_the_token(tokens: Tokens) -> None:
    token = tokens.issue()
    attempts = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise RuntimeError(f"attempt {len(attempts)} failed")
        return "ok"

    for n in (1, 2):
        with pytest.raises(RuntimeError, match=f"attempt {n} failed"):
            tokens.redeem(token, b"x", flaky)
    assert tokens.redeem(token, b"x", flaky) == "ok"
    assert tokens.redeem(token, b"x", flaky) == "ok"
    assert len(attempts) == 3


def test_forged_garbled_and_foreign_tokens(tokens: Tokens) -> None:
    op = Counter()
    good = tokens.issue()
    raw = bytearray(base64.urlsafe_b64decode(good))
    # Every single-bit flip anywhere in the token is refused.
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(InvalidTokenError):
            tokens.redeem(base64.urlsafe_b64encode(bytes(bad)).decode(), b"x", op)
    # A later expiry with the old signature is a forgery, not an extension.
    forged = bytearray(raw)
    forged[1:9] = (2**62).to_bytes(8, "big")
    with pytest.raises(InvalidTokenError, match="not issued with this secret"):
        tokens.redeem(base64.urlsafe_b64encode(bytes(forged)).decode(), b"x", op)
    other_secret = Tokens(tokens.store, namespace=tokens.namespace, secret=OTHER_SECRET)
    with pytest.raises(InvalidTokenError, match="not issued with this secret"):
        tokens.redeem(other_secret.issue(), b"x", op)
    other_ns = Tokens(tokens.store, namespace=fresh_ns(), secret=SECRET)
    with pytest.raises(InvalidTokenError, match="namespace"):
        tokens.redeem(other_ns.issue(), b"x", op)
    with pytest.raises(InvalidTokenError, match="64 characters, got 63"):
        tokens.redeem(good[:-1], b"x", op)
    with pytest.raises(InvalidTokenError, match="64 characters, got 65"):
        tokens.redeem(good + "A", b"x", op)
    with pytest.raises(InvalidTokenError, match=r"got 65 \(it contains whitespace"):
        tokens.redeem(good + "\n", b"x", op)
    with pytest.raises(InvalidTokenError, match="' ' at position 0, outside the URL-safe"):
        tokens.redeem(" " + good[1:], b"x", op)
    with pytest.raises(InvalidTokenError, match=r"'\+' at position 63, outside"):
        tokens.redeem(good[:-1] + "+", b"x", op)
    with pytest.raises(InvalidTokenError, match="'é' at position 63"):
        tokens.redeem(good[:-1] + "é", b"x", op)
    with pytest.raises(InvalidTokenError, match="64 characters, got 0"):
        tokens.redeem("", b"x", op)
    assert op.calls == 0
    # The errors are ValueErrors and DedupErrors for callers that know neither.
    assert issubclass(InvalidTokenError, ValueError) and issubclass(InvalidTokenError, DedupError)
    assert issubclass(ExpiredTokenError, InvalidTokenError)


def test_wrong_types(tokens: Tokens) -> None:
    token = tokens.issue()
    with pytest.raises(TypeError, match="token must be str, not bytes"):
        tokens.redeem(token.encode(), b"x", lambda: 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token must be str, not int"):
        tokens.redeem(12, b"x", lambda: 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token must be str, not NoneType"):
        tokens.redeem(None, b"x", lambda: 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fingerprint must be bytes or None, not str"):
        tokens.redeem(token, "x", lambda: 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fn must be callable, not int"):
        tokens.redeem(token, b"x", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="secret must be bytes, not str"):
        Tokens(tokens.store, secret="x" * 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 16 random bytes, got 3"):
        Tokens(tokens.store, secret=b"abc")
    with pytest.raises(TypeError, match="previous_secrets item must be bytes"):
        Tokens(tokens.store, secret=SECRET, previous_secrets=["old"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="ttl must be a number of seconds, not bool"):
        tokens.issue(ttl=True)
    with pytest.raises(ValueError, match="ttl must be > 0"):
        tokens.issue(ttl=-1)
    with pytest.raises(ValueError, match="ttl must be > 0"):
        tokens.issue(ttl=float("nan"))
    with pytest.raises(TypeError, match="store must be a ClaimAPI store"):
        Tokens(object(), secret=SECRET)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        Tokens(tokens.store, namespace="bad ns", secret=SECRET)
    # Nothing was redeemed by any of the above.
    assert tokens.redeem(token, b"x", lambda: 7) == 7


def wait_until_expired(tokens: Tokens, token: str) -> None:
    expires = tokens.verify(token, allow_expired=True).expires
    while time.time() <= expires:
        time.sleep(0.01)


def test_expired_tokens(tokens: Tokens) -> None:
    op = Counter()
    unused = tokens.issue(ttl=0.05)
    used = tokens.issue(ttl=0.05)
    first = tokens.redeem(used, b"x", op)
    wait_until_expired(tokens, unused)
    wait_until_expired(tokens, used)
    with pytest.raises(ExpiredTokenError, match="without being redeemed"):
        tokens.redeem(unused, b"x", op)
    with pytest.raises(ExpiredTokenError):
        tokens.verify(unused)
    # A late retry of a redeemed token still learns the first outcome, and
    # cannot read it with another request's payload.
    assert tokens.redeem(used, b"x", op) == first
    with pytest.raises(ConflictError):
        tokens.redeem(used, b"y", op)
    assert op.calls == 1


def test_rotation_and_other_processes_verify(tokens: Tokens) -> None:
    old = tokens.issue()
    rotated = Tokens(
        tokens.store, namespace=tokens.namespace, secret=OTHER_SECRET, previous_secrets=[SECRET]
    )
    assert rotated.redeem(old, b"x", lambda: "via rotated") == "via rotated"
    assert tokens.redeem(old, b"x", lambda: "again") == "via rotated"
    new = rotated.issue()
    with pytest.raises(InvalidTokenError):
        tokens.verify(new)


def test_results_that_cannot_be_stored(tmp_path: Path) -> None:
    ns = fresh_ns()
    with DedupStore.open(tmp_path / "s", max_result_bytes=1024) as store:
        tokens = Tokens(store, namespace=ns, secret=SECRET)
        op_calls = []

        def big() -> bytes:
            op_calls.append(1)
            return b"x" * 2000

        token = tokens.issue()
        with pytest.raises(UnstoredResultError, match="max_result_bytes=1024") as first:
            tokens.redeem(token, b"x", big)
        assert first.value.result == b"x" * 2000  # the attempt that ran still gets it
        with pytest.raises(UnstoredResultError, match="ran once already") as retry:
            tokens.redeem(token, b"x", big)
        assert retry.value.result is None
        assert op_calls == [1]

        unserializable = tokens.issue()
        with pytest.raises(UnstoredResultError, match="msgpack-serializable"):
            tokens.redeem(unserializable, None, object)
        with pytest.raises(UnstoredResultError):
            tokens.redeem(unserializable, None, object)
        # Just under the limit is stored.
        fits = tokens.issue()
        assert tokens.redeem(fits, None, lambda: b"y" * 1000) == b"y" * 1000
        assert tokens.redeem(fits, None, lambda: b"z") == b"y" * 1000


def test_results_over_the_daemons_limit(daemon: Any) -> None:
    """The daemon client does not know the daemon's limit: the daemon's refusal counts."""
    with daemon.client() as client:
        tokens = Tokens(client, namespace=fresh_ns(), secret=SECRET)
        calls = []

        def big() -> bytes:
            calls.append(1)
            return b"x" * 100_000

        token = tokens.issue()
        with pytest.raises(UnstoredResultError, match="could not be stored") as first:
            tokens.redeem(token, None, big)
        assert first.value.result == b"x" * 100_000
        with pytest.raises(UnstoredResultError):
            tokens.redeem(token, None, big)
        assert calls == [1]


def test_ttl_must_fit_the_exact_window(tmp_path: Path) -> None:
    with DedupStore.open(tmp_path / "s", retention=Retention(exact_window=600.0)) as store:
        with pytest.raises(ValueError, match="exceeds the store's exact window"):
            Tokens(store, secret=SECRET, ttl=3600)
        tokens = Tokens(store, secret=SECRET)
        assert tokens.ttl == 600.0  # the default is capped by the window
        with pytest.raises(ValueError, match="exact window"):
            tokens.issue(ttl=601)


def test_module_level_conveniences(any_store: ClaimAPI) -> None:
    ns = fresh_ns()
    token = issue_token(any_store, secret=SECRET, namespace=ns)
    assert redeem(any_store, token, b"x", lambda: 1, secret=SECRET, namespace=ns) == 1
    assert redeem(any_store, token, b"x", lambda: 2, secret=SECRET, namespace=ns) == 1
    with pytest.raises(InvalidTokenError):
        redeem(any_store, token, b"x", lambda: 3, secret=OTHER_SECRET, namespace=ns)
    assert tokens_mod.DEFAULT_TTL == 86400.0
