"""Stores for the idempotency tests: embedded, through the daemon, and on the real Redis
(rows of the store matrix, tests/support/stores.py).

The daemon is the module's shared one (tests/support/daemon.py); Redis keeps to the
suite's database (tests/support/servers.py), under a key prefix of each test's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import Daemon
from tests.support.stores import Stores

STORE_KINDS = ("embedded", "daemon", "redis")


@pytest.fixture(params=STORE_KINDS)
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """Each kind of ClaimAPI store in turn."""

    def daemon() -> Daemon:
        served: Daemon = request.getfixturevalue("daemon")
        return served

    with Stores(tmp_path, "idempotency", daemon=daemon) as stores:
        yield stores.open(request.param)
