"""The wire protocol: round trips of every op, a fuzzed decoder, and bad frames at a live daemon.

Whatever a peer sends, the daemon answers with an error reply or closes that
one connection; a fresh client on the same daemon is served afterwards.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import threading
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dedupcore._core as _core
from dedupcore.api import InProgressError, Outcome
from dedupcore.client import Client
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import FrameError, Op, Status
from dedupcore.errors import (
    ConflictError,
    CorruptFileError,
    DedupError,
    StaleTokenError,
    UnavailableError,
)
from dedupcore.memory import MemoryTable
from dedupcore.record import State
from tests.support.daemon import Daemon, serving
from tests.support.stores import unique_ns

HEADER = struct.Struct(">I")


class Raw:
    """A bare socket speaking (or abusing) the protocol."""

    def __init__(self, path: Any, timeout: float = 60.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> bool:
        """Sends; False if the daemon already hung up."""
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def send_body(self, body: bytes) -> bool:
        return self.send(HEADER.pack(len(body)) + body)

    def request(self, request_id: int, op: int, args: Any) -> bool:
        return self.send_body(msgpack.packb([request_id, op, args], use_bin_type=True))

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return buf

    def response(self) -> tuple[int, Status, Any] | None:
        """The next response, or None when the daemon closed the connection."""
        header = self._exact(4)
        if header is None:
            return None
        body = self._exact(HEADER.unpack(header)[0])
        assert body is not None, "the daemon sent a truncated frame"
        return protocol.decode_response(body)

    def call(self, request_id: int, op: int, args: Any) -> tuple[int, Status, Any]:
        assert self.request(request_id, op, args)
        reply = self.response()
        assert reply is not None, "the daemon hung up on a well-framed request"
        return reply

    def at_eof(self) -> bool:
        """True when the daemon has closed (after any replies still buffered)."""
        while True:
            reply = self.response()
            if reply is None:
                return True


def ok(reply: tuple[int, Status, Any], request_id: int) -> Any:
    rid, status, payload = reply
    assert (rid, status) == (request_id, Status.OK), payload
    return payload


def error(reply: tuple[int, Status, Any] | None, request_id: int | None = None) -> dict[str, Any]:
    assert reply is not None, "expected an error reply, the connection was closed"
    rid, status, payload = reply
    assert status is Status.ERROR, payload
    if request_id is not None:
        assert rid == request_id
    assert isinstance(payload, dict) and isinstance(payload["message"], str)
    return payload


def assert_still_serving(daemon: Daemon) -> None:
    """A fresh client on the daemon gets answers."""
    with Client(daemon.socket, timeout=60.0) as c:
        assert c.ping()
        ns = unique_ns("after")
        claim = c.claim("k", namespace=ns)
        assert claim.outcome is Outcome.NEW
        c.complete("k", claim.token, namespace=ns)
        assert c.claim("k", namespace=ns).outcome is Outcome.DUPLICATE


# -- round trips of every op ------------------------------------------------------------------


def test_every_op_round_trips_over_a_raw_socket(daemon: Daemon) -> None:
    ns = unique_ns()
    with Raw(daemon.socket) as r:
        assert ok(r.call(1, Op.PING, {}), 1) == "pong"
        rows = ok(
            r.call(
                2,
                Op.CLAIM_MANY,
                {"ns": ns, "keys": [b"a", "b", b"a"], "lease": 30.0, "owner": None, "fps": None},
            ),
            2,
        )
        assert rows == [
            ["new", 1, None, True, False],
            ["new", 1, None, True, False],
            ["in_progress", 1, None, True, False],
        ]
        # Optional arguments may be left out.
        assert ok(r.call(3, Op.CLAIM_MANY, {"ns": ns, "keys": ["c"]}), 3) == [
            ["new", 1, None, True, False]
        ]
        items = [[b"a", 1, {"r": [1, b"x"]}], ["b", 1]]
        assert ok(r.call(4, Op.COMPLETE_MANY, {"ns": ns, "items": items}), 4) is None
        assert ok(r.call(5, Op.RELEASE_MANY, {"ns": ns, "items": [["c", 1]]}), 5) is None
        rows = ok(r.call(6, Op.CLAIM_MANY, {"ns": ns, "keys": [b"a", "b", "c"]}), 6)
        assert rows == [
            ["duplicate", 1, {"r": [1, b"x"]}, True, False],
            ["duplicate", 1, None, True, False],
            ["new", 2, None, True, False],
        ]
        rec = ok(r.call(7, Op.GET, {"ns": ns, "key": b"a"}), 7)
        assert set(rec) == {
            "state",
            "token",
            "owner",
            "fingerprint",
            "result",
            "created",
            "updated",
            "exact",
        }
        assert rec["state"] == int(State.PROCESSED) and rec["result"] == {"r": [1, b"x"]}
        assert ok(r.call(8, Op.GET, {"ns": ns, "key": "missing"}), 8) is None
        stats = ok(r.call(9, Op.STATS, {}), 9)
        assert stats["namespaces"][ns]["new"] == 4
        assert stats["daemon"]["requests"] >= 9 and stats["daemon"]["connections_open"] >= 1
        # A store error arrives by name, with the request id.
        payload = error(r.call(10, Op.COMPLETE_MANY, {"ns": ns, "items": [["c", 1]]}), 10)
        assert payload["type"] == "StaleTokenError"
        rows = ok(
            r.call(11, Op.CLAIM_MANY, {"ns": ns, "keys": ["fp"], "owner": "w", "fps": [b"f"]}), 11
        )
        assert rows[0][0] == "new"
        payload = error(r.call(12, Op.CLAIM_MANY, {"ns": ns, "keys": ["fp"], "fps": [b"g"]}), 12)
        assert payload["type"] == "ConflictError"


def _extend_round_trips(path: Any) -> None:
    ns = unique_ns()
    with Raw(path) as r:
        rows = ok(r.call(1, Op.CLAIM_MANY, {"ns": ns, "keys": ["a", "b"], "lease": 30.0}), 1)
        assert [row[:2] for row in rows] == [["new", 1], ["new", 1]]
        items = [["a", 1], [b"b", 1]]
        assert ok(r.call(2, Op.EXTEND_MANY, {"ns": ns, "items": items, "lease": 600}), 2) is None
        # The lease may be left out (the store's default), or nil.
        assert ok(r.call(3, Op.EXTEND_MANY, {"ns": ns, "items": items}), 3) is None
        assert ok(r.call(4, Op.EXTEND_MANY, {"ns": ns, "items": [], "lease": None}), 4) is None
        assert ok(r.call(5, Op.COMPLETE_MANY, {"ns": ns, "items": [["b", 1]]}), 5) is None
        payload = error(r.call(6, Op.EXTEND_MANY, {"ns": ns, "items": items}), 6)
        assert payload["type"] == "StaleTokenError" and "extended" in payload["message"]
        payload = error(r.call(7, Op.EXTEND_MANY, {"ns": ns, "items": [["a", 2]]}), 7)
        assert payload["type"] == "StaleTokenError"
        rec = ok(r.call(8, Op.GET, {"ns": ns, "key": "a"}), 8)
        assert rec["state"] == int(State.PROCESSING) and rec["token"] == 1


def test_extend_many_round_trips_over_a_raw_socket(daemon: Daemon) -> None:
    """The embedded store's renewals, decided on the event loop."""
    _extend_round_trips(daemon.socket)
    assert_still_serving(daemon)


