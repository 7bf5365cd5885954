"""The daemon client's native round trip, ``_core.exchange`` (ext/dc_wire.h), against a
socket pair whose other end this test plays: what comes back, and every way it fails;
then its one-key frames and replies (``one_key_frame``, ``one_key_reply``) against what
the protocol module makes and reads of the same."""

from __future__ import annotations

import errno
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dedupcore._core as _core
from dedupcore._spin import SPIN_UP_TO, Spin
from dedupcore.api.batches import ChangeBatch, ClaimBatch, pack_result
from dedupcore.client import Client
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import FrameError, Op

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


@pytest.mark.parametrize("delay", [None, 0.0, 0.02])
@pytest.mark.parametrize("spin", [1e-6, 0.001, 0.01])
def test_a_reply_is_read_the_same_whether_it_comes_while_the_caller_checks_or_after(
    pair, spin: float, delay: float | None
) -> None:
    """``spin`` only changes how the call waits for the reply's first bytes: one
    already there, one that comes while it checks without sleeping, and one that
    comes after it gave up checking and sleeps in poll() read the same."""
    ours, theirs = pair
    if delay is None:
        theirs.sendall(frame(b"there"))
        assert _core.exchange(ours.fileno(), frame(b"q"), MAX, 5.0, spin) == b"there"
        assert read_frame(theirs) == b"q"
        return

    def answer() -> None:
        assert read_frame(theirs) == b"q"
        time.sleep(delay)
        theirs.sendall(frame(b"later"))

    t = threading.Thread(target=answer)
    t.start()
    try:
        assert _core.exchange(ours.fileno(), frame(b"q"), MAX, 5.0, spin) == b"later"
    finally:
        t.join()


def test_a_peer_that_hangs_up_while_the_caller_checks(pair) -> None:
    ours, theirs = pair
    theirs.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionResetError, match="waiting for the reply"):
        _core.exchange(ours.fileno(), frame(b"x"), MAX, 5.0, _core.MAX_SPIN)


def test_checking_for_the_reply_never_outlasts_the_timeout(pair) -> None:
    ours, _theirs = pair
    with pytest.raises(TimeoutError, match="waiting for the reply"):
        _core.exchange(ours.fileno(), frame(b"x"), MAX, 0.001, _core.MAX_SPIN)


@pytest.mark.parametrize("spin", [-1e-9, float("nan"), float("inf"), 0.0100001])
def test_spin_is_zero_to_max_spin_seconds(pair, spin: float) -> None:
    ours, _ = pair
    with pytest.raises(ValueError, match="spin must be 0 to"):
        _core.exchange(ours.fileno(), frame(b"x"), MAX, 1.0, spin)


def test_the_adaptive_spin_follows_the_typical_round_trip() -> None:
    """Twice the typical round trip, at most SPIN_UP_TO, none while round trips are
    longer than that; the typical one is an exponential average."""
    spin = Spin(None)
    assert spin.budget() == SPIN_UP_TO  # before the first call
    spin.took(50e-6)
    assert spin.typical == 50e-6
    assert spin.budget() == pytest.approx(100e-6)
    spin.took(130e-6)
    assert spin.typical == pytest.approx(60e-6)  # 50 + (130 - 50) / 8
    assert spin.budget() == pytest.approx(120e-6)
    for _ in range(3):
        spin.took(5e-3)  # a durable daemon's fdatasync
    assert spin.typical > SPIN_UP_TO
    assert spin.budget() == 0.0
    for _ in range(200):
        spin.took(40e-6)  # faster again
    assert spin.budget() == pytest.approx(80e-6)
    fixed = Spin(0.002)
    fixed.took(1.0)
    assert fixed.budget() == 0.002


@pytest.mark.parametrize(
    ("spin", "error"),
    [(True, TypeError), ("1", TypeError), (-0.001, ValueError), (0.011, ValueError)],
)
def test_a_client_spin_is_none_or_seconds(spin: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="spin must be"):
        Client("/nonexistent/socket", spin=spin)  # type: ignore[arg-type]
    assert Client("/nonexistent/socket", spin=0).spin == 0.0
    assert Client("/nonexistent/socket").spin is None


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


