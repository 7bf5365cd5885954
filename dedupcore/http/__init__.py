"""The IETF ``Idempotency-Key`` header for ASGI apps, whole or per route (docs/http.md).

Wrap an ASGI application (Starlette, FastAPI, or plain ASGI) so that a client
may retry a POST or PATCH safely (draft-ietf-httpapi-idempotency-key-header)::

    app = IdempotencyMiddleware(app, dedupcore.Client(socket), required=True)

or apply the same handling to some routes only: ``Idempotency(store,
...).endpoint(fn)`` for a Starlette endpoint, ``Depends(Idempotent(store,
...))`` on the routes of an ``IdempotentRoute`` router for FastAPI
(``dedupcore.http.fastapi``). A request whose method is in ``methods`` and
that carries the header is handled like this:

1. The key is the header's value: 1..255 printable ASCII characters
   (0x20-0x7E), bare or as a quoted structured-field string (``"abc"``).
   A malformed or repeated header is answered 400; a missing one is 400
   when ``required`` is set and otherwise passes through untouched.
   The key belongs to the client that sent it: the store key is a hash of
   the client's identity and the key (``scoped_key``). The identity is
   ``key_scope(scope)``, by default the SHA-256 of the ``Authorization``
   header; a request without one is answered 400.
2. The request body is read in full, at most ``max_body_bytes`` (413 above
   it, checked against Content-Length first). The request's fingerprint is
   SHA-256 over method, path, query string and body; any body is accepted as
   bytes, JSON or not.
3. The key is claimed in ``namespace`` with that fingerprint:

   - NEW: the app runs and its response streams to the client as usual. The
     final body chunk is held back until the response is recorded, so a
     client that has seen the end of the response always gets it replayed.
     A client that went away meanwhile does not stop this: the response is
     recorded and a later retry gets it.
   - DUPLICATE: the recorded response (status, headers, body) is sent again
     with ``Idempotent-Replayed: true`` added; the app does not run.
     Headers that carry one client's credentials or session
     (``replay_drop_headers``: ``Set-Cookie``, ``Authorization``, ...) are
     neither recorded nor replayed.
   - IN_PROGRESS: 409 with ``Retry-After: 1`` -- the first request is still
     running.
   - ConflictError (the key was used with another method/path/query/body):
     422.
   - The store cannot decide (UnavailableError): 503 with ``Retry-After``;
     the app does not run (fail closed).

What is recorded:

- 2xx, 3xx and 4xx responses are recorded and replayed, as the draft says
  (a 4xx is the outcome of that request; a retry with the same payload would
  get the same answer), except 408, 425 and 429 (``retry_statuses``), which
  ask the client to try again: like a 5xx, they release the key.
- A 5xx response, or an exception from the app, releases the key: a retry
  runs the app again.
- A response too large for the store's result limit (``max_response_bytes``,
  by default the store's ``max_result_bytes``, 64 KiB, minus a few bytes of
  framing) is sent to the first client, and the key is completed *without*
  a replayable response: the request's effect happened and must not happen
  again, and a wrong or truncated replay must never be sent. Retries get 422
  with a problem document saying the response cannot be replayed. The same
  holds for a response with HTTP trailers. Keep idempotent responses small
  (return an id and a status URL), or raise the store's limit.

Retention: a key is remembered for the store's exact window of
``namespace`` (7 days by default for ``DedupStore``, ``RedisStore`` and the
daemon); a retry after that runs the request again. Clients must not reuse
keys, and should not retry after the window (the draft's "expiry"). The
draft defines no header for it, so none is sent; document the window to your
clients. With ``DedupStore`` or ``RedisStore`` also give the namespace
``Retention(cold_window=0)``: a key found only in the cold Bloom archive has
no response to replay and is answered 422.

Leases: the app must answer within the claim ``lease`` (the store's default,
30 s, when None); after it a retry may take the key over and run the app a
second time. With ``heartbeat=True`` the claim is renewed every third of its
lease while the app runs, so only a stopped or dead process loses its key.
An app that writes its effect to its own SQL database closes the rest of the
window with the transactional table keyed by ``scope["dedupcore.key"]``
(docs/http.md, "The effect and its key in one transaction"). If the store
cannot record the response at the end (it became unavailable), the response
is still sent and the key stays claimed until its lease ends; a retry after
that runs the app again.

Logs name a key by the first 12 hex digits of its scoped hash (``key_ref``),
never as sent. Problem documents have ``type: about:blank`` unless
``problem_base_url`` links each problem to your API's documentation.

Store calls of a sync store (``DedupStore``, ``Client``, ``RedisStore``) run
in worker threads (``anyio.to_thread``); ``dedupcore.aio.Client`` is awaited
directly. Calls that record or release a claim are shielded from
cancellation.
"""

from __future__ import annotations

from dedupcore.http.asgi import Idempotency, IdempotencyMiddleware
from dedupcore.http.protocol import (
    DEFAULT_REPLAY_DROP_HEADERS,
    DEFAULT_RETRY_STATUSES,
    PROBLEMS,
    credentials_identity,
    key_ref,
    parse_key,
    scoped_key,
)

# The building blocks other frameworks' integrations share (the fingerprint, the
# recorded response, the problem documents, ...) are in dedupcore.http.protocol.
__all__ = [
    "DEFAULT_REPLAY_DROP_HEADERS",
    "DEFAULT_RETRY_STATUSES",
    "PROBLEMS",
    "Idempotency",
    "IdempotencyMiddleware",
    "credentials_identity",
    "key_ref",
    "parse_key",
    "scoped_key",
]