def test_extend_many_round_trips_on_a_store_served_from_the_thread_pool() -> None:
    """A store that does not decide on the loop (here the memory table) renews in the
    daemon's thread pool."""
    with serving(MemoryTable()) as (_server, path):
        _extend_round_trips(path)


def test_pipelined_requests_get_their_own_replies(daemon: Daemon) -> None:
    ns = unique_ns()
    with Raw(daemon.socket) as r:
        burst = b"".join(
            protocol.encode_request(100 + i, Op.CLAIM_MANY, {"ns": ns, "keys": [f"p{i}"]})
            for i in range(30)
        )
        burst += protocol.encode_request(200, Op.PING, {})
        burst += protocol.encode_request(201, 99, {})  # type: ignore[arg-type]
        burst += protocol.encode_request(202, Op.GET, {"ns": ns, "key": 5})
        assert r.send(burst)
        replies = {}
        for _ in range(33):
            reply = r.response()
            assert reply is not None
            replies.setdefault(reply[0], []).append(reply)
        for i in range(30):
            ((_, status, rows),) = replies[100 + i]
            assert status is Status.OK and rows == [["new", 1, None, True, False]]
        assert replies[200] == [(200, Status.OK, "pong")]
        # A frame that does not decode cannot be tied to its id: it is answered as id 0.
        assert error(replies[0][0])["type"] == "FrameError"
        assert error(replies[202][0])["type"] == "TypeError"
        assert ok(r.call(300, Op.PING, {}), 300) == "pong"


