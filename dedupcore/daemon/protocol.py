"""The wire protocol between ``dedupcore serve`` and its clients; the one place it is defined.

A connection carries frames in both directions. A frame is a 4-byte
big-endian length followed by that many bytes of msgpack (``use_bin_type``,
so ``bytes`` and ``str`` keys stay distinct). No pickle anywhere.

Request body:  ``[request_id, op, args]``
Response body: ``[request_id, status, payload]``

``request_id`` is a client-chosen unsigned integer echoed in the response,
so a client may pipeline several requests on one connection; the daemon
answers in any order. ``status`` is ``OK`` (payload: the result) or
``ERROR`` (payload: ``{"type": <exception name>, "message": <text>}``); the
client raises the same exception class the store would have raised.

Ops and their ``args`` (a map) and results:

- ``PING`` (1): ``{}`` -> ``"pong"``
- ``CLAIM_MANY`` (2): ``ns``, ``keys``, ``lease``?, ``owner``?, ``fps``?, ``cols``?
  -> ``[[outcome, token, result, exact, takeover], ...]`` in key order, or with
  ``cols: 1`` the same answers in columns, a map (see :class:`ClaimColumns`);
  a daemon that predates ``cols`` ignores it and sends rows, so a client
  accepts both (a list is rows, a map is columns)
- ``COMPLETE_MANY`` (3): ``ns``, ``items``: ``[[key, token, result?], ...]`` -> ``None``
- ``RELEASE_MANY`` (4): ``ns``, ``items``: ``[[key, token], ...]`` -> ``None``
- ``GET`` (5): ``ns``, ``key`` -> a record map or ``None``
- ``STATS`` (6): ``{}`` -> the store's ``stats()`` map plus ``daemon`` counters
- ``EXTEND_MANY`` (7): ``ns``, ``items``: ``[[key, token], ...]``, ``lease``? (seconds;
  absent or nil: the store's default) -> ``None``; every claim renewed, or none
- ``WAIT`` (8): ``ns``, ``keys``, ``timeout`` (seconds, 0 to 3600) -> ``"woken"`` once
  one of the keys may have changed (completed, released, or the first of their leases
  ran out), ``"timeout"`` after ``timeout`` seconds, or ``"poll"``: the daemon will not
  wake this waiter (its store has other writers, too many wait, or it is stopping), and
  the client asks again after a backoff (docs/daemon.md, "Waiting on keys")

``outcome`` is ``Outcome.value`` ("new", "duplicate", "in_progress").
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any

import msgpack

import dedupcore._core as _core
import dedupcore._engine as _engine
import dedupcore.errors as errors
from dedupcore.api import Claim, KeyRecord, Outcome
from dedupcore.config import check_lease
from dedupcore.errors import FrameError
from dedupcore.record import State

if TYPE_CHECKING:  # the clients import this module: never the store (nor LMDB) at run time
    from dedupcore.store import ReplyColumns

__all__ = [
    "COLUMNS_ARG",
    "DEFAULT_MAX_FRAME",
    "HEADER",
    "OUTCOME_ORDER",
    "POLL",
    "SAFE_TO_REPEAT",
    "TIMED_OUT",
    "WOKEN",
    "ClaimColumns",
    "FrameError",
    "FrameItems",
    "OneClaim",
    "OneKey",
    "Op",
    "Request",
    "Status",
    "batch_request",
    "claim_args",
    "claim_columns",
    "claim_row",
    "claims_from_columns",
    "claims_from_reply",
    "claims_from_rows",
    "decode_request",
    "decode_response",
    "encode_error",
    "encode_request",
    "encode_response",
    "error_from_payload",
    "key_list",
    "one_key_payload",
    "one_key_request",
    "packed_len",
    "record_from_map",
    "record_map",
]

HEADER = struct.Struct(">I")
#: Largest frame either side accepts (16 MiB); a larger length prefix closes the connection.
DEFAULT_MAX_FRAME = 16 << 20
MAX_REQUEST_ID = (1 << 64) - 1


class Op(enum.IntEnum):
    """Operation codes."""

    PING = 1
    CLAIM_MANY = 2
    COMPLETE_MANY = 3
    RELEASE_MANY = 4
    GET = 5
    STATS = 6
    EXTEND_MANY = 7
    WAIT = 8


class Status(enum.IntEnum):
    """Response status codes."""

    OK = 0
    ERROR = 1


@dataclass(frozen=True, slots=True)
class Request:
    """A decoded request."""

    request_id: int
    op: Op
    args: dict[str, Any]


def frame(body: bytes) -> bytes:
    """The frame carrying ``body``."""
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes, max_frame: int) -> int:
    """The body length announced by a 4-byte header; FrameError if out of bounds."""
    (length,) = HEADER.unpack(header)
    if length == 0:
        raise FrameError("empty frame")
    if length > max_frame:
        raise FrameError(f"frame of {length} bytes exceeds the limit of {max_frame}")
    return int(length)


def _pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def _unpack(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ) as exc:
        # Some of msgpack's errors carry no message (too deep a nesting: StackError).
        why = str(exc) or type(exc).__name__
        raise FrameError(f"frame body is not valid msgpack: {why}") from None


def _three_fields(body: bytes, layout: str) -> list[Any]:
    """The three fields of a request or response body; FrameError saying ``layout`` otherwise."""
    msg = _unpack(body)
    if not isinstance(msg, list) or len(msg) != 3:
        raise FrameError(layout)
    return msg


def packed_len(obj: Any) -> int:
    """Bytes ``obj`` takes in a message."""
    return len(_pack(obj))


def encode_request(request_id: int, op: Op, args: dict[str, Any]) -> bytes:
    """A framed request; TypeError for a value msgpack cannot carry (e.g. an int over 64 bits)."""
    try:
        return frame(_pack([request_id, int(op), args]))
    except OverflowError as exc:
        raise TypeError(f"request holds a value msgpack cannot carry: {exc}") from None


def decode_request(body: bytes) -> Request:
    """A request from a frame body; FrameError naming what is wrong."""
    request_id, op, args = _three_fields(body, "a request is [request_id, op, args]")
    if isinstance(request_id, bool) or not isinstance(request_id, int):
        raise FrameError(f"request_id must be an unsigned integer, got {type(request_id).__name__}")
    if not 0 <= request_id <= MAX_REQUEST_ID:
        raise FrameError("request_id out of range")
    try:
        code = Op(op)
    except ValueError:
        raise FrameError(f"unknown op code {op!r}") from None
    if not isinstance(args, dict):
        raise FrameError(f"args must be a map, got {type(args).__name__}")
    return Request(request_id, code, args)


def encode_response(request_id: int, result: Any) -> bytes:
    """A framed OK response."""
    return frame(_pack([request_id, int(Status.OK), result]))


#: The exceptions a reply names, so that a client raises the class the store raised:
#: every public exception of dedupcore (all defined in dedupcore/errors.py, which lists
#: them), and the built-in ValueError and TypeError of a bad argument. Anything else
#: arrives as DedupError, an OSError as UnavailableError.
_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (*(getattr(errors, name) for name in errors.__all__), ValueError, TypeError)
}


def encode_error(request_id: int, exc: BaseException) -> bytes:
    """A framed ERROR response for an exception."""
    name = type(exc).__name__
    if _ERRORS.get(name) is not type(exc):  # another class of that name is not ours
        name = "DedupError"
    if isinstance(exc, OSError) and not isinstance(exc, errors.DedupError):
        name = "UnavailableError"
    return frame(_pack([request_id, int(Status.ERROR), {"type": name, "message": str(exc)}]))


def error_from_payload(payload: Any) -> BaseException:
    """The exception an ERROR response stands for."""
    if not isinstance(payload, dict):
        return errors.DedupError(f"malformed error reply: {payload!r}")
    cls = _ERRORS.get(str(payload.get("type")), errors.DedupError)
    return cls(str(payload.get("message", "")))


def decode_response(body: bytes) -> tuple[int, Status, Any]:
    """(request_id, status, payload) from a frame body."""
    request_id, status, payload = _three_fields(body, "a response is [request_id, status, payload]")
    if isinstance(request_id, bool) or not isinstance(request_id, int):
        raise FrameError(f"response request_id must be an integer, got {request_id!r:.40}")
    try:
        return request_id, Status(status), payload
    except ValueError:
        raise FrameError(f"unknown response status {status!r:.40}") from None


# -- op arguments and results, shared by the server and both clients ---------------

#: Ops a client may send again after a lost reply: repeating them changes nothing
#: (a renewal sent twice renews the claim from the second one's now; a wait changes nothing).
SAFE_TO_REPEAT = frozenset({Op.PING, Op.GET, Op.STATS, Op.COMPLETE_MANY, Op.EXTEND_MANY, Op.WAIT})

#: The answers of a WAIT: a key may have changed; the time is up; ask again after a backoff.
WOKEN, TIMED_OUT, POLL = "woken", "timeout", "poll"


_PLAIN_KEYS = frozenset({bytes, str})


def key_list(keys: Any) -> list[Any]:
    """Keys as msgpack carries them: bytes-likes become bytes; other types raise TypeError."""
    if type(keys) is list and set(map(type, keys)) <= _PLAIN_KEYS:
        return list(keys)  # the usual case, in C: every key exactly bytes or str
    out = []
    for k in keys:
        if isinstance(k, (bytearray, memoryview)):
            k = bytes(k)
        elif not isinstance(k, (bytes, str)):
            raise TypeError(f"key must be bytes or str, not {type(k).__name__}")
        out.append(k)
    return out


def claim_args(
    namespace: str, keys: list[Any], lease: Any, owner: Any, fingerprints: Any
) -> dict[str, Any]:
    """The args of a CLAIM_MANY request (the lease checked here, as the store checks it)."""
    return {
        "ns": namespace,
        "keys": keys,
        "lease": None if lease is None else check_lease(lease),
        "owner": owner,
        "fps": None if fingerprints is None else list(fingerprints),
        COLUMNS_ARG: 1,
    }


#: CLAIM_MANY argument by which a client asks for the reply in columns (see
#: :class:`ClaimColumns`); a daemon that does not know it ignores it and sends rows.
COLUMNS_ARG = "cols"
#: Outcomes as one byte each in a columns reply (the code is the index).
OUTCOME_ORDER = (Outcome.NEW, Outcome.DUPLICATE, Outcome.IN_PROGRESS)
_OUTCOME_CODE = {o: i for i, o in enumerate(OUTCOME_ORDER)}
_SWAP = sys.byteorder != "little"


class ClaimColumns:
    """A CLAIM_MANY reply in columns, built slice by slice.

    ``{"o": outcomes, one byte per key (0 NEW, 1 DUPLICATE, 2 IN_PROGRESS),
    "t": tokens as little-endian unsigned 64-bit integers, "ri"/"rv": the indexes
    and values of the results that are not None, "x": indexes of the answers
    that are not exact (cold archive), "k": indexes of the takeovers}``. A
    client asks for it with ``cols: 1``; a map instead of a list tells it apart
    from the rows an older daemon sends.
    """

    def __init__(self) -> None:
        self.outcomes = bytearray()
        self.tokens = array("Q")
        self.result_index: list[int] = []
        self.results: list[Any] = []
        self.cold: list[int] = []
        self.takeovers: list[int] = []

    def add(self, claims: list[Claim]) -> None:
        base = len(self.outcomes)
        code = _OUTCOME_CODE
        self.outcomes += bytes([code[c.outcome] for c in claims])
        self.tokens.extend([c.token for c in claims])
        for i, c in enumerate(claims, base):
            if c.result is not None:
                self.result_index.append(i)
                self.results.append(c.result)
            if not c.exact:
                self.cold.append(i)
            if c.takeover:
                self.takeovers.append(i)

    def add_columns(self, part: ReplyColumns) -> None:
        """Appends the columns of one slice as the store decided them
        (:meth:`DedupStore.claim_deferred` with ``form=FORM_COLUMNS``): no object per key."""
        outcomes, tokens, result_index, results, cold, takeovers = part
        base = len(self.outcomes)  # the slice's indexes continue the earlier slices'
        self.outcomes += outcomes
        self.tokens.frombytes(tokens)
        self.result_index.extend([i + base for i in result_index])
        self.cold.extend([i + base for i in cold])
        self.takeovers.extend([i + base for i in takeovers])
        self.results.extend(results)

    def payload(self) -> dict[str, Any]:
        tokens = self.tokens
        if _SWAP:  # pragma: no cover - big-endian hosts
            tokens = array("Q", tokens)
            tokens.byteswap()
        return {
            "o": bytes(self.outcomes),
            "t": tokens.tobytes(),
            "ri": self.result_index,
            "rv": self.results,
            "x": self.cold,
            "k": self.takeovers,
        }


def claim_columns(claims: list[Claim]) -> dict[str, Any]:
    """The claims as a columns reply (see :class:`ClaimColumns`)."""
    cols = ClaimColumns()
    cols.add(claims)
    return cols.payload()


def columns_payload(part: ReplyColumns) -> dict[str, Any]:
    """A columns reply of one batch as the store decided it (see :class:`ClaimColumns`)."""
    outcomes, tokens, result_index, results, cold, takeovers = part
    if _SWAP:  # pragma: no cover - big-endian hosts
        cols = ClaimColumns()
        cols.add_columns(part)
        return cols.payload()
    return {
        "o": outcomes,
        "t": tokens,
        "ri": result_index,
        "rv": results,
        "x": cold,
        "k": takeovers,
    }


# -- one-key requests, read and answered natively ---------------------------------------


@dataclass(frozen=True, slots=True)
class OneKey:
    """The args of a one-key CLAIM_MANY, COMPLETE_MANY or RELEASE_MANY as
    :func:`one_key_request` read them (the form the sync client sends its one-key
    calls in, ``_core.one_key_frame``): the namespace, the key, the token (0 for a
    claim) and a completion's result."""

    namespace: str
    key: bytes | str
    token: int
    value: Any

    def args(self, op: Op) -> dict[str, Any]:
        """The same args as a map, as ``decode_request`` gives them."""
        if op is Op.CLAIM_MANY:
            return {"ns": self.namespace, "keys": [self.key], COLUMNS_ARG: 1}
        return {"ns": self.namespace, "items": [self.item(op)]}

    def item(self, op: Op) -> list[Any]:
        """The one item of a COMPLETE_MANY (key, token, result) or RELEASE_MANY (key,
        token)."""
        if op is Op.COMPLETE_MANY:
            return [self.key, self.token, self.value]
        return [self.key, self.token]


