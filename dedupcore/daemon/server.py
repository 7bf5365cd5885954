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
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import msgpack

import dedupcore._platform as _platform
from dedupcore.api import ClaimAPI, check_fingerprints
from dedupcore.daemon import protocol
from dedupcore.daemon.admission import SMALL_FRAME, _Budget, connection_cap
from dedupcore.daemon.commit import INLINE_COMMIT_BYTES, _Committer, _Decided
from dedupcore.daemon.connection import (
    _DRAIN_QUIET,
    _STATUS_OK,
    _Connection,
    _header_of,
    _Pending,
)
from dedupcore.daemon.dispatch import (
    _CLAIMS,
    _COMPLETES,
    _DEFERRED_OPS,
    _INLINE_OPS,
    _REPLY_FIXED,
    _ROW_FIXED,
    SLICE_ABOVE,
    SLICE_KEYS,
    SMALL_FIRST_SECONDS,
    _arg,
    _claim_options,
    _Gate,
    _max_result_bytes,
)
from dedupcore.daemon.protocol import FrameError, Op
from dedupcore.daemon.socketpath import (
    _PEERCRED,
    MAX_SOCKET_PATH,
    check_socket_path,
    inherited_socket,
    peer_admitted,
    peer_groups,
)
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

T = TypeVar("T")

log = logging.getLogger("dedupcore.daemon")


