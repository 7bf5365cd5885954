"""The daemon client's native round trip, ``_core.exchange`` (ext/dc_wire.h), against a
socket pair whose other end this test plays: what comes back, and every way it fails."""

from __future__ import annotations

import errno
import socket
import struct
import threading
from collections.abc import Iterator

import pytest

import dedupcore._core as _core

MAX = 1 << 20


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.settimeout(5.0)  # non-blocking underneath, as the client's sockets are
    try:
        yield ours, theirs
    finally:
        ours.close()
        theirs.close()


def read_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
    return sock.recv(n, socket.MSG_WAITALL)


def test_a_request_is_sent_whole_and_the_reply_body_comes_back(pair) -> None:
    ours, theirs = pair
    theirs.sendall(frame(b"reply"))  # already waiting: read without a wait
    assert _core.exchange(ours.fileno(), frame(b"request"), MAX, 5.0) == b"reply"
    assert read_frame(theirs) == b"request"


def test_the_reply_may_come_later_and_in_pieces(pair) -> None:
    ours, theirs = pair
    body = bytes(range(256)) * (4 << 10)  # 1 MiB: more than one read
    data = frame(body)

    def answer() -> None:
        assert read_frame(theirs) == b"q"
        for i in range(0, len(data), 100_003):
            theirs.sendall(data[i : i + 100_003])

    t = threading.Thread(target=answer)
    t.start()
    try:
        assert _core.exchange(ours.fileno(), frame(b"q"), 2 * MAX, 5.0) == body
    finally:
        t.join()


def test_an_empty_request_reads_the_next_reply_only(pair) -> None:
    ours, theirs = pair
    theirs.sendall(frame(b"one") + frame(b"two"))
    assert _core.exchange(ours.fileno(), frame(b"x"), MAX, 5.0) == b"one"
    assert _core.exchange(ours.fileno(), b"", MAX, 5.0) == b"two"
    theirs.setblocking(False)
    assert read_frame(theirs) == b"x"
    with pytest.raises(BlockingIOError):  # the empty request sent nothing
        theirs.recv(1)


def test_a_request_that_cannot_be_sent_returns_its_errno(pair) -> None:
    ours, theirs = pair
    theirs.close()
    # Not sent: nothing of it can have been applied; the caller retries elsewhere.
    assert _core.exchange(ours.fileno(), frame(b"x"), MAX, 5.0) == errno.EPIPE


def test_a_closed_descriptor_is_a_send_failure() -> None:
    a, b = socket.socketpair()
    fd = a.detach()
    socket.close(fd)
    b.close()
    assert _core.exchange(fd, frame(b"x"), MAX, 1.0) == errno.EBADF


def test_a_peer_that_hangs_up_before_replying(pair) -> None:
    ours, theirs = pair

    def hang_up() -> None:
        read_frame(theirs)
        theirs.shutdown(socket.SHUT_RDWR)

    t = threading.Thread(target=hang_up)
    t.start()
    try:
        with pytest.raises(ConnectionResetError, match="waiting for the reply"):
            _core.exchange(ours.fileno(), frame(b"x"), MAX, 5.0)
    finally:
        t.join()


def test_a_reply_cut_off_in_its_body(pair) -> None:
    ours, theirs = pair
    theirs.sendall(struct.pack(">I", 10) + b"12345")
    theirs.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionResetError, match="reading the reply"):
        _core.exchange(ours.fileno(), frame(b"x"), MAX, 5.0)


def test_no_reply_within_the_timeout(pair) -> None:
    ours, _theirs = pair
    with pytest.raises(TimeoutError, match="waiting for the reply"):
        _core.exchange(ours.fileno(), frame(b"x"), MAX, 0.05)


def test_a_body_that_stops_coming_times_out(pair) -> None:
    ours, theirs = pair
    theirs.sendall(struct.pack(">I", 10) + b"123")
    with pytest.raises(TimeoutError, match="reading the reply"):
        _core.exchange(ours.fileno(), frame(b"x"), MAX, 0.05)


@pytest.mark.parametrize(
    ("length", "message"),
    [(0, "empty frame"), (MAX + 1, f"frame of {MAX + 1} bytes exceeds the limit of {MAX}")],
)
def test_a_reply_length_out_of_bounds(pair, length: int, message: str) -> None:
    ours, theirs = pair
    theirs.sendall(struct.pack(">I", length))
    with pytest.raises(ValueError, match=message):
        _core.exchange(ours.fileno(), frame(b"x"), MAX, 5.0)


def test_a_request_that_fills_the_socket_buffer_is_sent_as_the_peer_reads(pair) -> None:
    ours, theirs = pair
    body = b"r" * (8 << 20)  # far more than a socket buffer holds

    def read_then_answer() -> None:
        assert read_frame(theirs) == body
        theirs.sendall(frame(b"ok"))

    t = threading.Thread(target=read_then_answer)
    t.start()
    try:
        assert _core.exchange(ours.fileno(), frame(body), MAX, 10.0) == b"ok"
    finally:
        t.join()


def test_a_send_the_peer_never_reads_times_out_as_not_sent(pair) -> None:
    ours, _theirs = pair
    assert _core.exchange(ours.fileno(), frame(b"r" * (8 << 20)), MAX, 0.05) == errno.ETIMEDOUT


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan")])
def test_a_timeout_must_be_positive(pair, timeout: float) -> None:
    ours, _ = pair
    with pytest.raises(ValueError, match="timeout must be positive"):
        _core.exchange(ours.fileno(), frame(b"x"), MAX, timeout)


def test_bad_arguments(pair) -> None:
    ours, _ = pair
    with pytest.raises(ValueError, match="max_frame must be positive"):
        _core.exchange(ours.fileno(), frame(b"x"), 0, 1.0)
    with pytest.raises(TypeError):
        _core.exchange(ours.fileno(), "text", MAX, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _core.exchange("fd", frame(b"x"), MAX, 1.0)  # type: ignore[arg-type]


def test_threads_exchange_at_once_each_on_its_own_socket() -> None:
    """The waits release the GIL: eight threads, each with its own echoing peer."""
    results: dict[int, list[bytes]] = {}

    def peer(sock: socket.socket, n: int) -> None:
        for _ in range(n):
            sock.sendall(frame(b"re:" + read_frame(sock)))

    def client(i: int, sock: socket.socket, n: int) -> None:
        results[i] = [
            _core.exchange(sock.fileno(), frame(b"%d-%d" % (i, k)), MAX, 10.0)  # type: ignore[misc]
            for k in range(n)
        ]

    n = 200
    pairs = [socket.socketpair() for _ in range(8)]
    threads = [threading.Thread(target=peer, args=(p[1], n)) for p in pairs]
    threads += [threading.Thread(target=client, args=(i, p[0], n)) for i, p in enumerate(pairs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in pairs:
        a.close()
        b.close()
    assert results == {i: [b"re:%d-%d" % (i, k) for k in range(n)] for i in range(8)}
