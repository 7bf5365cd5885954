"""The daemon's limits, with real processes and sockets: oversized batches, clients that do
not read their replies, descriptors, a failing store and bytes of partial frames.

Waits are deterministic: each test polls the daemon's counters (or a process state) with
a generous bound rather than sleeping and hoping.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from dedupcore import errors
from dedupcore.api import Outcome
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import Op, Status
from dedupcore.daemon.server import EXIT_STORE_FAILED
from tests.support.daemon import Daemon, Lab, assert_serves, connect, daemon_stats, read_frame
from tests.support.procs import PATIENCE, wait_until
from tests.support.stores import unique_ns

RESULT = b"r" * 60_000


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


def test_a_batch_whose_reply_could_exceed_a_frame_is_refused_and_the_client_splits_it(
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
        # 280 results of 60 kB: the reply would be ~17 MB, over the 16 MiB frame. The
        # daemon refuses it whole (nothing applied); the client sends it again in halves.
        got = c.claim_many(done + fresh, namespace=ns)
        assert c.stats()["daemon"]["refused_batches"] == 1
        assert [x.outcome for x in got] == [Outcome.DUPLICATE] * 280 + [Outcome.NEW] * 20
        assert all(x.result == RESULT for x in got[:280])
        assert all(x.token > 0 for x in got[280:])
        # A large batch of keys without results is not refused.
        assert len(c.claim_many([f"many{i}" for i in range(5000)], namespace=ns)) == 5000


# -- clients that do not read their replies ------------------------------------------------


def test_a_client_that_never_reads_its_replies_is_paused_not_buffered(lab: Lab) -> None:
    daemon = lab.configured(write_timeout=600.0)
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
    daemon = lab.configured(write_timeout=2.0)
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
    daemon = lab.configured(write_timeout=3.0, drain_timeout=600.0)
    ns = unique_ns()
    done_key(daemon, ns)
    flood = Flood(daemon, ns, 2000)
    try:
        wait_until(lambda: daemon_stats(daemon).get("paused_reads", 0) >= 1, "a stuck peer")
        assert daemon.stop(timeout=PATIENCE) == 0
    finally:
        flood.close()


# -- descriptors and a failed store --------------------------------------------------------


def limited_daemon(lab: Lab, soft: int, hard: int) -> Daemon:
    """A daemon started with this open-file limit (set in its process before the exec)."""
    prelude = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
        "os.execv(sys.executable, sys.argv[1:])"
    )
    return lab.daemon(prefix=[sys.executable, "-c", prelude])


def open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit")


def test_the_daemon_raises_its_open_file_limit_to_the_hard_limit(lab: Lab) -> None:
    # A hard limit of our own choosing, set in the daemon's process before the
    # exec: lowering a hard limit is always allowed and raising one needs root
    # (CI runs as root), so the test never depends on the machine's limit.
    hard = 2048
    daemon = limited_daemon(lab, 512, hard)
    assert open_files_limit(daemon.pid) == (hard, hard)
    assert daemon_stats(daemon)["max_connections"] == 1024


def test_idle_connections_cannot_take_the_descriptors_the_store_needs(lab: Lab) -> None:
    daemon = limited_daemon(lab, 512, 512)  # asks for the default 1024 connections
    ns = unique_ns()
    main = daemon.client(timeout=PATIENCE)
    idle: list[socket.socket] = []
    try:
        assert main.ping()
        cap = main.stats()["daemon"]["max_connections"]
        assert cap <= 512 - 256
        for _ in range(600):
            idle.append(connect(daemon.socket))
        wait_until(
            lambda: main.stats()["daemon"]["refused_connections"] >= 600 - cap,
            "the connections over the cap to be refused",
        )
        assert main.stats()["daemon"]["connections_open"] <= cap
        # The store still has descriptors: claims and completions are logged.
        claims = main.claim_many([f"k{i}" for i in range(2000)], namespace=ns)
        assert all(x.outcome is Outcome.NEW for x in claims)
        main.complete_many([(x.key, x.token, b"x") for x in claims], namespace=ns)
    finally:
        for s in idle:
            s.close()
        main.close()
    wait_until(lambda: daemon_stats(daemon)["connections_open"] == 1, "idle ones to close")
    assert_serves(daemon)


def test_a_store_that_fails_makes_the_daemon_exit_for_a_restart(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns()
    with daemon.client(timeout=PATIENCE, retries=0) as c:
        kept = c.claim("kept", namespace=ns)
        assert kept.outcome is Outcome.NEW
        # Every later write of the daemon fails with EFBIG: its log can take no more.
        resource.prlimit(daemon.pid, resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))
        with pytest.raises(errors.UnavailableError, match="write-ahead log"):
            c.claim("lost", namespace=ns)  # an OSError in the store, as in process
    assert daemon.proc is not None
    assert daemon.proc.wait(PATIENCE) == EXIT_STORE_FAILED
    # Restarted (as a supervisor would), the store recovers what was acknowledged.
    daemon.start()
    with daemon.client(timeout=PATIENCE) as c:
        assert c.claim("kept", namespace=ns).outcome is Outcome.IN_PROGRESS
        assert c.claim("lost", namespace=ns).outcome is Outcome.NEW


# -- bytes of partial frames ---------------------------------------------------------------


def test_partial_frames_of_all_connections_share_one_byte_budget(lab: Lab) -> None:
    daemon = lab.configured(max_buffered=16 << 20)
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
