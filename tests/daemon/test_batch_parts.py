"""Batches of any size through the daemon's clients: split into frames, answered in
order, and a failure part way through names what was applied (docs/daemon.md,
"Batches of any size"). A real ``dedupcore serve`` process; the sync and the
asyncio client."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dedupcore import aio
from dedupcore.api import Outcome
from dedupcore.errors import ConflictError, PartialBatchError, StaleTokenError
from tests.support.daemon import Daemon
from tests.support.procs import PATIENCE
from tests.support.stores import unique_ns

SMALL_FRAME = 64 << 10  # a client frame of 64 KiB: parts of at most 32 KiB of keys


def _keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:07d}" for i in range(n)]


def test_a_batch_larger_than_a_frame_is_claimed_completed_and_renewed_in_parts(
    daemon: Daemon,
) -> None:
    ns = unique_ns()
    keys = _keys("k", 20_000)  # ~360 KiB of keys: a dozen parts
    with daemon.client(timeout=PATIENCE, max_frame=SMALL_FRAME) as c:
        before = c.stats()["daemon"]["requests"]
        claims = c.claim_many(keys, namespace=ns)
        assert [x.key for x in claims] == keys
        assert all(x.outcome is Outcome.NEW for x in claims)
        assert c.stats()["daemon"]["requests"] - before > 10  # sent in parts
        c.extend_many([(x.key, x.token) for x in claims], namespace=ns, lease=600)
        c.complete_many([(x.key, x.token, x.key[-3:]) for x in claims], namespace=ns)
        again = c.claim_many(keys, namespace=ns)
    assert all(x.outcome is Outcome.DUPLICATE for x in again)
    assert [x.result for x in again[:3]] == ["000", "001", "002"]
    assert [x.token for x in again] == [x.token for x in claims]


def test_a_million_keys_in_one_call(daemon: Daemon) -> None:
    ns = unique_ns()
    keys = _keys("m", 1_000_000)
    with daemon.client(timeout=PATIENCE) as c:
        claims = c.claim_many(keys, namespace=ns)
    assert len(claims) == 1_000_000 and claims[-1].key == keys[-1]
    assert sum(x.outcome is Outcome.NEW for x in claims) == 1_000_000


def test_a_conflict_in_a_later_part_names_what_was_claimed(daemon: Daemon) -> None:
    ns = unique_ns()
    keys = _keys("c", 6_000)
    late = keys[-1]
    with daemon.client(timeout=PATIENCE, max_frame=SMALL_FRAME) as c:
        c.claim(late, namespace=ns, fingerprint=b"first")
        fps: list[bytes | None] = [None] * len(keys)
        fps[-1] = b"other"
        with pytest.raises(PartialBatchError, match="were applied") as caught:
            c.claim_many(keys, namespace=ns, fingerprints=fps)
        applied: Any = caught.value.applied
        assert isinstance(caught.value.__cause__, ConflictError)
        n = len(applied)
        assert 0 < n < len(keys) and [x.key for x in applied] == keys[:n]
        assert all(x.outcome is Outcome.NEW for x in applied)
        # What was applied is claimed; the part that failed and the rest were not.
        assert c.get(keys[n - 1], namespace=ns) is not None
        assert c.get(keys[n], namespace=ns) is None


def test_a_failure_in_the_first_part_is_the_error_itself(daemon: Daemon) -> None:
    ns = unique_ns()
    keys = _keys("f", 6_000)
    with daemon.client(timeout=PATIENCE, max_frame=SMALL_FRAME) as c:
        c.claim(keys[0], namespace=ns, fingerprint=b"first")
        with pytest.raises(ConflictError):
            c.claim_many(keys, namespace=ns, fingerprints=[b"other"] + [None] * 5_999)
        claims = c.claim_many(keys[1:], namespace=ns)
        with pytest.raises(PartialBatchError) as caught:
            items = [(x.key, x.token) for x in claims]
            items[-1] = (items[-1][0], items[-1][1] + 1)  # stale: the last part fails
            c.complete_many(items, namespace=ns)
        assert isinstance(caught.value.__cause__, StaleTokenError)
        assert 0 < caught.value.applied < len(items)


def test_the_asyncio_client_sends_parts_too(daemon: Daemon) -> None:
    ns = unique_ns()
    keys = _keys("a", 10_000)

    async def main() -> list[Outcome]:
        async with aio.Client(daemon.socket, timeout=PATIENCE, max_frame=SMALL_FRAME) as c:
            claims = await c.claim_many(keys, namespace=ns)
            await c.complete_many([(x.key, x.token) for x in claims], namespace=ns)
            return [x.outcome for x in await c.claim_many(keys, namespace=ns)]

    assert asyncio.run(main()) == [Outcome.DUPLICATE] * len(keys)
