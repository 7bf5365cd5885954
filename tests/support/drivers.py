"""The sync and the async claim API driven through the same cases over one store
(tests/unit/test_conveniences.py, tests/unit/test_decorator.py)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from dedupcore.api import (
    AsyncClaimAPI,
    ChangeBatch,
    Claim,
    ClaimAPI,
    ClaimBatch,
    ExtendBatch,
    KeyRecord,
)


class AsyncOver(AsyncClaimAPI):
    """An AsyncClaimAPI front end over a sync store's primitives (the async driver of
    the same cases)."""

    def __init__(self, store: ClaimAPI) -> None:
        self.store = store
        self.limits = store.limits

    async def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        await asyncio.sleep(0)  # a real suspension point, as a network client has
        return self.store._claim_batch(batch)

    async def _change_batch(self, batch: ChangeBatch) -> None:
        self.store._change_batch(batch)

    async def _extend_batch(self, batch: ExtendBatch) -> None:
        self.store._extend_batch(batch)

    async def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        return self.store._get_record(ns, key)

    async def stats(self) -> dict[str, Any]:
        return self.store.stats()


class Driver:
    """Runs one test case through the sync API or the async one, over the same store.

    ``idempotent(**kw)(fn)`` decorates a plain ``fn`` (made ``async def`` for
    the async API) and returns a plain function that runs the decorated call;
    ``processing(key, **kw)`` enters and leaves a block and returns its claim.
    """

    def __init__(self, store: ClaimAPI, mode: str) -> None:
        self.store = store
        self.mode = mode
        self.api: ClaimAPI | AsyncClaimAPI = store if mode == "sync" else AsyncOver(store)

    def idempotent(self, **kw: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            if isinstance(self.api, ClaimAPI):
                return self.api.idempotent(**kw)(fn)

            @functools.wraps(fn)
            async def afn(*args: Any, **kwargs: Any) -> Any:
                await asyncio.sleep(0)
                return fn(*args, **kwargs)

            decorated = self.api.idempotent(**kw)(afn)

            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                return asyncio.run(decorated(*args, **kwargs))

            return call

        return decorate

    def processing(self, key: bytes | str, **kw: Any) -> Claim:
        if isinstance(self.api, ClaimAPI):
            with self.api.processing(key, **kw) as c:
                return c
        api = self.api

        async def main() -> Claim:
            async with api.processing(key, **kw) as c:
                return c

        return asyncio.run(main())


MODES = ["sync", "async"]
