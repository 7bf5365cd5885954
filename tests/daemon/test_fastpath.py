"""The embedded store's request path in the daemon: decided on the event loop, replied
only after the log is durable, one commit shared by many connections, large batches
in slices that let other connections through (docs/daemon.md)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore import aio, errors
from dedupcore.api import Outcome
from dedupcore.client import Client
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import Op, Status
from dedupcore.daemon.server import SLICE_ABOVE, SLICE_KEYS, DaemonServer
from dedupcore.store import DedupStore

from .conftest import PATIENCE, Daemon, Lab, unique_ns
from .test_faults import read_frame, wait_until
from .test_limits import RESULT, connect, daemon_stats


@contextlib.contextmanager
def _serving(store: DedupStore, **options: Any) -> Iterator[tuple[DaemonServer, Path]]:
    """A DaemonServer over ``store`` on its own loop thread: (server, socket path).
    Stops it, closes the store and removes the socket's directory afterwards."""
    home = Path(tempfile.mkdtemp(prefix="dc", dir="/tmp"))
    server = DaemonServer(store, home / "d.sock", **options)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve_forever(),))
    thread.start()
    try:
        wait_until(lambda: (home / "d.sock").exists(), "the socket")
        yield server, home / "d.sock"
    finally:
        loop.call_soon_threadsafe(server.stop)
        thread.join(PATIENCE)
        loop.close()
        store.close()
        shutil.rmtree(home, ignore_errors=True)


def _store_stats(daemon: Daemon) -> dict[str, Any]:
    with Client(daemon.socket, timeout=PATIENCE) as c:
        return c.stats()


def _claim(request_id: int, ns: str, keys: list[str]) -> bytes:
    return protocol.encode_request(request_id, Op.CLAIM_MANY, {"ns": ns, "keys": keys})


