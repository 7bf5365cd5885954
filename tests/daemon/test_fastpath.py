"""The embedded store's request path in the daemon: decided on the event loop, replied
only after the log is durable, one commit shared by many connections, large batches
in slices that let other connections through (docs/daemon.md)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dedupcore import _core, aio, errors
from dedupcore.api import Outcome
from dedupcore.client import Client
from dedupcore.daemon import protocol
from dedupcore.daemon.commit import LONE_STREAK
from dedupcore.daemon.protocol import FrameError, Op, Status
from dedupcore.daemon.server import SLICE_ABOVE, SLICE_KEYS, SMALL_FRAME, DaemonServer
from dedupcore.store import DedupStore
from tests.support.daemon import (
    Daemon,
    Lab,
    connect,
    daemon_stats,
    read_frame,
    read_until_eof,
    serving,
)
from tests.support.procs import PATIENCE, wait_until
from tests.support.stores import lmdb_writer_held, namespace_writes, unique_ns

#: A 60 kB result.
RESULT = b"r" * 60_000


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
        # A namespace's first batch is served by a task (its id is recorded in a
        # worker thread): this one is known before the count starts.
        c.claim("first", namespace=ns)
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


def test_a_lone_small_commit_is_waited_for_on_the_loop_a_large_one_on_the_native_thread(
    lab: Lab,
) -> None:
    """The loop syncs the log itself only for a small commit with nothing else in
    flight, after LONE_STREAK such groups in a row: the log records of a batch of
    thousands of keys go to the native commit thread, and the batch is answered
    once they are durable: a SIGKILL of the daemon right after the answer loses
    none of its keys."""
    daemon = lab.daemon()
    ns = unique_ns("inline")

    def rounds() -> tuple[int, int, int]:
        figures = daemon_stats(daemon)
        return (
            figures["commit_rounds"],
            figures["inline_commit_rounds"],
            figures["native_commit_rounds"],
        )

    keys = [f"k{i}" for i in range(8 * SLICE_KEYS)]  # about 300 KiB of log records
    with daemon.client(timeout=PATIENCE) as c:
        for i in range(LONE_STREAK + 2):
            c.claim(f"warm-{i}", namespace=ns)
        total, inline, native = rounds()
        c.claim("one", namespace=ns)
        total_1, inline_1, native_1 = rounds()
        assert (total_1 - total, inline_1 - inline, native_1 - native) == (1, 1, 0)
        claims = c.claim_many(keys, namespace=ns)
        assert all(x.outcome is Outcome.NEW for x in claims)
        total_2, inline_2, native_2 = rounds()
        assert (total_2 - total_1, inline_2 - inline_1, native_2 - native_1) == (1, 0, 1)
    daemon.kill()
    daemon.start()
    with daemon.client(timeout=PATIENCE) as c:
        again = c.claim_many(keys, namespace=ns)
        assert [(x.outcome, x.token) for x in again] == [
            (Outcome.IN_PROGRESS, x.token) for x in claims
        ]


def test_a_group_of_several_sends_the_next_lone_commits_to_the_native_thread(
    lab: Lab,
) -> None:
    """While several requests share a commit, other connections are taking turns: a
    lone request right after goes to the native commit thread (the loop goes on
    reading), and the loop syncs a lone request itself again only after LONE_STREAK
    groups of one in a row (docs/daemon.md, "Group commit")."""
    daemon = lab.daemon()
    ns = unique_ns("streak")

    def rounds() -> tuple[int, int]:
        figures = daemon_stats(daemon)
        return figures["inline_commit_rounds"], figures["native_commit_rounds"]

    with daemon.client(timeout=PATIENCE) as c:
        for i in range(LONE_STREAK + 2):
            c.claim(f"warm-{i}", namespace=ns)
        inline, native = rounds()
        c.claim("lone", namespace=ns)
        assert rounds() == (inline + 1, native)
        # Three requests in one write: read and decided in one pass, one group.
        with contextlib.closing(connect(daemon.socket)) as s:
            s.sendall(b"".join(_claim(j, ns, [f"group-{j}"]) for j in range(3)))
            for _ in range(3):
                _, status, _ = protocol.decode_response(read_frame(s))
                assert status is Status.OK
        inline, native = rounds()
        c.claim("after", namespace=ns)
        assert rounds() == (inline, native + 1)
        for i in range(LONE_STREAK - 1):
            c.claim(f"again-{i}", namespace=ns)
        assert rounds() == (inline, native + LONE_STREAK)
        c.claim("inline-again", namespace=ns)
        assert rounds() == (inline + 1, native + LONE_STREAK)


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


@pytest.mark.parametrize("n", [SLICE_KEYS, SLICE_KEYS + 1, 8 * SLICE_KEYS])
def test_every_claim_batch_larger_than_a_slice_is_sliced(daemon: Daemon, n: int) -> None:
    # No step of the event loop decides more than one slice of a claim batch: one of
    # a few thousand keys, which small frames can carry, included.
    ns = unique_ns("slices")
    before = daemon_stats(daemon)
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many([f"s{i}" for i in range(n)], namespace=ns)
    after = daemon_stats(daemon)
    assert all(x.outcome is Outcome.NEW for x in claims) and len(claims) == n
    slices = -(-n // SLICE_KEYS) if n > SLICE_KEYS else 0
    assert after["sliced_batches"] - before["sliced_batches"] == (1 if slices else 0)
    assert after["batch_slices"] - before["batch_slices"] == slices


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


def test_a_large_claim_and_its_completion_are_decoded_a_slice_at_a_time(daemon: Daemon) -> None:
    # A frame over SMALL_FRAME of a plain claim, a completion or a release keeps its
    # keys or items in the frame until each slice is decided, with the same answers.
    ns = unique_ns("in-frame")
    n = 8 * SLICE_KEYS + 5
    keys: list[bytes | str] = [b"key-b-%06d" % i if i % 2 else f"key-s-{i:06}" for i in range(n)]
    assert len(_core.claim_frame(1, ns, keys) or b"") > SMALL_FRAME
    before = daemon_stats(daemon)
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many(keys, namespace=ns)
        assert [(x.key, x.outcome) for x in claims] == [(k, Outcome.NEW) for k in keys]
        c.complete_many([(x.key, x.token, i) for i, x in enumerate(claims)], namespace=ns)
        again = c.claim_many([*keys[:3], "fresh", *keys[3:]], namespace=ns)
        c.release_many([(x.key, x.token) for x in again[3:4]], namespace=ns)
    after = daemon_stats(daemon)
    # Two claims and the completion, each in slices (the one-item release is small).
    assert after["batches_read_in_slices"] - before["batches_read_in_slices"] == 3
    assert after["batch_slices"] - before["batch_slices"] == 3 * -(-n // SLICE_KEYS)
    expected = [(Outcome.DUPLICATE, i) for i in range(3)]
    expected += [(Outcome.NEW, None)] + [(Outcome.DUPLICATE, i) for i in range(3, n)]
    assert [(x.outcome, x.result) for x in again] == expected


def test_a_large_frame_of_no_more_than_a_slice_is_decoded_whole(daemon: Daemon) -> None:
    # Large keys: a frame over SMALL_FRAME whose claim fits one slice is decided at
    # once, as a small one is, and not scanned for slices first.
    ns = unique_ns("one-slice")
    keys: list[bytes | str] = [b"%04d" % i + b"k" * 200 for i in range(SLICE_KEYS)]
    assert len(_core.claim_frame(1, ns, keys) or b"") > SMALL_FRAME
    before = daemon_stats(daemon)
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many(keys, namespace=ns)
        assert [(x.key, x.outcome) for x in claims] == [(k, Outcome.NEW) for k in keys]
        assert all(x.outcome is Outcome.IN_PROGRESS for x in c.claim_many(keys, namespace=ns))
    after = daemon_stats(daemon)
    assert after["batches_read_in_slices"] == before["batches_read_in_slices"]
    assert after["batch_slices"] == before["batch_slices"]


def test_a_large_release_read_in_slices_releases_every_key(daemon: Daemon) -> None:
    ns = unique_ns("release-in-frame")
    keys = [f"r{i:06}" for i in range(8 * SLICE_KEYS)]
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many(keys, namespace=ns)
        items = [[x.key, x.token] for x in claims]
        before = daemon_stats(daemon)
        with connect(daemon.socket) as s:
            frame = protocol.encode_request(4, Op.RELEASE_MANY, {"ns": ns, "items": items})
            assert len(frame) > SMALL_FRAME
            s.sendall(frame)
            assert protocol.decode_response(read_frame(s)) == (4, Status.OK, None)
        after = daemon_stats(daemon)
        assert after["batches_read_in_slices"] - before["batches_read_in_slices"] == 1
        assert all(x.outcome is Outcome.NEW for x in c.claim_many(keys, namespace=ns))


@pytest.mark.parametrize("op", [Op.CLAIM_MANY, Op.COMPLETE_MANY])
def test_a_large_batch_with_an_element_not_decoding_in_a_late_slice_changes_nothing(
    lab: Lab, op: Op
) -> None:
    # A key or a result that is not UTF-8 is decoded with its slice, in the check
    # pass: the batch is refused whole with the error of a frame decoded whole,
    # and the connection goes on.
    daemon = lab.daemon()
    ns = unique_ns("not-utf8")
    keys = [f"u{i:06}" for i in range(8 * SLICE_KEYS)]
    if op is Op.CLAIM_MANY:
        frame = _core.claim_frame(5, ns, list(keys)) or b""
        at = frame.index(keys[-2].encode())
    else:
        with daemon.client(timeout=PATIENCE) as c:
            claims = c.claim_many(keys, namespace=ns)
        items = [[x.key, x.token, f"v{i:06}"] for i, x in enumerate(claims)]
        frame = protocol.encode_request(5, op, {"ns": ns, "items": items})
        at = frame.index(f"v{len(keys) - 2:06}".encode())
    assert len(frame) > SMALL_FRAME
    bad = frame[:at] + b"\xff" + frame[at + 1 :]
    with pytest.raises(FrameError):
        protocol.decode_request(bad[4:])
    before = daemon_stats(daemon)
    with connect(daemon.socket) as s:
        s.sendall(bad)
        rid, status, payload = protocol.decode_response(read_frame(s))
        assert (rid, status) == (5, Status.ERROR) and payload["type"] == "FrameError", payload
        assert "not valid msgpack" in payload["message"]
        s.sendall(protocol.encode_request(6, Op.PING, {}))
        assert protocol.decode_response(read_frame(s)) == (6, Status.OK, "pong")
    after = daemon_stats(daemon)
    assert after["batches_read_in_slices"] - before["batches_read_in_slices"] == 1
    assert after["batch_slices"] == before["batch_slices"]  # no slice was applied
    with daemon.client(timeout=PATIENCE) as c:
        for key in (keys[0], keys[-1]):
            record = c.get(key, namespace=ns)
            if op is Op.CLAIM_MANY:
                assert record is None
            else:
                assert record is not None and record.state.name == "PROCESSING"


@pytest.mark.parametrize("n", [SLICE_KEYS, SLICE_KEYS + 1, 8 * SLICE_KEYS])
@pytest.mark.parametrize("completing", [True, False], ids=["complete", "release"])
def test_every_change_batch_larger_than_a_slice_is_sliced(
    daemon: Daemon, n: int, completing: bool
) -> None:
    # A completion or release of more than a slice is decided a slice per step of
    # the event loop too, and changes every key it names.
    ns = unique_ns("change-slices")
    keys = [f"s{i}" for i in range(n)]
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many(keys, namespace=ns)
        before = daemon_stats(daemon)
        if completing:
            c.complete_many([(x.key, x.token, i) for i, x in enumerate(claims)], namespace=ns)
        else:
            c.release_many([(x.key, x.token) for x in claims], namespace=ns)
        after = daemon_stats(daemon)
        again = c.claim_many(keys, namespace=ns)
    if completing:
        assert [(x.outcome, x.result) for x in again] == [(Outcome.DUPLICATE, i) for i in range(n)]
    else:
        assert all(x.outcome is Outcome.NEW for x in again)
    slices = -(-n // SLICE_KEYS) if n > SLICE_KEYS else 0
    assert after["sliced_batches"] - before["sliced_batches"] == (1 if slices else 0)
    assert after["batch_slices"] - before["batch_slices"] == slices


@pytest.mark.parametrize("completing", [True, False], ids=["complete", "release"])
def test_a_large_change_with_a_stale_token_in_a_late_slice_changes_nothing(
    daemon: Daemon, completing: bool
) -> None:
    ns = unique_ns("change-atomic")
    keys = [f"a{i}" for i in range(SLICE_ABOVE + 2 * SLICE_KEYS)]
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many(keys, namespace=ns)
        items = [(x.key, x.token) for x in claims]
        items[-1] = (items[-1][0], items[-1][1] + 1)  # a token that is not the key's
        change = c.complete_many if completing else c.release_many
        with pytest.raises(errors.StaleTokenError):
            change(items, namespace=ns)
        # Nothing changed: every key is still held by its claim.
        assert all(x.outcome is Outcome.IN_PROGRESS for x in c.claim_many(keys, namespace=ns))


@pytest.mark.parametrize("n", [SLICE_ABOVE + SLICE_KEYS, 8 * SLICE_KEYS])
def test_a_large_change_naming_a_key_twice_is_decided_as_one_batch(daemon: Daemon, n: int) -> None:
    """A key named in two slices: a release is refused whole, as a release naming a
    key twice always is; a completion takes it once. The larger batches' items are
    decoded from their frames a slice at a time, then whole for the one step."""
    ns = unique_ns("change-twice")
    keys = [f"t{i}" for i in range(n)]
    before = daemon_stats(daemon)["batches_read_in_slices"]
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many(keys, namespace=ns)
        items = [(x.key, x.token) for x in claims]
        with pytest.raises(errors.StaleTokenError):
            c.release_many([*items, items[0]], namespace=ns)
        assert all(x.outcome is Outcome.IN_PROGRESS for x in c.claim_many(keys, namespace=ns))
        c.complete_many([*items, items[0]], namespace=ns)
        assert all(x.outcome is Outcome.DUPLICATE for x in c.claim_many(keys, namespace=ns))
    read_in_slices = daemon_stats(daemon)["batches_read_in_slices"] - before
    # The completion, when over SMALL_FRAME (the claims' short keys are not; the
    # client refuses the release itself).
    assert read_in_slices == (1 if n > 4 * SLICE_KEYS else 0)


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
            n = 10 * SLICE_KEYS
            assert n > SLICE_ABOVE
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


@pytest.mark.parametrize("spin", [None, 0, 0.001])
def test_a_client_that_checks_for_its_replies_gets_the_same_answers(
    daemon: Daemon, spin: float | None
) -> None:
    """Checking for a one-key reply without sleeping (``Client(spin=)``; adaptive by
    default) changes how the client waits, not what it reads; a batch never checks."""
    ns = unique_ns("spin")
    with Client(daemon.socket, timeout=PATIENCE, spin=spin) as c:
        first = c.claim("k", namespace=ns)
        assert first.outcome is Outcome.NEW
        assert c.claim("k", namespace=ns).outcome is Outcome.IN_PROGRESS
        c.complete("k", first.token, namespace=ns, result="done")
        again = c.claim("k", namespace=ns)
        assert (again.outcome, again.result) == (Outcome.DUPLICATE, "done")
        assert [x.outcome for x in c.claim_many(["k", "m"], namespace=ns)] == [
            Outcome.DUPLICATE,
            Outcome.NEW,
        ]
        conn = c._local.conn
        assert conn.spin.fixed == spin
        assert conn.spin.typical > 0  # the one-key calls' round trips were counted
        if spin is not None:
            assert conn.spin.budget() == spin


@pytest.mark.parametrize("poll", [0, 0.01])
def test_the_loop_polls_for_the_next_request_after_a_reply_only_when_asked(
    tmp_path: Path, poll: float
) -> None:
    """After a reply the event loop polls without sleeping for ``poll_after_reply``
    seconds (0: never); a request that arrives meanwhile is counted in
    ``polled_requests``. A client sends 200 claims one after another, each well
    within 10 ms of the last reply, and gets the same answers either way."""
    ns = unique_ns("awake")
    with serving(DedupStore.open(tmp_path / "d"), poll_after_reply=poll) as (server, path):
        with Client(path, timeout=PATIENCE, spin=0) as c:
            outcomes = [c.claim(f"k{i % 100}", namespace=ns).outcome for i in range(200)]
        polled = server.counters["polled_requests"]
    assert outcomes == [Outcome.NEW] * 100 + [Outcome.IN_PROGRESS] * 100
    if poll:
        assert polled > 0
    else:
        assert polled == 0


def test_plain_batches_are_framed_natively_and_the_others_the_general_way(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain batch goes out in the frame ``_core.claim_frame`` builds; one with a
    bytes-like key or an owner in ``protocol.encode_request``'s: the same answers."""
    ns = unique_ns("frames")
    sent: list[str] = []
    native, general = _core.claim_frame, protocol.encode_request

    def claim_frame(*args: Any) -> bytes | None:
        sent.append("native")
        return native(*args)

    def encode_request(*args: Any) -> bytes:
        sent.append("general")
        return general(*args)

    monkeypatch.setattr(_core, "claim_frame", claim_frame)
    monkeypatch.setattr(protocol, "encode_request", encode_request)
    with daemon.client(timeout=PATIENCE) as c:
        first = c.claim_many(["a", b"b", "c"], namespace=ns)
        assert sent == ["native"]
        again = c.claim_many([bytearray(b"a"), memoryview(b"b"), "d"], namespace=ns)
        assert sent == ["native", "general"]
        owned = c.claim_many(["e", "f"], namespace=ns, owner="w")
        assert sent == ["native", "general", "general"]
    assert [x.outcome for x in first] == [Outcome.NEW] * 3
    assert [x.key for x in again] == [b"a", b"b", "d"]
    assert [x.outcome for x in again] == [Outcome.IN_PROGRESS] * 2 + [Outcome.NEW]
    assert [x.outcome for x in owned] == [Outcome.NEW] * 2


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
        # that push the answer over the 16 MiB frame. Sent as one request (the client's
        # claim_many would send it again in halves).
        args = protocol.claim_args(ns, fresh + done, None, None, None)
        with pytest.raises(errors.BatchTooLargeError, match="split the batch"):
            c._call(Op.CLAIM_MANY, args)
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
    ns = unique_ns("slots")
    store.claim("first", namespace=ns)  # known: a namespace's first batch is a task's
    gate = threading.Event()
    real_wait = store.wait_durable

    def stuck_wait(lsn: int) -> None:
        assert gate.wait(PATIENCE)
        real_wait(lsn)

    # The commit thread takes every commit (none is small enough for the loop, and the
    # native commit thread is declined: a disk that hangs is simulated in Python).
    store.wait_durable = stuck_wait  # type: ignore[method-assign]
    store.commit_bytes = lambda: 1 << 30  # type: ignore[method-assign]
    store.start_commit = lambda: False  # type: ignore[method-assign]
    ns = unique_ns("stuck")
    with contextlib.ExitStack() as stack:
        server, sock = stack.enter_context(serving(store, request_timeout=0.5))
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
    with serving(DedupStore.open(tmp_path / "data")) as (_server, sock), connect(sock) as s:
        s.sendall(protocol.encode_request(1, Op.PING, {}))
        assert protocol.decode_response(read_frame(s)) == (1, Status.OK, "pong")
        # The namespace known first: its first batch would be served by a task.
        s.sendall(_claim(2, ns, ["first"]))
        assert protocol.decode_response(read_frame(s))[:2] == (2, Status.OK)
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


