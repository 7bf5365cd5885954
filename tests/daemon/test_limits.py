"""The daemon's limits, with real processes and sockets: oversized batches, clients that do
not read their replies and bytes of partial frames.

Waits are deterministic: each test polls the daemon's counters (or a process state) with
a generous bound rather than sleeping and hoping.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dedupcore import errors
from dedupcore.api import Outcome
from dedupcore.client import Client
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import Op, Status

from .conftest import PATIENCE, Daemon, Lab, unique_ns
from .test_faults import (
    assert_serves,
    read_frame,
    wait_until,
)

RESULT = b"r" * 60_000


def configured(lab: Lab, **settings: Any) -> Daemon:
    """A daemon started with these ``serve`` settings (through a TOML file)."""
    home = lab.tmpdir()
    config = home / "serve.toml"
    config.write_text("".join(f"{k} = {v!r}\n" for k, v in settings.items()))
    return lab.daemon("--config", str(config))


def daemon_stats(daemon: Daemon) -> dict[str, Any]:
    with Client(daemon.socket, timeout=PATIENCE) as c:
        figures: dict[str, Any] = c.stats()["daemon"]
        return figures


def connect(path: Path) -> socket.socket:
    """A connection; retried (within PATIENCE) while the daemon's accept backlog is full."""
    deadline = time.monotonic() + PATIENCE
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(PATIENCE)
        try:
            s.connect(str(path))
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise AssertionError("the daemon accepts no connection") from None
            time.sleep(0.01)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def done_key(daemon: Daemon, ns: str, key: str = "big") -> None:
    """Stores ``key`` with a 60 kB result."""
    with daemon.client() as c:
        claim = c.claim(key, namespace=ns)
        c.complete(key, claim.token, namespace=ns, result=RESULT)


class Flood:
    """Sends ``count`` GETs of a key with a 60 kB result, each padded to ~16 kB, and reads
    no reply until :meth:`read_all` (the daemon ignores the unknown ``pad`` argument)."""

    def __init__(self, daemon: Daemon, ns: str, count: int) -> None:
        self.count = count
        self.sock = connect(daemon.socket)
        self.frames = [
            protocol.encode_request(i, Op.GET, {"ns": ns, "key": "big", "pad": b"p" * 16_000})
            for i in range(count)
        ]
        self.sent = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def _send(self) -> None:
        try:
            for f in self.frames:
                self.sock.sendall(f)
                self.sent += 1
        except OSError as exc:
            self.error = exc

    def read_all(self) -> list[tuple[int, Status, Any]]:
        replies = []
        for _ in range(self.count):
            replies.append(protocol.decode_response(read_frame(self.sock)))
        return replies

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(PATIENCE)


# -- batches whose reply would not fit a frame ---------------------------------------------


def test_a_batch_whose_reply_could_exceed_a_frame_is_refused_before_anything_is_applied(
    lab: Lab,
) -> None:
    daemon = lab.daemon()
    ns = unique_ns()
    done = [f"done{i}" for i in range(280)]
    fresh = [f"fresh{i}" for i in range(20)]
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many(done, namespace=ns)
        for start in range(0, len(done), 100):
            c.complete_many(
                [(x.key, x.token, RESULT) for x in claims[start : start + 100]], namespace=ns
            )
        # 280 results of 60 kB: the reply would be ~17 MB, over the 16 MiB frame.
        with pytest.raises(errors.BatchTooLargeError, match="split the batch"):
            c.claim_many(done + fresh, namespace=ns)
        # Nothing of the refused batch was applied: the fresh keys were not claimed.
        assert all(c.get(k, namespace=ns) is None for k in fresh)
        assert c.stats()["daemon"]["refused_batches"] == 1
        # Split, the same keys are answered: the fresh ones are NEW, with their tokens.
        got = c.claim_many(done[:200], namespace=ns) + c.claim_many(
            done[200:] + fresh, namespace=ns
        )
        assert [x.outcome for x in got] == [Outcome.DUPLICATE] * 280 + [Outcome.NEW] * 20
        assert all(x.result == RESULT for x in got[:280])
        assert all(x.token > 0 for x in got[280:])
        # A large batch of keys without results is not refused.
        assert len(c.claim_many([f"many{i}" for i in range(5000)], namespace=ns)) == 5000


# -- clients that do not read their replies ------------------------------------------------


