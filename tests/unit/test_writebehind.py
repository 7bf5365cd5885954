"""WriteBehindStore over an in-memory authority, and MemoryTable's claim semantics."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dedupcore import writebehind
from dedupcore.api import Claim, ClaimAPI, KeyRecord, Outcome
from dedupcore.errors import ConflictError, StaleTokenError, UnavailableError
from dedupcore.record import State
from dedupcore.writebehind import Conflict, MemoryTable, WriteBehindStore
from tests.support.fakes import FakeClock

NS = "orders/billing"
NEVER = 3600.0  # a flush interval no test reaches: pushes happen only when the test says


class Switchable(ClaimAPI):
    """An authority that can be made unreachable, counting the calls it gets."""

    def __init__(self, inner: ClaimAPI) -> None:
        self.inner = inner
        self.down = False
        self.calls = 0
        self.before_release: Any = None

    def _check(self) -> None:
        self.calls += 1
        if self.down:
            raise UnavailableError("authority down (test)")

    def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[Claim]:
        self._check()
        return self.inner.claim_many(
            keys, namespace=namespace, lease=lease, owner=owner, fingerprints=fingerprints
        )

    def complete_many(self, items: Iterable[Any], *, namespace: str) -> None:
        self._check()
        self.inner.complete_many(items, namespace=namespace)

    def release_many(self, items: Iterable[tuple[bytes | str, int]], *, namespace: str) -> None:
        self._check()
        if self.before_release is not None:
            self.before_release()
        self.inner.release_many(items, namespace=namespace)

    def get(self, key: bytes | str, *, namespace: str) -> KeyRecord | None:
        return self.inner.get(key, namespace=namespace)

    def stats(self) -> dict[str, Any]:
        return {}


@pytest.fixture
def authority() -> MemoryTable:
    return MemoryTable()


@pytest.fixture
def wb(authority: MemoryTable) -> Iterator[WriteBehindStore]:
    s = WriteBehindStore(authority, flush_interval=NEVER, flush_keys=1_000_000)
    yield s
    s.close()


def state_at(store: ClaimAPI, key: str) -> State | None:
    rec = store.get(key, namespace=NS)
    return None if rec is None else rec.state


# -- MemoryTable -----------------------------------------------------------------


def test_memory_table_follows_the_claim_rules() -> None:
    t = MemoryTable()
    c = t.claim("k", namespace=NS, fingerprint=b"fp")
    assert c.outcome is Outcome.NEW and c.token == 1
    assert t.claim("k", namespace=NS).outcome is Outcome.IN_PROGRESS
    with pytest.raises(ConflictError):
        t.claim_many(["other", "k"], namespace=NS, fingerprints=[None, b"another"])
    assert t.get("other", namespace=NS) is None  # the batch changed nothing
    with pytest.raises(StaleTokenError):
        t.complete("k", 2, namespace=NS)
    t.complete("k", 1, namespace=NS, result={"charged": 5})
    dup = t.claim("k", namespace=NS)
    assert dup.outcome is Outcome.DUPLICATE and dup.result == {"charged": 5}
    with pytest.raises(StaleTokenError, match="already completed"):
        t.release("k", 1, namespace=NS)
    r = t.claim("r", namespace=NS, owner="a")
    assert t.claim("r", namespace=NS, owner="a").token == r.token  # the same owner: its claim
    t.release("r", r.token, namespace=NS)
    again = t.claim("r", namespace=NS)
    assert again.outcome is Outcome.NEW and again.token == 2
    rec = t.get("k", namespace=NS)
    assert rec is not None and rec.state is State.PROCESSED and rec.result == {"charged": 5}
    assert t.stats()["namespaces"][NS]["duplicate"] == 1


def test_memory_table_lease_takeover() -> None:
    t = MemoryTable()
    first = t.claim("k", namespace=NS, lease=0.001)
    time.sleep(0.01)  # well past the lease (monotonic clock)
    taken = t.claim("k", namespace=NS)
    assert taken.outcome is Outcome.NEW and taken.takeover and taken.token == first.token + 1
    with pytest.raises(StaleTokenError):
        t.complete("k", first.token, namespace=NS)


# -- the window --------------------------------------------------------------------


def test_a_second_consumer_sees_new_inside_the_window_and_not_after(
    wb: WriteBehindStore, authority: MemoryTable
) -> None:
    assert wb.claim("a", namespace=NS).outcome is Outcome.NEW
    assert wb.window()[0] == 1
    assert authority.get("a", namespace=NS) is None  # not pushed: the authority knows nothing
    wb.flush()
    assert wb.window()[0] == 0
    assert authority.claim("a", namespace=NS).outcome is Outcome.IN_PROGRESS
    # Inside the window, the second consumer is answered NEW: the duplicate.
    c = wb.claim("b", namespace=NS)
    second = authority.claim("b", namespace=NS)
    assert second.outcome is Outcome.NEW
    wb.complete("b", c.token, namespace=NS, result="first")
    wb.flush()
    st = wb.stats()["write_behind"]
    assert st["conflicts"] == 1 and st["pushed_claims"] == 1
    (conflict,) = wb.conflicts
    assert conflict.key == "b" and conflict.kind == "claimed"
    assert conflict.authority_outcome is Outcome.IN_PROGRESS
    assert conflict.local_state is State.PROCESSED
    # The key stays the second consumer's at the authority; this store pushed nothing more.
    authority.complete("b", second.token, namespace=NS, result="second")
    assert authority.claim("b", namespace=NS).result == "second"


def test_after_the_flush_the_authority_answers_in_progress_then_duplicate(
    wb: WriteBehindStore, authority: MemoryTable
) -> None:
    c = wb.claim("k", namespace=NS)
    wb.flush()
    assert authority.claim("k", namespace=NS).outcome is Outcome.IN_PROGRESS
    wb.complete("k", c.token, namespace=NS, result={"n": 1})
    assert authority.claim("k", namespace=NS).outcome is Outcome.IN_PROGRESS  # not pushed yet
    wb.flush()
    dup = authority.claim("k", namespace=NS)
    assert dup.outcome is Outcome.DUPLICATE and dup.result == {"n": 1}
    assert wb.stats()["write_behind"]["conflicts"] == 0


def test_the_window_is_measured(authority: MemoryTable) -> None:
    clock = FakeClock(1000.0)
    with WriteBehindStore(authority, flush_interval=NEVER, clock=clock) as s:
        s.claim("x", namespace=NS)
        clock.now += 1.0
        s.claim("y", namespace=NS)
        clock.now += 1.5
        assert s.window() == (2, 2.5)
        st = s.stats()["write_behind"]
        assert st["window_keys"] == 2 and st["oldest_window_seconds"] == 2.5
        s.flush()
        assert s.window() == (0, 0.0)
        assert s.stats()["write_behind"]["max_window_seconds"] == 2.5


def test_two_write_behind_consumers_on_the_same_keys_count_every_duplicate(
    authority: MemoryTable,
) -> None:
    keys = [f"k{i}" for i in range(10)]
    seen: list[Conflict] = []
    a = WriteBehindStore(authority, flush_interval=NEVER)
    b = WriteBehindStore(authority, flush_interval=NEVER, on_conflict=seen.append)
    try:
        assert all(c.outcome is Outcome.NEW for c in a.claim_many(keys, namespace=NS))
        assert all(c.outcome is Outcome.NEW for c in b.claim_many(keys, namespace=NS))
        a.flush()
        b.flush()
        assert a.stats()["write_behind"]["conflicts"] == 0
        assert b.stats()["write_behind"]["conflicts"] == 10
        assert sorted(c.key for c in seen) == sorted(keys)
    finally:
        a.close()
        b.close()


def test_flush_keys_starts_a_push(authority: MemoryTable) -> None:
    with WriteBehindStore(authority, flush_interval=NEVER, flush_keys=5) as s:
        s.claim_many(["a", "b", "c", "d"], namespace=NS)
        # Four keys wait; only the fifth wakes the pushing thread (the interval never comes).
        assert all(authority.get(k, namespace=NS) is None for k in "abcd")
        s.claim("e", namespace=NS)
        deadline = time.monotonic() + 60
        while s.window()[0] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert all(state_at(authority, k) is State.PROCESSING for k in "abcde")


def test_flush_interval_starts_a_push(authority: MemoryTable) -> None:
    with WriteBehindStore(authority, flush_interval=0.02) as s:
        s.claim("a", namespace=NS)
        deadline = time.monotonic() + 60
        while state_at(authority, "a") is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert state_at(authority, "a") is State.PROCESSING


def test_close_flushes_everything(authority: MemoryTable) -> None:
    s = WriteBehindStore(authority, flush_interval=NEVER)
    claims = s.claim_many(["a", "b", "c"], namespace=NS)
    s.complete_many([(c.key, c.token, c.key.upper()) for c in claims[:2]], namespace=NS)
    s.close()
    assert authority.claim("a", namespace=NS).result == "A"
    assert authority.claim("b", namespace=NS).result == "B"
    assert state_at(authority, "c") is State.PROCESSING
    with pytest.raises(RuntimeError, match="closed"):
        s.claim("d", namespace=NS)


# -- releases and re-claims ----------------------------------------------------------


def test_a_key_released_before_its_push_never_reaches_the_authority(
    wb: WriteBehindStore, authority: MemoryTable
) -> None:
    c = wb.claim("k", namespace=NS)
    wb.release("k", c.token, namespace=NS)
    assert wb.window()[0] == 0
    wb.flush()
    assert authority.get("k", namespace=NS) is None


def test_a_release_after_the_push_frees_the_key_at_the_authority(
    wb: WriteBehindStore, authority: MemoryTable
) -> None:
    c = wb.claim("k", namespace=NS)
    wb.flush()
    wb.release("k", c.token, namespace=NS)
    wb.flush()
    assert state_at(authority, "k") is State.RELEASED
    assert authority.claim("k", namespace=NS).outcome is Outcome.NEW


def test_reclaimed_before_the_release_is_pushed_keeps_the_authority_claim(
    wb: WriteBehindStore, authority: MemoryTable
) -> None:
    c = wb.claim("k", namespace=NS)
    wb.flush()
    wb.release("k", c.token, namespace=NS)
    again = wb.claim("k", namespace=NS)
    assert again.outcome is Outcome.NEW and again.token == c.token + 1
    wb.flush()
    assert authority.claim("k", namespace=NS).outcome is Outcome.IN_PROGRESS
    wb.complete("k", again.token, namespace=NS, result=1)
    wb.flush()
    assert authority.claim("k", namespace=NS).result == 1
    assert wb.stats()["write_behind"]["conflicts"] == 0


def test_reclaimed_while_the_release_is_being_pushed_is_claimed_again(
    authority: MemoryTable,
) -> None:
    hooked = Switchable(authority)
    s = WriteBehindStore(hooked, flush_interval=NEVER)
    try:
        c = s.claim("k", namespace=NS)
        s.flush()
        s.release("k", c.token, namespace=NS)
        again: list[Claim] = []
        # The release reaches the authority after this store claimed the key again locally.
        hooked.before_release = lambda: again.append(s.claim("k", namespace=NS))
        s.flush()
        assert again[0].outcome is Outcome.NEW
        # The authority claim was given back, so the new local claim was pushed anew.
        assert authority.claim("k", namespace=NS).outcome is Outcome.IN_PROGRESS
        assert s.window()[0] == 0
        s.complete("k", again[0].token, namespace=NS, result="second")
        s.flush()
        assert authority.claim("k", namespace=NS).result == "second"
    finally:
        s.close()


# -- the authority refusing or failing -----------------------------------------------


def test_fingerprint_conflict_at_the_authority_is_isolated(
    wb: WriteBehindStore, authority: MemoryTable
) -> None:
    authority.claim("k", namespace=NS, fingerprint=b"theirs")
    wb.claim_many(["j", "k"], namespace=NS, fingerprints=[b"mine", b"mine"])
    wb.flush()
    assert state_at(authority, "j") is State.PROCESSING  # the other key was pushed
    (conflict,) = wb.conflicts
    assert conflict.key == "k" and conflict.kind == "fingerprint"


def test_a_completion_after_the_authority_lease_ran_out_is_a_conflict(
    wb: WriteBehindStore, authority: MemoryTable
) -> None:
    c = wb.claim("k", namespace=NS, lease=0.001)
    wb.flush()
    time.sleep(0.01)  # the authority's lease (and the local one) ran out
    taken = authority.claim("k", namespace=NS)
    assert taken.outcome is Outcome.NEW and taken.takeover
    wb.complete("k", c.token, namespace=NS)  # locally still this store's token
    wb.flush()
    (conflict,) = wb.conflicts
    assert conflict.kind == "lease_lost"
    assert state_at(authority, "k") is State.PROCESSING  # the taker's claim is untouched


def test_a_result_the_authority_refuses_is_dropped_not_the_completion() -> None:
    authority = MemoryTable(max_result_bytes=16)
    with WriteBehindStore(authority, flush_interval=NEVER) as s:
        c = s.claim("k", namespace=NS)
        s.complete("k", c.token, namespace=NS, result="x" * 100)
        s.flush()
        rec = authority.get("k", namespace=NS)
        assert rec is not None and rec.state is State.PROCESSED and rec.result is None
        assert s.stats()["write_behind"]["results_dropped"] == 1


def test_an_unreachable_authority_keeps_the_queue(authority: MemoryTable) -> None:
    flaky = Switchable(authority)
    s = WriteBehindStore(flaky, flush_interval=NEVER)
    try:
        flaky.down = True
        c = s.claim("k", namespace=NS)
        assert c.outcome is Outcome.NEW  # answered locally, whatever the authority does
        with pytest.raises(UnavailableError):
            s.flush()
        st = s.stats()["write_behind"]
        assert st["push_errors"] == 1 and st["window_keys"] == 1
        assert "authority down" in st["last_error"]
        s.complete("k", c.token, namespace=NS, result="r")
        flaky.down = False
        s.flush()
        assert authority.claim("k", namespace=NS).result == "r"
        assert s.window()[0] == 0
    finally:
        s.close()


class _RecordedWaits:
    """The background thread's condition, recording (authority calls so far, wait given)."""

    def __init__(self, cond: threading.Condition, flaky: Switchable) -> None:
        self.cond = cond
        self.flaky = flaky
        self.waits: list[tuple[int, float | None]] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append((self.flaky.calls, timeout))
        return self.cond.wait(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cond, name)