def test_every_op_through_the_client(daemon: Daemon) -> None:
    ns = unique_ns()
    with daemon.client() as c:
        assert c.ping() is True
        claims = c.claim_many([b"a", "b"], namespace=ns, lease=10.0, owner="o")
        assert [x.outcome for x in claims] == [Outcome.NEW, Outcome.NEW]
        assert c.claim("z", namespace=ns, fingerprint=b"f").outcome is Outcome.NEW
        c.complete_many([(b"a", claims[0].token, "ra")], namespace=ns)
        c.release_many([("b", claims[1].token)], namespace=ns)
        c.complete("z", 1, namespace=ns, result=1)
        rec = c.get(b"a", namespace=ns)
        assert rec is not None and rec.state is State.PROCESSED and rec.result == "ra"
        assert rec.owner == b"o"
        b = c.get("b", namespace=ns)
        assert b is not None and b.state is State.RELEASED
        stats = c.stats()
        assert stats["namespaces"][ns]["new"] == 3
        assert {"requests", "errors", "protocol_errors", "connections_open"} <= set(stats["daemon"])


def test_client_threads_share_one_client(daemon: Daemon) -> None:
    ns = unique_ns()
    new_counts: list[int] = []
    errors: list[BaseException] = []
    client = daemon.client()

    def work(n: int) -> None:
        try:
            keys = [f"k{i}" for i in range(2000)]
            got = 0
            for start in range(0, 2000, 250):
                batch = keys[start : start + 250]
                got += sum(
                    c.outcome is Outcome.NEW
                    for c in client.claim_many(batch, namespace=ns, owner=f"t{n}")
                )
            new_counts.append(got)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    assert not errors
    assert sum(new_counts) == 2000


def test_error_names_map_to_the_same_classes() -> None:
    for cls in (
        DedupError,
        ConflictError,
        StaleTokenError,
        UnavailableError,
        CorruptFileError,
        InProgressError,
        FrameError,
        ValueError,
        TypeError,
    ):
        body = protocol.encode_error(7, cls("why"))[4:]
        rid, status, payload = protocol.decode_response(body)
        assert (rid, status) == (7, Status.ERROR)
        exc = protocol.error_from_payload(payload)
        assert type(exc) is cls and str(exc) == "why"
    # Anything else is a DedupError; an OSError means the store could not answer.
    exc = protocol.error_from_payload(
        protocol.decode_response(protocol.encode_error(1, KeyError("x"))[4:])[2]
    )
    assert type(exc) is DedupError
    exc = protocol.error_from_payload(
        protocol.decode_response(protocol.encode_error(1, OSError(5, "EIO"))[4:])[2]
    )
    assert type(exc) is UnavailableError
    assert type(protocol.error_from_payload("junk")) is DedupError
    assert type(protocol.error_from_payload({"type": "SystemExit"})) is DedupError


# -- the decoder, fuzzed --------------------------------------------------------------------

msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.binary(max_size=8), children, max_size=5)
    ),
    max_leaves=20,
)
# Anything msgpack can hold, including map keys the decoder refuses (ints, floats, None).
msgpack_any = st.recursive(
    msgpack_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(msgpack_scalars, children, max_size=5)
    ),
    max_leaves=20,
)
# Messages shaped like [id, op/status, args/payload], with every field fuzzed.
shaped = st.lists(msgpack_any, min_size=3, max_size=3) | st.tuples(
    st.integers(min_value=-(2**63), max_value=2**64 - 1) | msgpack_scalars,
    st.integers(min_value=-2, max_value=8) | msgpack_scalars,
    st.dictionaries(st.text(max_size=6), msgpack_any, max_size=5) | msgpack_any,
).map(list)


def _only_frame_errors(decode: Any, body: bytes) -> None:
    # Anything but FrameError propagates and fails the test with its type.
    with contextlib.suppress(FrameError):
        decode(body)


@settings(max_examples=1500)
@given(st.binary(max_size=200))
def test_fuzz_decode_request_bytes(body: bytes) -> None:
    _only_frame_errors(protocol.decode_request, body)


@settings(max_examples=1500)
@given(st.binary(max_size=200))
def test_fuzz_decode_response_bytes(body: bytes) -> None:
    _only_frame_errors(protocol.decode_response, body)


