"""What the ``Idempotency-Key`` header means and what is stored for a response.

The pieces every HTTP integration shares, whatever the framework: the
options and their checks (:class:`Options`, :class:`Handling`), the key's
syntax, the client a key belongs to, the request's fingerprint, the record of
a response and its replay, the name a key has in logs and what is logged when
the store fails, and the problem documents (RFC 9457). The ASGI middleware is
in :mod:`dedupcore.http.asgi`, Django's in :mod:`dedupcore.integrations.django`;
docs/http.md describes the behaviour.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any, ClassVar, NamedTuple, TypedDict

from dedupcore.api import HEARTBEAT_LEASE, Claim, Outcome, pack_result, result_refused
from dedupcore.api.conveniences import AsyncHeartbeat, Heartbeat
from dedupcore.errors import ConflictError, StaleTokenError, UnavailableError
from dedupcore.keys import check_namespace

#: 4xx statuses that ask the client to try again: released like a 5xx, not recorded.
DEFAULT_RETRY_STATUSES = frozenset({408, 425, 429})
MAX_KEY_CHARS = 255
DEFAULT_RESULT_LIMIT = 65536

# Recorded results: [1, status, [[name, value], ...], body] or [0, why, status].
RESPONSE = 1
NOT_REPLAYABLE = 0
ENVELOPE_SLACK = 64  # msgpack framing around the body, checked exactly before storing

#: Response headers that carry one client's credentials or session: never recorded, never
#: replayed (the first response still carries them).
DEFAULT_REPLAY_DROP_HEADERS = frozenset(
    {
        "set-cookie",
        "set-cookie2",
        "authorization",
        "proxy-authorization",
        "authentication-info",
        "proxy-authentication-info",
    }
)

#: The problems the middleware answers itself: slug -> (status, title). The slug is the
#: fragment of its section in docs/http.md and the tail of its ``type`` link.
PROBLEMS: dict[str, tuple[int, str]] = {
    "missing-key": (400, "Idempotency-Key is missing"),
    "invalid-key": (400, "Invalid Idempotency-Key"),
    "no-client-identity": (400, "Idempotency-Key needs a client identity"),
    "bad-content-length": (400, "Bad Content-Length"),
    "body-too-large": (413, "Request body too large"),
    "in-progress": (409, "Request in progress"),
    "key-reused": (422, "Idempotency-Key reused"),
    "not-replayable": (422, "Response not replayable"),
    "store-unavailable": (503, "Idempotency store unavailable"),
}

_SCOPED = "scoped:"

log = logging.getLogger("dedupcore")


class Refusal(NamedTuple):
    """An answer sent without running the app: the problem ``slug`` (:data:`PROBLEMS`), its
    detail and its ``Retry-After`` seconds (None: no header)."""

    slug: str
    detail: str
    retry_after: int | None = None


#: A response to send again: status, headers, body.
Replay = tuple[int, list[tuple[bytes, bytes]], bytes]


class Rejected(Exception):
    """The request is answered with the problem ``slug`` (:data:`PROBLEMS`) and ``detail``,
    without running the app; ``refusal`` holds both."""

    def __init__(self, slug: str, detail: str) -> None:
        super().__init__(detail)
        self.refusal = Refusal(slug, detail)


class ClientCheck:
    """Checks the identity found for a request's client; warns once when there is none."""

    def __init__(self, docs: str) -> None:
        #: Where the warning sends the reader ("docs/http.md, 'Whose key'").
        self.docs = docs
        self.warned = False

    def __call__(self, found: object, how: str) -> str | bytes | Refusal:
        """``found`` when it is a str or bytes; for None, the 400 refusal (and, the first
        time, a warning that the request came ``how``); TypeError for anything else."""
        if found is None:
            if not self.warned:
                self.warned = True
                log.warning(
                    "a request with an idempotency key came %s and was answered 400; keys "
                    "belong to a client: pass key_scope= to say who the client is (%s)",
                    how,
                    self.docs,
                )
            return Refusal(
                "no-client-identity",
                "idempotency keys belong to a client, and this request does not say which "
                "client sent it; send your credentials with it",
            )
        if not isinstance(found, (str, bytes)):
            raise TypeError(f"key_scope must return str, bytes or None, not {type(found).__name__}")
        return found


