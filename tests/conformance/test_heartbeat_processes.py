"""Heartbeats between processes: an owner that renews keeps its key past its first
lease, and an owner stopped with SIGSTOP loses it a lease after its last renewal.

The owner is a child process (heartbeat_child.py) holding a key under
``processing(heartbeat=True)`` on a store shared with this test: the daemon,
Redis, PostgreSQL or MariaDB. It reports each renewal and stops itself with
SIGSTOP after the fourth, between two renewals (no request or transaction of
it is left open to block this test's claims). This test then takes the key
over by polling (leases are decided on the store's clock), continues the
child, and the child's completion is refused: it exits with the code of a
StaleTokenError.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api import Outcome
from tests.support.procs import LineProcess, load_script, wait_until
from tests.support.servers import redis_url, sql_url
from tests.support.stores import Stores, take_over

CHILD = Path(__file__).with_name("heartbeat_child.py")
child = load_script(CHILD)

#: The child's lease: it renews every second; four renewals outlast the first lease.
LEASE = 3.0
RENEWALS = 4


def _child_config(kind: str, store: Any) -> dict[str, Any]:
    """How the child opens the store this test holds."""
    if kind == "daemon":
        return {"kind": "daemon", "socket": store.path}
    if kind == "redis":
        return {"kind": "redis", "url": redis_url("conformance"), "prefix": store.prefix.decode()}
    engine = "postgresql" if kind == "postgresql" else "mysql"
    return {"kind": "sql", "url": sql_url(engine), "table": store.table}


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


@pytest.mark.parametrize("kind", ["daemon", "redis", "postgresql", "mariadb"])
def test_a_stopped_owner_loses_its_renewed_key_and_cannot_complete_it(
    stores: Stores, ns: str, kind: str
) -> None:
    store = stores.open(kind)
    config = {
        **_child_config(kind, store),
        "key": "k",
        "ns": ns,
        "lease": LEASE,
        "stop_after": RENEWALS,
    }
    with LineProcess(
        [sys.executable, str(CHILD), json.dumps(config)], stdin=True, name="owner"
    ) as owner:
        try:
            token = int(owner.expect("HELD"))
            assert owner.expect("RENEWED") == "1"
            for n in range(2, RENEWALS + 1):
                assert owner.expect("RENEWED") == str(n)
            # Four renewals a third of a lease apart: the first lease has run out on
            # every clock, and the last renewal holds the key.
            busy = store.claim("k", namespace=ns, owner="other")
            assert (busy.outcome, busy.token) == (Outcome.IN_PROGRESS, token)
            wait_until(lambda: _stopped(owner.pid), "the owner stopped by SIGSTOP")
            # Stopped, it renews no more: the key is taken over a lease later.
            taken = take_over(store, "k", ns, owner="other", lease=600.0)
            assert taken.takeover and taken.token == token + 1
        finally:
            os.kill(owner.pid, signal.SIGCONT)
        owner.send("finish")
        assert owner.expect("COMPLETE") == "StaleTokenError"
        assert owner.wait() == child.EXIT_STALE
    store.complete("k", taken.token, namespace=ns, result="done by the other")
    record = store.get("k", namespace=ns)
    assert record is not None and record.result == "done by the other"
