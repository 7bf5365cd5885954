"""Django: the ``Idempotency-Key`` header for every view, or for the views you choose.

The semantics are those of the ASGI middleware (docs/http.md), and what
they share is written once in :mod:`dedupcore.http.protocol`: the key's
syntax, the client a key belongs to, the request's fingerprint (method, path,
query string, body), the record of a response and its replay, the name a key
has in logs and the problem documents. Two ways in (docs/django.md)::

    # settings.py: every POST and PATCH with the header, on the store DEDUPCORE_STORE makes
    MIDDLEWARE = [..., "dedupcore.integrations.django.idempotency_middleware"]
    DEDUPCORE_STORE = "myproject.stores.dedup_store"      # a callable that returns a store
    DEDUPCORE_IDEMPOTENCY = {"required": True}            # keywords of idempotent_view

    # views.py: one view
    @idempotent_view(store=store, required=True)
    def create_order(request): ...

A request whose method is in ``methods`` and that carries the header:

- the key is checked (400 if malformed, or if the header is missing and
  ``required``); a bare key may not hold a comma, since a server joins two
  headers with one (quote it as a structured-field string);
- the body is read, at most ``max_body_bytes`` (413 above it);
- the key is claimed in ``namespace``, scoped to the client (below), with the
  request's fingerprint: NEW runs the view and records its response; a
  DUPLICATE replays the recorded status, headers and body with
  ``Idempotent-Replayed: true`` (cookies and the headers in
  ``replay_drop_headers`` are never replayed: they belong to the first
  response's client); IN_PROGRESS is 409 with ``Retry-After: 1``; the same
  key with another method, path, query or body is 422; a store that cannot
  decide is 503 and the view does not run.
- 5xx, 408, 425 and 429 responses and exceptions release the key (a retry
  runs the view again); a streaming response, or one larger than
  ``max_response_bytes``, is sent once and retries get 422 (the effect
  happened; its response cannot be sent again).
- with ``heartbeat=True`` the claim is renewed every third of its ``lease``
  while the view runs; the view finds the store key in
  ``request.idempotency_key`` (for the transactional table, docs/django.md).

Keys belong to a client: the store key is a hash of the client's identity
and the key (``scoped_key``). The identity is ``key_scope(request)``, by
default the authenticated user (``request.user``: put Django's
``AuthenticationMiddleware`` before this one), else the SHA-256 of the
``Authorization`` header; a request with neither is answered 400.
``key_scope=lambda request: ""`` shares every key between all clients
(unsafe: a client that sends another's key and body gets that client's
response). Logs name a key by the first 12 hex digits of its scoped hash,
never as sent; ``problem_base_url`` links each problem document to your
API's documentation (``type``, otherwise ``about:blank``).

The middleware is sync and async capable: under ASGI it awaits the view and
runs store calls in threads (a ``dedupcore.aio.Client`` is awaited directly);
under WSGI it calls them in the request's thread. Under ASGI a client that
goes away does not cancel a request that holds a key: the view runs to its
end and its response is recorded for the client's retry, as with the ASGI
middleware.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import dedupcore.http.protocol as protocol
from dedupcore._checks import extra_imports
from dedupcore.errors import ConflictError, UnavailableError

with extra_imports("django", "django", "dedupcore.integrations.django", also=("asgiref",)):
    from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.http import HttpRequest, HttpResponse, HttpResponseBase
    from django.utils.decorators import sync_and_async_middleware
    from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "Idempotency",
    "client_identity",
    "idempotency_middleware",
    "idempotent_view",
    "store_from_settings",
]

log = logging.getLogger("dedupcore.integrations.django")

View = Callable[..., Any]
KeyScope = Callable[[HttpRequest], str | bytes | None]

# Responses that are not recorded, so retries get 422 instead of a replay.
_STREAMING = "the response was streamed (a streaming response is not recorded)"
# Tasks of requests whose client went away, kept until they have recorded their response.
_BACKGROUND: set[asyncio.Future[Any]] = set()


@dataclass
class _StoreCall:
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class _Scope:
    request: HttpRequest


@dataclass
class _View:
    request: HttpRequest
    key: str  # the store key the view runs under, and its claim's token
    token: int


_Step = _StoreCall | _Scope | _View
_Exchange = Generator[_Step, Any, HttpResponseBase]


class _Steps:
    """Runs an exchange: each step's result, or its exception, goes back into it.

    The sync and the async handling iterate over the steps and :meth:`settle`
    each one in their own way; :attr:`response` is the exchange's answer.
    """

    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange
        self.sent: Any = None
        self.error: BaseException | None = None
        self.response: Any = None

    def __iter__(self) -> Iterator[_Step]:
        while True:
            try:
                if self.error is not None:
                    step = self.exchange.throw(self.error)
                else:
                    step = self.exchange.send(self.sent)
            except StopIteration as stop:
                self.response = stop.value
                return
            self.sent, self.error = None, None
            yield step

    def settle(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.sent = fn(*args)
        except BaseException as exc:  # goes back into the exchange (at its yield)
            self.error = exc

    async def asettle(self, pending: Awaitable[Any]) -> None:
        try:
            self.sent = await pending
        except BaseException as exc:  # goes back into the exchange (at its yield)
            self.error = exc


def _response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> HttpResponse:
    response = HttpResponse(body, status=status)
    del response["Content-Type"]  # the headers given say what it is
    for name, value in headers:
        response[name.decode("latin-1")] = value.decode("latin-1")
    return response


def client_identity(request: HttpRequest) -> str | None:
    """The default client identity: the authenticated user, else the credentials sent.

    ``"user:"`` and ``request.user.pk`` when Django's ``AuthenticationMiddleware``
    (before this one) found a user; else the SHA-256 of the ``Authorization``
    header, as over ASGI (``credentials_identity`` of dedupcore.http); None when
    the request has neither.
    """
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    authorization = request.META.get("HTTP_AUTHORIZATION")
    values = [] if authorization is None else [authorization.encode("latin-1")]
    return protocol.credentials_identity(values)


class Idempotency(protocol.Handling):
    """The ``Idempotency-Key`` handling of a middleware or of decorated views.

    ``store`` is any ClaimAPI store (``DedupStore``, ``Client``,
    ``RedisStore``, ...), a ``dedupcore.aio.Client`` (for the middleware under
    ASGI and decorated async views), or None for the store ``DEDUPCORE_STORE`` makes
    (:func:`store_from_settings`). The keywords are those of
    :func:`idempotent_view`: ``key_scope`` (a callable of the request, or its
    dotted path) and the ASGI middleware's options, with its defaults
    (:class:`~dedupcore.http.protocol.Options`, docs/http.md, "Options").
    ``heartbeat=True`` renews a request's claim every third of its ``lease``
    (default :data:`~dedupcore.api.HEARTBEAT_LEASE`) while the view runs
    (docs/django.md, "Heartbeats"). The view finds the request's store key in
    ``request.idempotency_key``.
    """

    whose_key = "docs/django.md, 'Whose key'"

    def __init__(
        self,
        store: Any = None,
        *,
        key_scope: KeyScope | str | None = None,
        **options: Unpack[protocol.Options],
    ) -> None:
        if store is not None:
            protocol.check_store(store)
        if isinstance(key_scope, str):
            key_scope = import_string(key_scope)
        if key_scope is not None and not callable(key_scope):
            raise TypeError(f"key_scope must be callable, not {type(key_scope).__name__}")
        super().__init__(store, **options)
        self._store = store
        self._store_lock = threading.Lock()
        self.key_scope: KeyScope | None = key_scope

    def _name_headers(self, header: str, replay_header: str) -> None:
        self.header = header
        self.meta_name = "HTTP_" + header.upper().replace("-", "_")
        self.replay_header = replay_header
        self.replay_header_bytes = replay_header.encode("ascii")

    # -- the store -----------------------------------------------------------------------

    @property
    def store(self) -> Any:
        """The store; made by ``DEDUPCORE_STORE`` on first use when none was given."""
        if self._store is None:
            with self._store_lock:
                if self._store is None:
                    self._store = store_from_settings()
        return self._store

    @property
    def max_response_bytes(self) -> int:
        if self._max_response_bytes is None:
            self._max_response_bytes = protocol.result_limit(self.store)
        return self._max_response_bytes

    def _is_async_store(self) -> bool:
        return iscoroutinefunction(self.store.claim)

    # -- the exchange, written once for both drivers ------------------------------------

    def applies(self, request: HttpRequest) -> bool:
        """Whether ``request`` takes part: its method is one of ``methods``, and it has the
        header or must have it (``required``). Other requests go to the view untouched."""
        if (request.method or "").upper() not in self.methods:
            return False
        return self.required or self.meta_name in request.META

    def _key(self, request: HttpRequest) -> str:
        raw = request.META.get(self.meta_name)
        if raw is None:  # and required (see applies)
            raise protocol.Rejected(
                "missing-key",
                f"{request.method} requests to this endpoint need an {self.header} header",
            )
        if "," in raw and not raw.strip(" \t").startswith('"'):
            raise protocol.Rejected(
                "invalid-key",
                f"the request has more than one {self.header} header, or a bare key with a "
                "comma; send one key (quote it to use a comma)",
            )
        try:
            return protocol.parse_key(raw.encode("latin-1"))
        except ValueError as exc:
            raise protocol.Rejected("invalid-key", str(exc)) from None

    def _body(self, request: HttpRequest) -> bytes:
        limit = self.max_body_bytes
        declared = request.META.get("CONTENT_LENGTH") or "0"
        try:
            size = int(declared)
        except ValueError:
            raise protocol.Rejected("bad-content-length", "not a number") from None
        body: bytes = request.body if size <= limit else b""
        size = max(size, len(body))
        if size > limit:
            raise protocol.Rejected(
                "body-too-large",
                f"the body is {size} bytes; requests with an idempotency key may have at "
                f"most {limit}",
            )
        return body

    def identity(self, request: HttpRequest) -> str | bytes:
        """Who sent ``request``: ``key_scope(request)``, else :func:`client_identity`."""
        return self.client_of(
            request,
            client_identity,
            "without credentials (no authenticated user, no Authorization header)",
        )

    def problem(self, slug: str, detail: str, retry_after: int | None = None) -> HttpResponse:
        """The problem document ``slug`` (``PROBLEMS`` of dedupcore.http) as a response."""
        return _response(*protocol.refusal_problem(self.problem_types, slug, detail, retry_after))

    def _exchange(self, request: HttpRequest) -> _Exchange:
        """One request that takes part, as steps for a driver to run: store calls, finding
        the client's identity, the view."""
        try:
            key = self._key(request)
            body = self._body(request)
            dkey = protocol.scoped_key((yield _Scope(request)), key)
        except protocol.Rejected as rejected:
            return self.problem(*rejected.refusal)
        path = request.path.encode("utf-8", "surrogatepass")
        query = request.META.get("QUERY_STRING", "").encode("utf-8", "surrogatepass")
        try:
            claim = yield _StoreCall(
                "claim",
                (dkey,),
                {
                    "namespace": self.namespace,
                    "lease": self.lease,
                    "fingerprint": protocol.fingerprint(request.method or "", path, query, body),
                },
            )
        except (ConflictError, UnavailableError) as exc:
            return self.problem(*protocol.claim_refused(exc, dkey, log))
        answer = protocol.claim_answer(claim, self.replay_drop_headers, self.replay_header_bytes)
        if isinstance(answer, protocol.Refusal):
            return self.problem(*answer)
        if answer is not None:
            return _response(*answer)
        request.idempotency_key = dkey
        try:
            response: HttpResponseBase = yield _View(request, dkey, claim.token)
        except BaseException:
            yield from self._release(dkey, claim.token)
            raise
        yield from self._settle(response, dkey, claim.token)
        return response

    def _release(self, dkey: str, token: int) -> Generator[_Step, Any, None]:
        try:
            yield _StoreCall("release", (dkey, token), {"namespace": self.namespace})
        except Exception as exc:
            protocol.release_failed(exc, dkey, log)

    def _settle(
        self, response: HttpResponseBase, dkey: str, token: int
    ) -> Generator[_Step, Any, None]:
        """Records the response (or releases the key) before it goes to the client."""
        status = response.status_code
        if not protocol.recorded(status, self.retry_statuses):
            yield from self._release(dkey, token)
            return
        if response.streaming:
            result = protocol.not_replayable(_STREAMING, status)
        else:
            headers = protocol.without_headers(
                ((n.encode("latin-1"), v.encode("latin-1")) for n, v in response.items()),
                self.replay_drop_headers,
            )
            content: bytes = response.content
            result = protocol.response_record(status, headers, content, self.max_response_bytes)
        namespace = self.namespace
        try:
            try:
                yield _StoreCall(
                    "complete", (dkey, token), {"namespace": namespace, "result": result}
                )
            except (TypeError, ValueError) as exc:
                note = protocol.refused_record(exc, result)
                yield _StoreCall(
                    "complete", (dkey, token), {"namespace": namespace, "result": note}
                )
        except Exception as exc:
            protocol.record_failed(exc, dkey, log)

    # -- the drivers ------------------------------------------------------------------------

    def handle(self, request: HttpRequest, view: View, *args: Any, **kwargs: Any) -> Any:
        """Runs ``view(request, *args, **kwargs)`` under the key (sync views, WSGI)."""
        if not self.applies(request) or getattr(request, "idempotency", None) is not None:
            return view(request, *args, **kwargs)
        request.idempotency = self
        if self._is_async_store():
            raise TypeError(
                "a dedupcore.aio.Client is awaited: it serves the middleware under ASGI and "
                "decorated async views; give this one a sync store (dedupcore.Client)"
            )
        steps = _Steps(self._exchange(request))
        for step in steps:
            steps.settle(self._run, step, lambda r: view(r, *args, **kwargs))
        return steps.response

    def _run(self, step: _Step, view: View) -> Any:
        if isinstance(step, _StoreCall):
            return getattr(self.store, step.method)(*step.args, **step.kwargs)
        if isinstance(step, _Scope):
            return self.identity(step.request)
        with self._beat(step):
            return view(step.request)

    def _beat(self, step: _View) -> AbstractContextManager[Any]:
        """The heartbeat of the view's claim in a thread (``heartbeat=True``), else none."""
        if not self.heartbeat or self.lease is None:
            return nullcontext()
        return protocol.heartbeat(self.store, step.key, step.token, self.namespace, self.lease)

    def _abeat(self, step: _View) -> AbstractAsyncContextManager[Any]:
        """The heartbeat of an awaited view's claim, as a task (``heartbeat=True``)."""
        if not self.heartbeat or self.lease is None:
            return nullcontext()

        async def in_thread(fn: Callable[[], None]) -> None:
            await sync_to_async(fn, thread_sensitive=False)()

        return protocol.async_heartbeat(
            self.store, step.key, step.token, self.namespace, self.lease, in_thread
        )

    async def ahandle(
        self, request: HttpRequest, view: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> Any:
        """Awaits ``view(request, *args, **kwargs)`` under the key (async views, ASGI).

        Once the request takes part it runs to its end even if the client goes
        away (Django then cancels the request): its response is recorded for
        the client's retry.
        """
        if not self.applies(request) or getattr(request, "idempotency", None) is not None:
            return await view(request, *args, **kwargs)
        request.idempotency = self
        exchange = self._exchange(request)
        task = asyncio.ensure_future(self._adrive(exchange, lambda r: view(r, *args, **kwargs)))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
        return await asyncio.shield(task)

    async def _adrive(self, exchange: _Exchange, view: Callable[..., Awaitable[Any]]) -> Any:
        steps = _Steps(exchange)
        for step in steps:
            await steps.asettle(self._arun(step, view))
        return steps.response

    async def _arun(self, step: _Step, view: Callable[..., Awaitable[Any]]) -> Any:
        if isinstance(step, _StoreCall):
            call = functools.partial(getattr(self.store, step.method), *step.args, **step.kwargs)
            if self._is_async_store():
                return await call()
            return await sync_to_async(call, thread_sensitive=False)()
        if isinstance(step, _Scope):
            # key_scope and request.user may read the database: a sync context.
            return await sync_to_async(self.identity)(step.request)
        async with self._abeat(step):
            return await view(step.request)


#: DEDUPCORE_STORE's value -> the store its callable made (once per process).
_settings_stores: dict[str, Any] = {}
_settings_lock = threading.Lock()


def store_from_settings() -> Any:
    """The store ``DEDUPCORE_STORE`` makes: the dotted path of a callable that returns one.

    It is called once per process, on first use, and the store is shared by
    the middleware and every decorated view that was given no store.
    """
    path = getattr(settings, "DEDUPCORE_STORE", None)
    if not isinstance(path, str) or not path:
        raise ImproperlyConfigured(
            "set DEDUPCORE_STORE to the dotted path of a callable that returns a "
            "dedupcore store (docs/django.md), or give the decorator store="
        )
    with _settings_lock:
        if path not in _settings_stores:
            store = import_string(path)()
            protocol.check_store(store)
            _settings_stores[path] = store
        return _settings_stores[path]


def _options_from_settings() -> dict[str, Any]:
    options = getattr(settings, "DEDUPCORE_IDEMPOTENCY", None) or {}
    if not isinstance(options, Mapping):
        raise ImproperlyConfigured(
            f"DEDUPCORE_IDEMPOTENCY must be a dict of idempotent_view's keywords, "
            f"not {type(options).__name__}"
        )
    if "store" in options:
        raise ImproperlyConfigured("the middleware's store is DEDUPCORE_STORE, not a keyword")
    return dict(options)


@sync_and_async_middleware  # type: ignore[untyped-decorator]
def idempotency_middleware(get_response: View) -> View:
    """Django middleware: the ``Idempotency-Key`` header for every view (module docstring).

    The store is ``DEDUPCORE_STORE``'s, the options ``DEDUPCORE_IDEMPOTENCY``'s
    (a dict of :func:`idempotent_view`'s keywords). Put it after
    ``AuthenticationMiddleware`` (keys are scoped to ``request.user``) and
    after ``CsrfViewMiddleware`` (a refused request takes no key).
    """
    try:
        guard = Idempotency(**_options_from_settings())
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(f"DEDUPCORE_IDEMPOTENCY: {exc}") from exc

    if iscoroutinefunction(get_response):

        async def middleware(request: HttpRequest) -> Any:
            return await guard.ahandle(request, get_response)

        return middleware

    def sync_middleware(request: HttpRequest) -> Any:
        return guard.handle(request, get_response)

    return sync_middleware


def idempotent_view(view: View | None = None, *, store: Any = None, **options: Any) -> Any:
    """Decorates one view (sync or async) with the ``Idempotency-Key`` handling.

    ``@idempotent_view`` or ``@idempotent_view(store=..., required=True, ...)``;
    the keywords and defaults are the middleware's (module docstring). With no
    ``store`` the view uses ``DEDUPCORE_STORE``'s. A request the middleware
    already handles passes straight to the view. For a class-based view, use
    ``method_decorator(idempotent_view(...), name="dispatch")``.
    """
    guard = Idempotency(store, **options)

    def decorate(fn: View) -> View:
        if iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                return await guard.ahandle(request, fn, *args, **kwargs)

            return markcoroutinefunction(async_view)

        @functools.wraps(fn)
        def sync_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return guard.handle(request, fn, *args, **kwargs)

        return sync_view

    if view is not None:
        return decorate(view)
    return decorate