class Options(TypedDict, total=False):
    """The keywords of an ``Idempotency`` (ASGI's and Django's) besides the store and
    ``key_scope``; docs/http.md, "Options", tells what each does."""

    namespace: str
    header: str
    methods: Collection[str]
    required: bool
    max_body_bytes: int
    lease: float | None
    max_response_bytes: int | None
    retry_statuses: Collection[int]
    replay_header: str
    replay_drop_headers: Collection[str]
    problem_base_url: str | Mapping[str, str] | None
    heartbeat: bool


class Handling:
    """The :class:`Options` of an ``Idempotency``, checked and kept, whatever its framework.

    The headers' names are kept by each framework in its own form
    (:meth:`_name_headers`); ``max_response_bytes`` as given (None: the store's limit).
    """

    #: A ``max_response_bytes`` given must be above this.
    response_floor: ClassVar[int] = 0
    #: Where the warning about a request without a client identity sends the reader.
    whose_key: ClassVar[str] = "docs/http.md, 'Whose key'"
    #: ``key_scope(request)``: the identity of the request's client (None: it has none).
    key_scope: Callable[[Any], str | bytes | None] | None = None

    def __init__(
        self,
        store: object,
        *,
        namespace: str = "http",
        header: str = "Idempotency-Key",
        methods: Collection[str] = ("POST", "PATCH"),
        required: bool = False,
        max_body_bytes: int = 1 << 20,
        lease: float | None = None,
        max_response_bytes: int | None = None,
        retry_statuses: Collection[int] = DEFAULT_RETRY_STATUSES,
        replay_header: str = "Idempotent-Replayed",
        replay_drop_headers: Collection[str] = DEFAULT_REPLAY_DROP_HEADERS,
        problem_base_url: str | Mapping[str, str] | None = None,
        heartbeat: bool = False,
    ) -> None:
        self.lease = heartbeat_lease(store, heartbeat, lease)
        check_header_name("header", header)
        check_header_name("replay_header", replay_header)
        check_size("max_body_bytes", max_body_bytes)
        if max_response_bytes is not None:
            check_size("max_response_bytes", max_response_bytes, self.response_floor)
        self.namespace = check_namespace(namespace).decode()
        self.methods = frozenset(m.upper() for m in methods)
        self.required = required
        self.max_body_bytes = max_body_bytes
        self.heartbeat = heartbeat
        self._max_response_bytes = max_response_bytes
        self.retry_statuses = frozenset(retry_statuses)
        self.replay_drop_headers = header_names(replay_drop_headers)
        self.problem_types = problem_types(problem_base_url)
        self._check_client = ClientCheck(self.whose_key)
        self._name_headers(header, replay_header)

    def _name_headers(self, header: str, replay_header: str) -> None:
        """Keeps the names of the key's header and of the replay's, as the framework uses them."""
        raise NotImplementedError

    def client_of(
        self, request: Any, default: Callable[[Any], str | None], without: str
    ) -> str | bytes:
        """Who sent ``request``: ``key_scope(request)``, else ``default(request)``.

        Raises :class:`Rejected` (400) when it finds none; the first time, a
        warning says the request came ``without`` what ``default`` looks for.
        """
        found: str | bytes | None
        if self.key_scope is None:
            found, how = default(request), without
        else:
            found, how = self.key_scope(request), "for which key_scope found no client identity"
        checked = self._check_client(found, how)
        if isinstance(checked, Refusal):
            raise Rejected(checked.slug, checked.detail)
        return checked


def heartbeat_lease(store: object, heartbeat: bool, lease: float | None) -> float | None:
    """The claims' lease: ``lease``, or :data:`~dedupcore.api.HEARTBEAT_LEASE` under a
    heartbeat when none is given; TypeError if the heartbeat's store cannot renew claims."""
    if not isinstance(heartbeat, bool):
        raise TypeError(f"heartbeat must be True or False, not {type(heartbeat).__name__}")
    if not heartbeat:
        return lease
    if store is not None and not callable(getattr(store, "extend", None)):
        raise TypeError(
            f"heartbeat=True needs a store that renews claims (extend), not {type(store).__name__}"
        )
    return HEARTBEAT_LEASE if lease is None else lease


def heartbeat(store: Any, dedup_key: str, token: int, namespace: str, lease: float) -> Heartbeat:
    """The heartbeat of a request's claim on a sync store, in a thread: renews it by
    ``lease`` every third of ``lease`` while the view runs (docs/http.md, "Heartbeats").
    Its logs name the key by :func:`key_ref`."""
    renew = functools.partial(store.extend, dedup_key, token, namespace=namespace, lease=lease)
    return Heartbeat(Claim(key_ref(dedup_key), namespace, Outcome.NEW, token), lease, renew)


