"""Stores for the idempotency tests: embedded, through the daemon, and on the real Redis
(rows of the store matrix, tests/support/stores.py); and ``site``, one uvicorn server with
the HTTP middleware per framework and store (tests/idempotency/http_apps.py).

The daemon is the module's shared one (tests/support/daemon.py); Redis keeps to the
suite's database (tests/support/servers.py), under a key prefix of each test's own.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore import DedupStore
from tests.support.daemon import Daemon
from tests.support.stores import Stores

from .http_apps import CONFIGS, MAX_BODY, Effects, Site, serve

STORE_KINDS = ("embedded", "daemon", "redis")


@pytest.fixture(params=STORE_KINDS)
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """Each kind of ClaimAPI store in turn."""

    def daemon() -> Daemon:
        served: Daemon = request.getfixturevalue("daemon")
        return served

    with Stores(tmp_path, "idempotency", daemon=daemon) as stores:
        yield stores.open(request.param)


@pytest.fixture(scope="module", params=CONFIGS)
def site(request: pytest.FixtureRequest) -> Iterator[Site]:
    """A server with IdempotencyMiddleware over the app and store of one of ``CONFIGS``."""
    kind, store_kind = request.param.split("-")
    home = Path(tempfile.mkdtemp(prefix="dcidem"))
    effects = Effects(home / "effects.sqlite")
    ns = f"http/{uuid.uuid4().hex}"
    store: Any
    if store_kind == "embedded":
        store = DedupStore.open(home / "store")
    elif store_kind == "daemon":
        store = request.getfixturevalue("daemon").client()
    else:
        from dedupcore import aio

        store = aio.Client(request.getfixturevalue("daemon").socket)
    try:
        with serve(kind, store, effects, namespace=ns, max_body_bytes=MAX_BODY) as server:
            yield Site(server.url, effects, store, ns)
    finally:
        if store_kind != "aio":
            store.close()
