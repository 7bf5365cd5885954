"""What makes the daemon stop for a restart: a store that declares it failed (its
``failed`` property, docs/daemon.md), never an ordinary error of one request.

The daemon runs in this process (the DaemonServer helper of test_fastpath) so that
it can serve stores built here: an instrumented store, a stack, shards.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api import ClaimAPI, Outcome
from dedupcore.client import Client
from dedupcore.daemon.server import EXIT_STORE_FAILED, SLICE_KEYS
from dedupcore.errors import ConflictError, DedupError, StaleTokenError
from dedupcore.metrics import Metrics, instrument
from dedupcore.stack import ShardedStore, TieredStore
from dedupcore.store import DedupStore
from dedupcore.tiers.base import failure_of
from dedupcore.writebehind import MemoryTable, WriteBehindStore
from tests.support.daemon import serving
from tests.support.procs import PATIENCE
from tests.support.stores import unique_ns

#: No checkpoint while a test runs: every write goes to the log first.
QUIET = {"checkpoint_records": 10**9, "checkpoint_interval": 1e9}


def _fresh_metrics() -> Metrics:
    from prometheus_client import CollectorRegistry

    return Metrics(registry=CollectorRegistry())


@pytest.fixture
def fail_writes_under(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    """``fail_writes_under(dir)``: from then on, ``os.write`` to a file under ``dir``
    fails with EFBIG, as on a file past its size limit (other files are untouched)."""

    def arm(directory: Path) -> None:
        real = os.write

        def write(fd: int, data: Any) -> int:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if target.startswith(str(directory) + os.sep):
                raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
            return real(fd, data)

        monkeypatch.setattr(os, "write", write)

    yield arm


def test_an_instrumented_store_answers_ordinary_errors_and_keeps_serving(
    tmp_path: Path,
) -> None:
    store = instrument(DedupStore.open(tmp_path / "data", **QUIET), _fresh_metrics())
    assert store.failed is None
    with serving(store) as (server, path), Client(path, timeout=PATIENCE) as c:
        ns = unique_ns("instrumented")
        first = c.claim("k", namespace=ns, fingerprint=b"a")
        assert first.outcome is Outcome.NEW
        with pytest.raises(ConflictError):
            c.claim("k", namespace=ns, fingerprint=b"b")
        with pytest.raises(StaleTokenError):
            c.complete("k", first.token + 1, namespace=ns)
        # Still serving, on the same connection and on a new one.
        c.complete("k", first.token, namespace=ns, result=b"done")
        assert c.claim("k", namespace=ns, fingerprint=b"a").result == b"done"
        with Client(path, timeout=PATIENCE) as other:
            assert other.ping()
        assert server.exit_code == 0
        assert c.stats()["daemon"]["errors"] == 2


def _instrumented(root: Path) -> ClaimAPI:
    return instrument(DedupStore.open(root / "a", **QUIET), _fresh_metrics())


def _stacked(root: Path) -> ClaimAPI:
    return TieredStore(DedupStore.open(root / "a", **QUIET), front=True)


def _sharded_stacks(root: Path) -> ClaimAPI:
    return ShardedStore(
        [TieredStore(DedupStore.open(root / name, **QUIET), front=False) for name in "ab"]
    )


@pytest.mark.parametrize("build", [_instrumented, _stacked, _sharded_stacks])
def test_a_wrapped_store_that_fails_stops_the_daemon(
    tmp_path: Path,
    fail_writes_under: Callable[[Path], None],
    build: Callable[[Path], ClaimAPI],
) -> None:
    store = build(tmp_path)
    with serving(store) as (server, path), Client(path, timeout=PATIENCE, retries=0) as c:
        ns = unique_ns("wrapped")
        kept = c.claim_many([f"kept-{i}" for i in range(8)], namespace=ns)
        assert all(k.outcome is Outcome.NEW for k in kept)
        assert failure_of(store) is None
        fail_writes_under(tmp_path)
        with pytest.raises((OSError, DedupError)):
            c.claim_many([f"lost-{i}" for i in range(8)], namespace=ns)
        failed = failure_of(store)
        assert isinstance(failed, OSError) and failed.errno == errno.EFBIG
        assert server.exit_code == EXIT_STORE_FAILED


def test_the_failed_property_forwards_through_every_wrapper(
    tmp_path: Path, fail_writes_under: Callable[[Path], None]
) -> None:
    inner = DedupStore.open(tmp_path / "local", **QUIET)
    authority = MemoryTable()
    behind = WriteBehindStore(authority, local=inner)
    stacked = TieredStore(behind, front=False)
    wrappers: list[ClaimAPI] = [
        behind,
        stacked,
        ShardedStore([stacked]),
        instrument(stacked, _fresh_metrics()),
    ]
    try:
        assert [failure_of(w) for w in wrappers] == [None] * 4
        assert failure_of(authority) is None  # a store without the property: never failed
        fail_writes_under(tmp_path / "local")
        with pytest.raises(OSError):
            behind.claim("k", namespace="wb")
        assert inner.failed is not None
        assert [failure_of(w) for w in wrappers] == [inner.failed] * 4
        assert [w.failed for w in wrappers] == [inner.failed] * 4  # type: ignore[attr-defined]
    finally:
        with contextlib.suppress(DedupError, OSError):
            behind.close()  # its last push finds nothing to push
        inner.close()


def test_a_failed_native_commit_answers_an_error_and_stops_the_daemon(tmp_path: Path) -> None:
    """A large batch's log records go to the native commit thread (docs/daemon.md,
    "Group commit"); a write it cannot make fails the log: the batch is answered with
    the error, nothing of it is acknowledged, and the daemon stops for a restart."""
    store = DedupStore.open(tmp_path / "data", **QUIET)
    ns = unique_ns("native")
    keys = [f"lost-{i}" for i in range(8 * SLICE_KEYS)]  # far more log than the loop syncs
    with serving(store) as (server, path), Client(path, timeout=PATIENCE, retries=0) as c:
        kept = c.claim("kept", namespace=ns)
        assert kept.outcome is Outcome.NEW
        segments = store._wal._segments
        real_fd = segments.fd
        # From here the log's file takes no writes (EBADF): the native write fails.
        segments.fd = os.open(segments.file(segments.firsts[-1]), os.O_RDONLY)
        try:
            committer = server.dispatch.committer
            before = committer.native_rounds
            with pytest.raises((OSError, DedupError)):
                c.claim_many(keys, namespace=ns)
            assert committer.native_rounds == before + 1
            failed = store.failed
            assert isinstance(failed, OSError) and failed.errno == errno.EBADF
            assert server.exit_code == EXIT_STORE_FAILED
        finally:
            os.close(real_fd)
    with DedupStore.open(tmp_path / "data", **QUIET) as reopened:
        assert reopened.get("kept", namespace=ns) is not None
        assert all(reopened.get(k, namespace=ns) is None for k in keys[:100])