# -- the connection's own reader: frames parsed from its buffer, served in its callback -----


def _ping(request_id: int) -> bytes:
    return protocol.encode_request(request_id, Op.PING, {})


def _only_connection(server: DaemonServer) -> Any:
    """The server's one open connection (the daemon's object for it)."""
    wait_until(lambda: len(server._connections) == 1, "the connection to be accepted")
    (conn,) = list(server._connections)
    return conn


def _held(conn: Any) -> int:
    """Bytes of the frame being read that the connection holds (its header included)."""
    return len(conn._buf) + (4 if conn._length >= 0 else 0)


@pytest.mark.parametrize("durability", ["power-loss-unsafe", "durable"])
def test_pipelined_small_requests_in_one_write_are_all_answered_without_a_task_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str
) -> None:
    """300 claims and pings in one write: every one is answered, none through a task
    (``_handle``). Without fdatasync each is answered in the callback that read it, so
    the replies come in order; durable claims are answered by their commit's callback
    (the pings at once), and more than max_in_flight of them wait for a slot."""
    tasks = 0
    real_handle = DaemonServer._handle

    def counting(self: DaemonServer, *args: Any, **kwargs: Any) -> Any:
        nonlocal tasks
        tasks += 1
        return real_handle(self, *args, **kwargs)

    monkeypatch.setattr(DaemonServer, "_handle", counting)
    ns = unique_ns("pipelined")
    n = 300
    pings = set(range(0, n, 10))
    frames = [_ping(i) if i in pings else _claim(i, ns, [f"k{i}"]) for i in range(n)]
    store = DedupStore.open(tmp_path / "data", durability=durability)
    store.claim("first", namespace=ns)  # known: a namespace's first batch is a task's
    with serving(store) as (server, sock), connect(sock) as s:
        s.sendall(b"".join(frames))
        replies = [protocol.decode_response(read_frame(s)) for _ in range(n)]
        at_once = server.counters["answered_at_once"]
        by_commit = server.counters["completed_by_commit"]
    assert tasks == 0
    assert all(status is Status.OK for _, status, _ in replies), replies
    by_id = {rid: payload for rid, _, payload in replies}
    assert sorted(by_id) == list(range(n))
    assert all(by_id[i] == "pong" for i in pings)
    assert all(by_id[i][0][0] == Outcome.NEW.value for i in range(n) if i not in pings)
    if durability == "power-loss-unsafe":
        assert [rid for rid, _, _ in replies] == list(range(n))
        assert (at_once, by_commit) == (n, 0)
    else:
        assert (at_once, by_commit) == (len(pings), n - len(pings))


