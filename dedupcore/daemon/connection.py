"""One client connection: an ``asyncio.Protocol`` that parses frames out of its own
buffer and answers them (docs/daemon.md, "The request path of the embedded store").
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, cast

import msgpack

from dedupcore.daemon import protocol
from dedupcore.daemon.admission import SMALL_FRAME, Budget
from dedupcore.daemon.commit import Decided
from dedupcore.daemon.protocol import FrameError, Op

if TYPE_CHECKING:
    from dedupcore.daemon.server import DaemonServer, Pending

__all__ = ["DRAIN_QUIET", "Connection"]

log = logging.getLogger("dedupcore.daemon")

#: After SIGTERM, a connection that sends nothing for this long is closed.
DRAIN_QUIET = 0.2


#: What keeps a connection from reading (``Connection._blocked``, bits): a request
#: waits for a slot (max_in_flight), a frame for the buffer budget, the peer to take
#: its replies (max_unsent); or the connection reads no more requests (shut).
_SLOT, _BUDGET, _WRITE, _SHUT = 1, 2, 4, 8
_NEVER = float("inf")
_header_at = protocol.HEADER.unpack_from
_unpackb = msgpack.unpackb  # as protocol._unpack calls it
_OPS = {int(op): op for op in Op}
#: A request read while the connection's slots are taken: (body, bytes reserved,
#: small, the request as decoded, its decision), started once a slot is free.
_Held = tuple[bytes, int, bool, "protocol.Request | None", "Decided | None"]


def _request_parts(body: bytes) -> tuple[int, Op, dict[str, Any] | protocol.OneKey] | None:
    """(request id, op, args) of a request frame's body, as ``protocol.decode_request``
    gives them, without building its Request, the args of a one-key request as read
    natively (``protocol.one_key_request``); None when the body does not decode
    (``DaemonServer._handle`` then answers why)."""
    one = protocol.one_key_request(body)
    if one is not None:
        return one
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


class Connection(asyncio.Protocol):
    """One client connection, served from its transport's callbacks (docs/daemon.md,
    "The request path of the embedded store").

    ``data_received`` parses frames straight out of the connection's own buffer. A
    small request the embedded store decides at once is answered there and then with
    ``transport.write``: no task, no future, no timer. A decided request whose commit
    is still to come is answered from the commit's callback (:class:`Pending`); every
    other request is started as a task (``DaemonServer._handle``).

    The connection stops reading (``pause_reading``) while a request waits for one of
    its ``max_in_flight`` slots, while a frame waits for the shared buffer budget, and
    while its unsent replies are over ``max_unsent`` (the transport's high-water mark:
    ``pause_writing``/``resume_writing``). One timer per connection checks its
    deadlines lazily: the wait for a request (``idle_timeout``, ``DRAIN_QUIET`` after
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
        "budget",
        "finished",
        "in_flight",
        "loop",
        "pending",
        "server",
        "tasks",
        "transport",
    )

    def __init__(
        self, server: DaemonServer, loop: asyncio.AbstractEventLoop, budget: Budget
    ) -> None:
        self.server = server
        self.loop = loop
        #: The request bytes shared by every connection of the server (max_buffered).
        self.budget = budget
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        #: Resolved once the connection is closed and nothing of it is in flight.
        self.finished: asyncio.Future[None] | None = None
        self.in_flight = 0  # requests started (task or commit to come), reply not written
        self.tasks: set[asyncio.Task[None]] = set()
        self.pending: deque[Pending] = deque()  # answered by their commit, oldest first
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
        if not self.server.admit(self):  # credentials, the connection limit, shutdown
            self._blocked = _SHUT
            transport.close()
            return
        self.admitted = True
        self.finished = self.loop.create_future()
        # The transport pauses writing past this; resumes at a quarter of it.
        self.transport.set_write_buffer_limits(high=self.server.max_unsent)
        self._wait_for_request()

    def data_received(self, data: bytes) -> None:
        self.server.awake.arrived()
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
        # A peer that closed its side waits on no key any more (one that only half
        # closed is answered "poll" and may ask again on a new connection).
        self.server.waiters.drop(self)
        if not self._blocked:
            # Every whole frame was served; a partial one is cut off. The replies of
            # the requests in flight are still written (the peer only stopped sending).
            self.shut()
        return True  # keep the transport open for the replies

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        if not self.admitted:
            return
        self.server.waiters.drop(self)  # nobody reads their answers any more
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

    @property
    def peer_done(self) -> bool:
        """The peer closed its side (or the whole connection): it waits on no key."""
        return self._eof or self._lost

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
                budget = self.budget
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
        decided: Decided | None = None
        if small and server.decides_on_loop:
            parts = _request_parts(body)
            if parts is not None:
                now = server.decide_now(*parts)
                if isinstance(now, bytes):  # answered: nothing to wait for
                    self.budget.give(length)
                    # Past max_unsent, the transport pauses writing and the next
                    # request is not read until the peer takes its replies.
                    self.write(now)
                    return
                decided = now
                if now is None:  # the task path serves it
                    request_id, op, args = parts
                    if isinstance(args, protocol.OneKey):
                        args = args.args(op)
                    request = protocol.Request(request_id, op, args)
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
        now: Decided | None,
    ) -> None:
        self.in_flight += 1
        self.server.start_request(self, body, length, small, request, now)

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
            self.server.awake.replied()

    def _wait_for_request(self) -> None:
        """The wait for the next request's header starts now (idle_timeout; after
        SIGTERM, a short quiet period: requests already sent are still answered)."""
        server = self.server
        quiet = DRAIN_QUIET if server.draining else server.idle_timeout
        self._at(self.loop.time() + quiet)

    def _wait_for_budget(self, length: int) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        self._budget_wait = self.budget.wait(length, fut)
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
        budget = self.budget
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
        self.server.forget(self)
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