class ThreadHeartbeat:
    """A sync store's :class:`Heartbeat` (its own thread) behind ``async with``, for an
    event loop other than asyncio's (Trio): started at once, and stopped in a worker
    thread (``run_sync``) so that the loop is not blocked while a renewal under way
    ends first."""

    def __init__(self, beat: Heartbeat, run_sync: Callable[[Callable[[], None]], Awaitable[Any]]):
        self.beat = beat
        self._run_sync = run_sync

    async def __aenter__(self) -> ThreadHeartbeat:
        self.beat.__enter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._run_sync(functools.partial(self.beat.__exit__, None, None, None))


def async_heartbeat(
    store: Any,
    dedup_key: str,
    token: int,
    namespace: str,
    lease: float,
    run_sync: Callable[[Callable[[], None]], Awaitable[Any]],
) -> AsyncHeartbeat | ThreadHeartbeat:
    """:func:`heartbeat` for an async caller: on asyncio a task (an async store's
    ``extend`` awaited, a sync one's called through ``run_sync``, in a worker thread);
    on another event loop (an ASGI server on Trio) a sync store's heartbeat in a thread
    of its own (:class:`ThreadHeartbeat`). An async store (``dedupcore.aio.Client``)
    runs on asyncio only."""
    awaited = inspect.iscoroutinefunction(store.extend)
    if not awaited and not on_asyncio():
        return ThreadHeartbeat(heartbeat(store, dedup_key, token, namespace, lease), run_sync)
    renew = functools.partial(store.extend, dedup_key, token, namespace=namespace, lease=lease)
    shown = Claim(key_ref(dedup_key), namespace, Outcome.NEW, token)
    if awaited:
        return AsyncHeartbeat(shown, lease, renew)

    async def renew_in_thread() -> None:
        await run_sync(renew)

    return AsyncHeartbeat(shown, lease, renew_in_thread)


def on_asyncio() -> bool:
    """Whether the caller runs on an asyncio event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def parse_key(raw: bytes) -> str:
    """The idempotency key of a header value (bare, or a quoted sf-string); ValueError if bad."""
    text = raw.decode("latin-1").strip(" \t")
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        inner, out, i = text[1:-1], [], 0
        while i < len(inner):
            c = inner[i]
            if c == "\\":
                if i + 1 == len(inner) or inner[i + 1] not in '"\\':
                    raise ValueError("bad escape in the quoted key")
                out.append(inner[i + 1])
                i += 2
                continue
            if c == '"':
                raise ValueError("unescaped quote inside the quoted key")
            out.append(c)
            i += 1
        text = "".join(out)
    if not 1 <= len(text) <= MAX_KEY_CHARS:
        raise ValueError(f"the key must be 1..{MAX_KEY_CHARS} characters, got {len(text)}")
    bad = next((c for c in text if not " " <= c <= "~"), None)
    if bad is not None:
        raise ValueError(f"the key must be printable ASCII, it holds {bad!r}")
    return text


def result_limit(store: object) -> int:
    """The largest result ``store`` keeps (its ``max_result_bytes``), else 64 KiB."""
    config = getattr(store, "config", None)
    for owner in (config, store):
        limit = getattr(owner, "max_result_bytes", None)
        if isinstance(limit, int) and not isinstance(limit, bool):
            return limit
    return DEFAULT_RESULT_LIMIT


def fingerprint(method: str, path: bytes, query: bytes, body: bytes) -> bytes:
    """The request's fingerprint: SHA-256 over method, path, query string and body."""
    h = hashlib.sha256()
    for part in (method.upper().encode(), path, query):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    h.update(body)
    return h.digest()


def response_record(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes, limit: int
) -> list[Any]:
    """What the store keeps of a response: all of it, or a note if it is over ``limit``."""
    result = [RESPONSE, status, [list(h) for h in headers], body]
    try:
        pack_result(result, limit)
    except ValueError:
        return not_replayable(
            f"the response was larger than the {limit} bytes the store keeps per response",
            status,
        )
    return result


def not_replayable(why: str, status: int) -> list[Any]:
    """The record of a response that happened but cannot be sent again, and why."""
    return [NOT_REPLAYABLE, why, status]