# -- one-key frames and replies: the native forms against the protocol's --------------

keys_ = st.one_of(st.binary(max_size=70_000), st.text(max_size=300))
names = st.text(min_size=1, max_size=300)
request_ids = st.integers(0, (1 << 64) - 1)
tokens = st.integers(1, (1 << 63) - 1)
results = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(request_ids, names, keys_)
def test_a_claim_frame_is_the_protocols(rid: int, ns: str, key: bytes | str) -> None:
    args = {"ns": ns, "keys": [key], "cols": 1}
    assert _core.one_key_frame(rid, Op.CLAIM_MANY, ns, key) == protocol.encode_request(
        rid, Op.CLAIM_MANY, args
    )


@settings(max_examples=300, deadline=None)
@given(request_ids, names, keys_, tokens, results)
def test_a_completion_frame_is_the_protocols(
    rid: int, ns: str, key: bytes | str, token: int, result: object
) -> None:
    packed = pack_result(result, 1 << 30)
    expected = protocol.encode_request(
        rid, Op.COMPLETE_MANY, {"ns": ns, "items": [[key, token, result]]}
    )
    assert _core.one_key_frame(rid, Op.COMPLETE_MANY, ns, key, token, packed) == expected


@settings(max_examples=200, deadline=None)
@given(request_ids, names, keys_, tokens)
def test_a_release_frame_is_the_protocols(rid: int, ns: str, key: bytes | str, token: int) -> None:
    expected = protocol.encode_request(rid, Op.RELEASE_MANY, {"ns": ns, "items": [[key, token]]})
    assert _core.one_key_frame(rid, Op.RELEASE_MANY, ns, key, token) == expected


@settings(max_examples=200, deadline=None)
@given(request_ids, names, st.lists(st.binary(max_size=300) | st.text(max_size=40), max_size=40))
def test_a_claim_batch_frame_is_the_protocols(rid: int, ns: str, keys: list[bytes | str]) -> None:
    args = {"ns": ns, "keys": keys, "cols": 1}
    assert _core.claim_frame(rid, ns, keys) == protocol.encode_request(rid, Op.CLAIM_MANY, args)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 0xFFFF, 0x10000])
def test_a_claim_batch_frame_has_every_array_head(n: int) -> None:
    keys: list[bytes | str] = [b"k%d" % i if i % 2 else f"s{i}" for i in range(n)]
    args = {"ns": "ns", "keys": keys, "cols": 1}
    frame_ = _core.claim_frame(7, "ns", keys)
    assert frame_ == protocol.encode_request(7, Op.CLAIM_MANY, args)
    assert protocol.decode_request(frame_[4:]).args == args
    if n == 1:
        assert frame_ == _core.one_key_frame(7, Op.CLAIM_MANY, "ns", keys[0])


def test_a_claim_batch_of_long_keys_is_framed_as_the_protocol_frames_it() -> None:
    keys: list[bytes | str] = ["é" * 200, b"x" * 0x10000, "y" * 31, "z" * 32, b"w" * 0xFF]
    args = {"ns": "nämespace", "keys": keys, "cols": 1}
    expected = protocol.encode_request(1 << 40, Op.CLAIM_MANY, args)
    assert _core.claim_frame(1 << 40, "nämespace", keys) == expected


class _Bytes(bytes):
    pass


class _Str(str):
    pass


@pytest.mark.parametrize(
    "key", [bytearray(b"k"), memoryview(b"k"), _Bytes(b"k"), _Str("k"), 7, None]
)
def test_a_key_not_exactly_bytes_or_str_is_left_to_the_protocol(key: object) -> None:
    assert _core.one_key_frame(1, Op.CLAIM_MANY, "ns", key) is None
    assert _core.claim_frame(1, "ns", [b"a", key, "b"]) is None
    assert _core.one_key_frame(1, Op.RELEASE_MANY, "ns", key, 1) is None