def test_a_frame_sent_a_byte_at_a_time_is_reassembled(tmp_path: Path) -> None:
    """The connection keeps what it has of a frame across reads: a header split over
    several reads, a body that comes a byte at a time."""
    ns = unique_ns("bytes")
    store = DedupStore.open(tmp_path / "data", durability="power-loss-unsafe")
    with serving(store, request_timeout=PATIENCE) as (server, sock), connect(sock) as s:
        conn = _only_connection(server)
        frame = _claim(7, ns, ["k"])
        # The first bytes one read each: the daemon holds each before the next comes.
        for i in range(8):
            s.sendall(frame[i : i + 1])
            wait_until(lambda: _held(conn) == i + 1, f"byte {i} to be held")  # noqa: B023
        for i in range(8, len(frame)):
            s.sendall(frame[i : i + 1])
        rid, status, rows = protocol.decode_response(read_frame(s))
        assert (rid, status) == (7, Status.OK) and rows[0][0] == Outcome.NEW.value
        # Two frames sent a byte at a time, back to back, with nothing waited for.
        for byte in _ping(8) + _claim(9, ns, ["k"]):
            s.sendall(bytes([byte]))
        assert protocol.decode_response(read_frame(s)) == (8, Status.OK, "pong")
        rid, status, rows = protocol.decode_response(read_frame(s))
        assert (rid, status) == (9, Status.OK) and rows[0][0] == Outcome.IN_PROGRESS.value
        assert server._budget.used == 0


