"""dedupcore.aio.Client against a real daemon subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from dedupcore import aio
from dedupcore.api import (
    DISABLE_ENV,
    AsyncClaimAPI,
    DuplicateCache,
    InProgressError,
    KeyPathError,
    Outcome,
)
from dedupcore.client import Client as SyncClient
from dedupcore.errors import ConflictError, StaleTokenError, UnavailableError
from dedupcore.record import State
from tests.support.daemon import Daemon, Lab


@pytest.fixture
def own_daemon(lab: Lab) -> Daemon:
    """A daemon this test may stop, kill and restart (the module's is ``daemon``)."""
    return lab.daemon()


_ns_counter = iter(range(1_000_000))


def fresh_ns() -> str:
    return f"test/aio-{os.getpid()}-{next(_ns_counter)}"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- semantics ---------------------------------------------------------------------------


def test_claim_outcomes_and_results(daemon: Daemon) -> None:
    ns = fresh_ns()

    async def main() -> None:
        async with aio.Client(daemon.socket) as c:
            assert await c.ping() is True
            first = await c.claim("order-1", namespace=ns, owner="a")
            assert first.outcome is Outcome.NEW and first.token >= 1
            assert first.key == "order-1" and first.namespace == ns
            busy = await c.claim("order-1", namespace=ns, owner="b")
            assert busy.outcome is Outcome.IN_PROGRESS
            again = await c.claim("order-1", namespace=ns, owner="a")
            assert again.outcome is Outcome.NEW and again.token == first.token
            await c.complete("order-1", first.token, namespace=ns, result={"id": 7, "b": b"x"})
            dup = await c.claim("order-1", namespace=ns)
            assert dup.outcome is Outcome.DUPLICATE
            assert dup.result == {"id": 7, "b": b"x"}
            rec = await c.get("order-1", namespace=ns)
            assert rec is not None and rec.state is State.PROCESSED
            assert rec.result == {"id": 7, "b": b"x"}
            assert await c.get("never", namespace=ns) is None

            claims = await c.claim_many([b"k1", b"k2", b"k3"], namespace=ns)
            assert [x.outcome for x in claims] == [Outcome.NEW] * 3
            await c.complete_many(
                [(claims[0].key, claims[0].token), (claims[1].key, claims[1].token, 5)],
                namespace=ns,
            )
            await c.release_many([(claims[2].key, claims[2].token)], namespace=ns)
            after = await c.claim_many([b"k1", b"k2", b"k3"], namespace=ns)
            assert [x.outcome for x in after] == [Outcome.DUPLICATE, Outcome.DUPLICATE, Outcome.NEW]
            assert after[1].result == 5
            await c.release(b"k3", after[2].token, namespace=ns)
            st = await c.stats()
            assert st["namespaces"][ns]["new"] >= 5
            assert "daemon" in st

    run(main())


def test_stale_token_and_conflict(daemon: Daemon) -> None:
    ns = fresh_ns()

    async def main() -> None:
        async with aio.Client(daemon.socket) as c:
            first = await c.claim("lease", namespace=ns, lease=0.2, owner="a")
            await asyncio.sleep(0.4)
            second = await c.claim("lease", namespace=ns, owner="b")
            assert second.outcome is Outcome.NEW and second.takeover
            assert second.token == first.token + 1
            with pytest.raises(StaleTokenError):
                await c.complete("lease", first.token, namespace=ns)
            with pytest.raises(StaleTokenError):
                await c.release("lease", first.token, namespace=ns)
            await c.complete("lease", second.token, namespace=ns)

            c1 = await c.claim("fp", namespace=ns, fingerprint=b"A")
            assert c1.outcome is Outcome.NEW
            with pytest.raises(ConflictError):
                await c.claim("fp", namespace=ns, fingerprint=b"B")
            # the connection stays usable after error replies
            assert await c.ping()

    run(main())


BAD_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("claim", {"key": b"", "namespace": "ok"}),
    ("claim", {"key": b"x" * 5000, "namespace": "ok"}),
    ("claim", {"key": 123, "namespace": "ok"}),
    ("claim", {"key": b"k", "namespace": "bad ns!"}),
    ("claim", {"key": b"k", "namespace": ""}),
    ("claim", {"key": b"k", "namespace": "ok", "lease": -1.0}),
    ("claim_many", {"keys": [b"a", None], "namespace": "ok"}),
    ("get", {"key": 5, "namespace": "ok"}),
    ("complete", {"key": b"never-claimed", "token": 1, "namespace": "ok"}),
    ("release", {"key": b"never-claimed", "token": 1, "namespace": "ok"}),
]