@pytest.mark.parametrize("op", [Op.PING, Op.GET, Op.STATS, Op.EXTEND_MANY, Op.WAIT, 0, 99])
def test_other_ops_are_left_to_the_protocol(op: int) -> None:
    assert _core.one_key_frame(1, op, "ns", b"k", 1) is None


def test_bad_one_key_arguments() -> None:
    with pytest.raises(OverflowError):
        _core.one_key_frame(1, Op.RELEASE_MANY, "ns", b"k", -1)
    with pytest.raises(TypeError):
        _core.one_key_frame(1, Op.RELEASE_MANY, "ns", b"k", "1")
    with pytest.raises(TypeError, match="packed must be bytes or None"):
        _core.one_key_frame(1, Op.COMPLETE_MANY, "ns", b"k", 1, bytearray(b"\xc0"))
    with pytest.raises(TypeError):
        _core.one_key_frame(1, Op.CLAIM_MANY, b"ns", b"k")  # type: ignore[arg-type]
    with pytest.raises(UnicodeEncodeError):
        _core.one_key_frame(1, Op.CLAIM_MANY, "\udc80", b"k")
    with pytest.raises(OverflowError):
        _core.one_key_frame(-1, Op.CLAIM_MANY, "ns", b"k")


def _columns(code: int, token: int, **sparse: list[object]) -> dict[str, object]:
    cols: dict[str, object] = {"o": bytes([code]), "t": token.to_bytes(8, "little")}
    cols.update({"ri": [], "rv": [], "x": [], "k": []})
    cols.update(sparse)
    return cols


@settings(max_examples=300, deadline=None)
@given(request_ids, st.integers(0, 2), st.integers(0, (1 << 64) - 1))
def test_the_usual_claim_reply_is_read_as_the_protocol_reads_it(
    rid: int, code: int, token: int
) -> None:
    body = protocol.encode_response(rid, _columns(code, token))[4:]
    assert _core.one_key_reply(body, rid) == (code, token)
    got_rid, status, payload = protocol.decode_response(body)
    [claim] = protocol.claims_from_reply([b"k"], "ns", payload)
    assert (got_rid, status) == (rid, protocol.Status.OK)
    assert (protocol.OUTCOME_ORDER[code], token) == (claim.outcome, claim.token)
    assert (claim.result, claim.exact, claim.takeover) == (None, True, False)
    assert _core.one_key_reply(body, rid ^ 1) is None  # another request's reply


@pytest.mark.parametrize(
    "payload",
    [
        _columns(1, 5, ri=[0], rv=["result"]),  # a result: the protocol decodes it
        _columns(1, 5, x=[0]),  # a cold answer
        _columns(0, 5, k=[0]),  # a takeover
        _columns(3, 5),  # no such outcome
        {"o": b"\x00", "t": b"\x05" + bytes(7), "ri": [], "rv": [], "x": []},  # a field short
        [["new", 5, None, True, False]],  # rows, from an older daemon
        "pong",
        0,
    ],
)
def test_any_other_reply_is_left_to_the_protocol(payload: object) -> None:
    assert _core.one_key_reply(protocol.encode_response(9, payload)[4:], 9) is None


def test_a_change_reply_and_an_error_reply() -> None:
    assert _core.one_key_reply(protocol.encode_response(9, None)[4:], 9) is True
    error = protocol.encode_error(9, ValueError("no"))[4:]
    assert _core.one_key_reply(error, 9) is None
    assert _core.one_key_reply(protocol.encode_response(9, None)[4:] + b"\x00", 9) is None


