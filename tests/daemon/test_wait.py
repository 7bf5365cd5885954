"""``claim(wait=)`` through the daemon: its clients' waiters are woken by the daemon
(the WAIT op, docs/daemon.md "Waiting on keys"), not by polling.

The owner of a key is another process (tests/conformance/wait_child.py) or another
client; the test lets it complete, release or renew the key only once the daemon
reports the waiter (its ``waiters`` gauge), and reads from the daemon's counters
that one WAIT was answered, and how.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import socket
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from dedupcore import aio
from dedupcore.api import Claim, Outcome
from dedupcore.client import Client
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import FrameError, Op, Status
from dedupcore.store import DedupStore
from tests.support.daemon import (
    Daemon,
    Lab,
    assert_serves,
    connect,
    daemon_stats,
    read_frame,
    read_until_eof,
    serving,
)
from tests.support.procs import PATIENCE, ROOT, LineProcess, wait_until
from tests.support.stores import (
    OWNER_ENDINGS,
    assert_ending,
    end_owner,
    sql_table,
    unique_ns,
)

OWNER = ROOT / "tests" / "conformance" / "wait_child.py"


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for the waiters (each Client thread has a connection of its own)."""
    with ThreadPoolExecutor(4) as ex:
        yield ex


def owner(daemon: Daemon, ns: str, key: str = "k", lease: float = 600.0) -> LineProcess:
    """A child process holding ``key`` at the daemon (it says HELD <token>)."""
    config = {"kind": "daemon", "socket": str(daemon.socket), "key": key, "ns": ns}
    return LineProcess(
        [sys.executable, str(OWNER), json.dumps({**config, "lease": lease})],
        stdin=True,
        name="owner",
    )


def waits(daemon: Daemon) -> dict[str, int]:
    """The daemon's WAIT figures: the ``waiters`` gauge and the ``waits*`` counters."""
    return {k: v for k, v in daemon_stats(daemon).items() if k.startswith("wait")}


def waiting(daemon: Daemon, n: int = 1) -> None:
    """Returns once ``n`` waiters are registered at the daemon."""
    wait_until(lambda: waits(daemon)["waiters"] == n, f"{n} waiter(s) at the daemon")


def claim_waiting(daemon: Daemon, pool: ThreadPoolExecutor, ns: str, key: str = "k") -> Any:
    """``claim(key, wait=PATIENCE)`` in a thread: its future."""

    def claim() -> Claim:
        with Client(daemon.socket, timeout=60.0) as c:
            return c.claim(key, namespace=ns, owner="waiter", wait=PATIENCE)

    return pool.submit(claim)


def call(s: socket.socket, request_id: int, op: Op, args: dict[str, Any]) -> Any:
    """One request on a bare connection: (status, payload) of its reply."""
    s.sendall(protocol.encode_request(request_id, op, args))
    rid, status, payload = protocol.decode_response(read_frame(s))
    assert rid == request_id
    return status, payload


@pytest.mark.parametrize(("command", "outcome", "result"), OWNER_ENDINGS)
def test_a_waiter_is_woken_once_by_what_another_process_does_with_the_key(
    lab: Lab, pool: ThreadPoolExecutor, command: str, outcome: str, result: Any
) -> None:
    daemon = lab.daemon()
    ns = unique_ns("wait")
    with owner(daemon, ns) as held:
        token = int(held.expect("HELD"))
        claimed = claim_waiting(daemon, pool, ns)
        waiting(daemon)
        end_owner(held, command)
    assert_ending(claimed.result(PATIENCE), token, outcome, result)
    # One WAIT, woken by the change: no series of polls.
    assert waits(daemon) == {
        "waits": 1,
        "waits_woken": 1,
        "waits_timed_out": 0,
        "waits_polled": 0,
        "waits_over_cap": 0,
        "waits_dropped": 0,
        "waiters": 0,
    }


def test_a_waiter_takes_the_key_over_when_the_lease_runs_out(
    lab: Lab, pool: ThreadPoolExecutor
) -> None:
    """The waiter's timer follows the first lease end of its keys, renewals included:
    the owner shortens its lease once the waiter waits, and the waiter takes over."""
    daemon = lab.daemon()
    ns = unique_ns("wait-lease")
    with Client(daemon.socket, timeout=60.0) as holder:
        held = holder.claim("k", namespace=ns, lease=600.0)
        claimed = claim_waiting(daemon, pool, ns)
        waiting(daemon)
        holder.extend("k", held.token, namespace=ns, lease=0.5)
        claim = claimed.result(PATIENCE)
    assert (claim.outcome, claim.takeover, claim.token) == (Outcome.NEW, True, held.token + 1)
    figures = waits(daemon)
    assert (figures["waits"], figures["waits_woken"], figures["waits_polled"]) == (1, 1, 0)


