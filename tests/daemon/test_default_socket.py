"""Where clients and commands find the daemon when given no socket path: the path in
``DEDUPCORE_SOCKET``, else the default (docs/daemon-config.md, "The socket")."""

from __future__ import annotations

import asyncio
import json

import pytest

from dedupcore import aio
from dedupcore.api import Outcome
from dedupcore.client import Client
from tests.support.daemon import Daemon, Lab
from tests.support.procs import PATIENCE, child_env, run_cli
from tests.support.stores import unique_ns


@pytest.fixture
def daemon(lab: Lab) -> Daemon:
    """A daemon on a socket of its own, far from the default path."""
    return lab.daemon()


def test_client_without_a_path_uses_DEDUPCORE_SOCKET(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEDUPCORE_SOCKET", str(daemon.socket))
    ns = unique_ns("env")
    with Client(timeout=PATIENCE, retries=0) as c:
        assert c.path == str(daemon.socket)
        assert c.claim("k", namespace=ns).outcome is Outcome.NEW
    with Client(daemon.socket, timeout=PATIENCE) as c:  # an explicit path wins
        assert c.claim("k", namespace=ns).outcome is Outcome.IN_PROGRESS


def test_aio_client_without_a_path_uses_DEDUPCORE_SOCKET(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEDUPCORE_SOCKET", str(daemon.socket))
    ns = unique_ns("aio-env")

    async def run() -> tuple[str, Outcome]:
        async with aio.Client(timeout=PATIENCE, retries=0) as c:
            return c.path, (await c.claim("k", namespace=ns)).outcome

    assert asyncio.run(run()) == (str(daemon.socket), Outcome.NEW)


def test_stats_without_socket_uses_DEDUPCORE_SOCKET(daemon: Daemon) -> None:
    env = {**child_env(), "DEDUPCORE_SOCKET": str(daemon.socket)}
    out = run_cli("stats", "--json", "--interval", "0", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["daemon"]["requests"] >= 1
