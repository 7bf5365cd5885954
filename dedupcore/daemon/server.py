"""``dedupcore serve``: one process owns a data directory and serves it on a Unix socket.

Many consumer processes on a host share one store through this daemon. Each
connection is a protocol on the event loop whose data callback parses its frames
and answers small requests of the embedded store there and then. With the embedded store, claims,
completions and releases are decided on the loop itself (native work) and
only the wait for the log goes to one commit thread, which makes every
request waiting at that moment durable with one group commit; large claim
batches are decided in slices so other connections are served in between
(docs/daemon.md). Other requests, and every request of other stores, run
the store call in a small thread pool, so the batches of all connections
reach the log concurrently and share its group commits. Either way a reply
is sent only after the commit its answer depends on is durable.

Defences, so that one bad or slow client cannot hurt the others:

- the socket lives in a directory created 0700 (0750 with ``group``), the
  socket file is 0600 (0660); a path that is a symlink, belongs to another
  user or is longer than the platform limit is refused;
- the socket's ancestors must not let another user replace its directory:
  each belongs to root or to this user and is not writable by others unless
  sticky (like ``/tmp``), and no symlink on the way belongs to another user;
- peer credentials (``SO_PEERCRED``) are checked against allowed uids/gids
  (default: the daemon's own uid); with allowed gids, a peer's supplementary
  groups (``SO_PEERGROUPS``, else the user database) count as well;
- a frame larger than ``max_frame`` closes the connection; garbage inside a
  well-framed message gets an error reply and the connection stays usable;
- a request must arrive completely within ``request_timeout`` once started
  (slow senders are cut off), idle connections are closed after
  ``idle_timeout``, and at most ``max_connections`` are served at once;
- ``max_connections`` is kept below the open-file limit: at start the soft
  ``RLIMIT_NOFILE`` is raised to the hard one where allowed, and connections
  are capped at that limit minus the descriptors already open minus
  ``fd_reserve`` (256) kept for the store's log segments, LMDB and archives;
- a ``CLAIM_MANY`` whose reply could exceed ``max_frame`` is refused with
  :class:`~dedupcore.errors.BatchTooLargeError` before anything of it is
  applied (split the batch); the bound counts a fixed size per key plus, for
  keys that may be duplicates, the results they hold;
- each connection has at most ``max_in_flight`` (64) requests between read
  and reply written, and the daemon stops reading a connection while more
  than ``max_unsent`` (1 MiB) of its replies are waiting to be sent
  (backpressure on a client that pipelines without reading);
- every reply must be taken by the peer within ``write_timeout`` (10 s); a
  peer that does not read is disconnected, so neither it nor a shutdown
  waits on it longer;
- the bodies of frames being read and of requests not yet answered share a
  budget of ``max_buffered`` (256 MiB) across all connections; a connection
  whose next frame does not fit waits (within ``request_timeout``) until
  other requests are answered;
- a store that stopped after a failed log write cannot recover in place:
  the daemon answers the requests it has, then exits with
  :data:`EXIT_STORE_FAILED` so a supervisor restarts it (reopening the store
  recovers the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack

import dedupcore._platform as _platform
from dedupcore._spin import check_spin
from dedupcore.api import ClaimAPI
from dedupcore.daemon import protocol
from dedupcore.daemon.admission import SMALL_FRAME, Budget, SmallRequests, connection_cap
from dedupcore.daemon.admission import within as _within
from dedupcore.daemon.awake import Awake
from dedupcore.daemon.commit import INLINE_COMMIT_BYTES, Decided
from dedupcore.daemon.connection import DRAIN_QUIET, Connection
from dedupcore.daemon.dispatch import (
    CHANGE_OPS,
    INLINE_OPS,
    SLICE_ABOVE,
    SLICE_KEYS,
    SMALL_FIRST_SECONDS,
    Dispatcher,
)
from dedupcore.daemon.protocol import FrameError, Op, Status
from dedupcore.daemon.socketpath import (
    MAX_SOCKET_PATH,
    check_peer,
    check_socket_path,
    inherited_socket,
    peer_admitted,
    peer_groups,
)
from dedupcore.daemon.waiters import Waiters
from dedupcore.errors import (
    BatchTooLargeError,
    SocketPathError,
    UnavailableError,
    WalFailedError,
)
from dedupcore.tiers.base import failure_of

__all__ = [
    "EXIT_STORE_FAILED",
    "INLINE_COMMIT_BYTES",
    "MAX_SOCKET_PATH",
    "SLICE_ABOVE",
    "SLICE_KEYS",
    "SMALL_FIRST_SECONDS",
    "SMALL_FRAME",
    "SWITCH_INTERVAL",
    "DaemonServer",
    "SocketPathError",
    "check_socket_path",
    "connection_cap",
    "inherited_socket",
    "peer_admitted",
    "peer_groups",
    "serve",
]

log = logging.getLogger("dedupcore.daemon")

#: Exit status of ``dedupcore serve`` when the store failed and must be reopened.
EXIT_STORE_FAILED = 3
#: Seconds a thread may hold the GIL while another waits for it, in a serving process.
SWITCH_INTERVAL = 0.0005
_header_of = protocol.HEADER.pack
_STATUS_OK = int(Status.OK)


class Pending:
    """A request decided by its connection's reader whose commit is still to come. It is
    answered from the commit's callback (:meth:`finish`), or with the timeout error
    once its connection's timer finds ``deadline`` passed."""

    __slots__ = (
        "conn",
        "deadline",
        "done",
        "durable",
        "request_id",
        "reserved",
        "result",
        "small",
        "started",
    )

    def __init__(
        self, conn: Connection, decided: Decided, reserved: int, small: bool, deadline: float
    ) -> None:
        self.conn = conn
        self.request_id, self.result, self.durable, self.started = decided
        self.reserved = reserved
        self.small = small
        self.deadline = deadline
        self.done = False

    def finish(self, _: object = None) -> None:
        if self.done:  # the commit after its timeout, or the timeout after the commit
            return
        self.done = True
        conn = self.conn
        server = conn.server
        durable = self.durable
        if not durable.cancelled():  # cancelled: the loop is closing, nobody is answered
            if not durable.done():
                reply = server._error_reply(self.request_id, asyncio.TimeoutError())
            else:
                try:
                    durable.result()  # raises what the commit raised
                    reply = server._reply(self.request_id, self.result, self.started)
                    server.counters["completed_by_commit"] += 1
                except Exception as exc:
                    reply = server._error_reply(self.request_id, exc)
            conn.write(reply)
        self.result = None
        pending = conn.pending
        while pending and pending[0].done:
            pending.popleft()
        server._answered(conn, self.reserved, self.small)