def test_every_cut_of_a_reply_is_left_to_the_protocol() -> None:
    for body in (
        protocol.encode_response(300, _columns(0, 1 << 40))[4:],
        protocol.encode_response(300, None)[4:],
    ):
        for end in range(len(body)):
            assert _core.one_key_reply(body[:end], 300) is None


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64), request_ids)
def test_garbage_is_never_misread(body: bytes, rid: int) -> None:
    """Whatever the bytes, the native reading is None or what the protocol reads."""
    answer = _core.one_key_reply(body, rid)
    if answer is None:
        return
    got_rid, status, payload = protocol.decode_response(body)
    assert (got_rid, status) == (rid, protocol.Status.OK)
    if answer is True:
        assert payload is None
    else:
        [claim] = protocol.claims_from_reply([b"k"], "ns", payload)
        assert (claim.outcome, claim.token) == (protocol.OUTCOME_ORDER[answer[0]], answer[1])


# -- the daemon's side: one-key requests read, one-key claims answered -------------------


@settings(max_examples=300, deadline=None)
@given(
    request_ids,
    st.sampled_from([Op.CLAIM_MANY, Op.COMPLETE_MANY, Op.RELEASE_MANY]),
    names,
    keys_,
    tokens,
    results,
)
def test_a_one_key_frame_reads_back_as_it_was_built(
    rid: int, op: Op, ns: str, key: bytes | str, token: int, result: object
) -> None:
    packed = pack_result(result, 1 << 30) if op is Op.COMPLETE_MANY else None
    frame = _core.one_key_frame(rid, op, ns, key, token, packed)
    assert frame is not None
    read = protocol.one_key_request(frame[4:])
    assert read is not None
    got_rid, got_op, one = read
    assert (got_rid, got_op, one.namespace, one.key) == (rid, op, ns, key)
    assert type(one.key) is type(key)
    if op is Op.CLAIM_MANY:
        assert (one.token, one.value) == (0, None)
    else:
        assert one.token == token
        assert one.value == (result if op is Op.COMPLETE_MANY else None)
    # The args as a map are what the protocol module decodes from the same body.
    assert protocol.decode_request(frame[4:]).args == one.args(op)


@pytest.mark.parametrize(
    "args",
    [
        {"ns": "n", "keys": [b"k"]},  # no cols
        {"ns": "n", "keys": [b"k"], "cols": 1, "lease": None},
        {"ns": "n", "keys": [b"k", b"l"], "cols": 1},
        {"keys": [b"k"], "ns": "n", "cols": 1},  # another order
        {"ns": b"n", "keys": [b"k"], "cols": 1},  # a bytes namespace: refused by the checks
        {"ns": "n", "keys": [5], "cols": 1},
        {"ns": "n", "keys": [b"k"], "cols": 2},
    ],
)
def test_a_claim_of_another_shape_is_left_to_the_protocol(args: dict[str, object]) -> None:
    assert _core.one_key_request(protocol.encode_request(3, Op.CLAIM_MANY, args)[4:]) is None


@pytest.mark.parametrize(
    ("op", "items"),
    [
        (Op.COMPLETE_MANY, [[b"k", 1, None], [b"l", 2, None]]),
        (Op.COMPLETE_MANY, [[b"k", 1]]),  # a completion without its result
        (Op.COMPLETE_MANY, [[b"k", -1, None]]),  # a negative token: the checks name it
        (Op.RELEASE_MANY, [[b"k", 1, None]]),  # a release with a result
        (Op.RELEASE_MANY, [[b"k", "1"]]),
        (Op.EXTEND_MANY, [[b"k", 1]]),
    ],
)
def test_a_change_of_another_shape_is_left_to_the_protocol(op: Op, items: list[object]) -> None:
    body = protocol.encode_request(3, op, {"ns": "n", "items": items})[4:]
    assert _core.one_key_request(body) is None


