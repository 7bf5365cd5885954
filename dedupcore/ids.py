"""Sortable ids with a region prefix that never go back when the wall clock does.

An id is 16 bytes, big-endian, compared as bytes (or as its text form)::

    region   u16   0..65535, chosen per deployment region (the prefix)
    time     u48   milliseconds since the Unix epoch (until the year 10889)
    sequence u32   counter within one millisecond of one generator
    node     u32   the generator: random per generator (and per forked
                   process) unless given

Its text form is the 32 lowercase hex digits of those bytes: fixed width, so
comparing the text compares the bytes, and the first four digits are the
region. ``time_of``/``region_of``/``parse`` read the fields back.

A generator keeps the time it last issued. A clock reading at or before it
(the wall clock stepped back, or stood still) continues from that time with
the next sequence number; a sequence past ``sequence_limit`` moves to the
next millisecond. So the ids of one generator strictly increase whatever the
clock does, an id's time is never behind the clock reading it was issued at,
and it is ahead of that reading by at most the largest backward step seen
(plus one millisecond per ``sequence_limit + 1`` ids issued in a burst).
docs/ids.md has the reasoning against Snowflake's clock-skew failure modes.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from dedupcore._checks import checked_int

__all__ = [
    "ID_BYTES",
    "ID_TEXT_LENGTH",
    "MAX_NODE",
    "MAX_REGION",
    "MAX_SEQUENCE",
    "MAX_TIME_MS",
    "IdGenerator",
    "IdParts",
    "from_text",
    "node_of",
    "pack",
    "parse",
    "region_of",
    "sequence_of",
    "time_of",
    "to_text",
]

ID_BYTES = 16
ID_TEXT_LENGTH = 2 * ID_BYTES
MAX_REGION = (1 << 16) - 1
MAX_TIME_MS = (1 << 48) - 1
MAX_SEQUENCE = (1 << 32) - 1
MAX_NODE = (1 << 32) - 1
_HEX = frozenset("0123456789abcdef")


class IdParts(NamedTuple):
    """The fields of an id."""

    region: int
    time_ms: int
    sequence: int
    node: int


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


def pack(region: int, time_ms: int, sequence: int, node: int) -> bytes:
    """The 16 bytes of an id made of these fields (each checked against its width)."""
    checked_int("region", region, 0, MAX_REGION)
    checked_int("time_ms", time_ms, 0, MAX_TIME_MS)
    checked_int("sequence", sequence, 0, MAX_SEQUENCE)
    checked_int("node", node, 0, MAX_NODE)
    value = (region << 112) | (time_ms << 64) | (sequence << 32) | node
    return value.to_bytes(ID_BYTES, "big")


def _as_int(id_: bytes | str) -> int:
    if isinstance(id_, str):
        if len(id_) != ID_TEXT_LENGTH or not _HEX.issuperset(id_):
            raise ValueError(
                f"an id's text form is {ID_TEXT_LENGTH} lowercase hex digits, got {id_!r:.60}"
            )
        return int(id_, 16)
    if isinstance(id_, (bytes, bytearray, memoryview)):
        raw = bytes(id_)
        if len(raw) != ID_BYTES:
            raise ValueError(f"an id is {ID_BYTES} bytes, got {len(raw)}")
        return int.from_bytes(raw, "big")
    raise TypeError(f"an id is bytes or str, not {type(id_).__name__}")


def parse(id_: bytes | str) -> IdParts:
    """The fields of an id given as its 16 bytes or its 32-digit text form."""
    v = _as_int(id_)
    return IdParts(v >> 112, (v >> 64) & MAX_TIME_MS, (v >> 32) & MAX_SEQUENCE, v & MAX_NODE)


def time_of(id_: bytes | str) -> int:
    """The id's embedded time, in milliseconds since the Unix epoch."""
    return parse(id_).time_ms


def region_of(id_: bytes | str) -> int:
    """The id's region prefix."""
    return parse(id_).region


def sequence_of(id_: bytes | str) -> int:
    """The id's sequence number within its millisecond."""
    return parse(id_).sequence


def node_of(id_: bytes | str) -> int:
    """The generator (node) that issued the id."""
    return parse(id_).node


def to_text(raw: bytes) -> str:
    """The text form of an id's bytes."""
    parse(raw)
    return raw.hex()


def from_text(text: str) -> bytes:
    """The bytes of an id's text form."""
    parse(text)
    return bytes.fromhex(text)


