"""``dedupcore.Client``: the store's methods over the daemon's Unix socket.

Same methods, arguments and exceptions as :class:`~dedupcore.DedupStore`
(``claim``, ``claim_many``, ``complete``, ``complete_many``, ``release``,
``release_many``, ``get``, ``stats``, ``processing``, ``idempotent``).

Each thread gets its own connection (a fork gets new ones). A request that
could not be *sent* is retried on a new connection; connecting is retried
as ``retry`` says (a :class:`~dedupcore.retry.RetryPolicy`; ``retries=`` and
``backoff=`` are shorthands for its ``attempts`` and ``initial``). A
request that was sent but got no reply (the daemon died or the timeout
passed) raises :class:`UnavailableError` and is not resent, except
for the ones that are safe to repeat (``ping``, ``get``, ``stats``,
``complete``): resending a claim whose NEW answer was lost would report the
caller's own claim as IN_PROGRESS. Pass an ``owner`` to claims, and a retry
gets its own claim back.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import dedupcore._core as _core
from dedupcore._spin import Spin, check_spin
from dedupcore.api import Claim, ClaimAPI, KeyRecord, batches
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import Op, Status
from dedupcore.errors import (
    BatchTooLargeError,
    FrameError,
    PartialBatchError,
    UnavailableError,
)
from dedupcore.retry import RetryPolicy, policy_from_args

__all__ = ["DEFAULT_SOCKET", "Client", "default_socket"]

DEFAULT_SOCKET = "/run/dedupcore/dedupcore.sock"
#: The environment variable that names the daemon's socket for every command and client.
SOCKET_VARIABLE = "DEDUPCORE_SOCKET"


def default_socket(environ: Mapping[str, str] | None = None) -> str:
    """The daemon's socket when no path is given.

    ``DEDUPCORE_SOCKET`` if it is set (and not empty); else, for root,
    :data:`DEFAULT_SOCKET`; for another user, ``$XDG_RUNTIME_DIR/dedupcore/
    dedupcore.sock`` when ``XDG_RUNTIME_DIR`` is set (to an absolute path: the
    user's own runtime directory, which the login manager makes), else
    :data:`DEFAULT_SOCKET` as well (which such a user can seldom create: ``serve``
    then says so, and how to name another path). ``Client()``, ``aio.Client()``,
    ``dedupcore stats`` and ``dedupcore serve`` all resolve their default with this
    function, so they meet at the same path (docs/daemon-config.md, "The socket").
    """
    env = os.environ if environ is None else environ
    named = env.get(SOCKET_VARIABLE)
    if named:
        return named
    runtime = env.get("XDG_RUNTIME_DIR")
    if os.geteuid() != 0 and runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "dedupcore", "dedupcore.sock")
    return DEFAULT_SOCKET


class _Connection:
    def __init__(self, path: str, timeout: float, max_frame: int, spin: float | None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.timeout = timeout
        self.max_frame = max_frame
        self.spin = Spin(spin)
        self.pid = os.getpid()
        try:
            self.sock.connect(path)
        except BaseException:
            self.sock.close()
            raise
        self.fd = self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def exchange(self, data: bytes, spin: float = 0.0) -> bytes | int:
        """Sends a request frame and reads the reply, in one native call that waits with
        the GIL released (docs/daemon.md, "The client's round trip"), checking for the
        reply without sleeping for up to ``spin`` seconds first: the reply's body,
        or the errno of a send that failed (nothing of the request was applied). After
        the send, a failure raises OSError (TimeoutError, ConnectionResetError) or
        FrameError."""
        try:
            return _core.exchange(self.fd, data, self.max_frame, self.timeout, spin)
        except ValueError as exc:  # a reply length out of bounds
            raise FrameError(str(exc)) from None

    def exchange_one(self, data: bytes) -> bytes | int:
        """:meth:`exchange` for a one-key request: it checks for the reply without
        sleeping as long as the connection's :class:`~dedupcore._spin.Spin` says, and
        counts the round trip."""
        spin = self.spin
        started = time.perf_counter()
        body = self.exchange(data, spin.budget())
        spin.took(time.perf_counter() - started)
        return body

    def next_reply(self) -> tuple[int, Status, Any]:
        """The next reply, decoded (after one to an older request); raises as
        :meth:`exchange`."""
        body = self.exchange(b"")  # sends nothing: never an errno
        if isinstance(body, int):
            raise AssertionError("nothing was sent")
        return protocol.decode_response(body)


def _keys_only(batch: batches.ClaimBatch) -> bool:
    """Whether a claim batch carries nothing but its keys (no lease, owner or
    fingerprints): the claims whose frames are built natively."""
    return batch.lease is None and batch.owner is None and not batch.fingerprints


#: Bytes a key, token or fingerprint costs in a frame beyond its own (msgpack framing).
_ITEM_OVERHEAD = 16


class _Parts:
    """A batch sent in frames of at most ``budget`` estimated bytes, in order.

    :meth:`next` gives the next part (None when all were answered), :meth:`done`
    takes its answer, :meth:`failed` its error: a part whose reply would pass
    the daemon's frame (BatchTooLargeError, nothing of it applied) is sent
    again as two halves; another error is raised as it is when nothing was
    applied yet, else as a PartialBatchError naming what was (docs/daemon.md,
    "Batches of any size").
    """

    def __init__(self, batch: Any, budget: int, *, claims: bool) -> None:
        self.batch = batch
        self.claims: list[Claim] = []
        self.count = 0
        self._claims = claims
        self._queue = collections.deque(self._ranges(batch, budget))
        self._current = range(0)

    @staticmethod
    def _ranges(batch: Any, budget: int) -> list[range]:
        n = len(batch.keys)
        results = getattr(batch, "results", None) or ()
        fps = getattr(batch, "fingerprints", None) or ()
        quick = 4 * sum(map(len, batch.keys)) + sum(map(len, filter(None, [*results, *fps])))
        if quick + 2 * _ITEM_OVERHEAD * n <= budget:
            return [range(n)]  # the usual case: one frame, no per-key work
        sizes = [len(k) + _ITEM_OVERHEAD for k in batch.raw]
        for extra in (results, fps):
            for i, blob in enumerate(extra):
                sizes[i] += len(blob) if blob else 0
        out, start, held = [], 0, 0
        for i, size in enumerate(sizes):
            if held + size > budget and i > start:
                out.append(range(start, i))
                start, held = i, 0
            held += size
        out.append(range(start, n))
        return out

    def next(self) -> Any:
        if not self._queue:
            return None
        self._current = self._queue.popleft()
        whole = len(self._current) == len(self.batch.keys)
        return self.batch if whole else self.batch.subset(self._current)

    def done(self, answer: list[Claim] | None) -> None:
        if answer is not None:
            self.claims.extend(answer)
        self.count += len(self._current)

    def failed(self, exc: Exception) -> None:
        part = self._current
        if isinstance(exc, BatchTooLargeError) and len(part) > 1:
            half = part.start + len(part) // 2
            self._queue.extendleft([range(half, part.stop), range(part.start, half)])
            return
        if self.count == 0:
            raise exc
        total = len(self.batch.keys)
        maybe = (
            " (that part may or may not have been applied)"
            if isinstance(exc, UnavailableError)
            else ""
        )
        raise PartialBatchError(
            f"the batch of {total} was sent in parts: its first {self.count} were applied "
            f"(.applied), keys {part.start} to {total - 1} were not{maybe}: {exc}",
            self.claims if self._claims else self.count,
        ) from exc


class ClientBase:
    """What the sync and the asyncio client share: where the daemon is, their limits,
    request ids and request frames (the transport is each client's own).

    ``path``: the daemon's socket, else :func:`default_socket`; ``timeout`` bounds
    each reply; ``retry`` (a :class:`~dedupcore.retry.RetryPolicy`; ``retries=``
    and ``backoff=`` are shorthands for its ``attempts`` and ``initial``) governs
    connecting; ``max_frame`` is the largest frame either side sends.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        timeout: float = 30.0,
        retries: int | None = None,
        backoff: float | None = None,
        retry: RetryPolicy | None = None,
        max_frame: int = protocol.DEFAULT_MAX_FRAME,
    ) -> None:
        self.path = default_socket() if path is None else os.fspath(path)
        self.timeout = timeout
        self.retry = policy_from_args(retry, retries=retries, backoff=backoff)
        self.max_frame = max_frame
        self._ids = itertools.count(1)
        self._closed = False
        #: False once the daemon answered that it does not know WAIT (an older one).
        self._waits = True
        self._open()

    #: The client checks what every store checks (types, tokens, owners, fingerprints,
    #: msgpack results) within the largest limits a daemon can be configured with; the
    #: daemon checks keys and results against its store's own (docs/daemon.md).
    limits = batches.Limits(max_key_bytes=64 << 10, max_result_bytes=16 << 20)
    #: The client sends keys; the daemon makes their digests.
    hashes_keys = False

    def _open(self) -> None:
        """Sets up the client's own connection state (no connection is made yet)."""

    def _claim_sender(self, batch: batches.ClaimBatch) -> tuple[list[Any], Callable[[int], bytes]]:
        """The keys as sent, and what frames the CLAIM_MANY of ``batch`` for a request
        id: natively for a plain batch (no lease, owner or fingerprints, every key
        exactly bytes or str: ``_core.claim_frame``, no object per key), else from
        :meth:`_claim_request`'s args."""
        if batch.plain and _keys_only(batch):
            keys, namespace = batch.keys, batch.namespace

            def frame(request_id: int) -> bytes:
                data = _core.claim_frame(request_id, namespace, keys)
                assert data is not None  # every key is bytes or str (batch.plain)
                return self._checked(data)

            return keys, frame
        keys, args = self._claim_request(batch)
        return keys, functools.partial(self._frame, op=Op.CLAIM_MANY, args=args)

    @staticmethod
    def _claim_request(batch: batches.ClaimBatch) -> tuple[list[Any], dict[str, Any]]:
        """The keys as sent, and the args of the batch's CLAIM_MANY request."""
        keys = protocol.key_list(batch.keys)
        args = protocol.claim_args(
            batch.namespace, keys, batch.lease, batch.owner, batch.fingerprints
        )
        return keys, args

    @staticmethod
    def _change_request(batch: batches.ChangeBatch) -> tuple[Op, dict[str, Any]]:
        """The op and args of a checked COMPLETE_MANY or RELEASE_MANY."""
        if batch.completing:
            items = [[k, t, v] for k, t, v in batch.items()]
            return Op.COMPLETE_MANY, {"ns": batch.namespace, "items": items}
        items = [[k, t] for k, t in zip(batch.keys, batch.tokens, strict=True)]
        return Op.RELEASE_MANY, {"ns": batch.namespace, "items": items}

    @staticmethod
    def _extend_request(batch: batches.ExtendBatch) -> tuple[Op, dict[str, Any]]:
        """The op and args of a checked EXTEND_MANY."""
        items = [[k, t] for k, t in zip(batch.keys, batch.tokens, strict=True)]
        args: dict[str, Any] = {"ns": batch.namespace, "items": items}
        if batch.lease is not None:
            args["lease"] = batch.lease
        return Op.EXTEND_MANY, args

    #: A WAIT lasts at most this share of the client's ``timeout``: its answer comes
    #: well before the client gives up on the reply.
    WAIT_SHARE = 0.8

    def _wait_request(self, batch: batches.ClaimBatch, timeout: float) -> dict[str, Any] | None:
        """The args of a WAIT on ``batch``'s keys for ``timeout`` seconds at most; None when
        this daemon does not know WAIT (the client polls)."""
        if not self._waits:
            return None
        return {
            "ns": batch.namespace,
            "keys": protocol.key_list(batch.keys),
            "timeout": min(timeout, self.timeout * self.WAIT_SHARE),
        }

    def _waited(self, reply: Any) -> bool:
        """Whether a WAIT's answer ends the wait ("woken", "timeout"); False for "poll":
        the daemon does not wake this waiter, and the client asks again after a backoff."""
        return reply in (protocol.WOKEN, protocol.TIMED_OUT)

    def _wait_failed(self, exc: Exception) -> None:
        """A WAIT that failed: an unreachable daemon raises (the claim would too); any
        other error (a daemon that does not know WAIT, a request over a frame) is
        waited out with the default backoff."""
        if isinstance(exc, UnavailableError):
            raise exc
        if isinstance(exc, FrameError):
            self._waits = False

    def _parts(self, batch: Any, *, claims: bool) -> _Parts:
        """The frames a batch is sent in: at most half a frame of keys and results each,
        leaving room for the rest of the request and for the reply."""
        return _Parts(batch, self.max_frame // 2, claims=claims)

    def _request(self, op: Op, args: dict[str, Any]) -> tuple[int, bytes]:
        """A new request id and the request's frame; UnavailableError once the client is
        closed, ValueError for a request larger than a frame."""
        request_id = self._new_id()
        return request_id, self._frame(request_id, op, args)

    def _frame(self, request_id: int, op: Op, args: dict[str, Any]) -> bytes:
        """The request's frame under ``request_id``; ValueError when larger than a frame."""
        return self._checked(protocol.encode_request(request_id, op, args))

    def _new_id(self) -> int:
        """The next request id; UnavailableError once the client is closed."""
        if self._closed:
            raise UnavailableError("the client is closed")
        return next(self._ids)

    def _checked(self, data: bytes) -> bytes:
        """A request frame, or ValueError when it is larger than a frame."""
        if len(data) - 4 > self.max_frame:
            raise ValueError(
                f"request of {len(data) - 4} bytes exceeds the frame limit of {self.max_frame}; "
                "send smaller batches"
            )
        return data

    def _one_key_request(self, op: Op, batch: Any) -> Callable[[int], bytes] | None:
        """What frames a one-key request for a request id (``_core.one_key_frame``:
        docs/daemon.md, "The client's round trip"); None when ``batch`` is not one
        (more keys, a claim with a lease, an owner or fingerprints, a key that is
        not exactly bytes or str), which goes the general way."""
        if len(batch.keys) != 1 or not batch.plain:
            return None
        key, namespace = batch.keys[0], batch.namespace
        token, packed = 0, None
        if op is Op.CLAIM_MANY:
            if not _keys_only(batch):
                return None
        else:
            token = batch.tokens[0]
            if op is Op.COMPLETE_MANY and batch.results:  # none: no result given
                packed = batch.results[0]

        def frame(request_id: int) -> bytes:
            data = _core.one_key_frame(request_id, op, namespace, key, token, packed)
            assert data is not None  # the key's type was checked above
            return self._checked(data)

        return frame


class Client(ClientBase, ClaimAPI):
    """A connection to ``dedupcore serve`` at ``path`` (see the module docstring);
    without a path, at :func:`default_socket` (``DEDUPCORE_SOCKET``, else the default).

    ``spin``: how long a call on one key checks for its reply without sleeping
    before it waits in ``poll()``, in seconds (up to 0.01). None
    (the default) adapts it per connection: twice the typical round trip, at
    most 250 µs, and no checking while round trips are longer (a durable
    daemon); 0 never checks. A reply that arrives while the caller checks needs
    no wake-up, which is most of a round trip's time on a virtual machine; the
    checking takes that long of a core (docs/daemon.md, "Polling for the
    reply"). The other keyword arguments are :class:`ClientBase`'s.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        spin: float | None = None,
        **options: Any,
    ) -> None:
        self.spin = check_spin(spin)
        super().__init__(path, **options)

    def _open(self) -> None:
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"<dedupcore.Client {self.path!r}>"

    def close(self) -> None:
        """Closes this thread's connection; other threads' close when they end."""
        self._closed = True
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    # -- transport -------------------------------------------------------------

    def _connection(self) -> _Connection:
        conn: _Connection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.pid == os.getpid():
            return conn
        deadline = time.monotonic() + self.timeout
        attempt = 0  # refused connections so far
        waits = 0  # waits so far, of either kind
        while True:
            try:
                conn = _Connection(self.path, self.timeout, self.max_frame, self.spin)
                self._local.conn = conn
                return conn
            except BlockingIOError as exc:
                # The daemon's accept backlog is full: it is alive, so wait for
                # it up to the timeout rather than counting retries.
                delay = self.retry.delay(waits)
                if time.monotonic() + delay > deadline:
                    raise UnavailableError(
                        f"dedupcore daemon at {self.path} accepted no connection within "
                        f"{self.timeout} s ({exc})"
                    ) from exc
            except OSError as exc:
                # Refused, missing or not permitted: retry a few times, then give up.
                attempt += 1
                if attempt > self.retry.attempts:
                    raise UnavailableError(
                        f"dedupcore daemon at {self.path} is not reachable ({exc}); "
                        "is `dedupcore serve` running, and may this user open its socket?"
                    ) from exc
                delay = self.retry.delay(waits)
            time.sleep(delay)
            waits += 1

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def _call(self, op: Op, args: dict[str, Any]) -> Any:
        return self._send(op, *self._request(op, args))

    def _send(self, op: Op, request_id: int, data: bytes, *, quick: bool = False) -> Any:
        """Sends a request frame and returns its reply's payload, or raises the error the
        reply carries. With ``quick`` (a one-key request), the usual answer as
        ``_core.one_key_reply`` reads it natively when the reply is that: a tuple
        (outcome code, token) for a claim, True for a completion or release."""
        for attempt in range(2):
            conn = self._connection()
            try:
                body = conn.exchange_one(data) if quick else conn.exchange(data)
                if isinstance(body, int):
                    self._drop()
                    if attempt == 0:
                        continue  # not sent: a stale connection; send on a new one
                    raise UnavailableError(
                        f"cannot send to the daemon at {self.path}: {os.strerror(body)}"
                    )
                if quick:
                    answer = _core.one_key_reply(body, request_id)
                    if answer is not None:
                        return answer
                rid, status, payload = protocol.decode_response(body)
                while rid != request_id and rid != 0:  # a reply to an older request
                    rid, status, payload = conn.next_reply()
            except (OSError, protocol.FrameError) as exc:
                self._drop()
                if op in protocol.SAFE_TO_REPEAT and attempt == 0:
                    continue
                raise UnavailableError(
                    f"no reply from the daemon at {self.path} ({exc}); the request may or "
                    "may not have been applied"
                ) from exc
            if status is Status.ERROR:
                raise protocol.error_from_payload(payload)
            return payload
        raise AssertionError("unreachable")

    def _one_key(self, op: Op, frame: Callable[[int], bytes]) -> Any:
        """Sends a one-key request (:meth:`_one_key_request`) and returns its answer as
        :meth:`_send` gives it with ``quick``."""
        request_id = self._new_id()
        return self._send(op, request_id, frame(request_id), quick=True)

    # -- the store's methods -------------------------------------------------------

    def ping(self) -> bool:
        """True if the daemon answers."""
        return bool(self._call(Op.PING, {}) == "pong")

    def _claim_batch(self, batch: batches.ClaimBatch) -> list[Claim]:
        if len(batch.keys) == 1:  # one key: one frame, and its error is the batch's own
            frame = self._one_key_request(Op.CLAIM_MANY, batch)
            if frame is not None:
                key = batch.keys[0]
                answer = self._one_key(Op.CLAIM_MANY, frame)
                if type(answer) is tuple:
                    outcome = protocol.OUTCOME_ORDER[answer[0]]
                    return [Claim(key, batch.namespace, outcome, answer[1])]
                return protocol.claims_from_reply([key], batch.namespace, answer)
            keys, reply = self._claim_part(batch)
            return protocol.claims_from_reply(keys, batch.namespace, reply)
        parts = self._parts(batch, claims=True)
        while (part := parts.next()) is not None:
            try:
                keys, reply = self._claim_part(part)
            except Exception as exc:
                parts.failed(exc)
                continue
            parts.done(protocol.claims_from_reply(keys, part.namespace, reply))
        return parts.claims

    def _claim_part(self, batch: batches.ClaimBatch) -> tuple[list[Any], Any]:
        """Sends the CLAIM_MANY of a batch in one frame: the keys as sent, the reply."""
        keys, frame = self._claim_sender(batch)
        request_id = self._new_id()
        return keys, self._send(Op.CLAIM_MANY, request_id, frame(request_id))

    def _change_batch(self, batch: batches.ChangeBatch) -> None:
        op = Op.COMPLETE_MANY if batch.completing else Op.RELEASE_MANY
        frame = self._one_key_request(op, batch)
        if frame is not None:
            self._one_key(op, frame)
            return
        self._send_parts(batch, self._change_request)

    def _extend_batch(self, batch: batches.ExtendBatch) -> None:
        self._send_parts(batch, self._extend_request)

    def _send_parts(self, batch: Any, request: Callable[[Any], tuple[Op, dict[str, Any]]]) -> None:
        if len(batch.keys) == 1:  # one key: one frame, and its error is the batch's own
            self._call(*request(batch))
            return
        parts = self._parts(batch, claims=False)
        while (part := parts.next()) is not None:
            try:
                self._call(*request(part))
            except Exception as exc:
                parts.failed(exc)
                continue
            parts.done(None)

    def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        return protocol.record_from_map(self._call(Op.GET, {"ns": ns.decode(), "key": key}))

    def _wait_change(self, batch: batches.ClaimBatch, timeout: float, attempt: int) -> None:
        """Asks the daemon to answer when a key of ``batch`` may have changed (WAIT); on
        a poll hint or a failed WAIT, sleeps the default backoff."""
        args = self._wait_request(batch, timeout)
        if args is not None:
            try:
                if self._waited(self._call(Op.WAIT, args)):
                    return
            except Exception as exc:
                self._wait_failed(exc)
        super()._wait_change(batch, timeout, attempt)

    def stats(self) -> dict[str, Any]:
        """The daemon's store figures plus its own counters."""
        result: dict[str, Any] = self._call(Op.STATS, {})
        return result