def test_every_cut_of_a_one_key_request_is_left_to_the_protocol() -> None:
    for frame in (
        _core.one_key_frame(300, Op.CLAIM_MANY, "ns", b"key"),
        _core.one_key_frame(300, Op.COMPLETE_MANY, "ns", "kéy", 1 << 40, b"\x92\x01\xa1x"),
        _core.one_key_frame(300, Op.RELEASE_MANY, "ns", b"k" * 300, 7),
    ):
        assert frame is not None
        body = frame[4:]
        assert _core.one_key_request(body) is not None
        for end in range(len(body)):
            # A completion cut inside its result is read natively up to the result,
            # which then does not decode: the protocol module answers it.
            read = _core.one_key_request(body[:end])
            assert read is None or read[1] == Op.COMPLETE_MANY
            assert protocol.one_key_request(body[:end]) is None


def test_strings_that_are_not_utf8_are_left_to_the_protocol() -> None:
    frame = _core.one_key_frame(1, Op.CLAIM_MANY, "nn", "kk")
    assert frame is not None
    for at in (frame.index(b"nn"), frame.index(b"kk")):
        bad = frame[4:at] + b"\xff\xfe" + frame[at + 2 :]
        assert _core.one_key_request(bad) is None
        with pytest.raises(FrameError):
            protocol.decode_request(bad)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_request_garbage_is_never_misread(body: bytes) -> None:
    read = protocol.one_key_request(body)
    if read is None:
        return
    rid, op, one = read
    assert protocol.decode_request(body) == protocol.Request(rid, op, one.args(op))


@settings(max_examples=300, deadline=None)
@given(request_ids, st.integers(0, 2), st.integers(0, (1 << 64) - 1))
def test_a_one_key_answer_is_the_columns_reply(rid: int, code: int, token: int) -> None:
    answer = _core.one_key_answer(rid, code, token)
    assert answer == protocol.encode_response(rid, _columns(code, token))
    assert _core.one_key_reply(answer[4:], rid) == (code, token)
    assert protocol.OneClaim(code, token).frame(rid) == answer


def test_a_one_key_answer_has_one_of_three_outcomes() -> None:
    for code in (-1, 3):
        with pytest.raises(ValueError, match=f"no outcome has code {code}"):
            _core.one_key_answer(1, code, 1)


def test_a_one_key_payload_is_columns_where_there_is_more_than_outcome_and_token() -> None:
    token = (77).to_bytes(8, "little")
    assert protocol.one_key_payload((b"\x00", token, [], [], [], [])) == protocol.OneClaim(0, 77)
    for sparse in (([0], ["r"], [], []), ([], [], [0], []), ([], [], [], [0])):
        payload = protocol.one_key_payload((b"\x01", token, *sparse))
        assert isinstance(payload, dict) and payload["o"] == b"\x01"


# -- the clients' choice: which calls go as one-key requests -----------------------------


def _framer(op: Op, batch: object) -> bytes | None:
    frame = Client("/nonexistent/socket")._one_key_request(op, batch)
    return None if frame is None else frame(9)


def test_a_plain_one_key_call_goes_as_a_one_key_request() -> None:
    claim = ClaimBatch(["k"], namespace="ns")
    assert _framer(Op.CLAIM_MANY, claim) == _core.one_key_frame(9, Op.CLAIM_MANY, "ns", "k")
    done = ChangeBatch([(b"k", 3, {"r": 1})], namespace="ns", completing=True)
    packed = pack_result({"r": 1}, 1 << 20)
    assert _framer(Op.COMPLETE_MANY, done) == _core.one_key_frame(
        9, Op.COMPLETE_MANY, "ns", b"k", 3, packed
    )
    bare = ChangeBatch([(b"k", 3)], namespace="ns", completing=True)
    assert _framer(Op.COMPLETE_MANY, bare) == _core.one_key_frame(
        9, Op.COMPLETE_MANY, "ns", b"k", 3
    )
    gone = ChangeBatch([(b"k", 3)], namespace="ns", completing=False)
    assert _framer(Op.RELEASE_MANY, gone) == _core.one_key_frame(9, Op.RELEASE_MANY, "ns", b"k", 3)