_OP_OF = {int(op): op for op in Op}


def one_key_request(body: bytes) -> tuple[int, Op, OneKey] | None:
    """(request id, op, args) of a one-key request body read natively
    (``_core.one_key_request``); None for any other body, which
    :func:`decode_request` reads (and names what is wrong with), as it does a
    completion whose result does not decode."""
    one = _core.one_key_request(body)
    if one is None:
        return None
    request_id, code, namespace, key, token, packed = one
    value = None
    if packed is not None:
        try:
            value = _unpack(packed)
        except FrameError:
            return None
    return request_id, _OP_OF[code], OneKey(namespace, key, token, value)


# -- large batches, decoded a part at a time ---------------------------------------------

_heads = msgpack.Packer()


class FrameItems:
    """The keys of a large plain claim, or the items of a large completion or
    release, left in their frame's body as :func:`batch_request` found them:
    decoded one part of ``size`` at a time, so that the daemon decodes each slice
    as it decides it and no step of its event loop decodes the whole batch
    (docs/daemon.md, "Large batches in slices")."""

    __slots__ = ("_body", "_count", "_starts", "size")

    def __init__(self, body: bytes, count: int, size: int, starts: list[int]) -> None:
        self._body = body
        self._count = count
        self._starts = starts
        #: Elements of every part but the last.
        self.size = size

    def __len__(self) -> int:
        return self._count

    @property
    def parts(self) -> int:
        """The number of parts."""
        return len(self._starts) - 1

    def part(self, i: int) -> list[Any]:
        """The elements of part ``i``, decoded as :func:`decode_request` decodes the
        whole body (the same objects, the same FrameError for what does not decode)."""
        count = min(self.size, self._count - i * self.size)
        return self._decode(count, self._starts[i], self._starts[i + 1])

    def whole(self) -> list[Any]:
        """Every element, decoded in one step."""
        return self._decode(self._count, self._starts[0], self._starts[-1])

    def _decode(self, count: int, start: int, end: int) -> list[Any]:
        """The ``count`` elements between offsets ``start`` and ``end`` of the body."""
        elements: list[Any] = _unpack(_heads.pack_array_header(count) + self._body[start:end])
        return elements


