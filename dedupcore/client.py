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

import itertools
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from dedupcore.api import (
    ChangeBatch,
    Claim,
    ClaimAPI,
    ClaimBatch,
    ExtendBatch,
    KeyRecord,
    Limits,
)
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import Op, Status
from dedupcore.errors import UnavailableError
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
    def __init__(self, path: str, timeout: float, max_frame: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.max_frame = max_frame
        self.pid = os.getpid()
        try:
            self.sock.connect(path)
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def _read_exact(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self.sock.recv(min(n, 1 << 20))
            if not chunk:
                raise ConnectionResetError("the daemon closed the connection")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def read_response(self) -> tuple[int, Status, Any]:
        length = protocol.frame_length(self._read_exact(4), self.max_frame)
        return protocol.decode_response(self._read_exact(length))


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
        self._open()

    #: The client checks what every store checks (types, tokens, owners, fingerprints,
    #: msgpack results) within the largest limits a daemon can be configured with; the
    #: daemon checks keys and results against its store's own (docs/daemon.md).
    limits = Limits(max_key_bytes=64 << 10, max_result_bytes=16 << 20)

    def _open(self) -> None:
        """Sets up the client's own connection state (no connection is made yet)."""

    @staticmethod
    def _claim_request(batch: ClaimBatch) -> tuple[list[Any], dict[str, Any]]:
        """The keys as sent, and the args of the batch's CLAIM_MANY request."""
        keys = protocol.key_list(batch.keys)
        args = protocol.claim_args(
            batch.namespace, keys, batch.lease, batch.owner, batch.fingerprints
        )
        return keys, args

    @staticmethod
    def _change_request(batch: ChangeBatch) -> tuple[Op, dict[str, Any]]:
        """The op and args of a checked COMPLETE_MANY or RELEASE_MANY."""
        if batch.completing:
            items = [[k, t, v] for k, t, v in batch.items()]
            return Op.COMPLETE_MANY, {"ns": batch.namespace, "items": items}
        items = [[k, t] for k, t in zip(batch.keys, batch.tokens, strict=True)]
        return Op.RELEASE_MANY, {"ns": batch.namespace, "items": items}

    @staticmethod
    def _extend_request(batch: ExtendBatch) -> dict[str, Any]:
        """The args of a checked EXTEND_MANY."""
        items = [[k, t] for k, t in zip(batch.keys, batch.tokens, strict=True)]
        args: dict[str, Any] = {"ns": batch.namespace, "items": items}
        if batch.lease is not None:
            args["lease"] = batch.lease
        return args

    def _request(self, op: Op, args: dict[str, Any]) -> tuple[int, bytes]:
        """A new request id and the request's frame; UnavailableError once the client is
        closed, ValueError for a request larger than a frame."""
        if self._closed:
            raise UnavailableError("the client is closed")
        request_id = next(self._ids)
        data = protocol.encode_request(request_id, op, args)
        if len(data) - 4 > self.max_frame:
            raise ValueError(
                f"request of {len(data) - 4} bytes exceeds the frame limit of {self.max_frame}; "
                "send smaller batches"
            )
        return request_id, data


class Client(ClientBase, ClaimAPI):
    """A connection to ``dedupcore serve`` at ``path`` (see the module docstring);
    without a path, at :func:`default_socket` (``DEDUPCORE_SOCKET``, else the default)."""

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
                conn = _Connection(self.path, self.timeout, self.max_frame)
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
        request_id, data = self._request(op, args)
        for attempt in range(2):
            conn = self._connection()
            try:
                conn.sock.sendall(data)
            except OSError as exc:
                self._drop()
                if attempt == 0:
                    continue  # not sent: a stale connection; send on a new one
                raise UnavailableError(f"cannot send to the daemon at {self.path}: {exc}") from exc
            try:
                while True:
                    rid, status, payload = conn.read_response()
                    if rid == request_id or rid == 0:
                        break
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

    # -- the store's methods -------------------------------------------------------

    def ping(self) -> bool:
        """True if the daemon answers."""
        return bool(self._call(Op.PING, {}) == "pong")

    def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        keys, args = self._claim_request(batch)
        return protocol.claims_from_reply(keys, batch.namespace, self._call(Op.CLAIM_MANY, args))

    def _change_batch(self, batch: ChangeBatch) -> None:
        self._call(*self._change_request(batch))

    def _extend_batch(self, batch: ExtendBatch) -> None:
        self._call(Op.EXTEND_MANY, self._extend_request(batch))

    def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        return protocol.record_from_map(self._call(Op.GET, {"ns": ns.decode(), "key": key}))

    def stats(self) -> dict[str, Any]:
        """The daemon's store figures plus its own counters."""
        result: dict[str, Any] = self._call(Op.STATS, {})
        return result
