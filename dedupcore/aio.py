"""``dedupcore.aio.Client``: the asyncio twin of :class:`dedupcore.Client`.

Same methods, arguments, results and exceptions as the sync client (and so
as :class:`~dedupcore.DedupStore`), as coroutines: ``ping``, ``claim``,
``claim_many``, ``complete``, ``complete_many``, ``release``,
``release_many``, ``get``, ``stats``; ``processing(...)`` is an ``async
with`` block and ``idempotent`` decorates ``async def`` functions, with the
sync decorator's key paths, :class:`~dedupcore.api.DuplicateCache` and
``DEDUPCORE_DISABLED`` switch (all from :class:`~dedupcore.api.AsyncClaimAPI`).

One connection per client, shared by every coroutine that uses it: each
request carries its own request id, a single reader task hands every reply
to the future of its request, and the daemon answers in any order, so many
concurrent calls are pipelined on the one socket.

Failures follow the sync client:

- a request that was not sent (the connection was already gone, or the very
  first write of it failed) is sent on a new connection, opened with
  the client's :class:`~dedupcore.retry.RetryPolicy`;
- a request that was sent but got no reply (the daemon died, or ``timeout``
  passed) raises :class:`~dedupcore.errors.UnavailableError` -- it may or
  may not have been applied -- except for the ops that are safe to repeat
  (``ping``, ``get``, ``stats``, ``complete``), which are sent once more.
  Pass an ``owner`` to claims, and a retry gets its own claim back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any

import dedupcore._core as _core
from dedupcore.api import AsyncClaimAPI, ChangeBatch, Claim, ClaimBatch, ExtendBatch, KeyRecord
from dedupcore.client import DEFAULT_SOCKET, ClientBase, default_socket
from dedupcore.daemon import protocol
from dedupcore.daemon.admission import within
from dedupcore.daemon.protocol import Op, Status
from dedupcore.errors import UnavailableError

__all__ = ["DEFAULT_SOCKET", "Client", "default_socket"]


class _ConnectionLost(Exception):
    """Internal: the connection ended before the reply of a sent request arrived."""


class _Connection:
    """One socket, its reader task and the futures of the requests in flight on it."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame: int
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.max_frame = max_frame
        self.loop = asyncio.get_running_loop()
        self.pending: dict[int, asyncio.Future[tuple[Status, Any]]] = {}
        # The one-key requests in flight, whose usual reply is read natively.
        self.quick: set[int] = set()
        self.lost: BaseException | None = None
        self.task = self.loop.create_task(self._read_replies(), name="dedupcore-aio-reader")

    def usable(self) -> bool:
        return (
            self.lost is None
            and not self.writer.transport.is_closing()
            and not self.reader.at_eof()
            and self.loop is asyncio.get_running_loop()
        )

    async def _read_replies(self) -> None:
        try:
            while True:
                header = await self.reader.readexactly(4)
                length = protocol.frame_length(header, self.max_frame)
                body = await self.reader.readexactly(length)
                if len(self.quick) == 1:
                    # One one-key request in flight (one coroutine calling, the usual
                    # case): its usual answer is read natively, as the sync client does.
                    (quick_id,) = self.quick
                    answer = _core.one_key_reply(body, quick_id)
                    if answer is not None:
                        fut = self.pending.pop(quick_id, None)
                        if fut is not None and not fut.done():
                            fut.set_result((_QUICK, answer))
                        continue
                request_id, status, payload = protocol.decode_response(body)
                if request_id == 0 and status is Status.ERROR:
                    # The daemon rejects the stream itself and hangs up.
                    self._fail(protocol.error_from_payload(payload))
                    return
                fut = self.pending.pop(request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result((status, payload))
                # else: the caller gave up (timeout or cancellation); drop the late reply.
        except asyncio.CancelledError:
            self._fail(_ConnectionLost("the connection was closed"))
            raise
        except Exception as exc:  # OSError, IncompleteReadError, FrameError
            reason = (
                "the daemon closed the connection"
                if isinstance(exc, asyncio.IncompleteReadError)
                else str(exc) or type(exc).__name__
            )
            self._fail(_ConnectionLost(reason))

    def _fail(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        self.writer.close()
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    async def close(self) -> None:
        self._fail(_ConnectionLost("the client was closed"))
        if not self.task.done():
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


#: The status a reply read natively stands in (never on the wire): its payload is
#: what ``_core.one_key_reply`` gave.
_QUICK: Any = object()


async def _reply(conn: _Connection, fut: asyncio.Future[tuple[Status, Any]]) -> tuple[Status, Any]:
    """Waits until the request is flushed to the socket, then for its reply."""
    await conn.writer.drain()
    return await fut


class Client(ClientBase, AsyncClaimAPI):
    """An asyncio connection to ``dedupcore serve`` at ``path`` (see the module docstring);
    without a path, at :func:`~dedupcore.client.default_socket` (``DEDUPCORE_SOCKET``,
    else the default).

    ``timeout`` bounds the wait for each reply; ``retry`` (a
    :class:`~dedupcore.retry.RetryPolicy`, the same default as the sync
    client's: 5 retries from 0.05 s doubling up to 1 s) governs
    reconnecting; ``retries=`` and ``backoff=`` are shorthands for its
    ``attempts`` and ``initial``.
    """

    def _open(self) -> None:
        self._conn: _Connection | None = None
        self._connect_lock: asyncio.Lock | None = None

    def __repr__(self) -> str:
        return f"<dedupcore.aio.Client {self.path!r}>"

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the connection; requests still waiting get UnavailableError."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    close = aclose

    # -- transport -------------------------------------------------------------

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and conn.usable():
            return conn
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            conn = self._conn
            if conn is not None and conn.usable():
                return conn  # another coroutine reconnected meanwhile
            if conn is not None:
                self._conn = None
                if conn.loop is asyncio.get_running_loop():
                    await conn.close()
                else:  # made in another event loop: it cannot be awaited from this one
                    conn._fail(_ConnectionLost("the client moved to another event loop"))
            waits = self.retry.delays()
            while True:
                if self._closed:
                    raise UnavailableError("the client is closed")
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_unix_connection(self.path), self.timeout
                    )
                except (asyncio.TimeoutError, OSError) as exc:
                    delay = next(waits, None)
                    if delay is None:
                        raise UnavailableError(
                            f"dedupcore daemon at {self.path} is not reachable "
                            f"({exc or type(exc).__name__}); is `dedupcore serve` running?"
                        ) from exc
                    await asyncio.sleep(delay)
                    continue
                conn = _Connection(reader, writer, self.max_frame)
                self._conn = conn
                return conn

    async def _call(
        self, op: Op, args: dict[str, Any] | Callable[[int], bytes], *, quick: bool = False
    ) -> Any:
        """Sends a request (its args, or what frames it for a request id) and returns its
        reply's payload. With ``quick`` (a one-key request,
        ``ClientBase._one_key_request``), the usual answer as ``_core.one_key_reply``
        reads it natively when the reply is that: a tuple (outcome code, token) for a
        claim, True for a completion or release."""
        frame = args if callable(args) else functools.partial(self._frame, op=op, args=args)
        request_id = self._new_id()
        data = frame(request_id)
        loop = asyncio.get_running_loop()
        unsent_retries = 2  # a connection found dead before anything of the request left
        attempt = 0
        while True:
            conn = await self._connection()
            fut: asyncio.Future[tuple[Status, Any]] = loop.create_future()
            conn.pending[request_id] = fut
            if quick:
                conn.quick.add(request_id)
            try:
                if not conn.usable():
                    raise _ConnectionLost("the connection was closed")
                conn.writer.write(data)
                if conn.writer.transport.is_closing():
                    # The transport's first send of this frame failed: nothing was sent.
                    raise _ConnectionLost("cannot send to the daemon")
            except (_ConnectionLost, OSError) as exc:
                conn.pending.pop(request_id, None)
                conn.quick.discard(request_id)
                if unsent_retries:
                    unsent_retries -= 1
                    continue
                raise UnavailableError(f"cannot send to the daemon at {self.path}: {exc}") from exc
            try:
                if conn.writer.transport.get_write_buffer_size():
                    # Not all sent yet: the wait for the socket counts against the timeout.
                    status, payload = await asyncio.wait_for(_reply(conn, fut), self.timeout)
                else:
                    status, payload = await within(fut, self.timeout)
            except (_ConnectionLost, OSError, asyncio.TimeoutError) as exc:
                if op in protocol.SAFE_TO_REPEAT and attempt == 0:
                    # Resent under a new id, so a late reply to the first cannot be mistaken.
                    attempt += 1
                    request_id = next(self._ids)
                    data = frame(request_id)
                    continue
                if isinstance(exc, asyncio.TimeoutError):
                    why = f"no reply within {self.timeout} s"
                else:
                    why = str(exc) or type(exc).__name__
                raise UnavailableError(
                    f"no reply from the daemon at {self.path} ({why}); the request may or "
                    "may not have been applied"
                ) from exc
            finally:
                conn.pending.pop(request_id, None)
                conn.quick.discard(request_id)
            if status is _QUICK:
                return payload
            if status is Status.ERROR:
                raise protocol.error_from_payload(payload)
            return payload

    # -- the store's methods -------------------------------------------------------

    async def ping(self) -> bool:
        """True if the daemon answers."""
        return bool(await self._call(Op.PING, {}) == "pong")

    async def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        frame = self._one_key_request(Op.CLAIM_MANY, batch)
        if frame is not None:  # one frame, and its error is the batch's own
            reply = await self._call(Op.CLAIM_MANY, frame, quick=True)
            if type(reply) is tuple:
                outcome = protocol.OUTCOME_ORDER[reply[0]]
                return [Claim(batch.keys[0], batch.namespace, outcome, reply[1])]
            return protocol.claims_from_reply(batch.keys, batch.namespace, reply)
        parts = self._parts(batch, claims=True)
        while (part := parts.next()) is not None:
            try:
                keys, frame = self._claim_sender(part)
                reply = await self._call(Op.CLAIM_MANY, frame)
            except Exception as exc:
                parts.failed(exc)
                continue
            parts.done(protocol.claims_from_reply(keys, part.namespace, reply))
        return parts.claims

    async def _change_batch(self, batch: ChangeBatch) -> None:
        op = Op.COMPLETE_MANY if batch.completing else Op.RELEASE_MANY
        frame = self._one_key_request(op, batch)
        if frame is not None:
            await self._call(op, frame, quick=True)
            return
        await self._send_parts(batch, self._change_request)

    async def _extend_batch(self, batch: ExtendBatch) -> None:
        await self._send_parts(batch, self._extend_request)

    async def _send_parts(
        self, batch: Any, request: Callable[[Any], tuple[Op, dict[str, Any]]]
    ) -> None:
        parts = self._parts(batch, claims=False)
        while (part := parts.next()) is not None:
            try:
                await self._call(*request(part))
            except Exception as exc:
                parts.failed(exc)
                continue
            parts.done(None)

    async def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        reply = await self._call(Op.GET, {"ns": ns.decode(), "key": key})
        return protocol.record_from_map(reply)

    async def _wait_change(self, batch: ClaimBatch, timeout: float, attempt: int) -> None:
        """Asks the daemon to answer when a key of ``batch`` may have changed (WAIT); on
        a poll hint or a failed WAIT, sleeps the default backoff."""
        args = self._wait_request(batch, timeout)
        if args is not None:
            try:
                if self._waited(await self._call(Op.WAIT, args)):
                    return
            except Exception as exc:
                self._wait_failed(exc)
        await super()._wait_change(batch, timeout, attempt)

    async def stats(self) -> dict[str, Any]:
        """The daemon's store figures plus its own counters."""
        result: dict[str, Any] = await self._call(Op.STATS, {})
        return result