@settings(max_examples=800)
@given(msgpack_any | shaped)
@example([float("inf"), 1, {}])
@example([float("nan"), 1, {}])
@example([2**64 - 1, 1.0, {}])
@example([1, [1], {}])
@example([1, {"op": 1}, {}])
@example([1, float("inf"), {}])
@example([1, 1, {1: 2}])
def test_fuzz_decode_request_structures(msg: Any) -> None:
    body = msgpack.packb(msg, use_bin_type=True)
    try:
        request = protocol.decode_request(body)
    except FrameError:
        return
    assert isinstance(request.request_id, int) and not isinstance(request.request_id, bool)
    assert 0 <= request.request_id <= 2**64 - 1
    assert isinstance(request.op, Op) and isinstance(request.args, dict)


@settings(max_examples=800)
@given(msgpack_any | shaped)
@example([float("inf"), 0, None])
@example([float("-inf"), 1, {}])
@example([float("nan"), 0, None])
@example([[1], 0, None])
@example([1, [0], None])
@example([1, {"s": 0}, None])
@example([1, float("inf"), None])
def test_fuzz_decode_response_structures(msg: Any) -> None:
    body = msgpack.packb(msg, use_bin_type=True)
    try:
        rid, status, _ = protocol.decode_response(body)
    except FrameError:
        return
    assert isinstance(rid, int) and isinstance(status, Status)


@given(st.binary(min_size=4, max_size=4), st.integers(min_value=1, max_value=2**32))
def test_fuzz_frame_length(header: bytes, limit: int) -> None:
    try:
        n = protocol.frame_length(header, limit)
    except FrameError:
        assert HEADER.unpack(header)[0] in (0,) or HEADER.unpack(header)[0] > limit
        return
    assert 1 <= n <= limit and n == HEADER.unpack(header)[0]


@given(msgpack_any)
def test_fuzz_error_from_payload_never_raises(payload: Any) -> None:
    assert isinstance(protocol.error_from_payload(payload), BaseException)


def _no_nan(v: Any) -> bool:
    if isinstance(v, float):
        return not math.isnan(v)
    if isinstance(v, list):
        return all(_no_nan(x) for x in v)
    if isinstance(v, dict):
        return all(_no_nan(x) for x in v.values())
    return True


@given(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.sampled_from(list(Op)),
    st.dictionaries(st.text(max_size=8), msgpack_values, max_size=5).filter(_no_nan),
)
def test_request_encoding_round_trips(request_id: int, op: Op, args: dict[str, Any]) -> None:
    data = protocol.encode_request(request_id, op, args)
    assert protocol.frame_length(data[:4], protocol.DEFAULT_MAX_FRAME) == len(data) - 4
    request = protocol.decode_request(data[4:])
    assert (request.request_id, request.op, request.args) == (request_id, op, args)


@given(st.integers(min_value=0, max_value=2**64 - 1), msgpack_values.filter(_no_nan))
def test_response_encoding_round_trips(request_id: int, result: Any) -> None:
    data = protocol.encode_response(request_id, result)
    assert protocol.decode_response(data[4:]) == (request_id, Status.OK, result)


@settings(max_examples=150, suppress_health_check=list(HealthCheck))
@given(body=st.binary(min_size=1, max_size=300) | (msgpack_any | shaped).map(msgpack.packb))
def test_fuzz_live_daemon_with_well_framed_garbage(daemon: Daemon, body: bytes) -> None:
    """A well-framed body, whatever it holds, gets a reply; the connection stays usable."""
    with Raw(daemon.socket) as r:
        assert r.send_body(body)
        reply = r.response()
        assert reply is not None, f"closed on a well-framed body {body!r}"
        assert ok(r.call(4242, Op.PING, {}), 4242) == "pong"


# -- bad frames at a live daemon ----------------------------------------------------------------


