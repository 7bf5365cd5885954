"""A server process for the kill tests (tests/support/kills.py): ``python -m
tests.support.kill_app FORM`` serves, through uvicorn on a free port it prints as
``READY <port>``, the app of FORM over the daemon at DEDUPCORE_SOCKET:

- ``starlette-middleware``: a Starlette app behind IdempotencyMiddleware;
- ``fastapi-route``: FastAPI routes with ``Depends(Idempotent(...))``;
- ``django``: the test project (tests/integrations/django_app/, settings from the
  environment).

``POST /plain`` and ``POST /ledger`` apply :func:`tests.support.kills.effect`.
The claims have the lease ``kills.LEASE``, renewed by the heartbeat while the process lives.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import anyio.to_thread
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dedupcore import Client
from dedupcore.http import Idempotency
from dedupcore.http.asgi import SCOPE_KEY
from tests.support.kills import LEASE, effect


async def handle(request: Request) -> Response:
    """The effect of ``/plain`` or ``/ledger``, keyed by the request's store key."""
    mode = request.url.path.strip("/")
    await request.body()
    result, decided = await anyio.to_thread.run_sync(
        effect,
        mode,
        request.headers["x-tag"],
        request.scope[SCOPE_KEY],
        request.headers.get("x-pause"),
    )
    return JSONResponse(result, status_code=201, headers={"x-consumed": decided})


def app_of(form: str) -> Any:
    if form == "django":
        from tests.integrations.django_app.asgi import application

        return application
    idem = Idempotency(Client(), namespace=os.environ["DC_KILL_NS"], heartbeat=True, lease=LEASE)
    paths = ("/plain", "/ledger")
    if form == "starlette-middleware":
        return idem.wrap(Starlette(routes=[Route(p, handle, methods=["POST"]) for p in paths]))
    from fastapi import APIRouter, Depends, FastAPI

    from dedupcore.http.fastapi import Idempotent, IdempotentRoute

    router = APIRouter(route_class=IdempotentRoute)
    for path in paths:
        router.add_api_route(
            path, handle, methods=["POST"], dependencies=[Depends(Idempotent(idem))]
        )
    api = FastAPI()
    api.include_router(router)
    return api


def main(form: str) -> None:
    app = app_of(form)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # connections wait in the backlog until uvicorn accepts them
    print(f"READY {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, lifespan="off", log_level="warning", loop="asyncio", http="h11")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1])
