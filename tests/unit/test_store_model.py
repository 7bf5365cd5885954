"""Stateful model test of the embedded store against an in-memory model of its claim rules.

The rules are those of docs/architecture.md, "The decision" (the table is in
docs/engine.md).

The model is a dict key -> record (state, token, owner, fingerprint, result, lease,
lease deadline) driven by a fake monotonic clock that the test advances; the store's
module sees the same clock. Rules claim, complete and release in batches (current,
stale or wrong tokens), advance the clock past leases, checkpoint, close and reopen
(in-flight leases restart from the reopen: a holder may still be alive), and drop the
store without closing it (a crash: the log is replayed on reopen). Every answer, token,
result and error is compared with the model, and ``get`` of every key after each step.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import dedupcore.store.store as store_module
from dedupcore.errors import ConflictError, StaleTokenError
from dedupcore.record import State
from dedupcore.store import DedupStore, Outcome
from tests.support.fakes import FakeClock

NS = "model/ns"
KEYS = ["k0", "k1", "k2", "k3", "k4"]
OWNERS = [None, "a", "b", "c"]
FINGERPRINTS = [None, b"fp-1", b"fp-2"]
LEASES = [None, 1.0, 2.5, 6.0]  # exact in the record's f32 lease field
DEFAULT_LEASE = 4.0
RESULTS = [None, b"bin", "text", 42, [1, "x"], {"a": [True, None]}]
TOKEN_CHOICES = ["current"] * 5 + ["stale", "next", "any"]

PROCESSING, PROCESSED, RELEASED = State.PROCESSING, State.PROCESSED, State.RELEASED


def _fake_time_module(clock: FakeClock) -> types.SimpleNamespace:
    """Stands in for ``time`` inside dedupcore.store only: monotonic is the fake clock."""
    names = {n: getattr(time, n) for n in dir(time) if not n.startswith("__")}
    names["monotonic"] = clock.monotonic
    return types.SimpleNamespace(**names)


@dataclasses.dataclass
class MRec:
    state: State
    token: int
    owner: bytes | None
    fingerprint: bytes | None
    result: Any
    lease: float  # duration stored with the record (set when it was claimed NEW)
    deadline: float  # on the fake monotonic clock


class Rejected(Exception):
    """The model's prediction that a whole batch is refused with ``error``."""

    def __init__(self, error: type[Exception]) -> None:
        self.error = error


def _owner(owner: str | None) -> bytes | None:
    return None if owner is None else owner.encode()


class StoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(10_000.0)
        self._real_time = store_module.time
        store_module.time = _fake_time_module(self.clock)  # type: ignore[assignment]
        # On tmpfs where there is one: the model checks semantics, not the disk, and
        # fsyncs on a shared disk would cost most of the run.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.dir = Path(tempfile.mkdtemp(prefix="dedup-model-", dir=shm))
        self.model: dict[str, MRec] = {}
        self.store: DedupStore | None = None
        self.store = self._open()

    def _open(self) -> DedupStore:
        return DedupStore.open(
            self.dir / "data",
            lease=DEFAULT_LEASE,
            durability="power-loss-unsafe",  # same semantics, fewer fsyncs: more steps
            front_slice_capacity=1000,
            checkpoint_records=10**9,
            checkpoint_interval=1e9,
            sweep_interval=1e9,
        )

    def teardown(self) -> None:
        try:
            if self.store is not None:
                self.store.close()
        finally:
            store_module.time = self._real_time  # type: ignore[assignment]
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- the model of the claim rules (docs/architecture.md, "The decision") -------

    def model_claim(
        self,
        keys: list[str],
        owner: bytes | None,
        fps: list[bytes | None],
        lease: float | None,
    ) -> tuple[list[tuple[Outcome, int, Any, bool]], dict[str, MRec]]:
        """Expected (outcome, token, result, takeover) per key and the records after."""
        now = self.clock.now
        lease_s = DEFAULT_LEASE if lease is None else lease
        recs = {k: dataclasses.replace(r) for k, r in self.model.items()}
        out = []
        for key, fp in zip(keys, fps, strict=True):
            r = recs.get(key)
            if r is not None and r.state is not RELEASED:
                if fp is not None and r.fingerprint is not None and fp != r.fingerprint:
                    raise Rejected(ConflictError)
                if r.state is PROCESSED:
                    out.append((Outcome.DUPLICATE, r.token, r.result, False))
                    continue
                if owner is not None and r.owner == owner:
                    r.deadline = now + lease_s  # its own claim back, lease renewed
                    out.append((Outcome.NEW, r.token, None, False))
                    continue
                if r.deadline > now:
                    out.append((Outcome.IN_PROGRESS, r.token, None, False))
                    continue
                takeover = True
            else:
                takeover = False
            token = 1 if r is None else r.token + 1
            if takeover and fp is None:
                fp = r.fingerprint  # a takeover keeps the first claim's fingerprint
            recs[key] = MRec(PROCESSING, token, owner, fp, None, lease_s, now + lease_s)
            out.append((Outcome.NEW, token, None, takeover))
        return out, recs

    def model_change(self, items: list[tuple[str, int, Any]], state: State) -> dict[str, MRec]:
        """Records after completing (PROCESSED) or releasing (RELEASED) ``items``."""
        recs = {k: dataclasses.replace(r) for k, r in self.model.items()}
        for key, token, result in items:
            r = recs.get(key)
            if r is None or r.state is RELEASED or r.token != token:
                raise Rejected(StaleTokenError)
            if r.state is PROCESSED:
                if state is PROCESSED:
                    continue  # a retried completion: already done, result unchanged
                raise Rejected(StaleTokenError)  # a completed key cannot be released
            r.state = state
            r.result = result if state is PROCESSED else None
        return recs

    def token_for(self, key: str, choice: str, any_token: int) -> int:
        r = self.model.get(key)
        current = 1 if r is None else r.token
        if choice == "current":
            return current
        if choice == "stale":
            return current - 1 if current > 1 else current + 1
        if choice == "next":
            return current + 1
        return any_token

    # -- rules -----------------------------------------------------------------------

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)
        | st.tuples(st.sampled_from(KEYS), st.sampled_from(KEYS)).map(lambda t: [*t, *t]),
        owner=st.sampled_from(OWNERS),
        fps=st.none() | st.lists(st.sampled_from(FINGERPRINTS), min_size=4, max_size=4),
        lease=st.sampled_from(LEASES),
        wait=st.sampled_from([0.0, 0.0, 0.0, 2.0, 8.0]),
    )
    def claim(
        self,
        keys: list[str],
        owner: str | None,
        fps: list[bytes | None] | None,
        lease: float | None,
        wait: float,
    ) -> None:
        """Claims a batch, some time after the previous step (so leases run out)."""
        assert self.store is not None
        self.clock.now += wait
        fp_list = [None] * len(keys) if fps is None else fps[: len(keys)]
        try:
            expected, after = self.model_claim(keys, _owner(owner), fp_list, lease)
        except Rejected as rejected:
            try:
                self.store.claim_many(
                    keys,
                    namespace=NS,
                    owner=owner,
                    lease=lease,
                    fingerprints=None if fps is None else fp_list,
                )
            except rejected.error:
                return
            raise AssertionError(
                f"claim of {keys} should raise {rejected.error.__name__}"
            ) from None
        claims = self.store.claim_many(
            keys,
            namespace=NS,
            owner=owner,
            lease=lease,
            fingerprints=None if fps is None else fp_list,
        )
        got = [(c.outcome, c.token, c.result, c.takeover) for c in claims]
        assert got == expected, f"claim {keys} owner={owner} fps={fp_list} lease={lease}"
        assert [c.key for c in claims] == keys
        assert all(c.exact and c.namespace == NS for c in claims)
        self.model = after

    @rule(
        items=st.lists(
            st.tuples(
                st.sampled_from(KEYS),
                st.sampled_from(TOKEN_CHOICES),
                st.integers(1, 6),
                st.sampled_from(RESULTS),
            ),
            min_size=1,
            max_size=3,
        ),
    )
    def complete(self, items: list[tuple[str, str, int, Any]]) -> None:
        assert self.store is not None
        calls = [(k, self.token_for(k, choice, t), result) for k, choice, t, result in items]
        self._change(calls, PROCESSED)

    @rule(
        items=st.lists(
            st.tuples(st.sampled_from(KEYS), st.sampled_from(TOKEN_CHOICES), st.integers(1, 6)),
            min_size=1,
            max_size=3,
        ),
    )
    def release(self, items: list[tuple[str, str, int]]) -> None:
        calls = [(k, self.token_for(k, choice, t), None) for k, choice, t in items]
        self._change(calls, RELEASED)

    def _change(self, calls: list[tuple[str, int, Any]], state: State) -> None:
        assert self.store is not None
        if state is PROCESSED:
            do = lambda: self.store.complete_many(calls, namespace=NS)  # noqa: E731
        else:
            pairs = [(k, t) for k, t, _ in calls]
            do = lambda: self.store.release_many(pairs, namespace=NS)  # noqa: E731
        try:
            after = self.model_change(calls, state)
        except Rejected as rejected:
            try:
                do()
            except rejected.error:
                return
            raise AssertionError(f"{state.name} {calls} should raise StaleTokenError") from None
        do()
        self.model = after

    @rule(dt=st.sampled_from([0.5, 1.5, 3.0, 7.0, 20.0]))
    def advance_clock(self, dt: float) -> None:
        self.clock.now += dt

    @precondition(lambda self: any(r.state is PROCESSING for r in self.model.values()))
    @rule(data=st.data(), result=st.sampled_from(RESULTS))
    def complete_a_claimed_key(self, data: st.DataObject, result: Any) -> None:
        held = sorted(k for k, r in self.model.items() if r.state is PROCESSING)
        key = data.draw(st.sampled_from(held))
        self._change([(key, self.model[key].token, result)], PROCESSED)

    @precondition(lambda self: any(r.state is PROCESSING for r in self.model.values()))
    @rule(data=st.data())
    def release_a_claimed_key(self, data: st.DataObject) -> None:
        held = sorted(k for k, r in self.model.items() if r.state is PROCESSING)
        key = data.draw(st.sampled_from(held))
        self._change([(key, self.model[key].token, None)], RELEASED)

    @rule()
    def checkpoint(self) -> None:
        assert self.store is not None
        self.store.checkpoint()

    @rule()
    def close_and_reopen(self) -> None:
        assert self.store is not None
        self.store.close()
        self.store = None
        self.store = self._open()
        self._leases_restart()

    @rule()
    def crash_and_reopen(self) -> None:
        """Drops the store without close(): no checkpoint, no filter save; the log replays."""
        s = self.store
        assert s is not None
        with s._lock:
            s._closed = True
            s._wake.notify_all()
        if s._worker is not None:
            s._worker.join()
        s._wal.close()
        s._lmdb.close()
        s._release_lock()
        self.store = None
        self.store = self._open()
        self._leases_restart()

    def _leases_restart(self) -> None:
        # Deadlines live on the owning process's clock: a reopened PROCESSING record
        # gets a fresh lease of its stored duration.
        for r in self.model.values():
            if r.state is PROCESSING:
                r.deadline = self.clock.now + r.lease

    # -- invariants --------------------------------------------------------------------

    @precondition(lambda self: self.store is not None)
    @invariant()
    def records_match_the_model(self) -> None:
        assert self.store is not None
        for key in KEYS:
            rec = self.store.get(key, namespace=NS)
            m = self.model.get(key)
            if m is None:
                assert rec is None, (key, rec)
                continue
            assert rec is not None, (key, m)
            got = (rec.state, rec.token, rec.owner, rec.fingerprint, rec.result, rec.exact)
            assert got == (m.state, m.token, m.owner, m.fingerprint, m.result, True), (key, m)