def _framed(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


CLOSING_FAULTS = [
    pytest.param(b"GET / HTTP/1.1\r\nHost: dedupcore\r\n\r\n", id="http-garbage"),
    pytest.param(b"\xde\xad\xbe\xef" + bytes(range(256)), id="binary-garbage"),
    pytest.param(HEADER.pack(0), id="length-0"),
    pytest.param(HEADER.pack(0) + _framed([1, 1, {}]), id="length-0-then-a-frame"),
    pytest.param(HEADER.pack(2**32 - 1), id="length-2**32-1"),
    pytest.param(HEADER.pack(2**32 - 1) + b"x" * 1000, id="length-2**32-1-with-data"),
    pytest.param(HEADER.pack((16 << 20) + 1), id="length-over-the-limit"),
]


@pytest.mark.parametrize("data", CLOSING_FAULTS)
def test_unframeable_input_gets_an_error_and_the_connection_closes(
    daemon: Daemon, data: bytes
) -> None:
    with Raw(daemon.socket) as r:
        r.send(data)
        reply = r.response()
        payload = error(reply, 0)
        assert payload["type"] == "FrameError"
        assert r.at_eof()
    assert_still_serving(daemon)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(HEADER.pack(100) + b"x" * 10, id="truncated-body"),
        pytest.param(HEADER.pack(100), id="header-only"),
        pytest.param(b"\x00\x00", id="half-header"),
        pytest.param(_framed([1, Op.PING, {}])[:-1], id="ping-minus-one-byte"),
    ],
)
def test_truncated_frame_then_close(daemon: Daemon, data: bytes) -> None:
    with Raw(daemon.socket) as r:
        r.send(data)
        r.sock.shutdown(socket.SHUT_WR)
        assert r.at_eof()
    assert_still_serving(daemon)


BAD_REQUESTS = [
    # (request body, expected error type)
    pytest.param([5, 99, {}], "FrameError", id="unknown-op"),
    pytest.param([5, 0, {}], "FrameError", id="op-0"),
    pytest.param([5, -1, {}], "FrameError", id="op-negative"),
    pytest.param([5, "PING", {}], "FrameError", id="op-str"),
    pytest.param([5, None, {}], "FrameError", id="op-none"),
    pytest.param([5, 1, []], "FrameError", id="args-list"),
    pytest.param([5, 1, None], "FrameError", id="args-none"),
    pytest.param([5, 1], "FrameError", id="two-fields"),
    pytest.param([5, 1, {}, 4], "FrameError", id="four-fields"),
    pytest.param({"id": 5}, "FrameError", id="map-not-list"),
    pytest.param("hello", "FrameError", id="a-string"),
    pytest.param([-1, 1, {}], "FrameError", id="id-negative"),
    pytest.param([-(2**63), 1, {}], "FrameError", id="id-int64-min"),
    pytest.param(["5", 1, {}], "FrameError", id="id-str"),
    pytest.param([b"5", 1, {}], "FrameError", id="id-bytes"),
    pytest.param([5.0, 1, {}], "FrameError", id="id-float"),
    pytest.param([True, 1, {}], "FrameError", id="id-bool"),
    pytest.param([None, 1, {}], "FrameError", id="id-none"),
    pytest.param([5, Op.CLAIM_MANY, {"keys": ["k"]}], "FrameError", id="missing-ns"),
    pytest.param([5, Op.CLAIM_MANY, {"ns": "n"}], "FrameError", id="missing-keys"),
    pytest.param([5, Op.CLAIM_MANY, {"ns": 5, "keys": ["k"]}], "TypeError", id="ns-int"),
    pytest.param([5, Op.CLAIM_MANY, {"ns": b"n", "keys": ["k"]}], "TypeError", id="ns-bytes"),
    pytest.param([5, Op.CLAIM_MANY, {"ns": "a b", "keys": ["k"]}], "ValueError", id="ns-bad"),
    pytest.param([5, Op.CLAIM_MANY, {"ns": "n", "keys": "k"}], "TypeError", id="keys-str"),
    pytest.param([5, Op.CLAIM_MANY, {"ns": "n", "keys": {"k": 1}}], "TypeError", id="keys-map"),
    pytest.param([5, Op.CLAIM_MANY, {"ns": "n", "keys": [1]}], "TypeError", id="key-int"),
    pytest.param([5, Op.CLAIM_MANY, {"ns": "n", "keys": [["k"]]}], "TypeError", id="key-list"),
    pytest.param([5, Op.CLAIM_MANY, {"ns": "n", "keys": [None]}], "TypeError", id="key-none"),
    pytest.param([5, Op.CLAIM_MANY, {"ns": "n", "keys": [b""]}], "ValueError", id="key-empty"),
    pytest.param([5, Op.CLAIM_MANY, {"ns": "n", "keys": [b"x" * 513]}], "ValueError", id="key-513"),
    pytest.param(
        [5, Op.CLAIM_MANY, {"ns": "n", "keys": ["k" * (1 << 20)]}],
        "ValueError",
        id="key-1MiB",
    ),
    pytest.param(
        [5, Op.CLAIM_MANY, {"ns": "n", "keys": ["k"], "lease": "30"}],
        "TypeError",
        id="lease-str",
    ),
    pytest.param(
        [5, Op.CLAIM_MANY, {"ns": "n", "keys": ["k"], "lease": -1}],
        "ValueError",
        id="lease-negative",
    ),
    pytest.param(
        [5, Op.CLAIM_MANY, {"ns": "n", "keys": ["k"], "lease": True}],
        "TypeError",
        id="lease-bool",
    ),
    pytest.param(
        [5, Op.CLAIM_MANY, {"ns": "n", "keys": ["k"], "owner": 5}],
        "TypeError",
        id="owner-int",
    ),
    pytest.param(
        [5, Op.CLAIM_MANY, {"ns": "n", "keys": ["k"], "fps": b"f"}],
        "TypeError",
        id="fps-bytes",
    ),
    pytest.param(
        [5, Op.CLAIM_MANY, {"ns": "n", "keys": ["k"], "fps": [5]}],
        "TypeError",
        id="fp-int",
    ),
    pytest.param([5, Op.COMPLETE_MANY, {"ns": "n", "items": "k"}], "TypeError", id="items-str"),
    pytest.param(
        [5, Op.COMPLETE_MANY, {"ns": "n", "items": [["k"]]}], "TypeError", id="item-short"
    ),
    pytest.param(
        [5, Op.COMPLETE_MANY, {"ns": "n", "items": [["k", 1, None, 4]]}],
        "TypeError",
        id="item-long",
    ),
    pytest.param(
        [5, Op.COMPLETE_MANY, {"ns": "n", "items": [{"k": 1}]}], "TypeError", id="item-map"
    ),
    pytest.param(
        [5, Op.COMPLETE_MANY, {"ns": "n", "items": [["k", "1"]]}],
        "TypeError",
        id="token-str",
    ),
    pytest.param(
        [5, Op.COMPLETE_MANY, {"ns": "n", "items": [["k", -3]]}],
        "ValueError",
        id="token-negative",
    ),
    pytest.param(
        [5, Op.RELEASE_MANY, {"ns": "n", "items": [["k", 1, "r"]]}],
        "TypeError",
        id="release-with-result",
    ),
    pytest.param([5, Op.GET, {"ns": "n", "key": 5}], "TypeError", id="get-key-int"),
    pytest.param([5, Op.GET, {"ns": "n", "key": [b"k"]}], "TypeError", id="get-key-list"),
    pytest.param([5, Op.GET, {"ns": "n"}], "FrameError", id="get-no-key"),
]