@pytest.mark.parametrize("one_key", [True, False])
def test_a_first_claim_in_a_namespace_waits_for_lmdb_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_key: bool
) -> None:
    """A namespace's first claim records it in LMDB, which waits while a checkpoint
    holds LMDB's writer. The daemon has that done in a worker thread, not on its
    event loop: another connection's claim is answered meanwhile."""
    known, new = unique_ns("known"), unique_ns("new")
    store = DedupStore.open(tmp_path / "data", durability="power-loss-unsafe")
    store.claim("k", namespace=known)
    recording = namespace_writes(store, monkeypatch)
    keys = ["k"] if one_key else ["k", "k2"]
    with (
        serving(store, request_timeout=PATIENCE) as (server, sock),
        connect(sock) as first,
        connect(sock) as other,
    ):
        with lmdb_writer_held(store):
            first.sendall(_claim(1, new, keys))
            assert recording.wait(PATIENCE)
            # Answered in milliseconds; a loop that waits for LMDB times out here,
            # before the writer is let go.
            other.settimeout(30)
            other.sendall(_claim(2, known, ["k2"]))
            rid, status, rows = protocol.decode_response(read_frame(other))
            assert (rid, status) == (2, Status.OK) and rows[0][0] == Outcome.NEW.value
        rid, status, rows = protocol.decode_response(read_frame(first))
        assert (rid, status) == (1, Status.OK)
        assert [r[0] for r in rows] == [Outcome.NEW.value] * len(keys)
        # Known now: its next claim is decided at once again.
        answered = server.counters["answered_at_once"]
        first.sendall(_claim(3, new, ["k3"]))
        rid, status, rows = protocol.decode_response(read_frame(first))
        assert (rid, status, rows[0][0]) == (3, Status.OK, Outcome.NEW.value)
        assert server.counters["answered_at_once"] == answered + 1


