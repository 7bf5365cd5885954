"""The consumers' async gate keeps the event loop running while a sync store works."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from dedupcore.api import Claim, Outcome
from dedupcore.integrations._common import Delivery, Verdict, _AsyncGate
from dedupcore.store import DedupStore

NS = "orders/billing"
TICKS = 3


class _Ticker:
    """A coroutine counting its turns on the event loop, and threads waiting for turns."""

    def __init__(self) -> None:
        self.ticks = 0
        self.waiting: list[tuple[int, threading.Event]] = []

    def wait_for_turns(self, patience: float = 10.0) -> bool:
        """From another thread: whether the loop gave the ticker TICKS turns meanwhile."""
        done = threading.Event()
        self.waiting.append((self.ticks, done))
        return done.wait(patience)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.ticks += 1
            for start, done in list(self.waiting):
                if self.ticks - start >= TICKS:
                    done.set()


class _SlowStore:
    """A real embedded store whose every call lasts until the event loop ran TICKS turns.

    A call run inline on the event loop would wait out its patience with the
    loop stopped (and record False); run in a worker thread, it returns as
    soon as the ticker has had its turns.
    """

    def __init__(self, store: DedupStore, ticker: _Ticker) -> None:
        self.store = store
        self.ticker = ticker
        self.calls: list[tuple[str, bool]] = []  # (call, the loop ran while it waited)

    def claim(self, key: Any, **kw: Any) -> Claim:
        self.calls.append(("claim", self.ticker.wait_for_turns()))
        return self.store.claim(key, **kw)

    def complete(self, key: Any, token: int, **kw: Any) -> None:
        self.calls.append(("complete", self.ticker.wait_for_turns()))
        self.store.complete(key, token, **kw)

    def release(self, key: Any, token: int, **kw: Any) -> None:
        self.calls.append(("release", self.ticker.wait_for_turns()))
        self.store.release(key, token, **kw)


def _gate(store: Any, handler: Any, owner: str | None = None) -> _AsyncGate:
    gate = _AsyncGate(store, handler, namespace=NS, lease=None, owner=owner, before_ack=None)
    assert not gate.async_store
    return gate


def test_sync_store_calls_do_not_block_the_event_loop(tmp_path: Path) -> None:
    handled: list[Any] = []

    async def main() -> tuple[list[Verdict], list[tuple[str, bool]]]:
        ticker = _Ticker()
        with DedupStore.open(tmp_path / "d") as inner:
            store = _SlowStore(inner, ticker)
            gate = _gate(store, lambda d: handled.append(d.key))
            tick = asyncio.create_task(ticker.run())
            try:
                verdicts = [await gate.adecide(Delivery(b"", {}, "k1", NS)) for _ in range(2)]
            finally:
                tick.cancel()
            return verdicts, store.calls

    verdicts, calls = asyncio.run(main())
    assert verdicts == [Verdict.ACKED, Verdict.ACKED]  # NEW, then DUPLICATE
    assert handled == ["k1"]
    assert calls == [("claim", True), ("complete", True), ("claim", True)]


def test_sync_store_release_runs_in_a_thread_when_the_handler_fails(tmp_path: Path) -> None:
    def fail(delivery: Delivery) -> None:
        raise RuntimeError("handler failed")

    async def main() -> tuple[Verdict, list[tuple[str, bool]], Outcome]:
        ticker = _Ticker()
        with DedupStore.open(tmp_path / "d") as inner:
            store = _SlowStore(inner, ticker)
            tick = asyncio.create_task(ticker.run())
            try:
                verdict = await _gate(store, fail, owner="w").adecide(Delivery(b"", {}, "k", NS))
            finally:
                tick.cancel()
            # Released: another owner gets the key as NEW.
            return verdict, store.calls, inner.claim("k", namespace=NS, owner="o").outcome

    verdict, calls, outcome = asyncio.run(main())
    assert verdict is Verdict.FAILED
    assert calls == [("claim", True), ("release", True)]
    assert outcome is Outcome.NEW