@pytest.mark.parametrize(("message", "kind"), BAD_REQUESTS)
def test_bad_request_gets_an_error_reply_and_the_connection_stays_usable(
    daemon: Daemon, message: Any, kind: str
) -> None:
    # A message that decodes is answered under its id; one that does not, under id 0.
    try:
        protocol.decode_request(msgpack.packb(message))
        request_id = 5
    except FrameError:
        request_id = 0
    with Raw(daemon.socket) as r:
        assert r.send(_framed(message))
        payload = error(r.response(), request_id)
        assert payload["type"] == kind, payload
        assert ok(r.call(6, Op.PING, {}), 6) == "pong"
    assert_still_serving(daemon)


#: EXTEND_MANY requests that decode (op 7 is known) and are refused by their arguments.
BAD_EXTENSIONS = [
    pytest.param([5, Op.EXTEND_MANY, {"items": [["k", 1]]}], "FrameError", id="extend-no-ns"),
    pytest.param([5, Op.EXTEND_MANY, {"ns": "n"}], "FrameError", id="extend-no-items"),
    pytest.param(
        [5, Op.EXTEND_MANY, {"ns": 5, "items": [["k", 1]]}], "TypeError", id="extend-ns-int"
    ),
    pytest.param(
        [5, Op.EXTEND_MANY, {"ns": "n", "items": "k"}], "TypeError", id="extend-items-str"
    ),
    pytest.param(
        [5, Op.EXTEND_MANY, {"ns": "n", "items": [["k"]]}], "TypeError", id="extend-item-short"
    ),
    pytest.param(
        [5, Op.EXTEND_MANY, {"ns": "n", "items": [["k", 1, "r"]]}],
        "TypeError",
        id="extend-with-result",
    ),
    pytest.param(
        [5, Op.EXTEND_MANY, {"ns": "n", "items": [["k", "1"]]}],
        "TypeError",
        id="extend-token-str",
    ),
    pytest.param(
        [5, Op.EXTEND_MANY, {"ns": "n", "items": [[5, 1]]}], "TypeError", id="extend-key-int"
    ),
    pytest.param(
        [5, Op.EXTEND_MANY, {"ns": "n", "items": [["k", 1]], "lease": "30"}],
        "TypeError",
        id="extend-lease-str",
    ),
    pytest.param(
        [5, Op.EXTEND_MANY, {"ns": "n", "items": [["k", 1]], "lease": 0}],
        "ValueError",
        id="extend-lease-zero",
    ),
    pytest.param(
        [5, Op.EXTEND_MANY, {"ns": "n", "items": [["k", 1]], "lease": True}],
        "TypeError",
        id="extend-lease-bool",
    ),
]