def stored_response(stored: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes] | str:
    """The recorded response (status, headers, body), or why there is none to replay."""
    if (
        isinstance(stored, list)
        and len(stored) == 4
        and stored[0] == RESPONSE
        and isinstance(stored[1], int)
        and isinstance(stored[3], bytes)
    ):
        return stored[1], [(bytes(n), bytes(v)) for n, v in stored[2]], stored[3]
    if isinstance(stored, list) and len(stored) >= 2 and stored[0] == NOT_REPLAYABLE:
        return str(stored[1])
    return "the store holds no response for it (past the exact window, or not recorded)"


def problem(
    status: int,
    title: str,
    detail: str,
    *,
    retry_after: int | None = None,
    type_uri: str = "about:blank",
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """An RFC 9457 problem document: status, headers, body."""
    body = json.dumps({"type": type_uri, "title": title, "status": status, "detail": detail})
    payload = body.encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    return status, headers, payload


def problem_types(spec: str | Mapping[str, str] | None) -> dict[str, str]:
    """The ``type`` of each problem in :data:`PROBLEMS` (``problem_base_url=``).

    None: ``about:blank`` for all. A string: that prefix followed by the slug
    (``"https://example.com/docs/idempotency#"`` gives
    ``https://example.com/docs/idempotency#in-progress``). A mapping: a link per
    slug; a slug it leaves out keeps ``about:blank``.
    """
    if spec is None:
        return dict.fromkeys(PROBLEMS, "about:blank")
    if isinstance(spec, str):
        if not spec or not spec.isascii() or any(c in spec for c in ' "<>'):
            raise ValueError(f"problem_base_url must be an ASCII URI prefix, got {spec!r}")
        return {slug: spec + slug for slug in PROBLEMS}
    unknown = sorted(set(spec) - set(PROBLEMS))
    if unknown:
        raise ValueError(f"unknown problems {unknown}; the problems are {sorted(PROBLEMS)}")
    return {slug: spec.get(slug, "about:blank") for slug in PROBLEMS}


def header_names(names: Collection[str]) -> frozenset[bytes]:
    """Header names as the lower-case bytes ASGI uses; ValueError for a bad name."""
    if isinstance(names, (str, bytes)):
        raise TypeError("give a collection of header names, not one string")
    out = set()
    for name in names:
        if not isinstance(name, str) or not name or not name.isascii() or " " in name:
            raise ValueError(f"a header name must be a non-empty ASCII token, got {name!r}")
        out.add(name.lower().encode("ascii"))
    return frozenset(out)


def without_headers(
    headers: Iterable[tuple[bytes, bytes]], drop: Collection[bytes]
) -> list[tuple[bytes, bytes]]:
    """``headers`` minus those named in ``drop`` (lower-case names, :func:`header_names`)."""
    return [(n, v) for n, v in headers if n.lower() not in drop]


def credentials_identity(authorization: Iterable[bytes]) -> str | None:
    """The default client identity: the SHA-256 of the request's ``Authorization`` value.

    ``authorization`` holds the values of the request's ``Authorization``
    headers (normally one; several are joined with ``", "``). The identity is
    ``"authorization:"`` and the hex SHA-256 of the value, byte for byte, or
    None when there is none (the request has no credentials).
    """
    values = [bytes(v) for v in authorization]
    if not values:
        return None
    return "authorization:" + hashlib.sha256(b", ".join(values)).hexdigest()


def scoped_key(identity: str | bytes, key: str) -> str:
    """The store key of idempotency ``key`` sent by client ``identity``.

    ``"scoped:"`` and the hex SHA-256 of the identity, a NUL byte and the key:
    the same key from two clients is two store keys, and neither the key nor
    the identity is stored or logged as sent. An identity of ``""`` or ``b""``
    shares keys between all clients.
    """
    who = identity.encode() if isinstance(identity, str) else bytes(identity)
    return _SCOPED + hashlib.sha256(who + b"\x00" + key.encode("ascii")).hexdigest()


def key_ref(dedup_key: str) -> str:
    """How logs name a key: the first 12 hex digits of its scoped hash (:func:`scoped_key`).

    The store key of that request starts with ``scoped:`` and these digits.
    """
    if dedup_key.startswith(_SCOPED):
        return dedup_key[len(_SCOPED) : len(_SCOPED) + 12]
    return hashlib.sha256(dedup_key.encode()).hexdigest()[:12]


def claim_refused(
    error: ConflictError | UnavailableError, dedup_key: str, log: logging.Logger
) -> Refusal:
    """The answer to a claim of ``dedup_key`` that raised: 422 for a key used by another
    request, 503 (with ``Retry-After``: the app did not run) when the store could not
    decide, which is logged on ``log``."""
    if isinstance(error, ConflictError):
        return Refusal(
            "key-reused",
            "this key was already used for a different request (method, path, query or "
            "body); use a new key for a new request",
        )
    log.error("idempotency store unavailable (key %s): %s", key_ref(dedup_key), error)
    return Refusal("store-unavailable", "the request was not processed; retry later", 5)


def claim_answer(
    claim: Claim, drop: Collection[bytes], replay_header: bytes
) -> Refusal | Replay | None:
    """What a claim's outcome says to send: None for NEW (run the app), 409 while another
    request holds the key, or for a DUPLICATE the recorded response (less the headers in
    ``drop``, with ``replay_header: true``), or 422 when it cannot be sent again."""
    if claim.outcome is Outcome.IN_PROGRESS:
        return Refusal(
            "in-progress",
            "a request with this idempotency key is still being processed; retry later",
            1,
        )
    if claim.outcome is not Outcome.DUPLICATE:
        return None
    found = stored_response(claim.result if claim.exact else None)
    if isinstance(found, str):
        return Refusal(
            "not-replayable",
            "a request with this idempotency key was already processed, but its response "
            f"cannot be sent again: {found}",
        )
    status, headers, body = found
    return status, [*without_headers(headers, drop), (replay_header, b"true")], body


def recorded(status: int, retry_statuses: Collection[int]) -> bool:
    """Whether a response of ``status`` is recorded for replays; otherwise (a 5xx, or one of
    ``retry_statuses``) its key is released and a retry runs the request again."""
    return status < 500 and status not in retry_statuses


def refused_record(error: TypeError | ValueError, result: list[Any]) -> list[Any]:
    """What to record when completing with the response record ``result`` raised ``error``:
    if the store refused the record for its size (the store's own limit, a daemon's, is
    below the one assumed), a note that the response cannot be replayed; ``error`` itself
    is raised again otherwise."""
    if not result_refused(error) or result[0] != RESPONSE:
        raise error
    return not_replayable(f"the store refused to keep it ({error})", result[1])


def release_failed(error: Exception, dedup_key: str, log: logging.Logger) -> None:
    """Logs on ``log`` that releasing ``dedup_key`` raised ``error``."""
    if isinstance(error, StaleTokenError):
        log.warning(
            "could not release idempotency key %s: its lease was taken over", key_ref(dedup_key)
        )
    else:
        log.error("could not release idempotency key %s", key_ref(dedup_key), exc_info=error)


def record_failed(error: Exception, dedup_key: str, log: logging.Logger) -> None:
    """Logs on ``log`` that recording the response of ``dedup_key`` raised ``error``."""
    if isinstance(error, StaleTokenError):
        log.error(
            "idempotency key %s: the lease ran out before the response was recorded; "
            "another attempt may have run the request again (raise lease=)",
            key_ref(dedup_key),
        )
    else:
        log.error(
            "idempotency key %s: the response could not be recorded; the key stays "
            "claimed until its lease ends",
            key_ref(dedup_key),
            exc_info=error,
        )


def refusal_problem(
    types: Mapping[str, str], slug: str, detail: str, retry_after: int | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The problem document ``slug`` (:data:`PROBLEMS`) with ``detail`` and ``retry_after``
    (a :class:`Refusal`), its ``type`` link taken from ``types`` (:func:`problem_types`)."""
    status, title = PROBLEMS[slug]
    return problem(status, title, detail, retry_after=retry_after, type_uri=types[slug])


def check_store(store: object) -> None:
    """TypeError unless ``store`` has claim, complete and release (a store or a client)."""
    for name in ("claim", "complete", "release"):
        if not callable(getattr(store, name, None)):
            raise TypeError(
                "store must have claim/complete/release (a dedupcore store or client), "
                f"not {type(store).__name__}"
            )


def check_header_name(name: str, value: object) -> None:
    """ValueError unless the option ``name`` is a non-empty ASCII header name."""
    if not isinstance(value, str) or not value or not value.isascii():
        raise ValueError(f"{name} must be a non-empty ASCII name, got {value!r}")


def check_size(name: str, number: object, above: int = 0) -> None:
    """TypeError unless the option ``name`` is an int (not a bool), ValueError unless it is
    above ``above``."""
    if isinstance(number, bool) or not isinstance(number, int):
        raise TypeError(f"{name} must be an int, not {type(number).__name__}")
    if number <= above:
        raise ValueError(f"{name} must be > {above}, got {number}")
