"""Stand-ins the test project needs around the idempotency middleware."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from asgiref.sync import iscoroutinefunction
from django.conf import settings
from django.utils.asyncio import async_unsafe
from django.utils.decorators import sync_and_async_middleware
from django.utils.functional import SimpleLazyObject


@async_unsafe
def _load_user(name: str | None) -> Any:
    """Where Django would read the session and the user from the database: the
    ``X-User`` header names the user. Like a database call, it refuses to run on an
    event loop's thread."""
    if name is None:
        return SimpleNamespace(is_authenticated=False, pk=None)
    return SimpleNamespace(is_authenticated=True, pk=name)


@sync_and_async_middleware
def header_user(get_response: Any) -> Any:
    """``request.user``, lazily, as Django's AuthenticationMiddleware sets it."""

    def attach(request: Any) -> None:
        name = request.headers.get("x-user")
        request.user = SimpleLazyObject(lambda: _load_user(name))

    if iscoroutinefunction(get_response):

        async def middleware(request: Any) -> Any:
            attach(request)
            return await get_response(request)

        return middleware

    def sync_middleware(request: Any) -> Any:
        attach(request)
        return get_response(request)

    return sync_middleware


@sync_and_async_middleware
def went_away(get_response: Any) -> Any:
    """Writes ``NAME.cancelled`` in GATES when Django cancels a gated request because
    its client went away (ASGI), so a test knows the server has seen it go."""
    if not iscoroutinefunction(get_response):
        return get_response

    async def middleware(request: Any) -> Any:
        try:
            return await get_response(request)
        except asyncio.CancelledError:
            gate = request.headers.get("x-gate")
            if gate and settings.GATES:
                (Path(settings.GATES) / f"{gate}.cancelled").touch()
            raise

    return middleware
