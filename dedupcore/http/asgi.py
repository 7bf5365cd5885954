"""``IdempotencyMiddleware``: the ``Idempotency-Key`` header for any ASGI app (docs/http.md)."""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any

import anyio
import anyio.to_thread

from dedupcore.api import Outcome, result_refused
from dedupcore.errors import ConflictError, StaleTokenError, UnavailableError
from dedupcore.http.protocol import (
    DEFAULT_RETRY_STATUSES,
    ENVELOPE_SLACK,
    RESPONSE,
    fingerprint,
    not_replayable,
    parse_key,
    problem,
    response_record,
    result_limit,
    stored_response,
)
from dedupcore.keys import check_namespace

log = logging.getLogger("dedupcore")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Server extensions that would let a response bypass ``send`` wrapping.
_HIDDEN_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopy")


class _BadRequest(Exception):
    def __init__(self, status: int, title: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail


class IdempotencyMiddleware:
    """ASGI middleware for the ``Idempotency-Key`` header (see the module docstring).

    ``store`` is any ClaimAPI store (``DedupStore``, ``Client``,
    ``RedisStore``, ...) or a ``dedupcore.aio.Client``. ``key_scope(scope)``
    optionally returns the client identity keys are scoped to (str, bytes or
    None for "unscoped").
    """

    def __init__(
        self,
        app: ASGIApp,
        store: Any,
        *,
        namespace: str = "http",
        header: str = "Idempotency-Key",
        methods: Collection[str] = ("POST", "PATCH"),
        required: bool = False,
        max_body_bytes: int = 1 << 20,
        lease: float | None = None,
        max_response_bytes: int | None = None,
        retry_statuses: Collection[int] = DEFAULT_RETRY_STATUSES,
        key_scope: Callable[[Scope], str | bytes | None] | None = None,
        replay_header: str = "Idempotent-Replayed",
    ) -> None:
        for name in ("claim", "complete", "release"):
            if not callable(getattr(store, name, None)):
                raise TypeError(
                    f"store must have claim/complete/release (a dedupcore store or client), "
                    f"not {type(store).__name__}"
                )
        if not isinstance(header, str) or not header or not header.isascii():
            raise ValueError(f"header must be a non-empty ASCII name, got {header!r}")
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int):
            raise TypeError(f"max_body_bytes must be an int, not {type(max_body_bytes).__name__}")
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be > 0, got {max_body_bytes}")
        self.app = app
        self.store = store
        self.namespace = check_namespace(namespace).decode()
        self.header = header.lower().encode("ascii")
        self.methods = frozenset(m.upper() for m in methods)
        self.required = required
        self.max_body_bytes = max_body_bytes
        self.lease = lease
        if max_response_bytes is None:
            max_response_bytes = result_limit(store)
        if isinstance(max_response_bytes, bool) or not isinstance(max_response_bytes, int):
            raise TypeError(
                f"max_response_bytes must be an int, not {type(max_response_bytes).__name__}"
            )
        if max_response_bytes <= ENVELOPE_SLACK:
            raise ValueError(
                f"max_response_bytes must be > {ENVELOPE_SLACK}, got {max_response_bytes}"
            )
        self.max_response_bytes = max_response_bytes
        self.retry_statuses = frozenset(retry_statuses)
        self.key_scope = key_scope
        self.replay_header = replay_header.lower().encode("ascii")
        self._async = inspect.iscoroutinefunction(getattr(store, "claim", None))

    # -- store calls ----------------------------------------------------------------

    async def _store(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One store call, shielded so that a claim taken or recorded is never lost halfway."""
        fn = getattr(self.store, method)
        with anyio.CancelScope(shield=True):
            if self._async:
                return await fn(*args, **kwargs)
            return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    # -- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method", "").upper() not in self.methods:
            await self.app(scope, receive, send)
            return
        try:
            raw = self._header(scope)
            if raw is None:
                if self.required:
                    raise _BadRequest(
                        400,
                        "Idempotency-Key is missing",
                        f"{scope['method']} requests to this endpoint need an "
                        f"{self.header.decode()} header",
                    )
                await self.app(scope, receive, send)
                return
            try:
                key = parse_key(raw)
            except ValueError as exc:
                raise _BadRequest(400, "Invalid Idempotency-Key", str(exc)) from None
            body = await self._read_body(scope, receive)
            if body is None:
                return  # the client went away before sending its body: nothing happened
        except _BadRequest as bad:
            await _problem(send, bad.status, bad.title, bad.detail)
            return
        await self._handle(scope, receive, send, key, body)

    def _header(self, scope: Scope) -> bytes | None:
        values = [v for k, v in scope.get("headers", ()) if k.lower() == self.header]
        if len(values) > 1:
            raise _BadRequest(
                400,
                "Invalid Idempotency-Key",
                f"the request has {len(values)} {self.header.decode()} headers; send one",
            )
        return values[0] if values else None

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.max_body_bytes
        for k, v in scope.get("headers", ()):
            if k.lower() == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    raise _BadRequest(400, "Bad Content-Length", "not a number") from None
                if declared > limit:
                    raise _BadRequest(
                        413,
                        "Request body too large",
                        f"the body is {declared} bytes; requests with an idempotency key "
                        f"may have at most {limit}",
                    )
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            if message["type"] != "http.request":
                continue
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _BadRequest(
                    413,
                    "Request body too large",
                    f"requests with an idempotency key may have at most {limit} bytes of body",
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _dedup_key(self, scope: Scope, key: str) -> str:
        if self.key_scope is None:
            return key
        who = self.key_scope(scope)
        if who is None:
            return key
        who_b = who.encode() if isinstance(who, str) else bytes(who)
        digest = hashlib.sha256(who_b + b"\x00" + key.encode("ascii")).hexdigest()
        return f"scoped:{digest}"

    @staticmethod
    def _fingerprint(scope: Scope, body: bytes) -> bytes:
        path = scope.get("raw_path") or (scope.get("root_path", "") + scope["path"]).encode()
        return fingerprint(scope["method"], path, scope.get("query_string", b""), body)

    async def _handle(
        self, scope: Scope, receive: Receive, send: Send, key: str, body: bytes
    ) -> None:
        dkey = self._dedup_key(scope, key)
        try:
            claim = await self._store(
                "claim",
                dkey,
                namespace=self.namespace,
                lease=self.lease,
                fingerprint=self._fingerprint(scope, body),
            )
        except ConflictError:
            await _problem(
                send,
                422,
                "Idempotency-Key reused",
                "this key was already used for a different request (method, path, query or "
                "body); use a new key for a new request",
            )
            return
        except UnavailableError as exc:
            log.error("idempotency store unavailable: %s", exc)
            await _problem(
                send,
                503,
                "Idempotency store unavailable",
                "the request was not processed; retry later",
                retry_after=5,
            )
            return
        if claim.outcome is Outcome.IN_PROGRESS:
            await _problem(
                send,
                409,
                "Request in progress",
                "a request with this idempotency key is still being processed; retry later",
                retry_after=1,
            )
            return
        if claim.outcome is Outcome.DUPLICATE:
            await self._replay(send, claim.result if claim.exact else None)
            return
        await _Exchange(self, scope, receive, send, dkey, claim.token, body).run()

    async def _replay(self, send: Send, stored: Any) -> None:
        found = stored_response(stored)
        if not isinstance(found, str):
            status, headers, body = found
            headers.append((self.replay_header, b"true"))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        why = found
        await _problem(
            send,
            422,
            "Response not replayable",
            "a request with this idempotency key was already processed, but its response "
            f"cannot be sent again: {why}",
        )


class _Exchange:
    """One NEW request: runs the app, records or releases, forwards the response."""

    def __init__(
        self,
        mw: IdempotencyMiddleware,
        scope: Scope,
        receive: Receive,
        send: Send,
        key: str,
        token: int,
        body: bytes,
    ) -> None:
        self.mw = mw
        extensions = scope.get("extensions")
        if extensions and any(e in extensions for e in _HIDDEN_EXTENSIONS):
            extensions = {k: v for k, v in extensions.items() if k not in _HIDDEN_EXTENSIONS}
            scope = dict(scope, extensions=extensions)
        self.scope = scope
        self.receive_outer = receive
        self.send_outer = send
        self.key = key
        self.token = token
        self.body: bytes | None = body
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.unstorable: str | None = None
        self.settled = False  # completed or released
        self.client_gone = False

    async def receive(self) -> Message:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.receive_outer()

    async def forward(self, message: Message) -> None:
        if self.client_gone:
            return
        try:
            await self.send_outer(message)
        except OSError:
            # The client went away; the response is still recorded for its retry.
            self.client_gone = True

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            self.headers = [(bytes(n), bytes(v)) for n, v in message.get("headers", ())]
            if message.get("trailers"):
                self.unstorable = "the response has HTTP trailers"
            await self.forward(message)
            return
        if kind == "http.response.body" and not self.settled:
            chunk = bytes(message.get("body", b""))
            if self.unstorable is None and self.storing():
                self.size += len(chunk)
                if self.size + ENVELOPE_SLACK > self.mw.max_response_bytes:
                    self.unstorable = self.too_large()
                    self.chunks = []
                else:
                    self.chunks.append(chunk)
            if not message.get("more_body", False):
                await self.settle()
        await self.forward(message)

    def storing(self) -> bool:
        status = self.status or 500
        return status < 500 and status not in self.mw.retry_statuses

    def too_large(self) -> str:
        return (
            f"the response was larger than the {self.mw.max_response_bytes} bytes the store "
            "keeps per response"
        )

    async def run(self) -> None:
        try:
            await self.mw.app(self.scope, self.receive, self.send)
        except BaseException:
            if not self.settled:
                await self.release()
            raise
        if not self.settled:
            # The app returned without finishing a response: nothing to replay.
            await self.release()

    async def release(self) -> None:
        self.settled = True
        try:
            await self.mw._store("release", self.key, self.token, namespace=self.mw.namespace)
        except StaleTokenError:
            log.warning("could not release idempotency key %r: its lease was taken over", self.key)
        except Exception:
            log.exception("could not release idempotency key %r", self.key)

    async def settle(self) -> None:
        """Records (or releases) the response before its last chunk goes out."""
        if not self.storing():
            await self.release()
            return
        self.settled = True
        status = self.status if self.status is not None else 500
        result: list[Any]
        if self.unstorable is None:
            result = response_record(
                status, self.headers, b"".join(self.chunks), self.mw.max_response_bytes
            )
        else:
            result = not_replayable(self.unstorable, status)
        self.chunks = []
        try:
            try:
                await self.mw._store(
                    "complete", self.key, self.token, namespace=self.mw.namespace, result=result
                )
            except (TypeError, ValueError) as exc:
                if not result_refused(exc) or result[0] != RESPONSE:
                    raise
                # The store's own limit (a daemon's) is below the one assumed here.
                note = not_replayable(f"the store refused to keep it ({exc})", status)
                await self.mw._store(
                    "complete", self.key, self.token, namespace=self.mw.namespace, result=note
                )
        except StaleTokenError:
            log.error(
                "idempotency key %r: the lease ran out before the response was recorded; "
                "another attempt may have run the request again (raise lease=)",
                self.key,
            )
        except Exception:
            log.exception(
                "idempotency key %r: the response could not be recorded; the key stays "
                "claimed until its lease ends",
                self.key,
            )


async def _problem(
    send: Send, status: int, title: str, detail: str, *, retry_after: int | None = None
) -> None:
    """Sends an RFC 9457 problem document (:func:`problem`)."""
    status, headers, payload = problem(status, title, detail, retry_after=retry_after)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