class DaemonServer:
    """Serves one store (embedded, stacked or sharded) on a Unix socket (see the module doc).

    Limits (the ``dedupcore serve`` setting of the same name in brackets):
    ``max_connections`` (1024, capped by the open-file limit less
    ``fd_reserve``, 256), ``max_frame`` (16 MiB), ``request_timeout`` (30 s),
    ``idle_timeout`` (600 s), ``write_timeout`` (10 s), ``max_in_flight``
    per connection (64), ``max_unsent`` reply bytes per connection (1 MiB),
    ``max_buffered`` request bytes across connections (256 MiB, at least
    ``max_frame``), ``drain_timeout`` after SIGTERM (30 s), ``max_waiters``
    WAIT requests waiting at once (4096). ``poll_after_reply``: how long the
    event loop polls for the next request without sleeping after it writes a
    reply, in seconds (None, the default: adaptive; 0: never; :mod:`.awake`).
    """

    def __init__(
        self,
        store: ClaimAPI,
        socket_path: str | os.PathLike[str],
        *,
        group: str | None = None,
        allowed_uids: set[int] | None = None,
        allowed_gids: set[int] | None = None,
        max_connections: int = 1024,
        max_frame: int = protocol.DEFAULT_MAX_FRAME,
        request_timeout: float = 30.0,
        idle_timeout: float = 600.0,
        max_in_flight: int = 64,
        workers: int = 4,
        write_timeout: float = 10.0,
        max_unsent: int = 1 << 20,
        max_buffered: int = 256 << 20,
        fd_reserve: int = 256,
        drain_timeout: float = 30.0,
        max_waiters: int = 4096,
        poll_after_reply: float | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        if sock is not None and not isinstance(sock, socket.socket):
            raise TypeError(f"sock must be a listening socket.socket, not {type(sock).__name__}")
        # Who connects is checked with SO_PEERCRED: a clear error off Linux, before listening.
        self._peercred = _platform.peer_credentials_option()
        self.store = store
        self.socket_path = Path(socket_path)
        #: A listening socket passed in (socket activation): served as it is, never unlinked.
        self.sock = sock
        self.group = group
        self.allowed_uids = {os.geteuid()} if allowed_uids is None else set(allowed_uids)
        self.allowed_gids = set(allowed_gids or ())
        if group is not None:
            self.allowed_gids.add(grp.getgrnam(group).gr_gid)
        self.max_connections = max_connections
        self.max_frame = max_frame
        self.request_timeout = request_timeout
        self.idle_timeout = idle_timeout
        self.max_in_flight = max_in_flight
        self.write_timeout = write_timeout
        self.max_unsent = max_unsent
        self.max_buffered = max(max_buffered, max_frame)
        self.fd_reserve = fd_reserve
        self.drain_timeout = drain_timeout
        #: Exit status for ``dedupcore serve``: EXIT_STORE_FAILED once the store failed.
        self.exit_code = 0
        self._budget = Budget(self.max_buffered)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dedupcore-io")
        # Small requests read and not yet answered: a large batch's next slice waits
        # (up to SMALL_FIRST_SECONDS) until there are none.
        self.small = SmallRequests()
        self._deciding = 0  # requests being decided by decide_now (not tasks)
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[Connection] = set()
        # Requests in flight (started and not answered, of every connection): their
        # tasks, and those answered by their commit's callback.
        self._in_flight = 0
        self._stopping = asyncio.Event()
        self.counters = {
            "connections": 0,
            "refused_connections": 0,
            "requests": 0,
            "errors": 0,
            "protocol_errors": 0,
            "refused_batches": 0,
            "paused_reads": 0,
            "write_timeouts": 0,
            "sliced_batches": 0,
            "batch_slices": 0,
            "slices_held_for_small": 0,
            "answered_at_once": 0,  # by the connection's reader, without a task
            "completed_by_commit": 0,  # decided by the reader, answered by its commit
            "polled_requests": 0,  # arrived while the loop polled after a reply (Awake)
            "batches_read_in_slices": 0,  # large batches decoded a slice at a time
        }
        #: The loop kept polling after replies (``poll_after_reply``: None adapts).
        self.awake = Awake(check_spin(poll_after_reply, "poll_after_reply"), self.counters)
        self._commit_seconds = 0.0
        self._packer = msgpack.Packer(use_bin_type=True)  # replies, on the event loop only
        self.dispatch = Dispatcher(
            store,
            max_frame=max_frame,
            request_timeout=request_timeout,
            counters=self.counters,
            small=self.small,
        )
        #: WAIT requests: at most ``max_waiters`` wait at once, half a connection's
        #: ``max_in_flight`` of one connection (docs/daemon.md, "Waiting on keys").
        self.waiters = Waiters(
            store,
            max_waiters=max_waiters,
            per_connection=max(1, max_in_flight // 2),
            counters=self.counters,
        )
        if self.waiters.wakes:
            self.dispatch.waiters = self.waiters
        # The embedded store decides claims, completions and releases on the event loop
        # (native, the GIL released) and only the wait for the log goes to a thread.
        self.decides_on_loop = self.dispatch.abilities.decides_on_loop
        # Commits without fdatasync (a write to the OS) may run on the loop for each
        # request as it is read: the request path without a task (decide_now).
        self._cheap_commits = self.decides_on_loop and self.dispatch.abilities.unsynced_commits

    # -- life cycle ------------------------------------------------------------

    async def start(self) -> None:
        """Binds the socket (or takes the one passed in) and starts accepting connections."""
        if self.sock is None:
            path = check_socket_path(self.socket_path, group=self.group)
        else:  # its owner (systemd) made the file and its permissions
            path = Path(os.fsdecode(self.sock.getsockname()))
        loop = asyncio.get_running_loop()
        self.dispatch.start(loop, lambda n: self._in_flight + self._deciding > n)
        self.awake.loop = loop
        self.max_connections = connection_cap(self.max_connections, self.fd_reserve)

        def connection() -> Connection:
            return Connection(self, loop, self._budget)

        if self.sock is not None:
            self._server = await loop.create_unix_server(connection, sock=self.sock)
        else:
            old_umask = os.umask(0o177 if self.group is None else 0o117)
            try:
                self._server = await loop.create_unix_server(connection, path=str(path))
            finally:
                os.umask(old_umask)
            if self.group is not None:
                os.chown(path, -1, grp.getgrnam(self.group).gr_gid)
                os.chmod(path, 0o660)
            else:
                os.chmod(path, 0o600)
        log.info(
            "dedupcore serving %r on %s (at most %d connections)",
            self.store,
            path,
            self.max_connections,
        )

    async def serve_forever(self) -> None:
        """Serves until SIGTERM/SIGINT or :meth:`stop`, then drains and closes."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)
        if self._server is None:
            await self.start()
        await self._stopping.wait()
        await self.close(self.drain_timeout)

    def stop(self) -> None:
        """Asks the server to drain and close."""
        self._stopping.set()

    @property
    def listening(self) -> bool:
        """Whether :meth:`start` has bound the socket and listens on it: from then on
        a connection is accepted, where between the bind that makes the socket's file
        and the listen it would be refused. Safe to read from another thread."""
        return self._server is not None

    @property
    def draining(self) -> bool:
        """Whether the server was asked to stop (it reads the requests already sent)."""
        return self._stopping.is_set()

    async def close(self, drain_timeout: float = 30.0) -> None:
        """Stops accepting, answers the requests already sent, closes connections and the socket.

        Connections are closed once every one of them has been idle (waiting
        for a request, none in flight) for a short quiet period, or after
        ``drain_timeout``. A peer that does not take its replies is
        disconnected after ``write_timeout`` and holds nothing up.
        """
        self._stopping.set()
        if self._server is not None:
            self._server.close()
        self.waiters.close()  # answered at once: waiters hold up no drain
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        quiet_since = loop.time()
        while self._connections and loop.time() < deadline:
            busy = self._in_flight or not all(c.idle for c in self._connections)
            if busy:
                quiet_since = loop.time()
            elif loop.time() - quiet_since >= DRAIN_QUIET:
                break
            await asyncio.sleep(0.02)
        # Each connection reads no more; it closes once its requests in flight are
        # answered (a peer that does not take them is cut off after write_timeout).
        closing = list(self._connections)
        for conn in closing:
            conn.shut()
        waits = [c.finished for c in closing if c.finished is not None]
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self.sock is None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        await asyncio.get_running_loop().run_in_executor(None, self.dispatch.close)
        self._pool.shutdown(wait=True)

    # -- connections -----------------------------------------------------------

    def admit(self, conn: Connection) -> bool:
        """Whether a new connection is served: its peer's credentials are allowed, fewer
        than ``max_connections`` are open and the server is not stopping. An admitted
        connection is served until it calls :meth:`forget`."""
        assert conn.transport is not None
        sock = conn.transport.get_extra_info("socket")
        if sock is None:
            allowed, who = False, "no socket"
        else:
            allowed, who = check_peer(sock, self._peercred, self.allowed_uids, self.allowed_gids)
        if not allowed or len(self._connections) >= self.max_connections or self.draining:
            self.counters["refused_connections"] += 1
            log.warning(
                "refused connection from %s (%s)",
                who,
                "credentials" if not allowed else "connection limit or shutdown",
            )
            return False
        self._connections.add(conn)
        self.counters["connections"] += 1
        return True

    def forget(self, conn: Connection) -> None:
        """A connection is closing: it no longer counts against ``max_connections``."""
        self._connections.discard(conn)

    def start_request(
        self,
        conn: Connection,
        body: bytes,
        length: int,
        small: bool,
        request: protocol.Request | None,
        decided: Decided | None,
    ) -> None:
        """Serves a request its connection read (and, on the fast path, decided): answered
        from its commit's callback when decided, else by a task (:meth:`_handle`)."""
        self._in_flight += 1
        if small:
            self.small.add()
        if decided is not None:  # its commit is to come, no task waits for it
            self._complete_later(decided, length, conn, small)
        else:
            task = conn.loop.create_task(self._handle(body, length, conn, small, request))
            conn.tasks.add(task)
            task.add_done_callback(conn.tasks.discard)

    async def _handle(
        self,
        body: bytes,
        reserved: int,
        conn: Connection,
        small: bool = False,
        request: protocol.Request | None = None,
    ) -> None:
        request_id = 0
        try:
            try:
                if request is None:  # not decoded by the connection's reader
                    request = self._decode(body)
                request_id = request.request_id
                self.counters["requests"] += 1
                started = time.perf_counter()
                if request.op in INLINE_OPS:
                    # Nothing to wait for: answer on the event loop, no thread hop.
                    result = self.dispatch.call(request.op, request.args)
                elif request.op is Op.WAIT:
                    if small:  # a waiter holds no large batch's slices back
                        small = False
                        self.small.done()
                    result = await self.waiters.wait(conn, request.args)
                elif self.dispatch.decides_now(request.op):
                    result = await self.dispatch.decide(request.op, request.args)
                else:
                    loop = asyncio.get_running_loop()
                    result = await _within(
                        loop.run_in_executor(self._pool, self._call, request.op, request.args),
                        self.request_timeout,
                    )
                    if request.op in CHANGE_OPS and self.waiters.count:
                        change = self.dispatch.change(request.op, request.args)
                        self.waiters.wake(change.digests)
                reply = self._reply(request_id, result, started)
            except Exception as exc:
                reply = self._error_reply(request_id, exc)
            del body
            # Past max_unsent the transport pauses writing: the connection reads no
            # request until the peer takes its replies, or disconnects it after
            # write_timeout.
            conn.write(reply)
        finally:
            self._answered(conn, reserved, small)

    def _decode(self, body: bytes) -> protocol.Request:
        """The request of a frame its reader did not decode. A claim, completion or
        release of more than a slice that the event loop decides, in the form the
        clients send, keeps its keys or items in the frame, each slice decoded as
        it is decided (docs/daemon.md, "Large batches in slices"). A batch of no
        more than a slice (large elements) is decoded whole without the scan."""
        if len(body) > SMALL_FRAME and self.decides_on_loop:
            request = protocol.batch_request(body, SLICE_KEYS, SLICE_ABOVE + 1)
            if (
                request is not None
                and self.dispatch.decides_now(request.op)
                and self.dispatch.sliced(request.op, request.args)
            ):
                self.counters["batches_read_in_slices"] += 1
                return request
        return protocol.decode_request(body)

    def _answered(self, conn: Connection, reserved: int, small: bool) -> None:
        """Gives back what a request held until its reply was written: its frame's bytes,
        its place among the small requests, its connection's slot (the requests of a
        connection that does not read its replies stay bounded, and so do their bytes)."""
        self._in_flight -= 1
        self._budget.give(reserved)
        if small:
            self.small.done()
        conn.answered()

    def _complete_later(
        self, decided: Decided, reserved: int, conn: Connection, small: bool
    ) -> None:
        """Answers a request decided by the connection's reader once its commit is done,
        from the commit's own callback (no task; docs/daemon.md, "The request path of
        the embedded store"); after ``request_timeout`` without the commit, with the
        timeout error a task would have given (the connection's timer checks that: no
        timer per request)."""
        deadline = conn.loop.time() + self.request_timeout
        entry = Pending(conn, decided, reserved, small, deadline)
        conn.pending.append(entry)
        conn.arm_for(deadline)
        entry.durable.add_done_callback(entry.finish)

    def _reply(self, request_id: int, result: Any, started: float) -> bytes:
        """The reply frame of a request answered with ``result``."""
        self._commit_seconds += time.perf_counter() - started
        if type(result) is protocol.OneClaim:  # a one-key claim's usual answer, natively
            return result.frame(request_id)
        # protocol.encode_response, byte for byte, with a packer kept (not one per reply).
        body: bytes = self._packer.pack([request_id, _STATUS_OK, result])
        if len(body) > self.max_frame:
            return protocol.encode_error(
                request_id, FrameError("reply exceeds the frame limit; use smaller batches")
            )
        return _header_of(len(body)) + body

    def _error_reply(self, request_id: int, exc: Exception) -> bytes:
        """The error reply of a request that raised ``exc`` (counted; a failed store
        makes the daemon stop for a restart)."""
        if isinstance(exc, FrameError):
            self.counters["protocol_errors"] += 1
            return protocol.encode_error(request_id, exc)
        self.counters["errors"] += 1
        if isinstance(exc, asyncio.TimeoutError):
            return protocol.encode_error(
                request_id,
                UnavailableError(f"request not finished within {self.request_timeout} s"),
            )
        if isinstance(exc, BatchTooLargeError):
            self.counters["refused_batches"] += 1
        if self._store_failed(exc):
            self._fail_stop(exc)
        return protocol.encode_error(request_id, exc)

    # -- the embedded store's fast path (on the event loop) ----------------------------

    def decide_now(
        self, request_id: int, op: Op, args: dict[str, Any] | protocol.OneKey
    ) -> bytes | Decided | None:
        """A small request served without a task (docs/daemon.md, "The request path"):
        a ping, or a claim (of at most SLICE_ABOVE keys), completion or release that
        the embedded store decides here and now. Returns the reply when nothing is
        left to wait for (no log record, or the commit already done: a commit without
        fdatasync the log made as the records were queued, or the loop makes at once
        for a lone request); the decided request when its commit is still to come
        (the caller answers it from the commit's callback); None for a request the
        task path serves from the start (other ops, other stores).

        A durable commit is never made as the request is decided: it waits for
        the end of this pass of the loop, when the requests other connections sent
        in the same pass have been read and decided too, and they share one
        ``fdatasync``."""
        if op is not Op.PING:
            dispatch = self.dispatch
            if (
                not dispatch.decides_now(op)
                or not dispatch.knows_namespace(op, args)
                or dispatch.sliced(op, args)  # a task's, decided in slices
            ):
                return None
        self.counters["requests"] += 1
        started = time.perf_counter()
        self._deciding += 1  # in flight for the committer's "others in flight" count
        try:
            if op is Op.PING:
                result: Any = "pong"
                durable = None
            else:
                # A durable commit waits for the end of this pass of the loop, so
                # that it gathers the requests other connections sent meanwhile.
                result, durable = self.dispatch.decide_sync(
                    op, args, gather=not self._cheap_commits
                )
            if durable is not None and not durable.done():
                return request_id, result, durable, started
            if durable is not None:
                durable.result()  # raises what the commit raised
            self.counters["answered_at_once"] += 1
            return self._reply(request_id, result, started)
        except Exception as exc:
            return self._error_reply(request_id, exc)
        finally:
            self._deciding -= 1

    # -- a failed store --------------------------------------------------------------

    def _store_failed(self, exc: BaseException) -> bool:
        """Whether ``exc`` (or the store's state) says the store stopped after a failed write."""
        seen: BaseException | None = exc
        for _ in range(8):
            if seen is None:
                break
            if isinstance(seen, WalFailedError):
                return True
            seen = seen.__cause__ or seen.__context__
        # The store's declared failure state: the embedded store's, and through the
        # stores that wrap others (stacks, shards, instrumented) theirs, at any depth.
        return failure_of(self.store) is not None

    def _fail_stop(self, exc: BaseException) -> None:
        if self.exit_code == 0:
            log.error(
                "the store failed (%s: %s); answering what is in flight, then exiting with %d "
                "so that a supervisor restarts the daemon and the store recovers its log",
                type(exc).__name__,
                exc,
                EXIT_STORE_FAILED,
            )
        self.exit_code = EXIT_STORE_FAILED
        self.stop()

    # -- operations (run in the thread pool) ----------------------------------------

    def _call(self, op: Op, args: dict[str, Any]) -> Any:
        """Runs a request the ordinary way, in the thread pool: STATS here (the store's
        stats with the daemon's counters), every other op by the dispatcher."""
        if op is Op.STATS:
            committer = self.dispatch.committer
            stats = self.store.stats()
            stats["durability"] = self.store.durability()
            stats["daemon"] = dict(
                self.counters,
                connections_open=len(self._connections),
                waiters=self.waiters.count,
                max_connections=self.max_connections,
                buffered_bytes=self._budget.used,
                buffer_waits=self._budget.waits,
                request_seconds=self._commit_seconds,
                commit_rounds=0 if committer is None else committer.rounds,
                inline_commit_rounds=0 if committer is None else committer.inline_rounds,
                native_commit_rounds=0 if committer is None else committer.native_rounds,
            )
            return stats
        return self.dispatch.call(op, args)


def serve(store: ClaimAPI, socket_path: str | os.PathLike[str], **options: Any) -> int:
    """Runs a daemon in this process until SIGTERM/SIGINT (uvloop when installed).

    Returns the exit status: 0, or :data:`EXIT_STORE_FAILED` when it stopped
    because the store failed.
    """
    server = DaemonServer(store, socket_path, **options)
    # The event loop, the commit thread and the store's background checkpoints share
    # the GIL; a thread that wants it back waits up to the switch interval while
    # another runs Python code. The default 5 ms would be the floor of a claim's wait
    # behind a checkpoint (docs/daemon.md, "Latency under load").
    sys.setswitchinterval(SWITCH_INTERVAL)
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(server.serve_forever())
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise SocketPathError(f"another daemon is serving on {socket_path}") from exc
        raise
    return server.exit_code