@pytest.mark.parametrize(("message", "kind"), BAD_EXTENSIONS)
def test_a_bad_extend_many_gets_an_error_reply_under_its_id(
    daemon: Daemon, message: Any, kind: str
) -> None:
    with Raw(daemon.socket) as r:
        assert r.send(_framed(message))
        payload = error(r.response(), 5)
        assert payload["type"] == kind, payload
        assert ok(r.call(6, Op.PING, {}), 6) == "pong"
    assert_still_serving(daemon)


def test_request_id_extremes_are_echoed(daemon: Daemon) -> None:
    with Raw(daemon.socket) as r:
        for rid in (0, 1, 2**32, 2**63, 2**64 - 1):
            assert ok(r.call(rid, Op.PING, {}), rid) == "pong"


def test_well_framed_msgpack_garbage(daemon: Daemon) -> None:
    with Raw(daemon.socket) as r:
        for body in (b"\xc1" * 10, b"\x93\x01", b"\x93\x01\x01\x80\x00", b"\xff"):
            assert r.send_body(body)
            assert error(r.response(), 0)["type"] == "FrameError"
        assert ok(r.call(1, Op.PING, {}), 1) == "pong"
    assert_still_serving(daemon)


def test_a_reply_too_large_for_a_frame_is_an_error_not_a_broken_stream(daemon: Daemon) -> None:
    ns = unique_ns()
    keys = [f"big{i}" for i in range(300)]
    with daemon.client() as c:
        claims = c.claim_many(keys, namespace=ns)
        big = b"r" * 60_000
        for start in range(0, 300, 100):
            c.complete_many(
                [(x.key, x.token, big) for x in claims[start : start + 100]], namespace=ns
            )
        args = protocol.claim_args(ns, keys, None, None, None)
        with pytest.raises(ValueError):
            c._call(Op.CLAIM_MANY, args)  # ~18 MB of results in one reply
        assert c.ping()
        assert all(x.result == big for x in c.claim_many(keys[:100], namespace=ns))
        # The client's claim_many sends such a batch again in halves.
        assert all(x.result == big for x in c.claim_many(keys, namespace=ns))


def test_a_request_over_the_frame_limit_is_refused_by_the_client(daemon: Daemon) -> None:
    ns = unique_ns()
    with daemon.client(max_frame=64 << 10) as c:
        (claim,) = c.claim_many(["k"], namespace=ns)
        # One item larger than a frame cannot be split: refused before it is sent.
        with pytest.raises(ValueError, match="frame"):
            c.complete("k", claim.token, namespace=ns, result=b"x" * (100 << 10))
        assert c.ping()
        c.complete("k", claim.token, namespace=ns, result=b"fits")


def test_protocol_errors_are_counted(daemon: Daemon) -> None:
    with daemon.client() as c:
        before = c.stats()["daemon"]["protocol_errors"]
        with Raw(daemon.socket) as r:
            r.send(HEADER.pack(0))
            assert r.at_eof()
        assert c.stats()["daemon"]["protocol_errors"] > before


# -- one-key requests: read and answered natively, the same answers ---------------------


def _one_key(
    request_id: int, op: Op, ns: str, key: Any, token: int = 0, packed: Any = None
) -> bytes:
    frame = _core.one_key_frame(request_id, op, ns, key, token, packed)
    assert frame is not None
    return frame