def batch_request(body: bytes, size: int, at_least: int = 0) -> Request | None:
    """The request of a body of a batch in the form the clients send one in (a plain
    claim, a completion, a release), read without an object per key or item: args
    as :func:`decode_request` gives them, but the keys or items a
    :class:`FrameItems` of parts of ``size``. None for any other body, and for a
    batch of fewer than ``at_least`` keys or items (told before they are read),
    which :func:`decode_request` reads."""
    found = _core.batch_request(body, size, at_least)
    if found is None:
        return None
    request_id, code, namespace, count, starts = found
    elements = FrameItems(body, count, size, starts)
    if code == Op.CLAIM_MANY:
        return Request(
            request_id, Op.CLAIM_MANY, {"ns": namespace, "keys": elements, COLUMNS_ARG: 1}
        )
    return Request(request_id, Op(code), {"ns": namespace, "items": elements})


@dataclass(frozen=True, slots=True)
class OneClaim:
    """The answer to a one-key claim with nothing but its outcome code (the index in
    OUTCOME_ORDER) and token: its reply is framed natively (``_core.one_key_answer``),
    byte for byte the columns reply of the same answer."""

    code: int
    token: int

    def frame(self, request_id: int) -> bytes:
        """The reply frame."""
        return _core.one_key_answer(request_id, self.code, self.token)