async def _within(aw: Awaitable[T], seconds: float) -> T:
    """Awaits with a deadline; ``asyncio.timeout`` where available (no extra task)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)  # pragma: no cover


#: Exit status of ``dedupcore serve`` when the store failed and must be reopened.
EXIT_STORE_FAILED = 3


#: Seconds a thread may hold the GIL while another waits for it, in a serving process.
SWITCH_INTERVAL = 0.0005


class DaemonServer:
    """Serves one store (embedded, stacked or sharded) on a Unix socket (see the module doc).

    Limits (the ``dedupcore serve`` setting of the same name in brackets):
    ``max_connections`` (1024, capped by the open-file limit less
    ``fd_reserve``, 256), ``max_frame`` (16 MiB), ``request_timeout`` (30 s),
    ``idle_timeout`` (600 s), ``write_timeout`` (10 s), ``max_in_flight``
    per connection (64), ``max_unsent`` reply bytes per connection (1 MiB),
    ``max_buffered`` request bytes across connections (256 MiB, at least
    ``max_frame``), ``drain_timeout`` after SIGTERM (30 s).
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
        self._budget = _Budget(self.max_buffered)
        self._gate = _Gate()
        self._max_result = _max_result_bytes(store, max_frame)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dedupcore-io")
        # The embedded store decides claims, completions and releases on the event loop
        # (native, the GIL released) and only the wait for the log goes to a thread.
        self._fast = bool(
            getattr(store, "defers_durability", False) and getattr(store, "bounds_replies", False)
        )
        self._committer: _Committer | None = None
        # Commits without fdatasync (a write to the OS) may run on the loop for each
        # request as it is read: the request path without a task (_decide_now).
        config = getattr(store, "config", None)
        self._cheap_commits = self._fast and (
            getattr(config, "durability", "durable") == "power-loss-unsafe"
        )
        self._slice_turn = asyncio.Lock()  # one large batch's slice per pass of the loop
        # Small requests read and not yet answered: a large batch's next slice waits
        # (up to SMALL_FIRST_SECONDS) until there are none.
        self._small = 0
        self._deciding = 0  # requests being decided by _decide_now (not tasks)
        self._no_small = asyncio.Event()
        self._no_small.set()
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[_Connection] = set()
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
        }
        self._commit_seconds = 0.0
        self._packer = msgpack.Packer(use_bin_type=True)  # replies, on the event loop only

    # -- life cycle ------------------------------------------------------------

    async def start(self) -> None:
        """Binds the socket (or takes the one passed in) and starts accepting connections."""
        if self.sock is None:
            path = check_socket_path(self.socket_path, group=self.group)
        else:  # its owner (systemd) made the file and its permissions
            path = Path(os.fsdecode(self.sock.getsockname()))
        if self._fast and self._committer is None:
            self._committer = _Committer(
                self.store,
                asyncio.get_running_loop(),
                lambda n: self._in_flight + self._deciding > n,
            )
        self.max_connections = connection_cap(self.max_connections, self.fd_reserve)
        loop = asyncio.get_running_loop()

        def connection() -> _Connection:
            return _Connection(self, loop)

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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        quiet_since = loop.time()
        while self._connections and loop.time() < deadline:
            busy = self._in_flight or not all(c.idle for c in self._connections)
            if busy:
                quiet_since = loop.time()
            elif loop.time() - quiet_since >= _DRAIN_QUIET:
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
        if self._committer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._committer.close)
        self._pool.shutdown(wait=True)

    # -- connections -----------------------------------------------------------

    def _peer_allowed(self, transport: asyncio.BaseTransport) -> tuple[bool, str]:
        sock = transport.get_extra_info("socket")
        if sock is None:
            return False, "no socket"
        raw = sock.getsockopt(socket.SOL_SOCKET, self._peercred, _PEERCRED.size)
        pid, uid, gid = _PEERCRED.unpack(raw)
        who = f"pid {pid} uid {uid} gid {gid}"
        if uid in self.allowed_uids or gid in self.allowed_gids:
            return True, who
        if not self.allowed_gids:
            return False, who
        groups = peer_groups(sock, uid, gid)
        return peer_admitted(uid, gid, groups, self.allowed_uids, self.allowed_gids), (
            f"{who} groups {sorted(groups)}"
        )

    async def _handle(
        self,
        body: bytes,
        reserved: int,
        conn: _Connection,
        small: bool = False,
        request: protocol.Request | None = None,
    ) -> None:
        request_id = 0
        try:
            try:
                if request is None:  # not decoded by the connection's reader
                    request = protocol.decode_request(body)
                request_id = request.request_id
                self.counters["requests"] += 1
                started = time.perf_counter()
                if request.op in _INLINE_OPS:
                    # Nothing to wait for: answer on the event loop, no thread hop.
                    result = self._dispatch(request.op, request.args)
                elif self._committer is not None and request.op in _DEFERRED_OPS:
                    result = await self._decide(request.op, request.args)
                else:
                    loop = asyncio.get_running_loop()
                    result = await _within(
                        loop.run_in_executor(self._pool, self._dispatch, request.op, request.args),
                        self.request_timeout,
                    )
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

    def _answered(self, conn: _Connection, reserved: int, small: bool) -> None:
        """Gives back what a request held until its reply was written: its frame's bytes,
        its place among the small requests, its connection's slot (the requests of a
        connection that does not read its replies stay bounded, and so do their bytes)."""
        self._in_flight -= 1
        self._budget.give(reserved)
        if small:
            self._small -= 1
            if not self._small:
                self._no_small.set()
        conn.answered()

    def _complete_later(
        self, decided: _Decided, reserved: int, conn: _Connection, small: bool
    ) -> None:
        """Answers a request decided by the connection's reader once its commit is done,
        from the commit's own callback (no task; docs/daemon.md, "The request path of
        the embedded store"); after ``request_timeout`` without the commit, with the
        timeout error a task would have given (the connection's timer checks that: no
        timer per request)."""
        deadline = conn.loop.time() + self.request_timeout
        entry = _Pending(conn, decided, reserved, small, deadline)
        conn.pending.append(entry)
        conn.arm_for(deadline)
        entry.durable.add_done_callback(entry.finish)

    def _reply(self, request_id: int, result: Any, started: float) -> bytes:
        """The reply frame of a request answered with ``result``."""
        self._commit_seconds += time.perf_counter() - started
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
        if isinstance(exc, TimeoutError):
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

    def _decide_now(self, request_id: int, op: Op, args: dict[str, Any]) -> bytes | _Decided | None:
        """A small request served without a task (docs/daemon.md, "The request path"):
        a ping, or a claim (of at most SLICE_ABOVE keys), completion or release that
        the embedded store decides here and now. Returns the reply when nothing is
        left to wait for (no log record, or the commit already done, as for a lone
        request whose commit without fdatasync the loop makes at once); the decided
        request when its commit is still to come (the caller answers it from the
        commit's callback); None for a request the task path serves from the start
        (other ops, other stores).

        A durable commit is never made as the request is decided: it waits for
        the end of this pass of the loop, when the requests other connections sent
        in the same pass have been read and decided too, and they share one
        ``fdatasync``."""
        if op is not Op.PING:
            if self._committer is None or op not in _DEFERRED_OPS:
                return None
            keys = args.get("keys")
            if op is Op.CLAIM_MANY and (not isinstance(keys, list) or len(keys) > SLICE_ABOVE):
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
                result, durable = self._decide_sync(op, args, gather=not self._cheap_commits)
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

    async def _durable(self, durable: asyncio.Future[None] | None) -> None:
        """Waits for a commit (request_timeout); raises what it raised."""
        if durable is None:
            return
        if not durable.done():
            await _within(durable, self.request_timeout)
        durable.result()

    async def _decide(self, op: Op, args: dict[str, Any]) -> Any:
        """Decides a claim, completion or release on the event loop, then waits (without
        blocking the loop) until the log is durable through every record the answer
        depends on: nothing is answered before that (docs/daemon.md)."""
        keys = args.get("keys")
        if op is Op.CLAIM_MANY and isinstance(keys, list) and len(keys) > SLICE_ABOVE:
            options = _claim_options(args)
            columns = bool(args.get(protocol.COLUMNS_ARG))
            result, lsn = await self._claim_sliced(keys, options, columns)
            await self._durable(self._commit(lsn))
            return result
        result, durable = self._decide_sync(op, args)
        await self._durable(durable)
        return result

    def _commit(self, lsn: int, gather: bool = False) -> asyncio.Future[None] | None:
        """The commit through ``lsn`` (None when there is nothing to commit)."""
        if not lsn:
            return None
        assert self._committer is not None
        return self._committer.wait(lsn, gather=gather)

    def _decide_sync(
        self, op: Op, args: dict[str, Any], gather: bool = False
    ) -> tuple[Any, asyncio.Future[None] | None]:
        """Decides a claim (of at most SLICE_ABOVE keys), completion or release now:
        (the answer, the commit it waits for, or None)."""
        store: Any = self.store
        if op is Op.CLAIM_MANY:
            ns, keys = args.get("ns"), args.get("keys")
            options: dict[str, Any]
            if (
                type(ns) is str
                and type(keys) is list
                and args.get("lease") is None
                and args.get("owner") is None
                and args.get("fps") is None
            ):
                # The plain claim (what the clients send for claim()): its arguments
                # need no checking.
                options = {"namespace": ns, "lease": None, "owner": None, "fingerprints": None}
            else:
                _arg(args, "ns", str)  # checked first, as for every op
                keys = _arg(args, "keys", list)
                options = _claim_options(args)
            if args.get(protocol.COLUMNS_ARG):
                part, lsn = store.claim_columns_deferred(
                    keys,
                    **options,
                    reply_limit=self.max_frame - _REPLY_FIXED,
                    row_bytes=_ROW_FIXED + 8,
                )
                return protocol.columns_payload(part), self._commit(lsn, gather)
            claims, lsn = store.claim_many_deferred(
                keys,
                **options,
                reply_limit=self.max_frame - _REPLY_FIXED,
                row_bytes=_ROW_FIXED + 8,
            )
            return [protocol.claim_row(c) for c in claims], self._commit(lsn, gather)
        ns = _arg(args, "ns", str)
        if op is Op.COMPLETE_MANY:
            lsn = store.complete_many_deferred(_arg(args, "items", list), namespace=ns)
        else:
            lsn = store.release_many_deferred(_arg(args, "items", list), namespace=ns)
        return None, self._commit(lsn, gather)

    async def _claim_sliced(
        self, keys: list[Any], options: dict[str, Any], columns: bool
    ) -> tuple[Any, int]:
        """A large claim batch in slices of SLICE_KEYS keys, yielding to the loop between
        two slices so that other connections are served meanwhile.

        Every slice is first checked (decided, nothing applied): a bad key, a fingerprint
        conflict or an answer over the frame limit refuses the whole batch before any of
        it is claimed. Then the slices are claimed in order; a key repeated across slices
        is IN_PROGRESS in the later one, as within one batch. A conflict that other
        clients create between the check and the claim of a later slice can still refuse
        the batch after its earlier slices were claimed (they stay claimed, as after a
        lost reply)."""
        store: Any = self.store
        slices = [keys[i : i + SLICE_KEYS] for i in range(0, len(keys), SLICE_KEYS)]
        fps = options.pop("fingerprints")
        if fps is None:
            fp_slices: list[Any] = [None] * len(slices)
        else:
            check_fingerprints(fps, len(keys))
            fp_slices = [fps[i : i + SLICE_KEYS] for i in range(0, len(fps), SLICE_KEYS)]
        rows_bytes = _REPLY_FIXED + (_ROW_FIXED + 8) * len(keys)
        if rows_bytes > self.max_frame:
            raise BatchTooLargeError(
                f"the answer to a claim of {len(keys)} keys would pass {self.max_frame} bytes "
                "(the frame limit); nothing was claimed: split the batch"
            )
        self.counters["sliced_batches"] += 1
        budget = self.max_frame - rows_bytes
        held: list[int] = []  # bytes of stored results each slice's answer carries
        for part, part_fps in zip(slices, fp_slices, strict=True):
            async with self._turn():
                held.append(
                    store.check_claim_many(
                        part, **options, fingerprints=part_fps, reply_limit=budget - sum(held)
                    )
                )
        rows: list[list[Any]] = []
        cols = protocol.ClaimColumns()
        lsn = 0
        for i, (part, part_fps) in enumerate(zip(slices, fp_slices, strict=True)):
            # Later slices keep the room the checked answers of the others need.
            room = budget - sum(held[:i]) - sum(held[i + 1 :])
            async with self._turn():
                if columns:
                    answers, part_lsn = store.claim_columns_deferred(
                        part, **options, fingerprints=part_fps, reply_limit=room
                    )
                    cols.add_columns(answers)
                else:
                    claims, part_lsn = store.claim_many_deferred(
                        part, **options, fingerprints=part_fps, reply_limit=room
                    )
                    rows.extend(protocol.claim_row(c) for c in claims)
                self.counters["batch_slices"] += 1
                lsn = max(lsn, part_lsn)
        return (cols.payload() if columns else rows), lsn

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """One slice of one large batch: the batches in flight take turns (the lock
        wakes its waiters in order, one per pass of the loop), every other request
        that became ready meanwhile is served before the next slice, and a small
        request read meanwhile is answered first (up to SMALL_FIRST_SECONDS): its
        decision, its commit and its reply then wait for no slice."""
        async with self._slice_turn:
            if not self._no_small.is_set():
                self.counters["slices_held_for_small"] += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._no_small.wait(), SMALL_FIRST_SECONDS)
            yield
            await asyncio.sleep(0)

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

    def _dispatch(self, op: Op, args: dict[str, Any]) -> Any:
        if op is Op.PING:
            return "pong"
        if op is Op.STATS:
            stats = self.store.stats()
            stats["durability"] = self.store.durability()
            stats["daemon"] = dict(
                self.counters,
                connections_open=len(self._connections),
                max_connections=self.max_connections,
                buffered_bytes=self._budget.used,
                buffer_waits=self._budget.waits,
                request_seconds=self._commit_seconds,
                commit_rounds=0 if self._committer is None else self._committer.rounds,
                inline_commit_rounds=(
                    0 if self._committer is None else self._committer.inline_rounds
                ),
            )
            return stats
        ns = _arg(args, "ns", str)
        if op is Op.CLAIM_MANY:
            keys = _arg(args, "keys", list)
            options = _claim_options(args)
            fixed = _REPLY_FIXED + _ROW_FIXED * len(keys)
            if getattr(self.store, "bounds_replies", False):
                # The embedded store sizes the answer after deciding and before
                # applying anything: no read-ahead, no gate.
                bounded: Any = self.store
                claims = bounded.claim_many(
                    keys,
                    **options,
                    reply_limit=self.max_frame - _REPLY_FIXED,
                    row_bytes=_ROW_FIXED + 8,
                )
            elif fixed + len(keys) * (self._max_result + 8) <= self.max_frame:
                claims = self.store.claim_many(keys, **options)
            else:
                # The reply could exceed a frame if enough keys are duplicates with
                # large results: count the results they hold now, with completions
                # held off until the claim is done, and refuse before applying.
                with self._gate.side(_CLAIMS):
                    self._check_reply_bound(keys, ns, fixed)
                    claims = self.store.claim_many(keys, **options)
            if args.get(protocol.COLUMNS_ARG):
                return protocol.claim_columns(claims)
            return [protocol.claim_row(c) for c in claims]
        if op is Op.COMPLETE_MANY:
            items = _arg(args, "items", list)
            with self._gate.side(_COMPLETES):
                self.store.complete_many(items, namespace=ns)
            return None
        if op is Op.RELEASE_MANY:
            self.store.release_many(_arg(args, "items", list), namespace=ns)
            return None
        if op is Op.GET:
            return protocol.record_map(
                self.store.get(_arg(args, "key", (bytes, str)), namespace=ns)
            )
        raise FrameError(f"op {op!r} is not served")

    def _check_reply_bound(self, keys: list[Any], ns: str, fixed: int) -> None:
        """BatchTooLargeError if the claim reply for ``keys`` could exceed a frame."""
        sizes: dict[Any, int] = {}
        total = fixed
        for key in keys:
            size = sizes.get(key)
            if size is None:
                try:
                    record = self.store.get(key, namespace=ns)
                except (TypeError, ValueError):
                    record = None  # a bad key: claim_many names it
                size = 0
                if record is not None and record.result is not None:
                    size = 8 + protocol.packed_len(record.result)
                sizes[key] = size
            total += size
            if total > self.max_frame:
                raise BatchTooLargeError(
                    f"a claim of these {len(keys)} keys could be answered with more than "
                    f"{self.max_frame} bytes (the frame limit), counting the stored results "
                    "of the keys already done; nothing was claimed: split the batch"
                )


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