@pytest.mark.parametrize(("method", "kwargs"), BAD_CALLS, ids=lambda v: str(v)[:40])
def test_bad_input_same_errors_as_sync_client(
    daemon: Daemon, method: str, kwargs: dict[str, Any]
) -> None:
    with SyncClient(daemon.socket) as sc, pytest.raises(Exception) as sync_err:
        getattr(sc, method)(**kwargs)

    async def main() -> BaseException:
        async with aio.Client(daemon.socket) as c:
            try:
                await getattr(c, method)(**kwargs)
            except Exception as exc:
                assert await c.ping()  # still usable
                return exc
            raise AssertionError("no error")

    exc = run(main())
    assert type(exc) is type(sync_err.value), (exc, sync_err.value)
    assert isinstance(exc, (ValueError, TypeError))


def test_processing_completes_or_releases(daemon: Daemon) -> None:
    ns = fresh_ns()

    async def main() -> None:
        async with aio.Client(daemon.socket) as c:
            async with c.processing("p1", namespace=ns) as claim:
                assert claim.outcome is Outcome.NEW
                claim.result = "done"
            async with c.processing("p1", namespace=ns) as claim:
                assert claim.outcome is Outcome.DUPLICATE and claim.result == "done"

            with pytest.raises(RuntimeError, match="boom"):
                async with c.processing("p2", namespace=ns) as claim:
                    assert claim.outcome is Outcome.NEW
                    raise RuntimeError("boom")
            rec = await c.get("p2", namespace=ns)
            assert rec is None or rec.state is State.RELEASED
            async with c.processing("p2", namespace=ns) as claim:
                assert claim.outcome is Outcome.NEW  # released: the redelivery runs again

            # a result that cannot be stored: completed without it, the error raised
            with pytest.raises(TypeError):
                async with c.processing("p4", namespace=ns) as claim:
                    claim.result = object()
            dup = await c.claim("p4", namespace=ns)
            assert dup.outcome is Outcome.DUPLICATE and dup.result is None

            # a lease taken over meanwhile: the release is skipped, the error re-raised
            with pytest.raises(KeyError):
                async with c.processing("p3", namespace=ns, lease=0.1) as claim:
                    await asyncio.sleep(0.3)
                    assert (await c.claim("p3", namespace=ns)).outcome is Outcome.NEW
                    raise KeyError("late")

    run(main())


def test_idempotent_decorator(daemon: Daemon) -> None:
    ns = fresh_ns()
    calls: list[int] = []

    async def main() -> None:
        async with aio.Client(daemon.socket) as c:

            @c.idempotent(namespace=ns, key=lambda order, amount: f"charge-{order}")
            async def charge(order: int, amount: int) -> dict[str, int]:
                calls.append(order)
                await asyncio.sleep(0)
                return {"order": order, "charged": amount}

            assert charge.__name__ == "charge"
            assert await charge(1, 10) == {"order": 1, "charged": 10}
            assert await charge(1, 10) == {"order": 1, "charged": 10}
            assert calls == [1]

            held = await c.claim("charge-2", namespace=ns, owner="someone-else")
            assert held.outcome is Outcome.NEW
            with pytest.raises(InProgressError):
                await charge(2, 20)
            assert calls == [1]

            @c.idempotent(namespace=ns, key=lambda x: f"fail-{x}")
            async def fails(x: int) -> None:
                calls.append(-x)
                raise ValueError("no")

            for _ in range(2):  # released each time, so it runs again
                with pytest.raises(ValueError, match="no"):
                    await fails(3)
            assert calls == [1, -3, -3]

    run(main())