def test_single_claims_of_many_connections_share_log_commits(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns("group")
    n = 64
    socks = [connect(daemon.socket) for _ in range(n)]
    try:
        before = _store_stats(daemon)["wal_commits"]
        # Every connection sends its claim before any reply is read.
        for i, s in enumerate(socks):
            s.sendall(_claim(i, ns, [f"k{i}"]))
        for i, s in enumerate(socks):
            rid, status, rows = protocol.decode_response(read_frame(s))
            assert (rid, status) == (i, Status.OK), rows
            assert rows[0][0] == Outcome.NEW.value
        after = _store_stats(daemon)["wal_commits"]
    finally:
        for s in socks:
            s.close()
    assert isinstance(before, int) and isinstance(after, int)
    # 64 claims, each its own log record, were made durable by fewer commits.
    assert 1 <= after - before < n, (before, after)


@pytest.mark.parametrize("durability", ["power-loss-unsafe", "durable"])
def test_a_lone_request_is_decided_by_its_connection_reader_in_either_mode(
    lab: Lab, durability: str
) -> None:
    """A lone claim, completion or release is decided as its frame is read (no task).
    Without fdatasync its commit is made at once and it is answered there and then;
    a durable one is answered from its commit's callback, the commit made at the end
    of the loop's pass (so that other connections' requests can share it). An answer
    that needs no commit (a DUPLICATE of a durable record) and a ping are answered
    at once in either mode."""
    daemon = lab.daemon("--durability", durability)
    ns = unique_ns("at-once")
    with daemon.client(timeout=PATIENCE) as c:
        c.ping()
        before = daemon_stats(daemon)
        for i in range(20):
            claim = c.claim(f"k{i}", namespace=ns)
            assert claim.outcome is Outcome.NEW
            c.complete(claim.key, claim.token, namespace=ns, result=i)
            assert c.claim(f"k{i}", namespace=ns).result == i
        held = c.claim("held", namespace=ns)
        c.release(held.key, held.token, namespace=ns)
        for _ in range(5):
            assert c.ping()
        after = daemon_stats(daemon)
    at_once = after["answered_at_once"] - before["answered_at_once"]
    by_commit = after["completed_by_commit"] - before["completed_by_commit"]
    # 20 x (claim, complete, duplicate claim) + claim + release + 5 pings.
    if durability == "power-loss-unsafe":
        assert (at_once, by_commit) == (67, 0)
    else:  # the 20 duplicate claims and the pings need no commit
        assert (at_once, by_commit) == (25, 42)
    with daemon.client(timeout=PATIENCE) as c:  # and the answers held: all DUPLICATE
        claims = c.claim_many([f"k{i}" for i in range(20)], namespace=ns)
        assert [(x.outcome, x.result) for x in claims] == [
            (Outcome.DUPLICATE, i) for i in range(20)
        ]


def test_a_lone_small_commit_is_waited_for_on_the_loop_a_large_one_on_the_thread(
    lab: Lab,
) -> None:
    """The loop syncs the log itself only for a small commit with nothing else in
    flight: the log records of a batch of thousands of keys go to the commit thread."""
    daemon = lab.daemon()
    ns = unique_ns("inline")

    def rounds() -> tuple[int, int]:
        figures = daemon_stats(daemon)
        return figures["commit_rounds"], figures["inline_commit_rounds"]

    with daemon.client(timeout=PATIENCE) as c:
        c.claim("warm", namespace=ns)
        total, inline = rounds()
        c.claim("one", namespace=ns)
        total_1, inline_1 = rounds()
        assert (total_1 - total, inline_1 - inline) == (1, 1)
        keys = [f"k{i}" for i in range(SLICE_ABOVE)]  # about 300 KiB of log records
        assert all(x.outcome is Outcome.NEW for x in c.claim_many(keys, namespace=ns))
        total_2, inline_2 = rounds()
        assert (total_2 - total_1, inline_2 - inline_1) == (1, 0)


def test_replies_come_after_the_commit_so_a_killed_daemon_keeps_every_acknowledged_key(
    lab: Lab,
) -> None:
    daemon = lab.daemon()
    ns = unique_ns("acked")
    n = 32
    per = 20
    socks = [connect(daemon.socket) for _ in range(n)]
    acked: list[tuple[str, int]] = []
    for c, s in enumerate(socks):
        s.sendall(b"".join(_claim(j, ns, [f"c{c}-{j}"]) for j in range(per)))
    # Read some replies, then kill the daemon while the rest may still be in flight.
    for c, s in enumerate(socks[: n // 2]):
        for _ in range(per):
            rid, status, rows = protocol.decode_response(read_frame(s))
            assert status is Status.OK and rows[0][0] == Outcome.NEW.value
            acked.append((f"c{c}-{rid}", rows[0][1]))
    daemon.kill()
    for c, s in enumerate(socks[n // 2 :], n // 2):
        s.settimeout(PATIENCE)
        while True:
            try:
                body = read_frame(s)
            except (TimeoutError, AssertionError, ConnectionError):
                break
            rid, status, rows = protocol.decode_response(body)
            if status is Status.OK:
                acked.append((f"c{c}-{rid}", rows[0][1]))
        s.close()
    daemon.start()
    assert len(acked) >= n // 2 * per
    with daemon.client(timeout=PATIENCE) as client:
        for key, token in acked:
            record = client.get(key, namespace=ns)
            assert record is not None and record.token == token, key
            assert client.claim(key, namespace=ns).outcome is Outcome.IN_PROGRESS, key


def test_a_single_claim_is_answered_between_the_slices_of_a_large_batch(lab: Lab) -> None:
    daemon = lab.daemon()
    n = 200_000
    assert n > SLICE_ABOVE and n > 4 * SLICE_KEYS
    for _attempt in range(5):
        ns = unique_ns("fair")
        big = connect(daemon.socket)
        try:
            slices_before = daemon_stats(daemon)["batch_slices"]
            held_before = daemon_stats(daemon)["slices_held_for_small"]
            big.sendall(_claim(1, ns, [f"b{i}" for i in range(n)]))
            # Once the batch's first slice is claimed, another connection claims one key.
            wait_until(
                lambda: daemon_stats(daemon)["batch_slices"] > slices_before,  # noqa: B023
                "the large batch to start",
            )
            with daemon.client(timeout=PATIENCE) as c:
                single = c.claim("single", namespace=ns)
                assert single.outcome is Outcome.NEW
                rid, status, rows = protocol.decode_response(read_frame(big))
                assert (rid, status, len(rows)) == (1, Status.OK, n)
                assert all(row[0] == Outcome.NEW.value for row in rows)
                first = c.get("b0", namespace=ns)
                last = c.get(f"b{n - 1}", namespace=ns)
                one = c.get("single", namespace=ns)
        finally:
            big.close()
        assert first is not None and last is not None and one is not None
        # The single claim was decided after the batch's first slice and before its last.
        if first.created <= one.created <= last.created and first.created < last.created:
            # It was read before a later slice began, so that slice waited for it.
            assert daemon_stats(daemon)["slices_held_for_small"] > held_before
            return
        time.sleep(0.1)
    raise AssertionError("the single claim was never decided inside the large batch")


def test_a_large_batch_with_a_bad_key_in_a_late_slice_claims_nothing(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns("atomic")
    keys = [f"a{i}" for i in range(SLICE_ABOVE + 2 * SLICE_KEYS)]
    keys[-1] = ""  # an empty key is refused
    with connect(daemon.socket) as s:
        s.sendall(_claim(7, ns, keys))
        rid, status, payload = protocol.decode_response(read_frame(s))
    assert (rid, status) == (7, Status.ERROR) and payload["type"] == "ValueError", payload
    with daemon.client(timeout=PATIENCE) as c:
        assert c.get("a0", namespace=ns) is None
        assert c.get(f"a{SLICE_KEYS + 1}", namespace=ns) is None
        # Repeated keys across slices answer as within one batch: NEW once.
        claims = c.claim_many(["r", *keys[:-1], "r"], namespace=ns)
        assert claims[0].outcome is Outcome.NEW
        assert claims[-1].outcome is Outcome.IN_PROGRESS
        assert all(x.outcome is Outcome.NEW for x in claims[1:-1])


# -- CLAIM_MANY answers in columns ----------------------------------------------------------


def _call(s: socket.socket, request_id: int, op: Op, args: dict[str, Any]) -> Any:
    s.sendall(protocol.encode_request(request_id, op, args))
    rid, status, payload = protocol.decode_response(read_frame(s))
    assert (rid, status) == (request_id, Status.OK), payload
    return payload


@pytest.mark.parametrize("sliced", [False, True], ids=["one-batch", "sliced"])
def test_columns_carry_outcomes_tokens_results_cold_answers_and_takeovers(
    lab: Lab, sliced: bool
) -> None:
    """Sliced: the six keys sit in different slices of a large batch among fresh
    keys, so every sparse column's indexes continue across slices."""
    home = lab.tmpdir()
    ns = unique_ns("cols")
    # A key demoted to the cold archive (its exact window passed), prepared in process.
    with DedupStore.open(home / "data") as store:
        old = store.claim("cold", namespace=ns)
        store.complete("cold", old.token, namespace=ns, result=b"gone")
        assert store.sweep(now=time.time() + 8 * 86400) == 1
    daemon = lab.daemon(data=home / "data")
    with connect(daemon.socket) as s:
        first = _call(s, 1, Op.CLAIM_MANY, {"ns": ns, "keys": ["done", "held"]})
        _call(s, 2, Op.COMPLETE_MANY, {"ns": ns, "items": [["done", first[0][1], {"n": 1}]]})
        # "late" is claimed with a short lease that runs out: the next claim takes it over.
        _call(s, 3, Op.CLAIM_MANY, {"ns": ns, "keys": ["late"], "lease": 0.05})
        time.sleep(0.2)
        six = ["done", "held", "fresh", "cold", "late", "fresh"]
        keys = list(six)
        at = list(range(6))
        if sliced:  # one of the six in each of slices 0, 1, 3, 4, 6, 9, among fresh keys
            n = SLICE_ABOVE + 3 * SLICE_KEYS
            at = [3, SLICE_KEYS + 1, 3 * SLICE_KEYS, 4 * SLICE_KEYS + 17, 6 * SLICE_KEYS - 1, n - 1]
            keys = [f"filler{i}" for i in range(n)]
            for pos, key in zip(at, six, strict=True):
                keys[pos] = key
        args = {"ns": ns, "keys": keys}
        cols = _call(s, 4, Op.CLAIM_MANY, {**args, "cols": 1})
        rows = _call(s, 5, Op.CLAIM_MANY, args)  # an older client still gets rows
    assert isinstance(cols, dict) and isinstance(rows, list)
    every = protocol.claims_from_reply(keys, ns, cols)
    claims = [every[i] for i in at]
    fillers = [c for i, c in enumerate(every) if i not in at]
    assert all(c.outcome is Outcome.NEW and c.exact and not c.takeover for c in fillers)
    assert all(c.result is None and c.token > 0 for c in fillers)
    assert [c.outcome for c in claims] == [
        Outcome.DUPLICATE,
        Outcome.IN_PROGRESS,
        Outcome.NEW,
        Outcome.DUPLICATE,
        Outcome.NEW,
        Outcome.IN_PROGRESS,
    ]
    assert claims[0].result == {"n": 1} and claims[0].token == first[0][1]
    assert claims[1].token == first[1][1] and claims[1].result is None
    assert claims[2].token > 0
    assert claims[3].exact is False and claims[3].result is None
    assert all(c.exact for i, c in enumerate(claims) if i != 3)
    assert claims[4].takeover is True and claims[4].token > 1
    assert [c.takeover for c in claims] == [False, False, False, False, True, False]
    assert all(c.key == k and c.namespace == ns for c, k in zip(every, keys, strict=True))
    # The rows of the same keys, asked right after, agree where nothing changed since.
    again = [protocol.claims_from_reply(keys, ns, rows)[i] for i in at]
    assert [c.outcome for c in again[:2]] == [Outcome.DUPLICATE, Outcome.IN_PROGRESS]
    assert again[0].result == {"n": 1} and again[3].exact is False


def test_both_clients_ask_for_columns_and_read_rows_from_an_older_daemon() -> None:
    args = protocol.claim_args("ns", ["a", "b"], None, None, None)
    assert args[protocol.COLUMNS_ARG] == 1
    rows = [["new", 5, None, True, False], ["duplicate", 2, b"r", False, False]]
    from_rows = protocol.claims_from_reply(["a", "b"], "ns", rows)
    built = protocol.ClaimColumns()
    built.add(from_rows[:1])
    built.add(from_rows[1:])  # slices: indexes continue across them
    from_cols = protocol.claims_from_reply(["a", "b"], "ns", built.payload())
    assert from_cols == from_rows
    with pytest.raises(protocol.FrameError):
        protocol.claims_from_reply(["a"], "ns", built.payload())


def test_the_clients_get_the_same_claims_through_columns(daemon: Daemon) -> None:
    ns = unique_ns("client-cols")
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many([f"k{i}" for i in range(SLICE_ABOVE + SLICE_KEYS)], namespace=ns)
        assert all(x.outcome is Outcome.NEW for x in claims)
        c.complete_many([(x.key, x.token, x.key) for x in claims[:10]], namespace=ns)
        again = c.claim_many([f"k{i}" for i in range(12)], namespace=ns)
    assert [x.result for x in again] == [f"k{i}" for i in range(10)] + [None, None]
    assert [x.outcome for x in again[10:]] == [Outcome.IN_PROGRESS] * 2

    async def run() -> list[Any]:
        async with aio.Client(daemon.socket, timeout=PATIENCE) as ac:
            return await ac.claim_many([f"k{i}" for i in range(12)], namespace=ns)

    assert asyncio.run(run()) == again


def test_a_sliced_batch_whose_answer_passes_the_frame_in_a_late_slice_claims_nothing(
    lab: Lab,
) -> None:
    daemon = lab.daemon()
    ns = unique_ns("bound")
    done = [f"done{i}" for i in range(280)]
    fresh = [f"fresh{i}" for i in range(SLICE_ABOVE)]
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many(done, namespace=ns)
        for start in range(0, len(done), 100):
            c.complete_many(
                [(x.key, x.token, RESULT) for x in claims[start : start + 100]], namespace=ns
            )
        slices_before = daemon_stats(daemon)["batch_slices"]
        # The fresh keys come first: only the last slices hold the 280 results of 60 kB
        # that push the answer over the 16 MiB frame.
        with pytest.raises(errors.BatchTooLargeError, match="split the batch"):
            c.claim_many(fresh + done, namespace=ns)
        assert daemon_stats(daemon)["batch_slices"] == slices_before  # no slice was claimed
        assert c.get(fresh[0], namespace=ns) is None
        assert c.get(fresh[-1], namespace=ns) is None
        # Without the results the same batch is answered.
        got = c.claim_many(fresh + done[:10], namespace=ns)
        assert [x.outcome for x in got] == [Outcome.NEW] * len(fresh) + [Outcome.DUPLICATE] * 10
        assert all(x.result == RESULT for x in got[len(fresh) :])


def test_a_decided_request_whose_commit_outlasts_the_request_timeout_is_told_so(
    tmp_path: Path,
) -> None:
    """A request decided by its connection's reader is answered from its commit's
    callback; a commit that takes longer than ``request_timeout`` (a disk that hangs)
    answers it with the timeout error instead, and the daemon keeps serving. The
    record was decided and logged: once the commit is done, the key is held."""
    store = DedupStore.open(tmp_path / "data")
    gate = threading.Event()
    real_wait = store.wait_durable

    def stuck_wait(lsn: int) -> None:
        assert gate.wait(PATIENCE)
        real_wait(lsn)

    # The commit thread takes every commit (none is small enough for the loop).
    store.wait_durable = stuck_wait  # type: ignore[method-assign]
    store.commit_bytes = lambda: 1 << 30  # type: ignore[method-assign]
    ns = unique_ns("stuck")
    with contextlib.ExitStack() as stack:
        server, sock = stack.enter_context(_serving(store, request_timeout=0.5))
        stack.callback(gate.set)  # before the server stops: the commit thread may wait on it
        s = stack.enter_context(connect(sock))
        s.sendall(_claim(1, ns, ["k"]))
        rid, status, payload = protocol.decode_response(read_frame(s))
        assert (rid, status, payload["type"]) == (1, Status.ERROR, "UnavailableError")
        assert "not finished within 0.5 s" in payload["message"]
        s.sendall(protocol.encode_request(2, Op.PING, {}))
        assert protocol.decode_response(read_frame(s)) == (2, Status.OK, "pong")
        gate.set()
        s.sendall(_claim(3, ns, ["k"]))
        rid, status, rows = protocol.decode_response(read_frame(s))
        assert (rid, status) == (3, Status.OK)
        assert rows[0][0] == Outcome.IN_PROGRESS.value  # the first claim holds it
        assert server.counters["errors"] == 1


def test_the_reader_says_what_it_holds() -> None:
    """``_Reader.buffered`` follows the bytes fed and read (a Python whose StreamReader
    keeps them elsewhere would make it 0, and every read would wait with a deadline)."""
    from dedupcore.daemon.server import _Reader

    async def run() -> list[int]:
        reader = _Reader(limit=1 << 16)
        seen = [reader.buffered()]
        reader.feed_data(b"x" * 10)
        seen.append(reader.buffered())
        await reader.readexactly(4)
        seen.append(reader.buffered())
        await reader.readexactly(6)
        seen.append(reader.buffered())
        return seen

    assert asyncio.run(run()) == [0, 10, 6, 0]


def test_frames_already_read_are_served_without_a_deadline_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that arrived together (pipelined) are read from the connection's
    buffer without a timer per read; a request still coming is read with its
    deadline, as before (the trickle and stalled-sender tests, test_faults.py)."""
    from dedupcore.daemon import server as server_mod

    deadlines = 0
    real_within = server_mod._within

    async def counting(aw: Any, seconds: float) -> Any:
        nonlocal deadlines
        deadlines += 1
        return await real_within(aw, seconds)

    monkeypatch.setattr(server_mod, "_within", counting)
    ns = unique_ns("burst")
    with _serving(DedupStore.open(tmp_path / "data")) as (_server, sock), connect(sock) as s:
        s.sendall(protocol.encode_request(1, Op.PING, {}))
        assert protocol.decode_response(read_frame(s)) == (1, Status.OK, "pong")
        before = deadlines
        burst = b"".join(_claim(10 + i, ns, [f"k{i}"]) for i in range(40))
        s.sendall(burst)  # one write: the daemon reads all 40 frames at once
        for i in range(40):
            rid, status, rows = protocol.decode_response(read_frame(s))
            assert (rid, status) == (10 + i, Status.OK)
            assert rows[0][0] == Outcome.NEW.value
    # Two deadlines per request before; now the wait for the burst, and the one
    # for what comes after it.
    assert deadlines - before <= 4, deadlines - before
