"""Many client processes, killed and stopped clients, a killed and a terminated daemon.

Client processes run ``child.py`` (see its docstring) and report on stdout,
so the test can signal them at known points.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import Op, Status
from dedupcore.daemon.server import SLICE_KEYS
from dedupcore.errors import UnavailableError
from tests.support.daemon import Lab
from tests.support.procs import PATIENCE
from tests.support.stores import unique_ns

HEADER = struct.Struct(">I")


@pytest.mark.parametrize(
    ("n", "batch"),
    [(100_000, 1000), (40_000, 10_000)],
    ids=["small-batches", "batches-read-in-slices"],
)
def test_8_processes_claiming_the_same_keys_get_one_new_per_key(
    lab: Lab, n: int, batch: int
) -> None:
    """Batches of 10,000 keys pass SMALL_FRAME: the daemon reads them from their
    frames a slice at a time, and decides them in slices, while the others race."""
    daemon = lab.daemon()
    ns = unique_ns("race")
    children = [
        lab.child(
            mode="claim",
            socket=str(daemon.socket),
            ns=ns,
            prefix="race-key-",
            n=n,
            seed=seed,
            batch=batch,
            wait_go=True,
        )
        for seed in range(8)
    ]
    for c in children:
        c.expect("ready")
    for c in children:
        c.send("go")  # all start together, each in its own shuffled order
    results = [c.expect_json("result", timeout=600) for c in children]
    winners: dict[int, int] = {}
    for who, result in enumerate(results):
        assert sum(result["counts"].values()) == n
        assert result["counts"]["duplicate"] == 0  # nothing was ever completed
        for i, token, takeover in result["new"]:
            assert i not in winners, f"key {i} was NEW for {winners[i]} and {who}"
            winners[i] = who
            assert (token, takeover) == (1, False)
    assert len(winners) == n
    # Every other answer was IN_PROGRESS (each key has one winner and seven losers).
    assert sum(r["counts"]["in_progress"] for r in results) == 7 * n
    with daemon.client() as c:
        stats = c.stats()
        assert stats["namespaces"][ns]["new"] == n
        read_in_slices = stats["daemon"]["batches_read_in_slices"]
        assert read_in_slices == (8 * n // batch if batch > SLICE_KEYS else 0)


def test_a_killed_holders_keys_are_taken_over_once_after_the_lease(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns("killed")
    n = 1000
    holder = lab.child(
        mode="hold", socket=str(daemon.socket), ns=ns, prefix="k", n=n, lease=2.0, owner="holder"
    )
    claims = holder.expect_json("claims")
    assert [c[1] for c in claims] == ["new"] * n
    tokens = {i: token for i, _, token in claims}
    holder.kill()
    time.sleep(2.5)  # past the 2 s lease
    contenders = [
        lab.child(
            mode="claim",
            socket=str(daemon.socket),
            ns=ns,
            prefix="k",
            n=n,
            seed=seed,
            batch=100,
            owner=f"contender-{seed}",
            wait_go=True,
        )
        for seed in range(4)
    ]
    for c in contenders:
        c.expect("ready")
    for c in contenders:
        c.send("go")
    taken: dict[int, tuple[int, bool]] = {}
    for c in contenders:
        for i, token, takeover in c.expect_json("result")["new"]:
            assert i not in taken, f"key {i} was taken over twice"
            taken[i] = (token, takeover)
    assert sorted(taken) == list(range(n))
    for i, (token, takeover) in taken.items():
        assert takeover and token == tokens[i] + 1, (i, token, takeover, tokens[i])
    with daemon.client() as c:
        again = c.claim_many([f"k{i}" for i in range(n)], namespace=ns, owner="late")
        assert {x.outcome for x in again} == {Outcome.IN_PROGRESS}
        assert c.stats()["lease_takeovers"] >= n


def test_a_stopped_holder_resumed_after_takeover_gets_stale_token(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns("stopped")
    n = 100
    holder = lab.child(
        mode="hold", socket=str(daemon.socket), ns=ns, prefix="k", n=n, lease=2.0, owner="sleepy"
    )
    claims = holder.expect_json("claims")
    assert [c[1] for c in claims] == ["new"] * n
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)  # past the lease while the holder cannot run
        other = lab.child(
            mode="hold", socket=str(daemon.socket), ns=ns, prefix="k", n=n, owner="awake"
        )
        taken = other.expect_json("claims")
        assert [(i, outcome, token) for i, outcome, token in taken] == [
            (i, "new", token + 1) for i, _, token in claims
        ]
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    holder.send("complete")
    assert holder.expect("complete") == "StaleTokenError"
    holder.send("release")
    assert holder.expect("release") == "StaleTokenError"
    other.send("complete")
    assert other.expect("complete") == "ok"
    with daemon.client() as c:
        again = c.claim_many([f"k{i}" for i in range(n)], namespace=ns, owner="sleepy")
        assert {x.outcome for x in again} == {Outcome.DUPLICATE}
    holder.send("exit")
    other.send("exit")
    assert holder.wait() == 0 and other.wait() == 0


def test_acknowledged_keys_survive_a_sigkill_of_the_daemon(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns("durable")
    for round_ in range(2):
        stream = lab.child(
            mode="stream",
            socket=str(daemon.socket),
            ns=ns,
            prefix=f"r{round_}-",
            batch=1000,
            retries=0,
        )
        acked: list[int] = []
        claimed: list[int] = []
        while len(acked) < 5 + 5 * round_:
            line = stream.next_line()
            assert line is not None and not line.startswith(("error", "wrong")), line
            kind, batch = line.split()
            (acked if kind == "acked" else claimed).append(int(batch))
        time.sleep(0.02 * round_)
        daemon.kill()  # mid-stream: the client is between batches or inside one
        for line in stream.rest():
            assert not line.startswith("wrong"), line
            if line.startswith("error"):
                assert line.split()[1] == "UnavailableError", line
                continue
            kind, batch = line.split()
            (acked if kind == "acked" else claimed).append(int(batch))
        assert stream.wait() == 0
        daemon.start()  # same data directory and socket
        with daemon.client(timeout=PATIENCE) as c:
            for b in acked:
                keys = [f"r{round_}-{b}-{j}" for j in range(1000)]
                dup = c.claim_many(keys, namespace=ns, owner="checker")
                assert all(x.outcome is Outcome.DUPLICATE and x.result == b for x in dup), b
            for b in set(claimed) - set(acked):
                # Acknowledged as claimed: never NEW again (held, or completed just before
                # the kill).
                keys = [f"r{round_}-{b}-{j}" for j in range(1000)]
                outcomes = {x.outcome for x in c.claim_many(keys, namespace=ns, owner="checker")}
                assert Outcome.NEW not in outcomes, (b, outcomes)


def _claim_frame(request_id: int, ns: str, keys: list[str]) -> bytes:
    return protocol.encode_request(request_id, Op.CLAIM_MANY, {"ns": ns, "keys": keys})


def _read_reply(sock: socket.socket) -> tuple[int, Status, Any] | None:
    buf = b""
    need = 4
    header_done = False
    while True:
        while len(buf) < need:
            try:
                chunk = sock.recv(1 << 20)
            except ConnectionResetError:
                return None
            if not chunk:
                assert not header_done, "the daemon sent half a reply"
                return None
            buf += chunk
        if header_done:
            return protocol.decode_response(buf[4:need])
        need = 4 + HEADER.unpack(buf[:4])[0]
        header_done = True


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns("drain")
    n_conn, n_keys = 4, 20_000
    keysets = [[f"c{k}-{i}" for i in range(n_keys)] for k in range(n_conn)]
    socks = []
    for _ in range(n_conn):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(daemon.socket))
        s.settimeout(PATIENCE)
        socks.append(s)
    idle = daemon.client(timeout=PATIENCE)
    assert idle.ping()  # an idle client connection, open during the shutdown

    client_answers: list[Any] = []

    def client_claim() -> None:
        try:
            with daemon.client(timeout=PATIENCE, retries=0) as c:
                client_answers.append(c.claim_many([f"t-{i}" for i in range(n_keys)], namespace=ns))
        except UnavailableError as exc:
            client_answers.append(exc)

    frames = [_claim_frame(10 + k, ns, keysets[k]) for k in range(n_conn)]
    for s, f in zip(socks, frames, strict=True):
        s.sendall(f)
    t = threading.Thread(target=client_claim)
    t.start()
    daemon.signal(signal.SIGTERM)  # while those requests are in flight
    replies = [_read_reply(s) for s in socks]
    t.join()
    rc = daemon.proc.wait(PATIENCE) if daemon.proc else None
    assert rc == 0, daemon.log_text()
    assert not daemon.socket.exists(), "the socket file was left behind"
    for s in socks:
        s.close()
    idle.close()

    # Each in-flight request got its true answer, or an error / a closed connection.
    answered: list[int] = []
    for k, reply in enumerate(replies):
        if reply is None:
            continue
        rid, status, payload = reply
        assert rid == 10 + k
        if status is Status.OK:
            assert [row[0] for row in payload] == ["new"] * n_keys
            answered.append(k)
        else:
            assert payload["type"] == "UnavailableError", payload
    (answer,) = client_answers
    if not isinstance(answer, UnavailableError):
        assert [c.outcome for c in answer] == [Outcome.NEW] * n_keys

    # What was answered is durable; what was not is all or nothing.
    daemon.start()
    with daemon.client(timeout=PATIENCE) as c:
        for k in range(n_conn):
            outcomes = {x.outcome for x in c.claim_many(keysets[k], namespace=ns, owner="x")}
            if k in answered:
                assert outcomes == {Outcome.IN_PROGRESS}, (k, outcomes)
            else:
                assert outcomes in ({Outcome.NEW}, {Outcome.IN_PROGRESS}), (k, outcomes)
    assert daemon.stop() == 0
    assert not daemon.socket.exists()
