"""Lease heartbeats through the asyncio client: ``async with processing(heartbeat=True)``
renews its claim at the daemon from a task while the block awaits, and a renewal
the daemon refuses arrives as the store's StaleTokenError."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from dedupcore import aio
from dedupcore.api import Outcome
from dedupcore.client import Client
from dedupcore.errors import StaleTokenError
from dedupcore.record import State
from tests.support.daemon import Daemon
from tests.support.procs import PATIENCE
from tests.support.stores import unique_ns


def test_an_async_block_keeps_its_claim_past_its_first_lease(daemon: Daemon) -> None:
    ns = unique_ns("aio-heartbeat")

    async def main() -> int:
        async with aio.Client(daemon.socket) as c:
            extend = c.extend
            renewals: list[float] = []
            four = asyncio.Event()

            async def counting_extend(*args: Any, **kwargs: Any) -> None:
                await extend(*args, **kwargs)
                renewals.append(time.monotonic())
                if len(renewals) >= 4:
                    four.set()

            c.extend = counting_extend  # type: ignore[method-assign]
            started = time.monotonic()
            async with c.processing("k", namespace=ns, lease=3.0, heartbeat=True) as claim:
                assert claim.outcome is Outcome.NEW
                await asyncio.wait_for(four.wait(), PATIENCE)
                # Four beats a third of a lease apart (asyncio.sleep): past the first lease.
                assert time.monotonic() - started > 3.0
                with Client(daemon.socket, timeout=60.0) as other:
                    busy = other.claim("k", namespace=ns, owner="other")
                assert (busy.outcome, busy.token) == (Outcome.IN_PROGRESS, claim.token)
                claim.result = "long async work"
            count = len(renewals)
            record = await c.get("k", namespace=ns)
            assert record is not None and record.state is State.PROCESSED
            assert record.result == "long async work"
            return count

    assert asyncio.run(main()) >= 4


def test_async_renewals_are_refused_like_the_sync_ones(daemon: Daemon) -> None:
    ns = unique_ns("aio-extend")

    async def main() -> None:
        async with aio.Client(daemon.socket) as c:
            held = await c.claim_many(["a", "b"], namespace=ns, lease=30.0)
            items = [(x.key, x.token) for x in held]
            await c.extend_many(items, namespace=ns, lease=600.0)
            await c.complete("b", held[1].token, namespace=ns)
            with pytest.raises(StaleTokenError, match="cannot be extended"):
                await c.extend_many(items, namespace=ns)
            with pytest.raises(StaleTokenError):
                await c.extend("a", held[0].token + 1, namespace=ns)
            with pytest.raises(ValueError):
                await c.extend("a", held[0].token, namespace=ns, lease=-1)
            await c.extend("a", held[0].token, namespace=ns)

    asyncio.run(main())
