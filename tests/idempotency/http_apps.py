"""Starlette and FastAPI apps behind IdempotencyMiddleware, or idempotent per route,
served by a real uvicorn; the helpers the HTTP tests share.

Every handler records its side effect as a row of an SQLite file (one row
per execution), so a test counts executions independently of the responses.
Handlers can be held at a gate (``X-Gate`` header) the test opens, and say
through ``started`` that they are running. Clients send credentials
(``ALICE``, ``BOB``): keys belong to the client that sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dedupcore.http import Idempotency, IdempotencyMiddleware

PATIENCE = 60.0
#: Two clients' credentials.
ALICE = {"Authorization": "Bearer alice-0c1d"}
BOB = {"Authorization": "Bearer bob-77e2"}
#: Headers a server sets per response, not part of what the app answered.
PER_RESPONSE = {"date", "server", "idempotent-replayed"}
#: Response headers that carry a client's credentials or session (what ``/session`` sets).
CREDENTIAL_HEADERS = {"set-cookie", "authorization", "authentication-info"}
#: The largest request body the ``site`` servers take with a key.
MAX_BODY = 64 * 1024
#: (framework, store) pairs every ``site`` test runs against (tests/idempotency/conftest.py).
CONFIGS = ("starlette-embedded", "fastapi-daemon", "starlette-aio")


def new_key() -> str:
    return uuid.uuid4().hex


def app_view(r: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    """What the app answered: status, headers (minus per-response ones), body."""
    headers = sorted((k, v) for k, v in r.headers.multi_items() if k not in PER_RESPONSE)
    return r.status_code, headers, r.content


def is_replay(r: httpx.Response) -> bool:
    return r.headers.get("idempotent-replayed") == "true"


@dataclass
class Site:
    """A running server of the ``site`` fixture: where, its ledger, store and namespace."""

    url: str
    effects: Effects
    store: Any
    namespace: str

    def client(self, credentials: dict[str, str] | None = None, **options: Any) -> httpx.Client:
        """An HTTP client that sends ``credentials`` (``ALICE``'s by default) with each request."""
        headers = ALICE if credentials is None else credentials
        return httpx.Client(base_url=self.url, timeout=PATIENCE, headers=headers, **options)


class Order(BaseModel):
    """The body of ``/typed`` (FastAPI parses and checks it)."""

    sku: str
    quantity: int


class Effects:
    """The side-effect ledger (SQLite) and the gates of one server."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with self.connect() as db:
            db.execute("CREATE TABLE IF NOT EXISTS effects (tag TEXT, nonce TEXT, body BLOB)")
        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30, isolation_level=None)

    def record(self, tag: str, body: bytes) -> tuple[int, str]:
        nonce = uuid.uuid4().hex
        with contextlib.closing(self.connect()) as db:
            cur = db.execute("INSERT INTO effects VALUES (?, ?, ?)", (tag, nonce, body))
            return int(cur.lastrowid or 0), nonce

    def rows(self, tag: str) -> list[tuple[str, bytes]]:
        with contextlib.closing(self.connect()) as db:
            return list(db.execute("SELECT nonce, body FROM effects WHERE tag = ?", (tag,)))

    def gate(self, name: str) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(name, threading.Event())

    def started_event(self, name: str) -> threading.Event:
        with self.lock:
            return self.started.setdefault(name, threading.Event())

    async def hold(self, request: Request) -> None:
        name = request.headers.get("x-gate")
        if name is None:
            return
        self.started_event(name).set()
        gate = self.gate(name)
        deadline = time.monotonic() + PATIENCE
        while not gate.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


def routes(effects: Effects) -> list[tuple[str, Any]]:
    """The endpoints, as (path, async handler taking a Request)."""

    async def orders(request: Request) -> Response:
        body = await request.body()
        await effects.hold(request)
        tag = request.headers.get("x-tag", "orders")
        row, nonce = effects.record(tag, body)
        return JSONResponse(
            {"row": row, "nonce": nonce, "sha256": hashlib.sha256(body).hexdigest()},
            status_code=201,
            headers={"x-order-nonce": nonce, "location": f"/orders/{row}"},
        )

    async def flaky(request: Request) -> Response:
        """5xx (or an exception, or 429) on the first execution of a tag, 201 after."""
        body = await request.body()
        await effects.hold(request)
        tag = request.headers["x-tag"]
        first = not effects.rows(tag)
        _, nonce = effects.record(tag, body)
        if first:
            mode = request.headers.get("x-fail", "500")
            if mode == "raise":
                raise RuntimeError("the handler failed")
            return Response(f"failed {nonce}", status_code=int(mode))
        return Response(f"done {nonce}", status_code=201)

    async def reject(request: Request) -> Response:
        body = await request.body()
        _, nonce = effects.record(request.headers["x-tag"], body)
        return JSONResponse({"error": "no such account", "nonce": nonce}, status_code=400)

    async def big(request: Request) -> Response:
        body = await request.body()
        _, nonce = effects.record(request.headers["x-tag"], body)
        size = int(request.headers.get("x-size", "100000"))
        return Response(nonce.encode() * (size // 32 + 1), media_type="application/octet-stream")

    async def session(request: Request) -> Response:
        """201 that opens a session: a cookie and other credentials of the caller's own."""
        body = await request.body()
        row, nonce = effects.record(request.headers["x-tag"], body)
        response = JSONResponse({"row": row, "nonce": nonce}, status_code=201)
        response.set_cookie("session", f"s-{nonce}", httponly=True)
        response.headers["authorization"] = f"Bearer t-{nonce}"
        response.headers["authentication-info"] = f'nextnonce="{nonce}"'
        response.headers["x-order-nonce"] = nonce
        return response

    return [
        ("/orders", orders),
        ("/flaky", flaky),
        ("/reject", reject),
        ("/big", big),
        ("/session", session),
    ]


def starlette_app(effects: Effects) -> Starlette:
    return Starlette(
        routes=[Route(path, fn, methods=["POST", "PATCH", "GET"]) for path, fn in routes(effects)]
    )


def fastapi_app(effects: Effects) -> Any:
    from fastapi import FastAPI

    api = FastAPI()
    for path, fn in routes(effects):
        api.add_api_route(path, fn, methods=["POST", "PATCH", "GET"])
    return api


class Server:
    """uvicorn serving ``app`` on a free loopback port, in a thread of this process."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, lifespan="off", log_level="warning", loop="asyncio", http="h11"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + PATIENCE
        while not self.server.started:
            if not self.thread.is_alive():
                raise AssertionError("uvicorn exited before serving")
            if time.monotonic() > deadline:
                raise AssertionError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(PATIENCE)
        self.sock.close()


def per_route_app(kind: str, store: Any, effects: Effects, **options: Any) -> Any:
    """Every route of :func:`routes` idempotent on its own, and ``/free`` (``orders``) not.

    FastAPI: ``Depends(Idempotent(...))`` on routes of an ``IdempotentRoute`` router,
    included in the app, and ``/typed``, whose body FastAPI parses into a model.
    Starlette: ``Idempotency.endpoint`` on each endpoint.
    """
    free = dict(routes(effects))["/orders"]
    if kind == "starlette":
        idem = Idempotency(store, **options)
        endpoints = [Route(p, idem.endpoint(fn), methods=["POST"]) for p, fn in routes(effects)]
        return Starlette(routes=[*endpoints, Route("/free", free, methods=["POST"])])
    from fastapi import APIRouter, Depends, FastAPI

    from dedupcore.http.fastapi import Idempotent, IdempotentRoute

    idempotent = Idempotent(store, **options)

    async def typed(order: Order, request: Request) -> dict[str, Any]:
        body = await request.body()
        row, nonce = effects.record(request.headers["x-tag"], body)
        return {"row": row, "nonce": nonce, "sku": order.sku, "quantity": order.quantity}

    router = APIRouter(route_class=IdempotentRoute)
    for path, fn in routes(effects):
        router.add_api_route(path, fn, methods=["POST"], dependencies=[Depends(idempotent)])
    router.add_api_route(
        "/typed", typed, methods=["POST"], status_code=201, dependencies=[Depends(idempotent)]
    )
    router.add_api_route("/free", free, methods=["POST"])
    api = FastAPI()
    api.include_router(router)
    return api


@contextlib.contextmanager
def serve(kind: str, store: Any, effects: Effects, **options: Any) -> Iterator[Server]:
    """A running server: ``kind`` is "starlette" or "fastapi"."""
    app = starlette_app(effects) if kind == "starlette" else fastapi_app(effects)
    with Server(IdempotencyMiddleware(app, store, **options)) as server:
        yield server


@contextlib.contextmanager
def serve_routes(kind: str, store: Any, effects: Effects, **options: Any) -> Iterator[Server]:
    """A running server of :func:`per_route_app`."""
    with Server(per_route_app(kind, store, effects, **options)) as server:
        yield server