def test_requests_waiting_for_their_namespace_are_decided_in_the_order_they_came(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pipelined claims of one key in a new namespace all wait for its id, and are
    then decided in the order they were sent: the first is NEW, the others
    IN_PROGRESS. A claim that comes once the id is recorded keeps its place too."""
    new = unique_ns("order")
    store = DedupStore.open(tmp_path / "data", durability="power-loss-unsafe")
    recording = namespace_writes(store, monkeypatch)
    with serving(store, request_timeout=PATIENCE) as (_server, sock), connect(sock) as s:
        with lmdb_writer_held(store):
            s.sendall(b"".join(_claim(10 + i, new, ["k"]) for i in range(5)))
            assert recording.wait(PATIENCE)
        s.sendall(_claim(15, new, ["k"]))
        outcomes = {}
        for _ in range(6):
            rid, status, rows = protocol.decode_response(read_frame(s))
            assert status == Status.OK, rows
            outcomes[rid] = rows[0][0]
    assert outcomes == {10: Outcome.NEW.value} | {
        i: Outcome.IN_PROGRESS.value for i in range(11, 16)
    }


def test_a_header_read_first_reserves_the_body_which_is_served_when_it_comes(
    tmp_path: Path,
) -> None:
    ns = unique_ns("header")
    store = DedupStore.open(tmp_path / "data", durability="power-loss-unsafe")
    store.claim("first", namespace=ns)  # known: a namespace's first batch is a task's
    with serving(store, request_timeout=PATIENCE) as (server, sock), connect(sock) as s:
        frame = _claim(3, ns, ["k"])
        s.sendall(frame[:4])
        # The body's bytes are taken from the shared budget once the header is read.
        wait_until(lambda: server._budget.used == len(frame) - 4, "the header to be read")
        s.sendall(frame[4:])
        rid, status, rows = protocol.decode_response(read_frame(s))
        assert (rid, status) == (3, Status.OK) and rows[0][0] == Outcome.NEW.value
        assert server._budget.used == 0
        assert server.counters["answered_at_once"] == 1


def test_a_partial_frame_is_cut_off_after_the_request_timeout(tmp_path: Path) -> None:
    """A frame not complete within request_timeout of its header closes its connection
    without a reply and gives its bytes back; another connection is not disturbed."""
    store = DedupStore.open(tmp_path / "data")
    with (
        serving(store, request_timeout=0.3) as (server, sock),
        connect(sock) as stalled,
        connect(sock) as other,
    ):
        frame = _claim(1, unique_ns("cut"), ["k"])
        stalled.sendall(frame[:10])
        assert read_until_eof(stalled) == b""  # closed by the daemon, without a reply
        wait_until(lambda: len(server._connections) == 1, "its connection to be dropped")
        assert server._budget.used == 0
        other.sendall(_ping(2))
        assert protocol.decode_response(read_frame(other)) == (2, Status.OK, "pong")


def test_a_connection_is_closed_after_the_idle_timeout_with_nothing_in_flight(
    tmp_path: Path,
) -> None:
    """A connection that sends no request within idle_timeout is closed: one that never
    sent anything, and one once its last request was answered. (The timeout is
    lowered once both are served: a wait for a request starting from then on gets
    it, so nothing here depends on how fast the test runs.)"""
    store = DedupStore.open(tmp_path / "data")
    with serving(store, idle_timeout=PATIENCE) as (server, sock), connect(sock) as served:
        served.sendall(_ping(1))
        assert protocol.decode_response(read_frame(served)) == (1, Status.OK, "pong")
        server.idle_timeout = 0.3
        served.sendall(_ping(2))
        assert protocol.decode_response(read_frame(served)) == (2, Status.OK, "pong")
        assert read_until_eof(served) == b""
        with connect(sock) as silent:
            assert read_until_eof(silent) == b""
        wait_until(lambda: not server._connections, "both connections to be dropped")


@pytest.mark.parametrize("durability", ["power-loss-unsafe", "durable"])
def test_no_timer_is_set_per_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str
) -> None:
    """A connection's deadlines (the wait for a request, a partial frame, a commit)
    share one timer that is re-armed when it fires (or for an earlier deadline), not
    set and cancelled for every request: 100 round trips arm no timer at all."""
    armed = 0
    counting_on = False
    real_call_at = asyncio.BaseEventLoop.call_at

    def counting(
        self: asyncio.BaseEventLoop, when: float, callback: Any, *args: Any, **kwargs: Any
    ) -> Any:
        nonlocal armed
        if counting_on:
            armed += 1
        return real_call_at(self, when, callback, *args, **kwargs)

    monkeypatch.setattr(asyncio.BaseEventLoop, "call_at", counting)
    ns = unique_ns("timers")
    store = DedupStore.open(tmp_path / "data", durability=durability)
    store.claim("known", namespace=ns)  # known: a namespace's first batch is a task's
    with serving(store) as (_server, sock), connect(sock) as s:
        # The first request arms the timer for its deadline (the idle one, or a
        # commit's, earlier); those after it only move deadlines later.
        s.sendall(_claim(0, ns, ["first"]))
        assert protocol.decode_response(read_frame(s))[:2] == (0, Status.OK)
        counting_on = True
        for i in range(1, 101):
            s.sendall(_claim(i, ns, [f"k{i}"]))
            rid, status, _rows = protocol.decode_response(read_frame(s))
            assert (rid, status) == (i, Status.OK)
        counting_on = False
    assert armed == 0, armed


def test_max_in_flight_stops_reading_until_a_reply_is_written(tmp_path: Path) -> None:
    """With max_in_flight requests waiting for their commit, the next one read waits for
    a slot and nothing more is read; once the commits are done, all are answered."""
    store = DedupStore.open(tmp_path / "data")
    ns = unique_ns("slots")
    store.claim("first", namespace=ns)  # known: a namespace's first batch is a task's
    gate = threading.Event()
    real_wait = store.wait_durable

    def stuck_wait(lsn: int) -> None:
        assert gate.wait(PATIENCE)
        real_wait(lsn)

    store.wait_durable = stuck_wait  # type: ignore[method-assign]
    store.commit_bytes = lambda: 1 << 30  # type: ignore[method-assign]  # the thread commits
    with contextlib.ExitStack() as stack:
        server, sock = stack.enter_context(serving(store, max_in_flight=2))
        stack.callback(gate.set)
        s = stack.enter_context(connect(sock))
        s.sendall(b"".join(_claim(i, ns, [f"k{i}"]) for i in range(6)))
        wait_until(lambda: server.counters["paused_reads"] >= 1, "the reads to pause")
        # Two wait for their commit, the third was read and waits for a slot, the
        # others are not read.
        assert server.counters["requests"] == 3
        assert server._in_flight == 2
        gate.set()
        replies = sorted(protocol.decode_response(read_frame(s)) for _ in range(6))
    assert [(rid, status) for rid, status, _ in replies] == [(i, Status.OK) for i in range(6)]
    assert all(rows[0][0] == Outcome.NEW.value for _, _, rows in replies)


def _done_key(store: DedupStore, ns: str, result: bytes) -> None:
    claim = store.claim("big", namespace=ns)
    store.complete("big", claim.token, namespace=ns, result=result)


@pytest.mark.parametrize("reads_later", [False, True], ids=["never-reads", "reads-later"])
def test_a_peer_that_stops_reading_is_paused_then_disconnected_or_served(
    tmp_path: Path, reads_later: bool
) -> None:
    """Claims answered at once, each a DUPLICATE carrying a 60 kB result, sent by a peer
    that reads nothing: past max_unsent the connection reads no more requests; after
    write_timeout the peer is disconnected, or, if it reads in time, gets every reply."""
    ns = unique_ns("unread")
    n = 100
    store = DedupStore.open(tmp_path / "data", durability="power-loss-unsafe")
    _done_key(store, ns, RESULT)
    timeout = PATIENCE if reads_later else 0.5
    with (
        serving(store, max_unsent=64 << 10, write_timeout=timeout) as (server, sock),
        connect(sock) as s,
    ):
        before = server.counters["requests"]
        s.sendall(b"".join(_claim(i, ns, ["big"]) for i in range(n)))
        wait_until(lambda: server.counters["paused_reads"] >= 1, "the reads to pause")
        if reads_later:
            replies = [protocol.decode_response(read_frame(s)) for _ in range(n)]
            assert [rid for rid, _, _ in replies] == list(range(n))
            assert all(rows[0][0] == Outcome.DUPLICATE.value for _, _, rows in replies)
            assert all(rows[0][2] == RESULT for _, _, rows in replies)
            assert server.counters["write_timeouts"] == 0
            return
        wait_until(lambda: server.counters["write_timeouts"] >= 1, "the peer to be cut off")
        # Reading stopped long before the last request (60 kB replies vs 64 kB).
        assert server.counters["requests"] - before < n
        wait_until(lambda: not server._connections, "its connection to be dropped")
        # What the kernel took before the cut may still be read, not every reply.
        assert len(read_until_eof(s)) < n * len(RESULT)
        with connect(sock) as other:
            other.sendall(_ping(1))
            assert protocol.decode_response(read_frame(other)) == (1, Status.OK, "pong")


_BUDGET_LIMIT = 1 << 20


@contextlib.contextmanager
def _first_frame_held(
    tmp_path: Path,
) -> Iterator[tuple[DaemonServer, Path, socket.socket, socket.socket, bytes, bytes]]:
    """A daemon with a 1 MiB frame budget and two connections; the first has sent all
    but the last byte of a 900 KiB frame, whose bytes the budget now holds. Yields
    (server, socket path, first, second, that frame, a 200 KiB frame not yet sent)."""
    store = DedupStore.open(tmp_path / "data")
    limit = _BUDGET_LIMIT
    big = protocol.encode_request(1, Op.PING, {"pad": b"a" * (900 << 10)})
    other = protocol.encode_request(2, Op.PING, {"pad": b"b" * (200 << 10)})
    with (
        serving(store, max_frame=limit, max_buffered=limit, request_timeout=PATIENCE) as (
            server,
            sock,
        ),
        connect(sock) as first,
        connect(sock) as second,
    ):
        first.sendall(big[:-1])
        wait_until(lambda: server._budget.used >= 900 << 10, "the first frame to be held")
        yield server, sock, first, second, big, other


def test_a_frame_that_does_not_fit_the_budget_pauses_its_connection_until_it_does(
    tmp_path: Path,
) -> None:
    """A frame whose bytes would pass max_buffered waits (its connection reads nothing
    more) until another request is answered; small frames pass it meanwhile."""
    with _first_frame_held(tmp_path) as (server, sock, first, second, big, other):
        sender = threading.Thread(target=second.sendall, args=(other,), daemon=True)
        sender.start()
        wait_until(lambda: server._budget.waits >= 1, "the second frame to wait")
        assert server._budget.used <= _BUDGET_LIMIT
        with connect(sock) as third:  # a small frame is served meanwhile
            third.sendall(_ping(3))
            assert protocol.decode_response(read_frame(third)) == (3, Status.OK, "pong")
        first.sendall(big[-1:])
        assert protocol.decode_response(read_frame(first)) == (1, Status.OK, "pong")
        sender.join(PATIENCE)
        assert protocol.decode_response(read_frame(second)) == (2, Status.OK, "pong")
        wait_until(lambda: server._budget.used == 0, "the budget to be free")


def test_a_frame_waiting_for_the_budget_is_cut_off_after_the_request_timeout(
    tmp_path: Path,
) -> None:
    """The wait for the budget counts in request_timeout (its deadline runs from the
    header): the waiting connection is closed without a reply, its place in the queue
    given up; the frame it waited behind is still served. (The timeout is lowered
    once the first frame's header is read: only the second frame's deadline is short.)"""
    with _first_frame_held(tmp_path) as (server, _, first, second, big, other):
        server.request_timeout = 0.3
        second.sendall(other[:4])
        assert read_until_eof(second) == b""  # cut off while waiting, never answered
        assert server._budget.waits == 1 and not server._budget._waiters
        assert server._budget.used == len(big) - 4  # only the first frame's bytes
        first.sendall(big[-1:])
        assert protocol.decode_response(read_frame(first)) == (1, Status.OK, "pong")
        wait_until(lambda: server._budget.used == 0, "the budget to be free")


def test_a_bad_header_is_answered_then_the_connection_closes_after_its_replies(
    tmp_path: Path,
) -> None:
    """A frame header the stream cannot recover from: the requests before it are
    answered, then the error (as request 0), then the connection is closed."""
    store = DedupStore.open(tmp_path / "data", durability="power-loss-unsafe")
    with serving(store) as (server, sock), connect(sock) as s:
        s.sendall(_ping(1) + b"\x00\x00\x00\x00" + _ping(2))
        assert protocol.decode_response(read_frame(s)) == (1, Status.OK, "pong")
        rid, status, payload = protocol.decode_response(read_frame(s))
        assert (rid, status, payload["type"]) == (0, Status.ERROR, "FrameError")
        assert "empty frame" in payload["message"]
        assert read_until_eof(s) == b""
        assert server.counters["protocol_errors"] == 1


# -- the reader's own codec agrees with the protocol's -------------------------------------


_small_ints = st.integers(min_value=-(2**31), max_value=2**31)


@settings(max_examples=600, deadline=None)
@given(
    st.lists(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**63), max_value=2**64 - 1)
        | st.floats()
        | st.text(max_size=5)
        | st.dictionaries(st.text(max_size=4), _small_ints | st.text(max_size=4), max_size=3),
        min_size=2,
        max_size=4,
    )
    | st.tuples(
        st.integers(min_value=0, max_value=2**64 - 1),
        st.integers(min_value=-1, max_value=12) | st.booleans() | st.floats(0, 10),
        st.dictionaries(st.text(max_size=4), _small_ints, max_size=3),
    ).map(list)
)
@example([1, True, {}])
@example([True, 1, {}])
@example([1, 1.0, {}])
@example([2**64 - 1, int(Op.CLAIM_MANY), {"ns": "a", "keys": ["k"]}])
def test_the_readers_decoder_agrees_with_decode_request(msg: list[Any]) -> None:
    from dedupcore.daemon.connection import _request_parts

    body = msgpack.packb(msg, use_bin_type=True)
    try:
        request = protocol.decode_request(body)
    except FrameError:
        assert _request_parts(body) is None
        return
    parts = _request_parts(body)
    assert parts == (request.request_id, request.op, request.args)
    assert parts is not None and type(parts[1]) is Op


def test_replies_are_encoded_as_encode_response_encodes_them(tmp_path: Path) -> None:
    server = DaemonServer(DedupStore.open(tmp_path / "data"), tmp_path / "d.sock")
    try:
        results: list[Any] = [
            "pong",
            None,
            [["new", 1, None, True, False]],
            {"o": b"\x00\x01", "t": b"\x00" * 16, "r": [[0, {"n": 1}]]},
            b"x" * 70_000,
            2**64 - 1,
        ]
        for i, result in enumerate(results):
            assert server._reply(i, result, time.perf_counter()) == protocol.encode_response(
                i, result
            )
        with pytest.raises(TypeError):
            server._reply(9, object(), time.perf_counter())
        assert server._reply(10, "after", 0.0) == protocol.encode_response(10, "after")
    finally:
        server._pool.shutdown()
        server.store.close()