@pytest.mark.parametrize(
    "batch",
    [
        ClaimBatch(["k", "l"], namespace="ns"),
        ClaimBatch(["k"], namespace="ns", lease=5.0),
        ClaimBatch(["k"], namespace="ns", owner="me"),
        ClaimBatch(["k"], namespace="ns", fingerprints=[b"fp"]),
        ClaimBatch([bytearray(b"k")], namespace="ns"),
    ],
    ids=["two-keys", "lease", "owner", "fingerprint", "bytearray-key"],
)
def test_any_other_claim_goes_the_general_way(batch: ClaimBatch) -> None:
    assert _framer(Op.CLAIM_MANY, batch) is None


def test_a_one_key_request_over_the_frame_is_refused_before_it_is_sent() -> None:
    client = Client("/nonexistent/socket", max_frame=64)
    frame = client._one_key_request(Op.CLAIM_MANY, ClaimBatch(["k" * 100], namespace="ns"))
    assert frame is not None
    with pytest.raises(ValueError, match="exceeds the frame limit of 64"):
        frame(1)


# -- a large batch read a part at a time (batch_request) ----------------------------------


def _read(request: protocol.Request) -> list[Any]:
    """The keys or items of a request read by batch_request, decoded part by part."""
    elements = request.args["keys" if request.op is Op.CLAIM_MANY else "items"]
    assert isinstance(elements, protocol.FrameItems)
    out: list[Any] = []
    for i in range(elements.parts):
        out.extend(elements.part(i))
    return out


