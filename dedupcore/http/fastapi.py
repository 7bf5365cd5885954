"""The ``Idempotency-Key`` header on chosen FastAPI routes (docs/http.md, "Per route").

::

    from fastapi import APIRouter, Depends
    from dedupcore.http.fastapi import Idempotent, IdempotentRoute

    idempotent = Idempotent(store, required=True)
    router = APIRouter(route_class=IdempotentRoute)   # or app.router.route_class = ...

    @router.post("/orders", status_code=201, dependencies=[Depends(idempotent)])
    async def create_order(order: Order) -> OrderOut: ...

The dependency names the routes and their options; the route class does the
work, with the middleware's code (:meth:`dedupcore.http.Idempotency.begin`,
:class:`dedupcore.http.asgi.Exchange`): it reads the body and claims before
FastAPI parses the request, answers 400/409/413/422/503 or the replay
without running the endpoint, and records the response while it is sent.
An exception from the endpoint (``HTTPException`` too) releases the key.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the dependency's
# ``Request`` annotation at run time.

from collections.abc import Callable, Coroutine
from typing import Any

from dedupcore.errors import MissingExtraError
from dedupcore.http.asgi import Answer, Exchange, Idempotency, Receive, Scope, Send

try:
    from fastapi import Request, Response
    from fastapi.dependencies.models import Dependant
    from fastapi.routing import APIRoute
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingExtraError(
        "dedupcore.http.fastapi needs FastAPI: pip install fastapi (the ASGI middleware in "
        "dedupcore.http needs only the 'http' extra)"
    ) from exc

__all__ = ["Idempotent", "IdempotentRoute"]

#: Where an IdempotentRoute marks a request it handles, for the dependency to check.
SCOPE_KEY = "dedupcore.idempotent"


class Idempotent:
    """A FastAPI dependency: the routes that use it get the ``Idempotency-Key`` handling.

    ``Idempotent(store, **options)`` takes the options of
    :class:`dedupcore.http.Idempotency`, or ``Idempotent(idempotency)`` shares
    one. It works on routes of an :class:`IdempotentRoute`; elsewhere it
    raises ``RuntimeError`` before the endpoint runs.
    """

    def __init__(self, store: Any, **options: Any) -> None:
        self.idempotency = Idempotency.of(store, **options)

    async def __call__(self, request: Request) -> None:
        if request.scope.get(SCOPE_KEY) is not self:
            raise RuntimeError(
                "Depends(Idempotent(...)) needs its route to be an IdempotentRoute: "
                "APIRouter(route_class=IdempotentRoute), or app.router.route_class = "
                "IdempotentRoute before the routes are added; declare it on the route or the "
                "endpoint, not in include_router() (docs/http.md, 'Per route')"
            )


class IdempotentRoute(APIRoute):
    """A FastAPI route that applies the :class:`Idempotent` dependency it declares."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        found = _idempotent_of(self.dependant)
        if found is None:
            return handler
        idempotency = found.idempotency

        async def idempotent_handler(request: Request) -> Response:
            request.scope[SCOPE_KEY] = found
            step = await idempotency.begin(request.scope, request.receive)
            if step is None:
                return await handler(request)
            if isinstance(step, Answer):
                return _AnswerResponse(step)
            await step.start_heartbeat()
            try:
                response = await handler(Request(request.scope, step.receive))
            except BaseException:
                await step.release()
                raise
            return _RecordedResponse(step, response)

        return idempotent_handler


def _idempotent_of(dependant: Dependant) -> Idempotent | None:
    """The one Idempotent among ``dependant``'s dependencies, at any depth; None if none."""
    found: list[Idempotent] = []
    stack = list(dependant.dependencies)
    while stack:
        dep = stack.pop()
        if isinstance(dep.call, Idempotent) and dep.call not in found:
            found.append(dep.call)
        stack.extend(dep.dependencies)
    if len(found) > 1:
        raise ValueError(f"a route may depend on one Idempotent, this one has {len(found)}")
    return found[0] if found else None


class _AnswerResponse(Response):
    """Sends an :class:`~dedupcore.http.asgi.Answer` (a problem or a replay) as it is."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(status_code=answer.status or 200)
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.answer(scope, receive, send)


class _RecordedResponse(Response):
    """Sends the endpoint's response through its :class:`~dedupcore.http.asgi.Exchange`."""

    def __init__(self, exchange: Exchange, response: Response) -> None:
        super().__init__(status_code=response.status_code)
        self.exchange = exchange
        self.response = response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.exchange.run(self.response, send)
