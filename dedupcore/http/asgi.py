"""The ``Idempotency-Key`` header over ASGI: for a whole app, or per route (docs/http.md).

:class:`Idempotency` holds the options and makes the one decision for a
request (:meth:`Idempotency.begin`): pass it through, answer it without the
app (a problem or a replay: :class:`Answer`), or run the app once and record
its response (:class:`Exchange`). :class:`IdempotencyMiddleware` applies it to
a whole ASGI app; :meth:`Idempotency.endpoint` to one Starlette endpoint;
``dedupcore.http.fastapi`` to FastAPI routes. All three share this code.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import anyio.to_thread

import dedupcore.http.protocol as protocol
from dedupcore.api.conveniences import AsyncHeartbeat
from dedupcore.errors import ConflictError, UnavailableError

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("dedupcore")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
#: ``key_scope(scope)``: the client identity a key belongs to; None when it has none.
KeyScope = Callable[[Scope], str | bytes | None]

#: Where the app finds a request's store key (:func:`~dedupcore.http.protocol.scoped_key`),
#: to key a transactional effect by it (docs/http.md, "Where exactly once holds").
SCOPE_KEY = "dedupcore.key"

# Server extensions that would let a response bypass ``send`` wrapping.
_HIDDEN_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopy")


def _credentials(scope: Scope) -> str | None:
    """The default client identity: :func:`~dedupcore.http.protocol.credentials_identity`
    of the request's ``Authorization`` headers."""
    return protocol.credentials_identity(
        v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"
    )


class Answer:
    """A response the middleware sends itself (a problem or a replay); the app does not run."""

    #: The client went away before its request was read: nothing is sent.
    GONE: ClassVar[Answer]

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self is Answer.GONE:
            return
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


Answer.GONE = Answer(0, [], b"")