def _same_request(body: bytes, size: int) -> None:
    """batch_request reads ``body`` as decode_request decodes it, part by part."""
    request = protocol.batch_request(body, size)
    assert request is not None
    decoded = protocol.decode_request(body)
    name = "keys" if request.op is Op.CLAIM_MANY else "items"
    assert (request.request_id, request.op) == (decoded.request_id, decoded.op)
    assert {k: v for k, v in request.args.items() if k != name} == {
        k: v for k, v in decoded.args.items() if k != name
    }
    elements = request.args[name]
    assert _read(request) == decoded.args[name] == elements.whole()
    assert len(elements) == len(decoded.args[name])
    assert elements.parts == -(-len(elements) // size)
    for i in range(elements.parts):  # each part holds ``size`` but the last
        assert elements.part(i) == decoded.args[name][i * size : (i + 1) * size]


@settings(max_examples=200, deadline=None)
@given(
    request_ids,
    names,
    st.lists(st.binary(max_size=300) | st.text(max_size=40), max_size=80),
    st.integers(1, 20),
)
def test_a_claim_frame_read_in_parts_is_what_the_protocol_decodes(
    rid: int, ns: str, keys: list[bytes | str], size: int
) -> None:
    frame_ = _core.claim_frame(rid, ns, keys)
    assert frame_ is not None
    _same_request(frame_[4:], size)
    request = protocol.batch_request(frame_[4:], size)
    assert request is not None
    assert [type(k) for k in _read(request)] == [type(k) for k in keys]


@settings(max_examples=200, deadline=None)
@given(
    request_ids,
    st.sampled_from([Op.COMPLETE_MANY, Op.RELEASE_MANY]),
    names,
    st.lists(st.tuples(keys_, tokens, results), max_size=30),
    st.integers(1, 12),
)
def test_a_change_read_in_parts_is_what_the_protocol_decodes(
    rid: int, op: Op, ns: str, items: list[tuple[Any, int, Any]], size: int
) -> None:
    rows = [list(item) if op is Op.COMPLETE_MANY else list(item[:2]) for item in items]
    body = protocol.encode_request(rid, op, {"ns": ns, "items": rows})[4:]
    _same_request(body, size)


@pytest.mark.parametrize("n", [15, 16, 0xFFFF, 0x10000])
def test_a_batch_read_in_parts_has_every_array_head(n: int) -> None:
    keys: list[bytes | str] = [b"k%d" % i if i % 2 else f"s{i}" for i in range(n)]
    frame_ = _core.claim_frame(7, "ns", keys)
    assert frame_ is not None
    _same_request(frame_[4:], 1024)
    items = [[k, i + 1, i] for i, k in enumerate(keys)]
    _same_request(
        protocol.encode_request(7, Op.COMPLETE_MANY, {"ns": "n", "items": items})[4:], 999
    )


@pytest.mark.parametrize(
    "result",
    [
        None, True, 0, -1, -33, 1 << 63, -(1 << 63), 1.5, 1e300, "é" * 40, b"b" * 300,
        b"x" * 70_000, "y" * 70_000, [1, [2, [3, [4]]]], {"a": {"b": [1, 2]}, 3: None},
        list(range(20)), {str(i): i for i in range(20)}, msgpack.ExtType(5, b"abc"),
        msgpack.ExtType(1, b"x" * 17), msgpack.ExtType(2, b"y" * 300),
    ],
)  # fmt: skip
def test_every_kind_of_result_is_read_in_parts(result: object) -> None:
    items = [[b"a", 1, result], [b"b", 2, [result, result]], [b"c", 3, {"r": result}]]
    _same_request(protocol.encode_request(1, Op.COMPLETE_MANY, {"ns": "n", "items": items})[4:], 2)


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (Op.CLAIM_MANY, {"ns": "n", "keys": [b"k", b"l"]}),  # no cols
        (Op.CLAIM_MANY, {"ns": "n", "keys": [b"k", b"l"], "cols": 1, "lease": 5}),
        (Op.CLAIM_MANY, {"ns": "n", "keys": [b"k", b"l"], "cols": 1, "owner": "w"}),
        (Op.CLAIM_MANY, {"keys": [b"k", b"l"], "ns": "n", "cols": 1}),  # another order
        (Op.CLAIM_MANY, {"ns": b"n", "keys": [b"k", b"l"], "cols": 1}),  # a bytes namespace
        (Op.CLAIM_MANY, {"ns": "n", "keys": [b"k", b"l"], "cols": 2}),
        (Op.CLAIM_MANY, {"ns": "n", "items": [b"k", b"l"], "cols": 1}),
        (Op.COMPLETE_MANY, {"ns": "n", "keys": [[b"k", 1, None]]}),
        (Op.COMPLETE_MANY, {"ns": "n", "items": [[b"k", 1, None]], "cols": 1}),
        (Op.RELEASE_MANY, {"items": [[b"k", 1]], "ns": "n"}),
        (Op.RELEASE_MANY, {"ns": "n", "items": "not a list"}),
        (Op.EXTEND_MANY, {"ns": "n", "items": [[b"k", 1]]}),
        (Op.WAIT, {"ns": "n", "keys": [b"k"], "timeout": 1}),
        (Op.GET, {"ns": "n", "key": b"k"}),
    ],
)
def test_a_request_of_another_shape_is_decoded_whole(op: Op, args: dict[str, object]) -> None:
    body = protocol.encode_request(3, op, args)[4:]
    assert protocol.batch_request(body, 4) is None


def test_every_cut_of_a_batch_is_decoded_whole() -> None:
    frame_ = _core.claim_frame(300, "nämespace", [b"a" * 40, "b" * 300, b"c", "dé" * 20] * 5)
    assert frame_ is not None
    items = [[b"k%d" % i, 1 << 40, {"r": [i, "é" * i, 1.5, None]}] for i in range(12)]
    for body in (
        frame_[4:],
        protocol.encode_request(300, Op.COMPLETE_MANY, {"ns": "n", "items": items})[4:],
    ):
        assert protocol.batch_request(body, 3) is not None
        for end in range(len(body)):
            assert protocol.batch_request(body[:end], 3) is None
        assert protocol.batch_request(body + b"\x00", 3) is None  # a byte left over


