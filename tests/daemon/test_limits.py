"""The daemon's limits, with real processes and sockets.

Waits are deterministic: each test polls the daemon's counters (or a process state) with
a generous bound rather than sleeping and hoping.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from dedupcore import errors
from dedupcore.api import Outcome
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import Op, Status

from .conftest import PATIENCE, Daemon, Lab, unique_ns
from .test_faults import read_frame

RESULT = b"r" * 60_000


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
