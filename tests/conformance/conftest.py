"""The stores every conformance test runs against, as ``api``: the store matrix of
tests/support/stores.py, rows ``CONFORMANCE``.

``api`` is, in turn: the embedded store in this process, a
:class:`dedupcore.Client` talking to ``dedupcore serve`` (a real subprocess,
tests/support/daemon.py), Redis and each SQL engine as the authority
(the machine's real servers), a stack with a front filter, a Redis cache and
a cold archive over PostgreSQL, and a store sharded over Redis and SQLite.
Servers and the daemon are shared by a test module; each test works in a
namespace of its own (``ns``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import Daemon
from tests.support.stores import CONFORMANCE, Stores


@pytest.fixture
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    """This test's stores ("daemon": clients of the module's daemon, started on first use)."""

    def daemon() -> Daemon:
        shared: Daemon = request.getfixturevalue("daemon")
        return shared

    with Stores(tmp_path, "conformance", daemon=daemon) as s:
        yield s


@pytest.fixture(scope="module")
def module_stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stores]:
    """The server stores of this module, opened on first use."""
    with Stores(tmp_path_factory.mktemp("stores"), "conformance") as s:
        yield s


@pytest.fixture
def store(stores: Stores) -> Any:
    return stores.open("embedded")


@pytest.fixture
def client(stores: Stores) -> Any:
    return stores.open("daemon", timeout=60.0)


@pytest.fixture(params=list(CONFORMANCE))
def api(request: pytest.FixtureRequest) -> Any:
    """The embedded store, a daemon client, or one of the server stores and stacks."""
    kind = CONFORMANCE[request.param]
    if kind == "embedded":
        return request.getfixturevalue("store")
    if kind == "daemon":
        return request.getfixturevalue("client")
    return request.getfixturevalue("module_stores").shared(kind)