def test_a_waiter_whose_time_is_up_gets_in_progress(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns("wait-timeout")
    with owner(daemon, ns) as held:
        token = int(held.expect("HELD"))
        with Client(daemon.socket, timeout=60.0) as c:
            claim = c.claim("k", namespace=ns, owner="waiter", wait=0.5)
        held.send("exit")
        assert held.wait() == 0
    assert (claim.outcome, claim.token) == (Outcome.IN_PROGRESS, token)
    figures = waits(daemon)
    assert figures["waits_timed_out"] >= 1
    assert (figures["waits_woken"], figures["waits_polled"], figures["waiters"]) == (0, 0, 0)


def test_the_asyncio_client_is_woken_as_the_sync_one(lab: Lab, pool: ThreadPoolExecutor) -> None:
    daemon = lab.daemon()
    ns = unique_ns("wait-aio")

    async def claim() -> Claim:
        async with aio.Client(daemon.socket, timeout=60.0) as c:
            return await c.claim("k", namespace=ns, owner="waiter", wait=PATIENCE)

    with owner(daemon, ns) as held:
        token = int(held.expect("HELD"))
        claimed = pool.submit(asyncio.run, claim())
        waiting(daemon)
        end_owner(held, 'complete "async"')
    got = claimed.result(PATIENCE)
    assert (got.outcome, got.token, got.result) == (Outcome.DUPLICATE, token, "async")
    figures = waits(daemon)
    assert (figures["waits"], figures["waits_woken"], figures["waits_polled"]) == (1, 1, 0)


#: WAIT requests refused by their arguments: (args, the error's type, what it names).
BAD_WAITS = [
    pytest.param({"keys": ["k"], "timeout": 1}, "FrameError", "'ns'", id="no-ns"),
    pytest.param({"ns": "n", "timeout": 1}, "FrameError", "'keys'", id="no-keys"),
    pytest.param({"ns": "n", "keys": ["k"]}, "FrameError", "'timeout'", id="no-timeout"),
    pytest.param({"ns": 5, "keys": ["k"], "timeout": 1}, "TypeError", "'ns'", id="ns-int"),
    pytest.param({"ns": "n", "keys": "k", "timeout": 1}, "TypeError", "'keys'", id="keys-str"),
    pytest.param({"ns": "n", "keys": [5], "timeout": 1}, "TypeError", "key", id="key-int"),
    pytest.param(
        {"ns": "n", "keys": ["k" * 600], "timeout": 1}, "ValueError", "key", id="key-long"
    ),
    pytest.param(
        {"ns": "n", "keys": ["k"], "timeout": "1"}, "TypeError", "'timeout'", id="timeout-str"
    ),
    pytest.param(
        {"ns": "n", "keys": ["k"], "timeout": True}, "TypeError", "'timeout'", id="timeout-bool"
    ),
    pytest.param(
        {"ns": "n", "keys": ["k"], "timeout": -1}, "ValueError", "timeout", id="timeout-neg"
    ),
    pytest.param(
        {"ns": "n", "keys": ["k"], "timeout": math.nan}, "ValueError", "timeout", id="timeout-nan"
    ),
    pytest.param(
        {"ns": "n", "keys": ["k"], "timeout": 3601}, "ValueError", "timeout", id="timeout-long"
    ),
]


@pytest.mark.parametrize(("args", "kind", "names"), BAD_WAITS)
def test_a_bad_wait_gets_an_error_and_the_daemon_keeps_serving(
    daemon: Daemon, args: dict[str, Any], kind: str, names: str
) -> None:
    with connect(daemon.socket) as s:
        status, payload = call(s, 7, Op.WAIT, args)
        assert (status, payload["type"]) == (Status.ERROR, kind), payload
        assert names in payload["message"], payload
        # The same connection is served on.
        assert call(s, 8, Op.PING, {}) == (Status.OK, "pong")
    assert_serves(daemon)


def test_waits_past_the_caps_are_answered_at_once_with_a_poll_hint(lab: Lab) -> None:
    """At most ``max_waiters`` wait (here 2), half a connection's ``max_in_flight`` of one
    connection (here 1); the others are told to poll, and their clients do."""
    daemon = lab.configured(max_waiters=2, max_in_flight=2)
    ns = unique_ns("wait-cap")
    wait = {"ns": ns, "keys": ["k"], "timeout": 600.0}
    with (
        Client(daemon.socket, timeout=60.0) as holder,
        connect(daemon.socket) as a,
        connect(daemon.socket) as b,
        connect(daemon.socket) as c,
    ):
        held = holder.claim("k", namespace=ns, lease=600.0)
        a.sendall(protocol.encode_request(1, Op.WAIT, wait))
        waiting(daemon, 1)
        assert call(a, 2, Op.WAIT, wait) == (Status.OK, "poll")  # the connection's cap
        b.sendall(protocol.encode_request(3, Op.WAIT, wait))
        waiting(daemon, 2)
        assert call(c, 4, Op.WAIT, wait) == (Status.OK, "poll")  # the daemon's cap
        holder.complete("k", held.token, namespace=ns)
        for s, request_id in ((a, 1), (b, 3)):
            assert protocol.decode_response(read_frame(s)) == (request_id, Status.OK, "woken")
    figures = waits(daemon)
    assert (figures["waits_over_cap"], figures["waits_woken"], figures["waiters"]) == (2, 2, 0)


def test_a_closed_connection_drops_its_waiters(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns("wait-closed")
    with Client(daemon.socket, timeout=60.0) as holder:
        held = holder.claim("k", namespace=ns, lease=600.0)
        with connect(daemon.socket) as s:
            s.sendall(
                protocol.encode_request(1, Op.WAIT, {"ns": ns, "keys": ["k"], "timeout": 600})
            )
            waiting(daemon, 1)
        waiting(daemon, 0)
        holder.complete("k", held.token, namespace=ns)
    assert waits(daemon)["waits_dropped"] == 1
    assert_serves(daemon)


def test_sigterm_answers_the_waiters_and_the_daemon_exits(lab: Lab) -> None:
    """Waiters do not hold up the drain: each is answered "poll" at once (here a drain
    that waits up to 600 s for the clients to go quiet, and a WAIT of 3000 s)."""
    daemon = lab.configured(drain_timeout=600.0)
    ns = unique_ns("wait-term")
    with Client(daemon.socket, timeout=60.0) as holder:
        holder.claim("k", namespace=ns, lease=600.0)
    with connect(daemon.socket) as s:
        s.sendall(protocol.encode_request(1, Op.WAIT, {"ns": ns, "keys": ["k"], "timeout": 3000}))
        waiting(daemon, 1)
        daemon.signal(signal.SIGTERM)
        assert protocol.decode_response(read_frame(s)) == (1, Status.OK, "poll")
        assert read_until_eof(s) == b""
    assert daemon.stop() == 0


def test_a_daemon_over_another_authority_tells_its_waiters_to_poll(
    lab: Lab, pool: ThreadPoolExecutor, tmp_path: Path
) -> None:
    """A SQL authority may be changed by others than the daemon: its WAITs are answered
    "poll" and the client asks again after its backoff, until the owner completes."""
    table = sql_table("sqlite", tmp_path)
    with table.store() as schema:
        schema.init_schema()
    daemon = lab.daemon("--authority", table.url, "--table", table.table)
    ns = unique_ns("wait-poll")
    with Client(daemon.socket, timeout=60.0) as holder:
        held = holder.claim("k", namespace=ns, lease=600.0)
        claimed = claim_waiting(daemon, pool, ns)
        wait_until(lambda: waits(daemon)["waits_polled"] >= 2, "the waiter polling")
        holder.complete("k", held.token, namespace=ns, result="polled")
    claim = claimed.result(PATIENCE)
    assert (claim.outcome, claim.result) == (Outcome.DUPLICATE, "polled")
    figures = waits(daemon)
    assert (figures["waits_woken"], figures["waiters"]) == (0, 0)
    assert figures["waits_polled"] == figures["waits"]


def test_a_completion_served_from_the_thread_pool_wakes_the_waiters(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """The embedded store's requests served the ordinary way (in the thread pool, not
    decided on the event loop) wake the waiters of the keys they complete as well."""
    with serving(DedupStore.open(tmp_path / "store")) as (server, path):
        server.dispatch.decides_now = lambda op: False
        ns = unique_ns("wait-pool")
        with Client(path, timeout=60.0) as holder, Client(path, timeout=60.0) as waiter:
            held = holder.claim("k", namespace=ns, lease=600.0)
            claimed = pool.submit(waiter.claim, "k", namespace=ns, wait=PATIENCE)
            wait_until(lambda: server.waiters.count == 1, "the waiter at the daemon")
            holder.complete("k", held.token, namespace=ns, result="pooled")
            claim = claimed.result(PATIENCE)
        assert (claim.outcome, claim.result) == (Outcome.DUPLICATE, "pooled")
        counters = server.counters
        assert (counters["waits"], counters["waits_woken"], counters["waits_polled"]) == (1, 1, 0)


def test_a_client_polls_a_daemon_that_does_not_know_wait(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """A daemon that answers WAIT with the error of an unknown op (an older one): the
    client asks once, then waits by polling, and gets the answer all the same."""
    with serving(DedupStore.open(tmp_path / "store")) as (server, path):

        async def unknown_op(conn: Any, args: Any) -> str:
            raise FrameError(f"unknown op code {int(Op.WAIT)}")

        server.waiters.wait = unknown_op
        ns = unique_ns("wait-old")
        with Client(path, timeout=60.0) as holder, Client(path, timeout=60.0) as waiter:
            held = holder.claim("k", namespace=ns, lease=600.0)
            claimed = pool.submit(waiter.claim, "k", namespace=ns, wait=PATIENCE)
            # Refused once; then the waiter polls (more claims of the key than one).
            wait_until(lambda: server.counters["protocol_errors"] == 1, "the refused WAIT")
            requests = server.counters["requests"]
            wait_until(lambda: server.counters["requests"] >= requests + 2, "claims by polling")
            holder.complete("k", held.token, namespace=ns, result="polled")
            claim = claimed.result(PATIENCE)
        assert (claim.outcome, claim.result) == (Outcome.DUPLICATE, "polled")
        assert server.counters["protocol_errors"] == 1