def one_key_payload(part: ReplyColumns) -> OneClaim | dict[str, Any]:
    """The reply payload of a one-key claim as the store decided it: a
    :class:`OneClaim` when it holds no result, cold answer or takeover, else
    its columns (:func:`columns_payload`)."""
    outcomes, tokens, result_index, _results, cold, takeovers = part
    if result_index or cold or takeovers or _SWAP:
        return columns_payload(part)
    return OneClaim(outcomes[0], int.from_bytes(tokens, "little"))


def claims_from_reply(keys: list[Any], namespace: str, reply: Any) -> list[Claim]:
    """The claims of a CLAIM_MANY reply, rows or columns, in key order."""
    if isinstance(reply, dict):
        return claims_from_columns(keys, namespace, reply)
    return claims_from_rows(keys, namespace, reply)


def claims_from_columns(keys: list[Any], namespace: str, cols: dict[str, Any]) -> list[Claim]:
    """The claims of a columns reply: one Claim per key, the sparse fields filled in after."""
    try:
        outcomes, raw_tokens = cols["o"], cols["t"]
        if not (
            isinstance(outcomes, bytes)
            and isinstance(raw_tokens, bytes)
            and len(outcomes) == len(keys)
            and len(raw_tokens) == 8 * len(keys)
        ):
            raise FrameError("claim reply does not match the request")
        if not _SWAP:  # built natively (docs/engine.md, "Answers")
            claims = _engine.build_records(
                Claim, keys, namespace, outcomes, raw_tokens, OUTCOME_ORDER
            )
        else:  # pragma: no cover - big-endian hosts
            tokens = array("Q")
            tokens.frombytes(raw_tokens)
            tokens.byteswap()
            by_code = OUTCOME_ORDER
            claims = list(
                map(Claim, keys, repeat(namespace), map(by_code.__getitem__, outcomes), tokens)
            )
        for i, result in zip(cols["ri"], cols["rv"], strict=True):
            claims[i].result = result
        for i in cols["x"]:
            claims[i].exact = False
        for i in cols["k"]:
            claims[i].takeover = True
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        if isinstance(exc, FrameError):
            raise
        raise FrameError(f"malformed claim reply: {exc!r}") from None
    return claims