StoreModel.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    # No explain phase: it reruns a failing case many times more (minutes) after shrinking.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStoreModel = StoreModel.TestCase


# -- the smallest cases the machine found, as plain tests -------------------------------


def test_conflict_after_a_same_owner_repeat_in_a_batch_claims_nothing(tmp_path: Path) -> None:
    """A batch that raises ConflictError must leave no claim behind, even for a key the
    same owner repeated earlier in that batch."""
    with DedupStore.open(tmp_path / "data") as store:
        with pytest.raises(ConflictError):
            store.claim_many(
                ["k0", "k1", "k0", "k1"],
                namespace=NS,
                owner="a",
                fingerprints=[None, b"fp-1", None, b"fp-2"],
            )
        assert store.get("k0", namespace=NS) is None
        assert store.claim("k0", namespace=NS, owner="b").outcome is Outcome.NEW


def test_conflict_after_a_same_owner_repeat_takes_nothing_over(tmp_path: Path) -> None:
    """After a lease ran out, a batch that would take the key over but raises
    ConflictError must not fence the first owner out."""
    with DedupStore.open(tmp_path / "data") as store:
        first = store.claim("k0", namespace=NS, lease=0.05)
        time.sleep(0.1)
        with pytest.raises(ConflictError):
            store.claim_many(
                ["k0", "k1", "k0", "k1"],
                namespace=NS,
                owner="a",
                fingerprints=[None, b"fp-1", None, b"fp-2"],
            )
        rec = store.get("k0", namespace=NS)
        assert rec is not None and (rec.token, rec.owner) == (first.token, None)
        store.complete("k0", first.token, namespace=NS, result=b"done")
        assert store.claim("k0", namespace=NS).result == b"done"