class Idempotency(protocol.Handling):
    """The ``Idempotency-Key`` handling of an app or of some of its routes (docs/http.md).

    ``store`` is any ClaimAPI store (``DedupStore``, ``Client``,
    ``RedisStore``, ...) or a ``dedupcore.aio.Client``. Keys belong to a client:
    ``key_scope(scope)`` returns its identity (str or bytes; None when the
    request has none, answered 400). Without ``key_scope`` the identity is the
    SHA-256 of the request's ``Authorization`` header
    (:func:`~dedupcore.http.protocol.credentials_identity`); ``key_scope=lambda
    scope: ""`` shares every key between all clients (unsafe: a client that
    sends another's key and body gets that client's response).

    ``heartbeat=True`` renews a request's claim every third of its ``lease``
    (default :data:`~dedupcore.api.HEARTBEAT_LEASE`) while the app runs, so an
    app slower than its lease keeps its key (docs/http.md, "Heartbeats"). The
    app finds the request's store key in ``scope["dedupcore.key"]``.

    The other keywords are those of :class:`~dedupcore.http.protocol.Options`
    (``namespace``, ``header``, ``methods``, ``required``, ``max_body_bytes``,
    ``lease``, ``max_response_bytes``, ``retry_statuses``, ``replay_header``,
    ``replay_drop_headers``, ``problem_base_url``, ``heartbeat``), with the
    defaults docs/http.md, "Options", gives.
    """

    response_floor = protocol.ENVELOPE_SLACK

    def __init__(
        self,
        store: Any,
        *,
        key_scope: KeyScope | None = None,
        **options: Unpack[protocol.Options],
    ) -> None:
        protocol.check_store(store)
        if key_scope is not None and not callable(key_scope):
            raise TypeError(
                f"key_scope must be a callable of the ASGI scope, not {type(key_scope).__name__}"
            )
        super().__init__(store, **options)
        self.store = store
        self.key_scope = key_scope
        limit = self._max_response_bytes
        if limit is None:
            limit = protocol.result_limit(store)
            protocol.check_size("max_response_bytes", limit, self.response_floor)
        self.max_response_bytes = limit
        self._async = inspect.iscoroutinefunction(getattr(store, "claim", None))

    def _name_headers(self, header: str, replay_header: str) -> None:
        self.header = header.lower().encode("ascii")
        self.replay_header = replay_header.lower().encode("ascii")

    @classmethod
    def of(cls, store: Any, **options: Any) -> Idempotency:
        """``store`` itself if it is an Idempotency (no options then), else a new one."""
        if not isinstance(store, Idempotency):
            return cls(store, **options)
        if options:
            raise TypeError(f"options go to Idempotency(...), not next to one: {sorted(options)}")
        return store

    # -- where it applies -----------------------------------------------------------------

    def wrap(self, app: ASGIApp) -> IdempotencyMiddleware:
        """``app`` behind this handling (the middleware, sharing these options)."""
        return IdempotencyMiddleware(app, self)

    def endpoint(self, fn: Callable[..., Any]) -> IdempotencyMiddleware:
        """A Starlette endpoint ``fn(request) -> response`` behind this handling.

        Use as a decorator, or ``Route("/orders", idem.endpoint(create_order),
        methods=["POST"])``: the route serves an ASGI app that runs ``fn`` as
        Starlette would.
        """
        from starlette.routing import request_response

        wrapped = self.wrap(request_response(fn))
        functools.update_wrapper(wrapped, fn)  # the route's name is the function's
        return wrapped

    # -- store calls ----------------------------------------------------------------

    async def call_store(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One store call, shielded so that a claim taken or recorded is never lost halfway."""
        fn = getattr(self.store, method)
        with anyio.CancelScope(shield=True):
            if self._async:
                if not protocol.on_asyncio():
                    kind = type(self.store)
                    raise RuntimeError(
                        f"the store ({kind.__module__}.{kind.__qualname__}) runs on asyncio "
                        "only and this server runs another event loop (Trio): give the "
                        "middleware a sync store (dedupcore.Client), whose calls run in "
                        "worker threads"
                    )
                return await fn(*args, **kwargs)
            return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    # -- the decision -----------------------------------------------------------------

    async def begin(self, scope: Scope, receive: Receive) -> Answer | Exchange | None:
        """What to do with a request: None (pass it to the app), an Answer, or an Exchange.

        Reads the request's body when it carries a key; the Exchange hands it
        to the app again (:meth:`Exchange.receive`).
        """
        if scope.get("type") != "http" or scope.get("method", "").upper() not in self.methods:
            return None
        try:
            raw = self._header(scope)
            if raw is None:
                if self.required:
                    raise protocol.Rejected(
                        "missing-key",
                        f"{scope['method']} requests to this endpoint need an "
                        f"{self.header.decode()} header",
                    )
                return None
            try:
                key = protocol.parse_key(raw)
            except ValueError as exc:
                raise protocol.Rejected("invalid-key", str(exc)) from None
            identity = self._identity(scope)
            body = await self._read_body(scope, receive)
            if body is None:
                return Answer.GONE  # the client went away before sending its body
        except protocol.Rejected as rejected:
            return self.problem(*rejected.refusal)
        return await self._claim(scope, receive, protocol.scoped_key(identity, key), body)

    def problem(self, slug: str, detail: str, retry_after: int | None = None) -> Answer:
        """The problem document ``slug`` (:data:`~dedupcore.http.protocol.PROBLEMS`)."""
        return Answer(*protocol.refusal_problem(self.problem_types, slug, detail, retry_after))

    def _header(self, scope: Scope) -> bytes | None:
        values = [v for k, v in scope.get("headers", ()) if k.lower() == self.header]
        if len(values) > 1:
            raise protocol.Rejected(
                "invalid-key",
                f"the request has {len(values)} {self.header.decode()} headers; send one",
            )
        return values[0] if values else None

    def _identity(self, scope: Scope) -> str | bytes:
        return self.client_of(scope, _credentials, "without credentials (an Authorization header)")

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.max_body_bytes
        for k, v in scope.get("headers", ()):
            if k.lower() == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    raise protocol.Rejected("bad-content-length", "not a number") from None
                if declared > limit:
                    raise protocol.Rejected(
                        "body-too-large",
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
                raise protocol.Rejected(
                    "body-too-large",
                    f"requests with an idempotency key may have at most {limit} bytes of body",
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    def _fingerprint(scope: Scope, body: bytes) -> bytes:
        path = scope.get("raw_path") or (scope.get("root_path", "") + scope["path"]).encode()
        return protocol.fingerprint(scope["method"], path, scope.get("query_string", b""), body)

    async def _claim(
        self, scope: Scope, receive: Receive, key: str, body: bytes
    ) -> Answer | Exchange:
        try:
            claim = await self.call_store(
                "claim",
                key,
                namespace=self.namespace,
                lease=self.lease,
                fingerprint=self._fingerprint(scope, body),
            )
        except (ConflictError, UnavailableError) as exc:
            return self.problem(*protocol.claim_refused(exc, key, log))
        answer = protocol.claim_answer(claim, self.replay_drop_headers, self.replay_header)
        if answer is None:
            return Exchange(self, scope, receive, key, claim.token, body)
        if isinstance(answer, protocol.Refusal):
            return self.problem(*answer)
        return Answer(*answer)


class IdempotencyMiddleware:
    """ASGI middleware for the ``Idempotency-Key`` header (docs/http.md).

    ``IdempotencyMiddleware(app, store, **options)`` with the options of
    :class:`Idempotency`, or ``IdempotencyMiddleware(app, idempotency)`` to
    share one :class:`Idempotency` (for instance as a Starlette route's
    ``middleware=[Middleware(IdempotencyMiddleware, idempotency)]``).
    """

    def __init__(self, app: ASGIApp, store: Any, **options: Any) -> None:
        self.app = app
        self.idempotency = Idempotency.of(store, **options)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        step = await self.idempotency.begin(scope, receive)
        if step is None:
            await self.app(scope, receive, send)
        elif isinstance(step, Exchange):
            await step.run(self.app, send)
        else:
            await step(scope, receive, send)


class Exchange:
    """One NEW request: runs the app, records or releases, forwards the response."""

    def __init__(
        self,
        idempotency: Idempotency,
        scope: Scope,
        receive: Receive,
        key: str,
        token: int,
        body: bytes,
    ) -> None:
        self.idempotency = idempotency
        scope[SCOPE_KEY] = key
        extensions = scope.get("extensions")
        if extensions and any(e in extensions for e in _HIDDEN_EXTENSIONS):
            extensions = {k: v for k, v in extensions.items() if k not in _HIDDEN_EXTENSIONS}
            scope = dict(scope, extensions=extensions)
        self.scope = scope
        self.receive_outer = receive
        self.send_outer: Send | None = None
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
        self.beat: AsyncHeartbeat | protocol.ThreadHeartbeat | None = None
        self.beat_stopped = False

    async def receive(self) -> Message:
        """The request's body (read already), then what the client sends next."""
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.receive_outer()

    async def forward(self, message: Message) -> None:
        if self.client_gone or self.send_outer is None:
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
                if self.size + protocol.ENVELOPE_SLACK > self.idempotency.max_response_bytes:
                    self.unstorable = self.too_large()
                    self.chunks = []
                else:
                    self.chunks.append(chunk)
            if not message.get("more_body", False):
                await self.settle()
        await self.forward(message)

    def storing(self) -> bool:
        return protocol.recorded(self.status or 500, self.idempotency.retry_statuses)

    def too_large(self) -> str:
        return (
            f"the response was larger than the {self.idempotency.max_response_bytes} bytes "
            "the store keeps per response"
        )

    async def run(self, app: ASGIApp, send: Send) -> None:
        """Runs ``app`` (or a framework's response object) with its response going to ``send``."""
        self.send_outer = send
        await self.start_heartbeat()
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException:
            if not self.settled:
                await self.release()
            raise
        finally:
            await self.stop_heartbeat()
        if not self.settled:
            # The app returned without finishing a response: nothing to replay.
            await self.release()

    async def start_heartbeat(self) -> None:
        """Starts renewing the claim (with ``heartbeat=True``), once, until it is settled."""
        idem = self.idempotency
        if not idem.heartbeat or idem.lease is None or self.beat is not None or self.beat_stopped:
            return
        beat = protocol.async_heartbeat(
            idem.store, self.key, self.token, idem.namespace, idem.lease, anyio.to_thread.run_sync
        )
        self.beat = await beat.__aenter__()

    async def stop_heartbeat(self) -> None:
        """Stops the renewals for good; one under way ends first, so none follows the
        completion or release."""
        self.beat_stopped = True
        beat, self.beat = self.beat, None
        if beat is not None:
            await beat.__aexit__(None, None, None)

    async def release(self) -> None:
        """Gives the key up (a failed attempt): a retry runs the request again."""
        await self.stop_heartbeat()
        self.settled = True
        idem = self.idempotency
        try:
            await idem.call_store("release", self.key, self.token, namespace=idem.namespace)
        except Exception as exc:
            protocol.release_failed(exc, self.key, log)

    async def settle(self) -> None:
        """Records (or releases) the response before its last chunk goes out."""
        if not self.storing():
            await self.release()
            return
        await self.stop_heartbeat()
        self.settled = True
        idem = self.idempotency
        status = self.status if self.status is not None else 500
        result: list[Any]
        if self.unstorable is None:
            headers = protocol.without_headers(self.headers, idem.replay_drop_headers)
            result = protocol.response_record(
                status, headers, b"".join(self.chunks), idem.max_response_bytes
            )
        else:
            result = protocol.not_replayable(self.unstorable, status)
        self.chunks = []
        try:
            try:
                await idem.call_store(
                    "complete", self.key, self.token, namespace=idem.namespace, result=result
                )
            except (TypeError, ValueError) as exc:
                note = protocol.refused_record(exc, result)
                await idem.call_store(
                    "complete", self.key, self.token, namespace=idem.namespace, result=note
                )
        except Exception as exc:
            protocol.record_failed(exc, self.key, log)