def test_an_element_that_does_not_decode_is_a_frame_error_of_its_part() -> None:
    keys: list[bytes | str] = [f"k{i:02}" for i in range(12)]
    frame_ = _core.claim_frame(1, "ns", keys)
    assert frame_ is not None
    at = frame_.index(b"k10")
    body = frame_[4:at] + b"\xff\xfe" + frame_[at + 2 :]  # not UTF-8
    with pytest.raises(FrameError):
        protocol.decode_request(body)
    request = protocol.batch_request(body, 4)
    assert request is not None
    keys_read = request.args["keys"]
    assert keys_read.part(0) == keys[:4] and keys_read.part(1) == keys[4:8]
    with pytest.raises(FrameError, match="not valid msgpack"):
        keys_read.part(2)
    with pytest.raises(FrameError, match="not valid msgpack"):
        keys_read.whole()


def test_a_batch_of_fewer_elements_than_asked_for_is_left_to_the_whole_decode() -> None:
    keys: list[bytes | str] = [f"k{i}" for i in range(10)]
    body = (_core.claim_frame(3, "ns", keys) or b"")[4:]
    items = protocol.encode_request(4, Op.COMPLETE_MANY, {"ns": "ns", "items": [["k", 1, 2]] * 10})
    for frame_body in (body, items[4:]):
        assert protocol.batch_request(frame_body, 4, 11) is None  # told from the array head
        request = protocol.batch_request(frame_body, 4, 10)
        assert request is not None
        whole = protocol.decode_request(frame_body)
        name = "keys" if whole.op is Op.CLAIM_MANY else "items"
        assert _read(request) == whole.args[name]


def test_a_part_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="part must be at least 1"):
        _core.batch_request(b"\x93\x01\x02\x83", 0)


def _read_as_the_protocol_reads(body: bytes, size: int) -> None:
    """A body batch_request reads at all is read as decode_request reads it."""
    request = protocol.batch_request(body, size)
    if request is None:
        return
    try:
        elements = _read(request)
    except FrameError:
        with pytest.raises(FrameError):
            protocol.decode_request(body)
        return
    decoded = protocol.decode_request(body)
    assert decoded.request_id == request.request_id and decoded.op == request.op
    assert decoded.args["keys" if request.op is Op.CLAIM_MANY else "items"] == elements


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=96), st.integers(1, 8))
def test_batch_garbage_is_never_misread(body: bytes, size: int) -> None:
    _read_as_the_protocol_reads(body, size)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_a_batch_with_a_byte_changed_is_read_as_the_protocol_reads_it(
    data: st.DataObject,
) -> None:
    keys: list[bytes | str] = [b"key-%d" % i if i % 3 else f"s-{i}" for i in range(40)]
    claim = _core.claim_frame(9, "ns", keys)
    assert claim is not None
    items = [[k, i + 1, [i, {"r": "é"}, 2.5, None, b"x" * i]] for i, k in enumerate(keys)]
    change = protocol.encode_request(9, Op.COMPLETE_MANY, {"ns": "n", "items": items})
    body = bytearray(data.draw(st.sampled_from([claim, change]))[4:])
    at = data.draw(st.integers(0, len(body) - 1))
    body[at] = data.draw(st.integers(0, 255))
    _read_as_the_protocol_reads(bytes(body), 7)


def test_a_nesting_too_deep_for_msgpack_is_named() -> None:
    # msgpack's StackError has no message of its own: the error still says what it is,
    # for a frame decoded whole and for a part of one read in parts.
    deep = b"\x91" * 5000 + b"\xc0"
    body = b"\x93\x01\x02\x83\xa2ns\xa1n\xa4keys\x92\xa1a" + deep + b"\xa4cols\x01"
    with pytest.raises(FrameError, match="not valid msgpack: StackError"):
        protocol.decode_request(body)
    request = protocol.batch_request(body, 1)
    assert request is not None
    assert request.args["keys"].part(0) == ["a"]
    with pytest.raises(FrameError, match="not valid msgpack: StackError"):
        request.args["keys"].part(1)
