"""The ASGI middleware on either event loop anyio runs it on: asyncio and Trio.

Starlette runs on anyio, so an ASGI server on Trio (Hypercorn's Trio worker)
runs the middleware too. The app and the store are real; the requests go
through httpx's ASGI transport on the test's own event loop (uvicorn serves
asyncio only). With ``heartbeat=True`` a sync store's claim is renewed from a
thread of its own on Trio, and by asyncio tasks on asyncio (docs/http.md,
"Heartbeats").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from dedupcore import DedupStore, aio
from dedupcore.http import Idempotency

from .http_apps import ALICE, PATIENCE, is_replay, new_key
from .test_http_heartbeat import LEASE, RENEWALS, Renewals

BACKENDS = ["asyncio", "trio"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_slower_than_its_lease_keeps_its_key(tmp_path: Path, backend: str) -> None:
    started, gate = anyio.Event(), anyio.Event()
    runs: list[str] = []

    async def slow(request: Request) -> JSONResponse:
        runs.append(request.headers["idempotency-key"])
        started.set()
        await gate.wait()
        return JSONResponse({"order": len(runs)}, status_code=201)

    with DedupStore.open(tmp_path / "store") as inner:
        store = Renewals(inner)
        app = Idempotency(store, namespace=f"trio-{new_key()}", heartbeat=True, lease=LEASE).wrap(
            Starlette(routes=[Route("/orders", slow, methods=["POST"])])
        )
        headers = {**ALICE, "Idempotency-Key": new_key()}
        answers: dict[str, httpx.Response] = {}

        async def main() -> None:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:

                async def post(name: str) -> None:
                    answers[name] = await c.post("/orders", headers=headers, content=b"x")

                with anyio.fail_after(PATIENCE):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(post, "first")
                        await started.wait()
                        while store.count < RENEWALS:  # more than a lease since the claim
                            await anyio.sleep(0.05)
                        await post("busy")
                        gate.set()
                    await post("again")

        anyio.run(main, backend=backend)
    first, busy, again = answers["first"], answers["busy"], answers["again"]
    assert busy.status_code == 409 and busy.headers["retry-after"] == "1"
    assert first.status_code == 201 and not is_replay(first)
    assert is_replay(again) and again.json() == first.json() == {"order": 1}
    assert len(runs) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_are_claimed_replayed_and_released_on_either_loop(
    tmp_path: Path, backend: str
) -> None:
    runs: list[bytes] = []

    async def create(request: Request) -> Any:
        body = await request.body()
        runs.append(body)
        if body == b"fail":
            return JSONResponse({"error": "try again"}, status_code=503)
        return JSONResponse({"made": body.decode()}, status_code=201)

    with DedupStore.open(tmp_path / "store") as store:
        app = Idempotency(store, namespace=f"trio-{new_key()}", heartbeat=True).wrap(
            Starlette(routes=[Route("/orders", create, methods=["POST"])])
        )
        got: list[httpx.Response] = []

        async def main() -> None:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
                key, failing = new_key(), new_key()
                for body, k in [(b"a", key), (b"a", key), (b"b", key), (b"fail", failing)]:
                    headers = {**ALICE, "Idempotency-Key": k}
                    got.append(await c.post("/orders", headers=headers, content=body))
                got.append(
                    await c.post(
                        "/orders", headers={**ALICE, "Idempotency-Key": failing}, content=b"fail"
                    )
                )

        anyio.run(main, backend=backend)
    made, replayed, other_body, failed, failed_again = got
    assert made.status_code == 201 and not is_replay(made)
    assert replayed.status_code == 201 and is_replay(replayed)
    assert other_body.status_code == 422  # the key came with another body
    assert failed.status_code == failed_again.status_code == 503  # released: run again
    assert runs == [b"a", b"fail", b"fail"]


def test_an_asyncio_client_as_the_store_on_trio_is_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    async def never(request: Request) -> JSONResponse:
        raise AssertionError("the app must not run")

    store = aio.Client(tmp_path / "no-daemon.sock")  # refused before any connection
    app = Idempotency(store).wrap(Starlette(routes=[Route("/orders", never, methods=["POST"])]))

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            await c.post("/orders", headers={**ALICE, "Idempotency-Key": new_key()})

    with pytest.raises(RuntimeError, match=r"dedupcore\.aio\.Client\) runs on asyncio only"):
        anyio.run(main, backend="trio")
