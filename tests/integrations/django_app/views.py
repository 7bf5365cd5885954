"""The views: each execution is a row in the effects file (see the package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

from dedupcore.integrations.django import idempotent_view
from tests.support import kills

PATIENCE = 60.0


def record(request: HttpRequest) -> tuple[int, str]:
    """One row for this execution: (row id, a nonce no other execution has)."""
    nonce = uuid.uuid4().hex
    tag = request.headers.get("x-tag", "untagged")
    with contextlib.closing(sqlite3.connect(settings.EFFECTS_DB, timeout=30)) as db, db:
        db.execute("CREATE TABLE IF NOT EXISTS effects (tag TEXT, nonce TEXT, body BLOB)")
        cur = db.execute("INSERT INTO effects VALUES (?, ?, ?)", (tag, nonce, request.body))
        return int(cur.lastrowid or 0), nonce


def _gate(request: HttpRequest) -> Path | None:
    name = request.headers.get("x-gate")
    if name is None:
        return None
    gates = Path(settings.GATES)
    (gates / f"{name}.started").touch()
    return gates / f"{name}.open"


def hold(request: HttpRequest) -> None:
    gate = _gate(request)
    deadline = time.monotonic() + PATIENCE
    while gate is not None and not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


async def ahold(request: HttpRequest) -> None:
    gate = _gate(request)
    deadline = time.monotonic() + PATIENCE
    while gate is not None and not gate.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def created(request: HttpRequest, row: int, nonce: str) -> JsonResponse:
    body = request.body
    response = JsonResponse(
        {"row": row, "nonce": nonce, "sha256": hashlib.sha256(body).hexdigest()}, status=201
    )
    response["X-Order-Nonce"] = nonce
    response["Location"] = f"/orders/{row}"
    response.set_cookie("session", nonce)  # the first client's: never replayed
    response["Authentication-Info"] = f'nextnonce="{nonce}"'  # nor this
    return response


def orders(request: HttpRequest) -> HttpResponse:
    hold(request)
    return created(request, *record(request))


async def aorders(request: HttpRequest) -> HttpResponse:
    await ahold(request)
    return created(request, *record(request))


def flaky(request: HttpRequest) -> HttpResponse:
    """``X-Fail`` (a status, or "raise") on the first execution of a tag, 201 after."""
    tag = request.headers["x-tag"]
    with contextlib.closing(sqlite3.connect(settings.EFFECTS_DB, timeout=30)) as db:
        db.execute("CREATE TABLE IF NOT EXISTS effects (tag TEXT, nonce TEXT, body BLOB)")
        first = not db.execute("SELECT 1 FROM effects WHERE tag = ?", (tag,)).fetchone()
    _, nonce = record(request)
    if first:
        mode = request.headers.get("x-fail", "500")
        if mode == "raise":
            raise RuntimeError("the view failed")
        return HttpResponse(f"failed {nonce}", status=int(mode))
    return HttpResponse(f"done {nonce}", status=201)


def reject(request: HttpRequest) -> HttpResponse:
    _, nonce = record(request)
    return JsonResponse({"error": "no such account", "nonce": nonce}, status=400)


def big(request: HttpRequest) -> HttpResponse:
    _, nonce = record(request)
    size = int(request.headers.get("x-size", "100000"))
    return HttpResponse(nonce.encode() * (size // 32 + 1), content_type="application/octet-stream")


def stream(request: HttpRequest) -> StreamingHttpResponse:
    _, nonce = record(request)

    def chunks() -> Iterator[bytes]:
        yield b"streamed "
        yield nonce.encode()

    return StreamingHttpResponse(chunks(), status=201)


async def effect(request: HttpRequest) -> HttpResponse:
    """``/plain`` or ``/ledger``: the kill tests' effect (tests/support/kills.py) in a
    worker thread, keyed by the request's store key."""
    mode = request.path.rsplit("/", 1)[-1]
    tag, pause = request.headers["x-tag"], request.headers.get("x-pause")
    key = request.idempotency_key  # type: ignore[attr-defined]
    result, decided = await asyncio.to_thread(kills.effect, mode, tag, key, pause)
    response = JsonResponse(result, status=201)
    response["X-Consumed"] = decided
    return response


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse(b"ok")


# The same views, decorated one by one (used where the middleware is not installed).
view_orders = idempotent_view(orders, namespace="django-views")
view_aorders = idempotent_view(aorders, namespace="django-views")
view_flaky = idempotent_view(flaky, namespace="django-views")
required_orders = idempotent_view(namespace="django-views", required=True)(orders)
view_effect = idempotent_view(effect, namespace="django-views", heartbeat=True, lease=kills.LEASE)
