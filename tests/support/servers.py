"""Fixtures for tests that talk to the machine's real servers.

Each server is probed once per session. Outside CI a server that does not
answer skips its tests with the reason; with CI=true it fails them, since
.ci/run starts every server first.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

IN_CI = os.environ.get("CI") == "true"


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def require_server(name: str, port: int) -> None:
    """Skips (or, in CI, fails) when the server on 127.0.0.1:port does not answer."""
    if _reachable("127.0.0.1", port):
        return
    message = f"{name} is not reachable on 127.0.0.1:{port} (scripts/services.sh starts it)"
    if not IN_CI:
        # A developer's machine without this server: the test cannot run, and the
        # reason is shown. CI starts every server first, so there it is a failure.
        pytest.skip(message)
    pytest.fail(message)


@pytest.fixture
def redis_client() -> Iterator[object]:
    """A redis-py client on a database of its own, flushed before and after."""
    require_server("redis", 6379)
    import redis

    client = redis.Redis(host="127.0.0.1", port=6379, db=12)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()