class IdGenerator:
    """Issues ids of one region; thread-safe.

    ``node`` names this generator within its region. Left out, it is drawn at
    random (32 bits) for each generator and drawn again (never the same) in a
    forked child, so two generators only collide if they draw the same node *and* issue the
    same millisecond and sequence. Give ``node`` (e.g. a worker index) when
    generators are assigned distinct numbers; a generator with a given node
    refuses to issue ids in a forked child, where it would repeat the
    parent's.

    ``clock`` returns the wall clock in integer milliseconds (the default is
    ``time.time_ns() // 1_000_000``); ``sequence_limit`` is the last sequence
    number issued in one millisecond before the generator moves on to the
    next one (at most :data:`MAX_SEQUENCE`).
    """

    def __init__(
        self,
        region: int,
        *,
        node: int | None = None,
        clock: Callable[[], int] | None = None,
        sequence_limit: int = MAX_SEQUENCE,
    ) -> None:
        self.region = checked_int("region", region, 0, MAX_REGION)
        self._fixed_node = node is not None
        self._node = checked_int("node", node, 0, MAX_NODE) if node is not None else _random_node()
        self._clock = clock or _wall_ms
        if checked_int("sequence_limit", sequence_limit, 0, MAX_SEQUENCE) < 1:
            raise ValueError("sequence_limit must be at least 1")
        self.sequence_limit = sequence_limit
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._last_ms = -1
        self._seq = 0
        #: Clock readings behind the last issued time, the largest such gap in
        #: ms, and the ms borrowed from the future because a sequence ran out.
        self.backward_steps = 0
        self.max_backward_ms = 0
        self.sequence_overflows = 0

    @property
    def node(self) -> int:
        """This generator's node number."""
        return self._node

    def _next_fields(self) -> tuple[int, int]:
        # Under self._lock.
        pid = os.getpid()
        if pid != self._pid:
            if self._fixed_node:
                raise RuntimeError(
                    f"IdGenerator(node={self._node}) was created in process {self._pid}; a "
                    "forked child would repeat its ids: create a generator per process, each "
                    "with its own node (or leave node out to draw one at random)"
                )
            old = self._node
            while self._node == old:  # the child must not share the parent's node
                self._node = _random_node()
            self._pid = pid
        now = self._clock()
        if isinstance(now, bool) or not isinstance(now, int):
            raise TypeError(f"clock must return int milliseconds, got {type(now).__name__}")
        if now > self._last_ms:
            self._last_ms = now
            self._seq = 0
        else:
            if now < self._last_ms:
                self.backward_steps += 1
                self.max_backward_ms = max(self.max_backward_ms, self._last_ms - now)
            if self._seq >= self.sequence_limit:
                self.sequence_overflows += 1
                self._last_ms += 1
                self._seq = 0
            else:
                self._seq += 1
        if self._last_ms > MAX_TIME_MS:
            raise OverflowError("the id time field (48 bits of milliseconds) is exhausted")
        return self._last_ms, self._seq

    def next_bytes(self) -> bytes:
        """A new id as 16 bytes."""
        with self._lock:
            ms, seq = self._next_fields()
            node = self._node
        return ((self.region << 112) | (ms << 64) | (seq << 32) | node).to_bytes(ID_BYTES, "big")

    def next(self) -> str:
        """A new id in its text form (32 lowercase hex digits)."""
        return self.next_bytes().hex()

    def next_many(self, n: int) -> list[str]:
        """``n`` new ids in their text form, in increasing order."""
        if n < 0:
            raise ValueError("n must be >= 0")
        head = self.region << 112
        out = []
        with self._lock:
            for _ in range(n):
                ms, seq = self._next_fields()
                out.append(
                    (head | (ms << 64) | (seq << 32) | self._node).to_bytes(ID_BYTES, "big").hex()
                )
        return out

    def stats(self) -> dict[str, int]:
        """What the clock did: backward steps seen, the largest in ms, sequence overflows."""
        with self._lock:
            return {
                "backward_steps": self.backward_steps,
                "max_backward_ms": self.max_backward_ms,
                "sequence_overflows": self.sequence_overflows,
                "last_ms": self._last_ms,
            }

    def __repr__(self) -> str:
        return f"<IdGenerator region={self.region} node={self._node}>"


def _random_node() -> int:
    return secrets.randbits(32)