def test_a_client_that_never_reads_its_replies_is_paused_not_buffered(lab: Lab) -> None:
    daemon = configured(lab, write_timeout=600.0)
    ns = unique_ns()
    done_key(daemon, ns)
    before = rss_bytes(daemon.pid)
    flood = Flood(daemon, ns, 2000)  # ~32 MB of requests asking for ~120 MB of replies
    try:
        # The daemon stops reading this connection once its unsent replies pile up...
        wait_until(lambda: daemon_stats(daemon).get("paused_reads", 0) >= 1, "the reads to pause")
        stalled = daemon_stats(daemon)["requests"]
        assert stalled < 500
        assert flood.sent < 2000
        # ...so its memory stays far below what the replies would take.
        assert rss_bytes(daemon.pid) - before < 64 << 20
        assert_serves(daemon)  # and everyone else is served meanwhile
        # Once the client reads, every request is answered, in full.
        replies = flood.read_all()
        assert sorted(rid for rid, _, _ in replies) == list(range(2000))
        assert all(s is Status.OK and p["result"] == RESULT for _, s, p in replies)
        flood.thread.join(PATIENCE)
        assert flood.error is None and flood.sent == 2000
    finally:
        flood.close()


def test_a_peer_that_takes_no_reply_is_disconnected_after_the_write_timeout(lab: Lab) -> None:
    daemon = configured(lab, write_timeout=2.0)
    ns = unique_ns()
    done_key(daemon, ns)
    flood = Flood(daemon, ns, 2000)
    try:
        wait_until(
            lambda: daemon_stats(daemon).get("write_timeouts", 0) >= 1,
            "the stuck peer to be disconnected",
        )
        wait_until(lambda: daemon_stats(daemon)["connections_open"] == 1, "its connection to close")
        flood.thread.join(PATIENCE)
        assert isinstance(flood.error, OSError)  # the daemon hung up on the sender
        assert "took no reply" in daemon.log_text()
        assert_serves(daemon)
    finally:
        flood.close()


def test_sigterm_does_not_wait_on_a_peer_that_takes_no_reply(lab: Lab) -> None:
    # With a drain timeout of 600 s, only the write timeout can end the wait in time.
    daemon = configured(lab, write_timeout=3.0, drain_timeout=600.0)
    ns = unique_ns()
    done_key(daemon, ns)
    flood = Flood(daemon, ns, 2000)
    try:
        wait_until(lambda: daemon_stats(daemon).get("paused_reads", 0) >= 1, "a stuck peer")
        assert daemon.stop(timeout=PATIENCE) == 0
    finally:
        flood.close()


# -- bytes of partial frames ---------------------------------------------------------------


def test_partial_frames_of_all_connections_share_one_byte_budget(lab: Lab) -> None:
    daemon = configured(lab, max_buffered=16 << 20)
    big = protocol.encode_request(1, Op.PING, {"pad": b"a" * (15 << 20)})
    other = protocol.encode_request(2, Op.PING, {"pad": b"b" * (2 << 20)})
    with connect(daemon.socket) as first, connect(daemon.socket) as second:
        first.sendall(big[:-1])  # 15 MiB held, one byte short
        wait_until(
            lambda: daemon_stats(daemon).get("buffered_bytes", 0) >= 15 << 20,
            "the partial frame to be buffered",
        )
        # 2 MiB more would pass the 16 MiB budget: the daemon waits before reading it (so
        # this send blocks once the socket's buffer is full).
        sender = threading.Thread(target=second.sendall, args=(other,), daemon=True)
        sender.start()
        wait_until(
            lambda: daemon_stats(daemon).get("buffer_waits", 0) >= 1,
            "the second frame to wait for the budget",
        )
        assert daemon_stats(daemon)["buffered_bytes"] <= 16 << 20
        assert_serves(daemon)  # small requests still pass
        first.sendall(big[-1:])
        assert protocol.decode_response(read_frame(first)) == (1, Status.OK, "pong")
        sender.join(PATIENCE)
        assert protocol.decode_response(read_frame(second)) == (2, Status.OK, "pong")
    # Only the asking STATS request itself is held now.
    wait_until(lambda: daemon_stats(daemon)["buffered_bytes"] < 100, "the budget to be free")


def test_a_refused_batch_carries_its_class_name_on_the_wire(daemon: Daemon) -> None:
    ns = unique_ns()
    keys = [f"b{i}" for i in range(300)]
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many(keys, namespace=ns)
        for start in range(0, 300, 100):
            c.complete_many(
                [(x.key, x.token, RESULT) for x in claims[start : start + 100]], namespace=ns
            )
    with connect(daemon.socket) as s:
        s.sendall(protocol.encode_request(3, Op.CLAIM_MANY, {"ns": ns, "keys": keys}))
        _, status, payload = protocol.decode_response(read_frame(s))
    assert status is Status.ERROR and payload["type"] == "BatchTooLargeError", payload
