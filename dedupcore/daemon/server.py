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
import pwd
import signal
import socket
import stat
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

import msgpack

import dedupcore._platform as _platform
from dedupcore.api import ClaimAPI, check_fingerprints
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import FrameError, Op, Status
from dedupcore.errors import BatchTooLargeError, SocketPathError, UnavailableError
from dedupcore.tiers.base import failure_of
from dedupcore.wal import WalFailedError

__all__ = [
    "EXIT_STORE_FAILED",
    "DaemonServer",
    "SocketPathError",
    "check_socket_path",
    "inherited_socket",
]

T = TypeVar("T")

log = logging.getLogger("dedupcore.daemon")

#: Longest Unix socket path on Linux (sun_path is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107
_PEERCRED = struct.Struct("3i")
#: Ops answered on the event loop itself (they neither block nor touch the log).
_INLINE_OPS = frozenset({Op.PING})


async def _within(aw: Awaitable[T], seconds: float) -> T:
    """Awaits with a deadline; ``asyncio.timeout`` where available (no extra task)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)  # pragma: no cover


#: After SIGTERM, a connection that sends nothing for this long is closed.
_DRAIN_QUIET = 0.2


#: Exit status of ``dedupcore serve`` when the store failed and must be reopened.
EXIT_STORE_FAILED = 3
#: Size of a CLAIM_MANY reply around its rows: frame header, [id, status, list header].
_REPLY_FIXED = 32
#: Upper bound of one claim row without its result: [outcome, token, result, exact, takeover].
_ROW_FIXED = 32
#: A request frame of at most this many bytes is small (a claim of up to a few
#: thousand keys): it may pass larger ones waiting for the buffer budget, and
#: while one is being answered, large batches wait between two slices.
SMALL_FRAME = 64 << 10
#: A CLAIM_MANY of more keys than this is decided on the event loop in slices of
#: SLICE_KEYS keys, with other connections' requests served between two slices.
SLICE_ABOVE = 8192
#: How long a large batch's next slice waits for the small requests in flight
#: to be answered, at most: under a steady stream of them batches still progress.
SMALL_FIRST_SECONDS = 0.005
#: Keys of one slice: about a millisecond of deciding. One slice of all the large
#: batches in flight is decided per pass of the event loop (they take turns), so a
#: request of another connection waits behind at most one slice per pass.
SLICE_KEYS = 1024
#: Ops the embedded store decides on the event loop (then only the commit is waited for).
_DEFERRED_OPS = frozenset({Op.CLAIM_MANY, Op.COMPLETE_MANY, Op.RELEASE_MANY})
#: The first descriptor passed by systemd socket activation (SD_LISTEN_FDS_START).
_LISTEN_FDS_START = 3
#: Linux SO_PEERGROUPS (the peer's supplementary groups), missing from the socket module.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


def _resolve_checked(path: Path) -> Path:
    """``path`` with its symlinks resolved (as far as it exists), refusing any symlink met
    on the way, also inside a symlink's target, that belongs to another user than root
    or this user: that user could point it elsewhere at any time."""
    me = os.geteuid()
    current = Path(path.anchor)
    todo = list(path.parts[1:])
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        step = current / part
        try:
            st = os.lstat(step)
        except FileNotFoundError:
            return step.joinpath(*todo)  # the rest is created by this user
        if not stat.S_ISLNK(st.st_mode):
            current = step
            continue
        if st.st_uid not in (0, me):
            raise SocketPathError(
                f"{step} is a symlink of uid {st.st_uid}; that user could redirect the socket"
            )
        hops += 1
        if hops > 40:
            raise SocketPathError(f"too many symlinks on the way to {path}")
        target = Path(os.readlink(step))
        if target.is_absolute():
            current = Path(target.anchor)
            todo = list(target.parts[1:]) + todo
        else:
            todo = list(target.parts) + todo
    return current


def _check_ancestors(parent: Path) -> None:
    """Refuses a directory that another user could swap out from above.

    Every symlink met on the way to ``parent`` must belong to root or to this
    user, and every directory on the resolved path must belong to root or to
    this user and must not be writable by others unless it has the sticky bit
    (like ``/tmp``): otherwise someone else could rename an ancestor and put
    a directory of their own in its place.
    """
    me = os.geteuid()
    real = _resolve_checked(Path(parent).absolute())
    for directory in (*reversed(real.parents), real):
        try:
            st = os.stat(directory)
        except FileNotFoundError:
            return  # created below, by this user
        if st.st_uid not in (0, me):
            raise SocketPathError(
                f"{directory} (on the way to {parent}) belongs to uid {st.st_uid}; "
                "that user could replace the socket's directory"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise SocketPathError(
                f"{directory} (on the way to {parent}) is writable by others without the "
                f"sticky bit (mode {stat.S_IMODE(st.st_mode):o}); another user could replace "
                "the socket's directory"
            )


def check_socket_path(path: str | os.PathLike[str], *, group: str | None = None) -> Path:
    """Prepares the socket's directory and refuses unsafe or stale paths.

    Creates the directory (0700, or 0750 with ``group``); refuses a path that
    is too long, a symlink, owned by another user, under an ancestor another
    user could replace (see :func:`_check_ancestors`), or a live socket of
    another daemon; removes the stale socket file of a killed daemon.
    """
    p = Path(path)
    if len(os.fsencode(p)) > MAX_SOCKET_PATH:
        raise SocketPathError(
            f"socket path is {len(os.fsencode(p))} bytes; the limit is {MAX_SOCKET_PATH}"
        )
    parent = p.parent
    _check_ancestors(parent)
    if not parent.exists():
        parent.mkdir(mode=0o750 if group else 0o700, parents=True)
        if group is not None:
            # Members need to enter the directory to reach the socket.
            os.chown(parent, -1, grp.getgrnam(group).gr_gid)
            os.chmod(parent, 0o750)
    st = os.lstat(parent)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise SocketPathError(f"{parent} is not a directory (a symlink is refused)")
    if st.st_uid != os.geteuid():
        raise SocketPathError(f"{parent} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o022:
        raise SocketPathError(
            f"{parent} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): another user "
            "could replace the socket; use a directory only this user can write"
        )
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return p
    if stat.S_ISLNK(st.st_mode):
        raise SocketPathError(f"{p} is a symlink; refusing to use it")
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{p} exists and is not a socket")
    if st.st_uid != os.geteuid():
        raise SocketPathError(f"{p} belongs to uid {st.st_uid}, not to this user")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(p))
    except (ConnectionRefusedError, FileNotFoundError):
        log.warning("removing stale socket %s left by a daemon that is gone", p)
        p.unlink()
        return p
    except OSError as exc:
        raise SocketPathError(f"cannot tell whether {p} is in use: {exc}") from exc
    finally:
        probe.close()
    raise SocketPathError(f"another daemon is serving on {p}")


def inherited_socket() -> socket.socket | None:
    """The listening socket systemd passed by socket activation, or None.

    The sd_listen_fds protocol: when ``LISTEN_PID`` is this process and
    ``LISTEN_FDS`` >= 1, descriptor 3 is a listening socket (further ones are
    not used). The variables are removed once read, whoever they were meant
    for, so no child process takes the socket for its own. A descriptor 3 that
    is not a listening Unix stream socket raises :class:`SocketPathError`.
    """
    pid = os.environ.pop("LISTEN_PID", None)
    fds = os.environ.pop("LISTEN_FDS", None)
    os.environ.pop("LISTEN_FDNAMES", None)
    if pid is None or fds is None or not pid.isdigit() or not fds.isdigit():
        return None
    if int(pid) != os.getpid() or int(fds) < 1:
        return None
    try:
        sock = socket.socket(fileno=_LISTEN_FDS_START)
    except OSError as exc:
        raise SocketPathError(f"LISTEN_FDS: descriptor 3 is not a socket ({exc})") from None
    if (
        sock.family != socket.AF_UNIX
        or sock.type != socket.SOCK_STREAM
        or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    ):
        sock.detach()
        raise SocketPathError("LISTEN_FDS: descriptor 3 is not a listening Unix stream socket")
    os.set_inheritable(sock.fileno(), False)
    return sock


class _Gate:
    """Two kinds of callers, each sharing the gate with its own kind only.

    Claim batches whose reply size was bounded by reading their keys' results
    first hold one side; completions (which store results) hold the other,
    so no result can grow between the reading and the claim.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = [0, 0]
        self._waiting = [0, 0]

    @contextlib.contextmanager
    def side(self, side: int) -> Iterator[None]:
        other = 1 - side
        with self._cond:
            self._waiting[side] += 1
            # Wait while the other side is in, or while it waits and this side is
            # in (so a steady stream of one kind cannot starve the other).
            while self._active[other] or (self._waiting[other] and self._active[side]):
                self._cond.wait()
            self._waiting[side] -= 1
            self._active[side] += 1
        try:
            yield
        finally:
            with self._cond:
                self._active[side] -= 1
                self._cond.notify_all()