def claim_row(c: Claim) -> list[Any]:
    """One claim as the server sends it."""
    return [c.outcome.value, c.token, c.result, c.exact, c.takeover]


def claims_from_rows(keys: list[Any], namespace: str, rows: Any) -> list[Claim]:
    """The claims of a CLAIM_MANY reply, in key order."""
    if not isinstance(rows, list) or len(rows) != len(keys):
        raise FrameError("claim reply does not match the request")
    outcomes = _OUTCOMES  # a dict lookup: calling the Enum per key costs more than the rest
    try:
        return [
            Claim(k, namespace, outcomes[row[0]], row[1], row[2], row[3], row[4])
            for k, row in zip(keys, rows, strict=True)
        ]
    except (KeyError, IndexError, TypeError) as exc:
        raise FrameError(f"malformed claim reply: {exc!r}") from None


_OUTCOMES = {o.value: o for o in Outcome}


def record_map(r: KeyRecord | None) -> dict[str, Any] | None:
    """A record as the server sends it."""
    if r is None:
        return None
    return {
        "state": int(r.state),
        "token": r.token,
        "owner": r.owner,
        "fingerprint": r.fingerprint,
        "result": r.result,
        "created": r.created,
        "updated": r.updated,
        "exact": r.exact,
    }


def record_from_map(m: Any) -> KeyRecord | None:
    """The record of a GET reply."""
    if m is None:
        return None
    return KeyRecord(
        State(m["state"]),
        m["token"],
        m["owner"],
        m["fingerprint"],
        m["result"],
        m["created"],
        m["updated"],
        m["exact"],
    )