def test_one_key_frames_get_the_answers_their_map_forms_get(daemon: Daemon) -> None:
    """The same one-key requests, once as the sync client frames them (read natively) and
    once as a map with every argument (read by the protocol module): the same replies."""
    ns = unique_ns("one")
    with Raw(daemon.socket) as r:
        for form in ("native", "map"):
            key = f"{form}-k"
            if form == "native":
                assert r.send(_one_key(1, Op.CLAIM_MANY, ns, key))
            else:
                assert r.request(1, Op.CLAIM_MANY, protocol.claim_args(ns, [key], None, None, None))
            [new] = protocol.claims_from_reply([key], ns, ok(r.response(), 1))
            assert (new.outcome, new.exact, new.takeover) == (Outcome.NEW, True, False)
            again = _one_key(2, Op.CLAIM_MANY, ns, key)
            assert r.send(again)
            assert _core.one_key_reply(r._exact(HEADER.unpack(r._exact(4))[0]), 2) == (2, new.token)
            packed = msgpack.packb({"done": form}, use_bin_type=True)
            if form == "native":
                assert r.send(_one_key(3, Op.COMPLETE_MANY, ns, key, new.token, packed))
            else:
                assert r.request(
                    3, Op.COMPLETE_MANY, {"ns": ns, "items": [[key, new.token, {"done": form}]]}
                )
            assert ok(r.response(), 3) is None
            # A duplicate with a result: the protocol module frames that reply.
            assert r.send(_one_key(4, Op.CLAIM_MANY, ns, key))
            [dup] = protocol.claims_from_reply([key], ns, ok(r.response(), 4))
            assert (dup.outcome, dup.result) == (Outcome.DUPLICATE, {"done": form})
            held = ok(r.call(5, Op.CLAIM_MANY, {"ns": ns, "keys": [f"{form}-r"]}), 5)
            token = protocol.claims_from_reply([f"{form}-r"], ns, held)[0].token
            assert r.send(_one_key(6, Op.RELEASE_MANY, ns, f"{form}-r", token))
            assert ok(r.response(), 6) is None
            assert r.send(_one_key(7, Op.RELEASE_MANY, ns, f"{form}-r", token))
            assert error(r.response(), 7)["type"] == "StaleTokenError"
    assert_still_serving(daemon)


@pytest.mark.parametrize(
    ("frame", "kind", "rid"),
    [
        # A completion whose result is no msgpack: the body does not decode, so the
        # reply comes under id 0, as for any such body.
        pytest.param(
            lambda: _one_key(5, Op.COMPLETE_MANY, "n", b"k", 1, b"\xc1"),
            "FrameError",
            0,
            id="result-not-msgpack",
        ),
        pytest.param(
            lambda: _one_key(5, Op.COMPLETE_MANY, "n", b"k", 1, b"\x01\x02"),
            "FrameError",
            0,
            id="result-two-objects",
        ),
        # Checked as every request is: the key, the namespace, the token.
        pytest.param(lambda: _one_key(5, Op.CLAIM_MANY, "n", b""), "ValueError", 5, id="empty-key"),
        pytest.param(
            lambda: _one_key(5, Op.CLAIM_MANY, "", b"k"), "ValueError", 5, id="empty-namespace"
        ),
        pytest.param(
            lambda: _one_key(5, Op.CLAIM_MANY, "n", b"k" * 513), "ValueError", 5, id="key-too-long"
        ),
        pytest.param(
            lambda: _one_key(5, Op.RELEASE_MANY, "n", b"k", 0), "ValueError", 5, id="token-zero"
        ),
        pytest.param(
            lambda: _one_key(5, Op.RELEASE_MANY, "n", b"k", 1 << 63),
            "ValueError",
            5,
            id="token-over",
        ),
        pytest.param(
            lambda: _one_key(5, Op.COMPLETE_MANY, "n", b"never-claimed", 9),
            "StaleTokenError",
            5,
            id="stale",
        ),
    ],
)
def test_a_bad_one_key_request_gets_the_error_its_map_form_gets(
    daemon: Daemon, frame: Any, kind: str, rid: int
) -> None:
    with Raw(daemon.socket) as r:
        assert r.send(frame())
        payload = error(r.response(), rid)
        assert payload["type"] == kind, payload
        assert ok(r.call(6, Op.PING, {}), 6) == "pong"
    assert_still_serving(daemon)


def test_a_one_key_frame_with_a_namespace_not_utf8_is_refused_as_any_frame(daemon: Daemon) -> None:
    body = bytearray(_one_key(5, Op.CLAIM_MANY, "nn", b"k")[4:])
    at = body.index(b"\xa2nn")
    body[at + 1 : at + 3] = b"\xff\xfe"  # the namespace's bytes, no longer UTF-8
    with Raw(daemon.socket) as r:
        assert r.send_body(bytes(body))
        error(r.response(), 0)  # not decodable: answered under id 0
        assert ok(r.call(6, Op.PING, {}), 6) == "pong"
    assert_still_serving(daemon)