def test_idempotent_key_path_cache_and_switch_over_the_daemon(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aio.Client gets the sync decorator's conveniences from AsyncClaimAPI."""
    ns = fresh_ns()
    calls: list[str] = []
    cache = DuplicateCache(maxsize=10, ttl=3600.0)
    monkeypatch.delenv(DISABLE_ENV, raising=False)

    async def main() -> None:
        async with aio.Client(daemon.socket) as c:
            assert isinstance(c, AsyncClaimAPI)

            @c.idempotent(namespace=ns, key="order.id", cache=cache)
            async def handle(event: dict[str, Any]) -> str:
                calls.append(event["order"]["id"])
                return f"done-{event['order']['id']}"

            assert await handle({"order": {"id": "o-1"}}) == "done-o-1"
            assert await handle({"order": {"id": "o-1"}}) == "done-o-1"  # from the daemon
            assert await handle({"order": {"id": "o-1"}}) == "done-o-1"  # from the cache
            assert calls == ["o-1"] and cache.stats()["hits"] == 1
            with pytest.raises(KeyPathError):
                await handle({"order": {}})
            monkeypatch.setenv(DISABLE_ENV, "1")
            assert await handle({"order": {"id": "o-1"}}) == "done-o-1"
            assert calls == ["o-1", "o-1"]  # ran again: nothing claimed
            monkeypatch.delenv(DISABLE_ENV)
            rec = await c.get("o-1", namespace=ns)
            assert rec is not None and rec.result == "done-o-1"

    run(main())


def test_one_key_calls_read_the_usual_reply_natively_and_answer_as_the_sync_client(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-key claim, completion or release whose reply is the usual one is read with
    ``_core.one_key_reply`` when it is the only one-key call in flight; every other
    reply (a result, an error, several calls at once) the general way; the answers
    are the sync client's either way."""
    ns = fresh_ns()
    native: list[object] = []
    real = aio._core.one_key_reply

    def counted(body: Any, request_id: int) -> Any:
        answer = real(body, request_id)
        if answer is not None:
            native.append(answer)
        return answer

    monkeypatch.setattr(aio._core, "one_key_reply", counted)

    async def calls(c: Any) -> list[Any]:
        first = await c.claim("a", namespace=ns)
        busy = await c.claim("a", namespace=ns)
        await c.complete("a", first.token, namespace=ns)
        plain = await c.claim("a", namespace=ns)  # DUPLICATE, no result
        second = await c.claim("b", namespace=ns)
        await c.complete("b", second.token, namespace=ns, result={"r": 1})
        with_result = await c.claim("b", namespace=ns)  # DUPLICATE carrying a result
        third = await c.claim("c", namespace=ns)
        await c.release("c", third.token, namespace=ns)
        with pytest.raises(StaleTokenError):
            await c.complete("c", third.token, namespace=ns)
        return [
            (x.key, x.outcome, x.result, x.exact, x.takeover)
            for x in (first, busy, plain, second, with_result, third)
        ]

    async def main() -> tuple[list[Any], list[Any]]:
        async with aio.Client(daemon.socket) as c:
            one_by_one = await calls(c)
            assert len(native) == 8  # 10 calls: all but the DUPLICATE with a result and the error
            native.clear()
            together = await asyncio.gather(*(c.claim(f"t{i}", namespace=ns) for i in range(20)))
            return one_by_one, [x.outcome for x in together]

    one_by_one, together = run(main())
    assert together == [Outcome.NEW] * 20
    assert len(native) <= 1  # several in flight: read the general way
    with SyncClient(daemon.socket) as sync:
        ns = fresh_ns()
        monkeypatch.setattr(aio._core, "one_key_reply", real)

        class Sync:
            async def claim(self, *a: Any, **kw: Any) -> Any:
                return sync.claim(*a, **kw)

            async def complete(self, *a: Any, **kw: Any) -> Any:
                return sync.complete(*a, **kw)

            async def release(self, *a: Any, **kw: Any) -> Any:
                return sync.release(*a, **kw)

        assert run(calls(Sync())) == one_by_one


# -- pipelining --------------------------------------------------------------------------


def test_pipelined_concurrent_claims_one_connection(daemon: Daemon) -> None:
    ns = fresh_ns()
    keys = [f"pipe-{i}" for i in range(100)]

    async def main() -> None:
        async with aio.Client(daemon.socket) as c:
            assert await c.ping()
            conn = c._conn
            before = (await c.stats())["daemon"]["connections"]
            tasks = [
                asyncio.create_task(c.claim(keys[i % 100], namespace=ns, owner=f"o{i}"))
                for i in range(200)
            ]
            in_flight = 0
            for _ in range(50):
                await asyncio.sleep(0)
                assert c._conn is not None
                in_flight = max(in_flight, len(c._conn.pending))
            claims = await asyncio.gather(*tasks)
            assert c._conn is conn  # the same connection throughout
            assert in_flight > 1  # requests really were outstanding together
            assert (await c.stats())["daemon"]["connections"] == before
            by_key: dict[str | bytes, list[Outcome]] = {}
            for i, cl in enumerate(claims):
                assert cl.key == keys[i % 100]  # each reply went to its own request
                by_key.setdefault(cl.key, []).append(cl.outcome)
            for k in keys:
                assert sorted(o.value for o in by_key[k]) == ["in_progress", "new"], k
            # complete them concurrently too, then every key is a duplicate
            await asyncio.gather(
                *(
                    c.complete(cl.key, cl.token, namespace=ns, result=i)
                    for i, cl in enumerate(claims)
                    if cl.outcome is Outcome.NEW
                )
            )
            again = await asyncio.gather(*(c.claim(k, namespace=ns) for k in keys))
            assert all(x.outcome is Outcome.DUPLICATE for x in again)

    run(main())


def test_2000_concurrent_single_claims_share_one_connection_and_commits(daemon: Daemon) -> None:
    ns = fresh_ns()
    n = 2000

    async def main() -> None:
        async with aio.Client(daemon.socket) as c:
            assert await c.ping()
            conn = c._conn
            before = await c.stats()
            tasks = [asyncio.create_task(c.claim(f"many-{i}", namespace=ns)) for i in range(n)]
            await asyncio.sleep(0)  # every task runs up to its wait for the reply
            assert c._conn is conn and conn is not None
            # Nothing serializes them on the client: all are sent and waiting at once.
            assert len(conn.pending) == n
            claims = await asyncio.gather(*tasks)
            after = await c.stats()
            assert c._conn is conn
            assert [x.key for x in claims] == [f"many-{i}" for i in range(n)]
            assert all(x.outcome is Outcome.NEW and x.token > 0 for x in claims)
            assert after["daemon"]["connections"] == before["daemon"]["connections"]
            # The daemon made them durable together: far fewer log commits than claims.
            assert after["wal_commits"] - before["wal_commits"] < n

    run(main())


def test_large_replies_interleave_with_small_requests(daemon: Daemon) -> None:
    ns = fresh_ns()
    big = [f"big-{i:06d}-{'x' * 40}" for i in range(20_000)]

    async def main() -> None:
        async with aio.Client(daemon.socket) as c:
            first = asyncio.create_task(c.claim_many(big, namespace=ns, owner="o"))
            pings = await asyncio.gather(*(c.ping() for _ in range(20)))
            claims = await first
            assert all(pings)
            assert [x.key for x in claims] == big
            assert all(x.outcome is Outcome.NEW for x in claims)
            await c.complete_many([(x.key, x.token, x.key) for x in claims], namespace=ns)
            again = await c.claim_many(big, namespace=ns)  # a reply of several MiB
            assert all(x.outcome is Outcome.DUPLICATE and x.result == x.key for x in again)

    run(main())


def test_pipelined_batches_and_mixed_ops(daemon: Daemon) -> None:
    ns = fresh_ns()

    async def worker(c: aio.Client, w: int) -> int:
        new = 0
        for b in range(5):
            batch = [f"m-{(w * 7 + b * 13 + j) % 300}" for j in range(50)]
            claims = await c.claim_many(batch, namespace=ns, owner=f"w{w}")
            mine = {x.key: x.token for x in claims if x.outcome is Outcome.NEW}
            new += len(mine)
            await c.complete_many(list(mine.items()), namespace=ns)
            assert await c.ping()
        return new

    async def main() -> None:
        async with aio.Client(daemon.socket) as c:
            totals = await asyncio.gather(*(worker(c, w) for w in range(8)))
            st = (await c.stats())["namespaces"][ns]
            # every distinct key was NEW exactly once (in-batch repeats are NEW again
            # for the same owner, so count distinct keys via get)
            records = await asyncio.gather(*(c.get(f"m-{i}", namespace=ns) for i in range(300)))
            seen = [r for r in records if r is not None]
            assert all(r.state is State.PROCESSED for r in seen)
            assert sum(totals) >= len(seen)
            assert st["new"] == sum(totals)

    run(main())


# -- faults ------------------------------------------------------------------------------


def test_timeout_then_reply_lost_then_reconnect_after_restart(own_daemon: Daemon) -> None:
    d = own_daemon
    ns = fresh_ns()

    async def main() -> None:
        c = aio.Client(d.socket, timeout=0.5, retries=50, backoff=0.05)
        first = await c.claim("durable", namespace=ns)
        await c.complete("durable", first.token, namespace=ns, result="kept")
        conn = c._conn
        assert conn is not None

        # What leaves the client is counted, not how long it waited: a claim is sent once
        # and given up after one wait of ``timeout`` (never resent, never retried).
        frames: list[bytes] = []
        write = conn.writer.write

        def counting(data: bytes) -> None:
            frames.append(bytes(data))
            write(data)

        conn.writer.write = counting  # type: ignore[method-assign,assignment]
        d.signal(signal.SIGSTOP)
        try:
            with pytest.raises(UnavailableError, match=r"no reply within 0\.5 s"):
                await c.claim("frozen", namespace=ns)  # claims are never resent
            assert len(frames) == 1 and c._conn is conn
            with pytest.raises(UnavailableError):
                await c.ping()  # sent twice (safe), both time out
            assert len(frames) == 3 and c._conn is conn
        finally:
            d.signal(signal.SIGCONT)
            conn.writer.write = write  # type: ignore[method-assign]
        assert await c.ping()  # late replies were dropped; the connection is fine
        assert c._conn is conn

        # a reply lost with the daemon: SIGKILL while the request waits
        d.signal(signal.SIGSTOP)
        c.timeout = 30.0
        pending = asyncio.create_task(c.claim("lost", namespace=ns))
        while not conn.pending:  # the request is written once it is pending
            await asyncio.sleep(0.01)
        d.kill()
        with pytest.raises(UnavailableError, match="may or may not"):
            await pending

        # restarted daemon: the next request reconnects, acknowledged keys are kept
        d.start()
        dup = await c.claim("durable", namespace=ns)
        assert dup.outcome is Outcome.DUPLICATE and dup.result == "kept"
        assert c._conn is not conn
        await c.aclose()
        with pytest.raises(UnavailableError, match="closed"):
            await c.ping()

    run(main())


def test_reconnect_after_restart_without_noticing(own_daemon: Daemon) -> None:
    """The daemon is killed and restarted while the loop is not running: the stale
    connection is found dead on the next send, and 50 concurrent calls share one new one."""
    d = own_daemon
    ns = fresh_ns()
    c = aio.Client(d.socket, retries=50)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(c.ping())
        old = c._conn
        d.kill()
        d.start()

        async def many() -> list[Any]:
            return await asyncio.gather(
                *(c.claim(f"r-{i}", namespace=ns, owner="x") for i in range(50))
            )

        claims = loop.run_until_complete(many())
        assert all(x.outcome is Outcome.NEW for x in claims)
        assert c._conn is not old
        assert loop.run_until_complete(c.stats())["daemon"]["connections"] == 2  # probe + ours
        loop.run_until_complete(c.aclose())
    finally:
        loop.close()


def test_safe_op_resent_after_reply_lost(own_daemon: Daemon) -> None:
    d = own_daemon

    async def main() -> None:
        c = aio.Client(d.socket, retries=100, backoff=0.05)
        assert await c.ping()
        d.signal(signal.SIGSTOP)
        stats = asyncio.create_task(c.stats())
        await asyncio.sleep(0.2)
        d.kill()
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, d.start)
        st = await stats  # resent on a new connection once the daemon is back
        assert "daemon" in st
        await c.aclose()

    run(main())


def test_a_one_key_completion_is_resent_after_its_reply_was_lost(own_daemon: Daemon) -> None:
    """A one-key request is framed again under a new id when it is resent."""
    d = own_daemon

    async def main() -> None:
        c = aio.Client(d.socket, retries=100, backoff=0.05)
        claim = await c.claim("resent", namespace="ns")
        assert claim.outcome is Outcome.NEW
        d.signal(signal.SIGSTOP)
        done = asyncio.create_task(c.complete("resent", claim.token, namespace="ns", result=7))
        await asyncio.sleep(0.2)
        d.kill()
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, d.start)
        await done  # resent on a new connection once the daemon is back
        again = await c.claim("resent", namespace="ns")
        assert (again.outcome, again.result) == (Outcome.DUPLICATE, 7)
        await c.aclose()

    run(main())