def test_background_retries_an_unreachable_authority_without_spinning(
    authority: MemoryTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pause after a failed push is read off what the thread waits for, on a clock
    # that stands still until the test moves it: no timing, whatever the load.
    clock = FakeClock()
    monkeypatch.setattr(writebehind, "time", SimpleNamespace(monotonic=clock, time=time.time))
    flaky = Switchable(authority)
    flaky.down = True
    s = WriteBehindStore(flaky, flush_interval=0.001, flush_keys=1)
    recorded = _RecordedWaits(s._wake, flaky)
    s._wake = recorded  # type: ignore[assignment]
    try:
        s.claim("k", namespace=NS)  # one waiting key reaches flush_keys: a push starts now
        guard = time.monotonic() + 60  # only a guard against a hang
        while not any(calls >= 1 for calls, _ in recorded.waits):  # failed, now pausing
            assert time.monotonic() < guard, "no failed push"
            time.sleep(0.005)
        assert s.stats()["write_behind"]["push_errors"] == 1
        # Failed pushes are at least a second apart, though a key stays queued: until the
        # clock has moved a second, the thread only waits, and for that second.
        after = [wait for calls, wait in recorded.waits if calls >= 1]
        assert after and all(wait == 1.0 for wait in after), after
        assert flaky.calls == 1
        flaky.down = False
        with s._lock:
            clock.now += 1.0
            recorded.notify_all()
        while state_at(authority, "k") is None:
            assert time.monotonic() < guard, "not retried"
            time.sleep(0.01)
        assert state_at(authority, "k") is State.PROCESSING  # retried once it answers
    finally:
        s.close()


def test_close_raises_when_the_last_push_fails(authority: MemoryTable) -> None:
    flaky = Switchable(authority)
    s = WriteBehindStore(flaky, flush_interval=NEVER)
    s.claim("k", namespace=NS)
    flaky.down = True
    with pytest.raises(UnavailableError):
        s.close()


def test_many_threads_lose_nothing(authority: MemoryTable) -> None:
    n_threads, per_thread = 6, 150
    with WriteBehindStore(authority, flush_interval=0.005, flush_keys=40) as s:

        def work(t: int) -> None:
            for i in range(per_thread):
                with s.processing(f"t{t}-{i}", namespace=NS) as c:
                    assert c.outcome is Outcome.NEW
                    c.result = i
                # A redelivery is answered locally.
                assert s.claim(f"t{t}-{i}", namespace=NS).outcome is Outcome.DUPLICATE

        threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    st = s.stats()["write_behind"]
    assert st["conflicts"] == 0 and st["pushed_completions"] == n_threads * per_thread
    for t in range(n_threads):
        for i in range(per_thread):
            rec = authority.get(f"t{t}-{i}", namespace=NS)
            assert rec is not None and rec.state is State.PROCESSED and rec.result == i


def test_window_and_conflict_with_an_embedded_authority(tmp_path: Path) -> None:
    from dedupcore.store import DedupStore

    with DedupStore.open(tmp_path / "authority", durability="power-loss-unsafe") as authority:
        s = WriteBehindStore(authority, local=tmp_path / "local", flush_interval=NEVER)
        try:
            c = s.claim("k", namespace=NS)
            other = authority.claim("k", namespace=NS)  # another consumer, inside the window
            assert other.outcome is Outcome.NEW
            pushed = s.claim("p", namespace=NS)
            s.flush()
            assert authority.claim("p", namespace=NS).outcome is Outcome.IN_PROGRESS
            s.complete_many([("k", c.token, "mine"), ("p", pushed.token, "p")], namespace=NS)
            s.flush()
            assert authority.claim("p", namespace=NS).result == "p"
            (conflict,) = s.conflicts
            assert conflict.key == "k" and conflict.authority_outcome is Outcome.IN_PROGRESS
            assert state_at(authority, "k") is State.PROCESSING  # still the other consumer's
        finally:
            s.close()