_CLAIMS, _COMPLETES = 0, 1


def _max_result_bytes(store: Any, ceiling: int) -> int:
    """The largest result ``store`` keeps, as far as it says (else ``ceiling``)."""
    for holder in (store, getattr(store, "config", None)):
        limit = getattr(holder, "max_result_bytes", None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return ceiling


def connection_cap(wanted: int, reserve: int) -> int:
    """``wanted`` connections, or fewer so that ``reserve`` descriptors stay free.

    Raises the soft ``RLIMIT_NOFILE`` to the hard limit where allowed, then
    leaves room for the descriptors already open and ``reserve`` more (the
    store's log segments, LMDB and archive files, the thread pool).
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft == resource.RLIM_INFINITY:
        return wanted
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    cap = max(1, soft - in_use - reserve)
    if cap < wanted:
        log.warning(
            "serving at most %d connections, not %d: the open-file limit is %d, %d descriptors "
            "are open and %d are kept for the store",
            cap,
            wanted,
            soft,
            in_use,
            reserve,
        )
        return cap
    return wanted


class _Budget:
    """Bytes of request frames held (being read or not yet answered), across connections."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.waits = 0  # reservations that had to wait
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def fits(self, n: int) -> bool:
        """Whether ``n`` bytes can be reserved at once, without waiting."""
        return self.used + n <= self.limit and (not self._waiters or n <= SMALL_FRAME)

    def wait(self, n: int, fut: asyncio.Future[None]) -> tuple[int, asyncio.Future[None]]:
        """Queues a reservation of ``n`` bytes that does not fit yet: ``fut`` is resolved,
        in order, once they are reserved. Returns the entry to :meth:`cancel` it by."""
        self.waits += 1
        entry = (n, fut)
        self._waiters.append(entry)
        return entry

    def cancel(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        """Gives up a reservation queued by :meth:`wait` (granted or not)."""
        n, fut = entry
        if fut.done() and not fut.cancelled():
            self.give(n)  # granted just as the wait was given up
            return
        fut.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(entry)
        self._wake()

    def give(self, n: int) -> None:
        self.used -= n
        if self._waiters:
            self._wake()

    def _wake(self) -> None:
        # In order; a small frame may pass a large one that does not fit yet.
        for entry in list(self._waiters):
            n, fut = entry
            head = entry is self._waiters[0]
            if fut.done():
                self._waiters.remove(entry)
            elif self.used + n <= self.limit and (head or n <= SMALL_FRAME):
                self._waiters.remove(entry)
                self.used += n
                fut.set_result(None)


def peer_groups(sock: socket.socket, uid: int, gid: int) -> set[int]:
    """The peer's groups: the kernel's ``SO_PEERGROUPS`` (the groups the peer process had
    when it connected), else the groups the user database gives the peer's uid."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)  # 256 groups
        return {gid, *struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])}
    except OSError:
        pass
    try:
        return {gid, *os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)}
    except (KeyError, OSError):
        return {gid}


def peer_admitted(
    uid: int, gid: int, groups: set[int], allowed_uids: set[int], allowed_gids: set[int]
) -> bool:
    """Whether a peer (uid, primary gid, all its groups) may use the daemon."""
    return uid in allowed_uids or gid in allowed_gids or bool(groups & allowed_gids)


#: Seconds a thread may hold the GIL while another waits for it, in a serving process.
SWITCH_INTERVAL = 0.0005


#: The event loop waits for a commit itself (no thread hop) only when the log it
#: writes is at most this big: a commit that carries a large batch's records
#: would stop every other connection for its write and sync.
INLINE_COMMIT_BYTES = 64 << 10


#: A request decided on the loop whose commit is still to come: (request id, answer,
#: the commit, when its handling started).
_Decided = tuple[int, Any, asyncio.Future[None], float]


class _Committer:
    """Makes the requests decided on the event loop durable, a group at a time.

    The requests decided in one pass of the loop are gathered; at the start of
    the next pass they are handed over together: when no commit is running,
    none is queued, no other request is in flight (``others_in_flight(n)``:
    requests beside the group's n) and the log to write is small
    (INLINE_COMMIT_BYTES), the loop itself waits for the log (one
    ``fdatasync`` for the group, no thread hop: a lone client's claim costs
    one wake-up less); otherwise the commit thread takes them (a sync under
    load can take far longer than its bytes say: other files' writes share
    the disk), and each of its rounds
    takes every group queued meanwhile, waits once until the highest LSN
    among them is durable, then resolves all their futures in one callback on
    the loop (the loop keeps deciding while the disk works)."""

    def __init__(
        self,
        store: Any,
        loop: asyncio.AbstractEventLoop,
        others_in_flight: Callable[[int], bool] = lambda n: False,
    ) -> None:
        self._store = store
        self._loop = loop
        self._others_in_flight = others_in_flight
        # A plain lock (not the default RLock): the loop takes it without a Python call.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []
        self._running = False  # a round of the commit thread is under way
        self._gathered: list[tuple[int, asyncio.Future[None]]] = []
        self._closed = False
        self.rounds = 0  # waits for the log, each covering every request queued meanwhile
        self.inline_rounds = 0  # of them, waits on the loop itself
        self._thread = threading.Thread(target=self._run, name="dedupcore-commit", daemon=True)
        self._thread.start()

    def wait(self, lsn: int, *, gather: bool = False) -> asyncio.Future[None] | None:
        """A future resolved (on the loop) once the log is durable through ``lsn``.
        Called on the loop. A lone request with a small commit, unless ``gather``, is
        committed here and now: None comes back (durable: no future, no pass of the
        loop for the hand-over), or the commit's error is raised. With ``gather``
        the commit waits for the end of this pass of the loop, so that requests
        other connections sent meanwhile share it."""
        if not self._gathered:
            if not gather:
                with self._lock:
                    lone = self._inline(1)
                if lone:
                    self.rounds += 1
                    self.inline_rounds += 1
                    try:
                        self._store.wait_durable(lsn)
                    except BaseException:
                        # As _commit: a second wait says whether the records were
                        # durable before the commit failed, else raises its error.
                        self._store.wait_durable(lsn)
                    return None
            self._loop.call_soon(self._hand_over)
        fut = self._loop.create_future()
        self._gathered.append((lsn, fut))
        return fut

    def _inline(self, n: int) -> bool:
        """Whether the loop commits a group of ``n`` requests itself (lock held): no
        commit running or queued, no other request in flight, a small commit."""
        return (
            not self._running
            and not self._waiting
            and not self._others_in_flight(n)
            and self._store.commit_bytes() <= INLINE_COMMIT_BYTES
        )

    def _hand_over(self) -> None:
        """The requests of the last pass of the loop: committed here when the thread is
        idle and the commit small, else queued for the thread."""
        batch, self._gathered = self._gathered, []
        with self._cond:
            # After close() the thread may be gone: the loop commits itself.
            if not (self._closed or self._inline(len(batch))):
                self._waiting.extend(batch)
                self._cond.notify()
                return
        self._commit_here(batch)

    def _commit_here(self, batch: list[tuple[int, asyncio.Future[None]]]) -> None:
        """Commits a group on the loop itself and resolves its futures."""
        self.rounds += 1
        self.inline_rounds += 1
        _resolve(self._commit(batch))

    def close(self) -> None:
        """Finishes the waits queued so far, then stops the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _commit(
        self, batch: list[tuple[int, asyncio.Future[None]]]
    ) -> list[tuple[asyncio.Future[None], BaseException | None]]:
        """Waits until the log is durable through the batch's highest LSN; what to
        resolve each future with."""
        try:
            self._store.wait_durable(max(lsn for lsn, _ in batch))
            return [(fut, None) for _, fut in batch]
        except BaseException:
            # The commit failed: the requests whose records were durable before
            # it are still answered; the others get the error their own wait gives.
            done: list[tuple[asyncio.Future[None], BaseException | None]] = []
            for lsn, fut in sorted(batch, key=lambda item: item[0]):
                try:
                    self._store.wait_durable(lsn)
                    done.append((fut, None))
                except BaseException as exc:
                    done.append((fut, exc))
            return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._running = False
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                batch, self._waiting = self._waiting, []
                self._running = True
            self.rounds += 1
            done = self._commit(batch)
            try:
                self._loop.call_soon_threadsafe(_resolve, done)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return


def _resolve(done: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for fut, exc in done:
        if fut.done():  # the request timed out or its connection went away
            continue
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


#: What keeps a connection from reading (``_Connection._blocked``, bits): a request
#: waits for a slot (max_in_flight), a frame for the buffer budget, the peer to take
#: its replies (max_unsent); or the connection reads no more requests (shut).
_SLOT, _BUDGET, _WRITE, _SHUT = 1, 2, 4, 8
_NEVER = float("inf")
_header_at = protocol.HEADER.unpack_from
_header_of = protocol.HEADER.pack
_unpackb = msgpack.unpackb  # as protocol._unpack calls it
_OPS = {int(op): op for op in Op}
_STATUS_OK = int(Status.OK)
#: A request read while the connection's slots are taken: (body, bytes reserved,
#: small, the request as decoded, its decision), started once a slot is free.
_Held = tuple[bytes, int, bool, "protocol.Request | None", "_Decided | None"]


def _request_parts(body: bytes) -> tuple[int, Op, dict[str, Any]] | None:
    """(request id, op, args) of a request frame's body, as ``protocol.decode_request``
    gives them, without building its Request; None when the body does not decode
    (``_handle`` then answers why)."""
    try:
        msg = _unpackb(body, raw=False, strict_map_key=False)
    except Exception:
        msg = None
    if type(msg) is list and len(msg) == 3:
        request_id, code, args = msg
        if (
            type(request_id) is int
            and 0 <= request_id <= protocol.MAX_REQUEST_ID
            and type(code) is int
            and type(args) is dict
        ):
            op = _OPS.get(code)
            if op is not None:
                return request_id, op, args
    # Anything unusual: the protocol's own decoder decides (and names what is wrong).
    try:
        request = protocol.decode_request(body)
    except FrameError:
        return None
    return request.request_id, request.op, request.args


class _Pending:
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
        self, conn: _Connection, decided: _Decided, reserved: int, small: bool, deadline: float
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
                reply = server._error_reply(self.request_id, TimeoutError())
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


class _Connection(asyncio.Protocol):
    """One client connection, served from its transport's callbacks (docs/daemon.md,
    "The request path of the embedded store").

    ``data_received`` parses frames straight out of the connection's own buffer. A
    small request the embedded store decides at once is answered there and then with
    ``transport.write``: no task, no future, no timer. A decided request whose commit
    is still to come is answered from the commit's callback (:class:`_Pending`); every
    other request is started as a task (``DaemonServer._handle``).

    The connection stops reading (``pause_reading``) while a request waits for one of
    its ``max_in_flight`` slots, while a frame waits for the shared buffer budget, and
    while its unsent replies are over ``max_unsent`` (the transport's high-water mark:
    ``pause_writing``/``resume_writing``). One timer per connection checks its
    deadlines lazily: the wait for a request (``idle_timeout``, ``_DRAIN_QUIET`` after
    SIGTERM), a frame not complete within ``request_timeout`` of its header (the wait
    for the budget included), unsent replies not taken within ``write_timeout``, and
    commits that outlast ``request_timeout``. A deadline that moves later re-arms
    nothing: the timer, when it fires, re-arms itself for the earliest one left.
    """

    __slots__ = (
        "_blocked",
        "_budget_wait",
        "_buf",
        "_done",
        "_eof",
        "_held",
        "_length",
        "_lost",
        "_read_deadline",
        "_reading",
        "_timer",
        "_timer_at",
        "_write_deadline",
        "_write_paused",
        "admitted",
        "finished",
        "in_flight",
        "loop",
        "pending",
        "server",
        "tasks",
        "transport",
    )

    def __init__(self, server: DaemonServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        #: Resolved once the connection is closed and nothing of it is in flight.
        self.finished: asyncio.Future[None] | None = None
        self.in_flight = 0  # requests started (task or commit to come), reply not written
        self.tasks: set[asyncio.Task[None]] = set()
        self.pending: deque[_Pending] = deque()  # answered by their commit, oldest first
        self._buf = bytearray()  # bytes read and not parsed yet
        self._length = -1  # body length of the frame whose header was read, else -1
        self._blocked = 0
        self._held: _Held | None = None
        self._budget_wait: tuple[int, asyncio.Future[None]] | None = None
        self._read_deadline: float | None = None
        self._write_deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = _NEVER
        self._reading = True
        self._write_paused = False
        self._eof = False
        self._lost = False
        self._done = False

    # -- the transport's callbacks ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses, only alike.)
        self.transport = cast(asyncio.Transport, transport)
        server = self.server
        allowed, who = server._peer_allowed(self.transport)
        if (
            not allowed
            or len(server._connections) >= server.max_connections
            or server._stopping.is_set()
        ):
            server.counters["refused_connections"] += 1
            log.warning(
                "refused connection from %s (%s)",
                who,
                "credentials" if not allowed else "connection limit or shutdown",
            )
            self._blocked = _SHUT
            transport.close()
            return
        self.admitted = True
        self.finished = self.loop.create_future()
        server._connections.add(self)
        server.counters["connections"] += 1
        # The transport pauses writing past this; resumes at a quarter of it.
        self.transport.set_write_buffer_limits(high=server.max_unsent)
        self._wait_for_request()

    def data_received(self, data: bytes) -> None:
        if self._blocked:
            if not self._blocked & _SHUT:  # read before the pause took effect: kept
                self._buf += data
            return
        buf = self._buf
        if buf:
            buf += data
            self._feed(buf)
        else:
            self._feed(data)

    def eof_received(self) -> bool:
        self._eof = True
        if not self._blocked:
            # Every whole frame was served; a partial one is cut off. The replies of
            # the requests in flight are still written (the peer only stopped sending).
            self.shut()
        return True  # keep the transport open for the replies

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        if not self.admitted:
            return
        self._write_paused = False
        self._write_deadline = None
        self.shut()
        if self._done:
            self._finish()

    def pause_writing(self) -> None:
        # More than max_unsent of replies wait to be sent: no request is read until the
        # peer takes them down to a quarter of it, which it must do within write_timeout.
        self._write_paused = True
        if self._write_deadline is None:
            self._at(self.loop.time() + self.server.write_timeout, write=True)

    def resume_writing(self) -> None:
        self._write_paused = False
        self._write_deadline = None
        if self._done and self.transport is not None and self.transport.get_write_buffer_size():
            # Closing with replies still queued: the peer takes them within write_timeout.
            self._at(self.loop.time() + self.server.write_timeout, write=True)
        if self._blocked & _WRITE:
            self._unblock(_WRITE)

    # -- reading requests -------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Waiting for a request: nothing of one read yet, reading not held up."""
        return self._length < 0 and not self._blocked

    def _feed(self, buf: bytes | bytearray) -> None:
        """Serves every frame ``buf`` holds, until one is incomplete or reading must
        wait; keeps the rest in the connection's buffer."""
        server = self.server
        pos = 0
        end = len(buf)
        served = False
        while not self._blocked:
            length = self._length
            if length < 0:
                if end - pos < 4:
                    break
                if self._write_paused:
                    # The peer is not reading its replies: read nothing more from it
                    # until it does (or write_timeout disconnects it).
                    server.counters["paused_reads"] += 1
                    self._block(_WRITE)
                    break
                (length,) = _header_at(buf, pos)
                if not 0 < length <= server.max_frame:
                    # The stream cannot be resynchronised: say why and hang up.
                    self._frame_error(bytes(buf[pos : pos + 4]))
                    return
                pos += 4
                self._length = length
                budget = server._budget
                if not budget.fits(length):
                    self._wait_for_budget(length)
                    break
                budget.used += length
                if end - pos < length:
                    # The rest of the frame must come within request_timeout.
                    self._at(self.loop.time() + server.request_timeout)
                    break
            elif end - pos < length:
                break
            if isinstance(buf, bytes):
                body = buf[pos : pos + length]
            else:
                with memoryview(buf) as view:
                    body = view[pos : pos + length].tobytes()
            pos += length
            self._length = -1
            served = True
            self._request(body, length)
        if self._blocked & _SHUT:
            return
        if buf is self._buf:
            if pos:
                del buf[:pos]
        elif pos < end:
            self._buf = bytearray(memoryview(buf)[pos:])
        if served and self._length < 0 and not self._blocked:
            self._wait_for_request()

    def _request(self, body: bytes, length: int) -> None:
        """Serves one frame's request: answered here and then when the embedded store
        decides it with nothing left to wait for, else started (or held for a slot)."""
        server = self.server
        small = length <= SMALL_FRAME
        request: protocol.Request | None = None
        decided: _Decided | None = None
        if small and server._fast:
            parts = _request_parts(body)
            if parts is not None:
                now = server._decide_now(*parts)
                if isinstance(now, bytes):  # answered: nothing to wait for
                    server._budget.give(length)
                    # Past max_unsent, the transport pauses writing and the next
                    # request is not read until the peer takes its replies.
                    self.write(now)
                    return
                decided = now
                if now is None:  # the task path serves it
                    request = protocol.Request(*parts)
        if self.in_flight >= server.max_in_flight:
            server.counters["paused_reads"] += 1  # max_in_flight replies not yet written
            self._held = (body, length, small, request, decided)
            self._block(_SLOT)
            return
        self._start(body, length, small, request, decided)

    def _start(
        self,
        body: bytes,
        length: int,
        small: bool,
        request: protocol.Request | None,
        now: _Decided | None,
    ) -> None:
        server = self.server
        self.in_flight += 1
        server._in_flight += 1
        if small:
            server._small += 1
            server._no_small.clear()
        if now is not None:  # decided: its commit is to come, no task waits for it
            server._complete_later(now, length, self, small)
        else:
            task = self.loop.create_task(server._handle(body, length, self, small, request))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def answered(self) -> None:
        """One of this connection's requests was answered (its slot is free)."""
        self.in_flight -= 1
        held = self._held
        if held is not None:
            self._held = None
            self._start(*held)
            self._unblock(_SLOT)
        elif self._blocked & _SHUT:
            self._maybe_done()

    def write(self, data: bytes) -> None:
        """Queues a reply (dropped once the connection is closing)."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def _wait_for_request(self) -> None:
        """The wait for the next request's header starts now (idle_timeout; after
        SIGTERM, a short quiet period: requests already sent are still answered)."""
        server = self.server
        quiet = _DRAIN_QUIET if server._stopping.is_set() else server.idle_timeout
        self._at(self.loop.time() + quiet)

    def _wait_for_budget(self, length: int) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        self._budget_wait = self.server._budget.wait(length, fut)
        fut.add_done_callback(self._budget_granted)
        self._block(_BUDGET)
        # The frame's bytes (and their wait for the budget) within request_timeout.
        self._at(self.loop.time() + self.server.request_timeout)

    def _budget_granted(self, fut: asyncio.Future[None]) -> None:
        wait = self._budget_wait
        if wait is None or wait[1] is not fut or fut.cancelled():
            return  # given up meanwhile (shut): the reservation went back
        self._budget_wait = None
        self._unblock(_BUDGET)

    def _frame_error(self, header: bytes) -> None:
        server = self.server
        server.counters["protocol_errors"] += 1
        try:
            protocol.frame_length(header, server.max_frame)
        except FrameError as exc:
            self.write(protocol.encode_error(0, exc))
        self.shut()

    def _block(self, why: int) -> None:
        self._blocked |= why
        if why != _BUDGET:  # a frame waiting for the budget keeps its deadline
            self._read_deadline = None
        if self._reading:
            self._reading = False
            if not (self._lost or self._eof) and self.transport is not None:
                self.transport.pause_reading()

    def _unblock(self, why: int) -> None:
        self._blocked &= ~why
        if self._blocked:
            return
        if self._length < 0:
            self._wait_for_request()
        if self._buf:
            self._feed(self._buf)
        if self._blocked:
            return
        if self._eof:
            self.shut()
        elif not self._reading:
            self._reading = True
            assert self.transport is not None
            self.transport.resume_reading()

    def shut(self) -> None:
        """Reads no more requests; the connection closes once those in flight are answered."""
        if self._blocked & _SHUT:
            return
        self._block(_SHUT)
        budget = self.server._budget
        if self._length >= 0:  # a partial frame (or one waiting for the budget) is dropped
            wait = self._budget_wait
            if wait is not None:
                self._budget_wait = None
                budget.cancel(wait)
            else:
                budget.give(self._length)
            self._length = -1
        if self._held is not None:  # read, but never started: not answered
            budget.give(self._held[1])
            self._held = None
        self._buf = bytearray()
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self._done or self.in_flight or not self._blocked & _SHUT:
            return
        self._done = True
        self.server._connections.discard(self)
        transport = self.transport
        if self._lost or transport is None:
            self._finish()
            return
        transport.close()  # once the replies queued are sent
        if transport.get_write_buffer_size() and self._write_deadline is None:
            self._at(self.loop.time() + self.server.write_timeout, write=True)

    def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_at = _NEVER
        if self.finished is not None and not self.finished.done():
            self.finished.set_result(None)

    # -- deadlines ----------------------------------------------------------------------

    def _at(self, when: float, write: bool = False) -> None:
        """Sets the read (or write) deadline; the timer is re-armed only for an earlier one."""
        if write:
            self._write_deadline = when
        else:
            self._read_deadline = when
        if when < self._timer_at:
            self._arm(when)

    def arm_for(self, when: float) -> None:
        """Makes sure the timer fires by ``when`` (a commit's deadline)."""
        if when < self._timer_at:
            self._arm(when)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._on_timer)
        self._timer_at = when

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = _NEVER
        now = self.loop.time()
        when = self._read_deadline
        if when is not None and now >= when:
            # No request within idle_timeout, or a frame not complete within
            # request_timeout: the connection closes once its replies are written.
            self._read_deadline = None
            self.shut()
        when = self._write_deadline
        if when is not None and now >= when:
            self._write_deadline = None
            self._write_timed_out()
        pending = self.pending
        while pending:
            first = pending[0]
            if first.done:
                pending.popleft()
            elif now >= first.deadline:
                pending.popleft()
                first.finish()  # with the timeout error: the commit outlasted request_timeout
            else:
                break
        nearest = _NEVER
        for when in (self._read_deadline, self._write_deadline):
            if when is not None and when < nearest:
                nearest = when
        if pending and pending[0].deadline < nearest:
            nearest = pending[0].deadline
        if nearest < self._timer_at and not (self._done and self._lost):
            self._arm(nearest)

    def _write_timed_out(self) -> None:
        transport = self.transport
        if self._lost or transport is None:
            return
        self.server.counters["write_timeouts"] += 1
        log.warning(
            "disconnecting a peer that took no reply for %s s (%d bytes unsent)",
            self.server.write_timeout,
            transport.get_write_buffer_size(),
        )
        transport.abort()


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


def _arg(args: dict[str, Any], name: str, kind: Any) -> Any:
    if name not in args:
        raise FrameError(f"missing argument {name!r}")
    value = args[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"argument {name!r} has type {type(value).__name__}")
    return value


def _optional(args: dict[str, Any], name: str, kind: Any) -> Any:
    if args.get(name) is None:
        return None
    return _arg(args, name, kind)


def _claim_options(args: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a CLAIM_MANY request for the store's claim methods."""
    return {
        "namespace": _arg(args, "ns", str),
        "lease": _optional(args, "lease", (int, float)),
        "owner": _optional(args, "owner", (bytes, str)),
        "fingerprints": _optional(args, "fps", list),
    }


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