def test_unreachable_daemon(tmp_path: Path) -> None:
    path = str(tmp_path / "none.sock")

    async def main() -> None:
        c = aio.Client(path, retries=2, backoff=0.01)
        with pytest.raises(UnavailableError, match="not reachable"):
            await c.ping()
        with pytest.raises(ConnectionError):  # UnavailableError is a ConnectionError
            await c.claim("k", namespace="ns")

    run(main())


def test_frame_limit_checked_before_sending(daemon: Daemon) -> None:
    async def main() -> None:
        async with aio.Client(daemon.socket, max_frame=1000) as c:
            # One key larger than a frame cannot be split: refused before it is sent.
            with pytest.raises(ValueError, match="frame limit"):
                await c.claim_many(["k" * 1100], namespace="ns")
            assert await c.ping()
            # Many keys that together pass a frame are sent in parts.
            claims = await c.claim_many([f"{i:0100d}" for i in range(50)], namespace=fresh_ns())
            assert len(claims) == 50

    run(main())


def test_cancelled_request_does_not_break_the_connection(daemon: Daemon) -> None:
    ns = fresh_ns()

    async def main() -> None:
        async with aio.Client(daemon.socket) as c:
            assert await c.ping()
            t = asyncio.create_task(c.claim_many([f"c{i}" for i in range(2000)], namespace=ns))
            await asyncio.sleep(0)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            assert await c.ping()
            assert c._conn is not None and not c._conn.pending

    run(main())
