"""``heartbeat=True`` through a real uvicorn: a request slower than its lease keeps its key.

The claim's lease is 2 s and the handler is held at a gate until the store has
renewed the claim four times (every third of the lease: more than a lease has
passed since the claim): a retry then still gets 409, and once the gate opens the first response
is recorded and replayed; the handler ran once (docs/http.md, "Heartbeats").
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from dedupcore import DedupStore, aio
from dedupcore.api import HEARTBEAT_LEASE
from dedupcore.http import Idempotency
from tests.support.daemon import Daemon
from tests.support.procs import wait_until

from .http_apps import ALICE, PATIENCE, Effects, app_view, is_replay, new_key, serve, serve_routes

#: Renewed every 0.67 s: a renewal may come up to 1.33 s late on a loaded machine.
LEASE = 2.0
#: Renewals the test waits for: more than the lease has passed since the claim.
RENEWALS = 4


class Renewals:
    """A store whose renewals (``extend`` calls that succeeded) are counted."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.count = 0
        if inspect.iscoroutinefunction(store.extend):
            self.extend = self._aextend

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def extend(self, *args: Any, **kwargs: Any) -> None:
        self.store.extend(*args, **kwargs)
        self.count += 1

    async def _aextend(self, *args: Any, **kwargs: Any) -> None:
        await self.store.extend(*args, **kwargs)
        self.count += 1


@pytest.fixture(params=["starlette-middleware", "fastapi-route", "starlette-route-aio"])
def heartbeat_site(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, Effects, Renewals]]:
    """A server with ``heartbeat=True, lease=LEASE`` over a store whose renewals are counted."""
    kind, form, *aio_store = request.param.split("-")
    effects = Effects(tmp_path / "effects.sqlite")
    options = {"namespace": f"beat-{new_key()}", "heartbeat": True, "lease": LEASE}
    if aio_store:
        daemon: Daemon = request.getfixturevalue("daemon")
        inner: Any = aio.Client(daemon.socket)
    else:
        inner = DedupStore.open(tmp_path / "store")
    store = Renewals(inner)
    run = serve if form == "middleware" else serve_routes
    try:
        with run(kind, store, effects, **options) as server:
            yield server.url, effects, store
    finally:
        if not aio_store:
            inner.close()


def test_a_request_slower_than_its_lease_keeps_its_key(
    heartbeat_site: tuple[str, Effects, Renewals],
) -> None:
    url, effects, store = heartbeat_site
    key, gate = new_key(), new_key()
    headers = {"Idempotency-Key": key, "X-Tag": key}

    def post(**extra: str) -> httpx.Response:
        with httpx.Client(base_url=url, timeout=PATIENCE, headers=ALICE) as c:
            return c.post("/orders", content=b"slow", headers={**headers, **extra})

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, **{"X-Gate": gate})
        assert effects.started_event(gate).wait(PATIENCE)
        wait_until(lambda: store.count >= RENEWALS, f"{RENEWALS} renewals of the held claim")
        busy = post()  # more than a lease after the claim: still held
        effects.gate(gate).set()
        original = first.result(PATIENCE)
    assert busy.status_code == 409 and busy.headers["retry-after"] == "1"
    assert original.status_code == 201 and not is_replay(original)
    again = post()
    assert is_replay(again) and app_view(again) == app_view(original)
    assert len(effects.rows(key)) == 1
    renewed = store.count
    assert post().status_code == 201 and store.count == renewed  # a replay renews nothing


def test_heartbeat_options(tmp_path: Path) -> None:
    with DedupStore.open(tmp_path / "store") as store:
        assert Idempotency(store, heartbeat=True).lease == HEARTBEAT_LEASE
        assert Idempotency(store, heartbeat=True, lease=5.0).lease == 5.0
        assert Idempotency(store).lease is None
        with pytest.raises(TypeError, match="heartbeat must be True or False"):
            Idempotency(store, heartbeat=1)  # type: ignore[arg-type]

    class NoExtend:
        def claim(self) -> None: ...
        def complete(self) -> None: ...
        def release(self) -> None: ...

    with pytest.raises(TypeError, match="renews claims"):
        Idempotency(NoExtend(), heartbeat=True)
    Idempotency(NoExtend())  # without a heartbeat, extend is not needed
