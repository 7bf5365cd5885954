"""Real-process tests of the embedded store: SIGKILL at set points, torn and damaged log
tails, lease takeover after a crash, and races between threads and processes.

The child (store_child.py) claims and completes batches of deterministic keys and prints
``ACK <batch>`` after each ``complete_many`` returned; everything it acknowledged must be
DUPLICATE with its result after the parent reopens the directory.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dedupcore import keys as dkeys
from dedupcore.errors import DedupError, StaleTokenError
from dedupcore.record import State
from dedupcore.store import DedupStore, Outcome
from tests.support.procs import LineProcess, load_script
from tests.support.wal import segment_frames

CHILD = Path(__file__).with_name("store_child.py")
store_child = load_script(CHILD)
batch_keys: Callable[[int], list[bytes]] = store_child.batch_keys
result_for: Callable[[bytes], list[object]] = store_child.result_for
NS: str = store_child.NS


# ---------------------------------------------------------------- helpers ---


class Child(LineProcess):
    """A running store_child.py; ``seen`` keeps the whole lines it wrote, in order."""

    def __init__(self, *args: str) -> None:
        super().__init__([sys.executable, str(CHILD), *args], name="store_child.py")
        self.seen: list[str] = []

    def next(self, timeout: float = 60.0) -> str:
        line = self.next_raw(timeout)
        if line is None or not line.endswith("\n"):
            self.kill()
            raise AssertionError(f"child ended early ({self.proc.returncode}): {self.stderr()}")
        self.seen.append(line.strip())
        return line.strip()

    def kill_here(self) -> None:
        """SIGKILL now; every line it wrote whole before dying joins ``seen``."""
        self.seen += self.sigkill()

    def acked(self) -> list[int]:
        return [int(line.split()[1]) for line in self.seen if line.startswith("ACK ")]


@contextmanager
def child(*args: str) -> Iterator[Child]:
    with Child(*args) as c:
        yield c


def check_acknowledged(store: DedupStore, batches: list[int]) -> None:
    """Every key of every acknowledged batch is DUPLICATE with its result."""
    keys = [k for b in batches for k in batch_keys(b)]
    for i in range(0, len(keys), 20_000):
        chunk = keys[i : i + 20_000]
        claims = store.claim_many(chunk, namespace=NS)
        wrong = [
            (c.key, c.outcome, c.result)
            for c in claims
            if c.outcome is not Outcome.DUPLICATE or c.result != result_for(c.key) or not c.exact
        ]
        assert not wrong, f"{len(wrong)} acknowledged keys lost or changed, e.g. {wrong[:3]}"


def check_unacknowledged(store: DedupStore, batch: int) -> Counter[str]:
    """A batch the child may have been working on: each key absent, claimed, or done right."""
    states: Counter[str] = Counter()
    for key in batch_keys(batch):
        rec = store.get(key, namespace=NS)
        if rec is None:
            states["absent"] += 1
            continue
        assert rec.token == 1, (key, rec)
        assert rec.state in (State.PROCESSING, State.PROCESSED), (key, rec)
        if rec.state is State.PROCESSED:
            assert rec.result == result_for(key), (key, rec)
        states[rec.state.name] += 1
    return states


def newest_segment(path: Path) -> Path:
    segments = sorted((path / "wal").glob("wal-*.log"))
    assert segments, "no log segment"
    return segments[-1]


# ------------------------------------------------------------ SIGKILL rounds ---


def test_sigkill_at_set_points_and_inside_checkpoints_loses_no_acknowledged_key(
    tmp_path: Path,
) -> None:
    """Rounds of a child claiming+completing batches in one directory, each ended by SIGKILL.

    Most rounds are killed as soon as the parent has read a set number of acks (the child
    goes on working meanwhile; checkpoints run every few batches, so some of those kills land
    in one); rounds 2, 5 and 9 are killed while
    the checkpoint is stalled before / after its LMDB commit (before the log is truncated).
    Every third round runs without fdatasync ("power-loss-unsafe" must survive a process
    crash). After each kill the parent reopens the store and checks every acknowledged key.
    """
    path = tmp_path / "data"
    # The acks read before each round's kill: fixed, so that every run kills alike.
    targets = [2, 17, 0, 9, 30, 0, 5, 23, 11, 0, 28, 3]
    acked: list[int] = []
    next_batch = 0
    checkpoints_seen = 0
    stalled_kills = 0
    for round_no in range(12):
        stall = {2: "begin", 5: "committed", 9: "begin"}.get(round_no)
        args = [str(path), str(next_batch), "--trace-checkpoints"]
        if round_no % 3 == 1:
            args += ["--durability", "power-loss-unsafe"]
        if stall:
            args += ["--stall", stall]
        with child(*args) as c:
            assert c.next() == "READY"
            if stall:
                # Wait for the stalled phase, after at least a few acks.
                while f"CKPT {stall}" not in c.seen or len(c.acked()) < 3:
                    c.next()
            else:
                while len(c.acked()) < targets[round_no]:
                    c.next()
            c.kill_here()
        if stall:
            # The checkpoint sleeps 30 s in the stalled phase: the kill was inside it.
            after = c.seen[c.seen.index(f"CKPT {stall}") :]
            assert "CKPT dropped" not in after, after
            if stall == "begin":
                assert "CKPT committed" not in after, after
            stalled_kills += 1
        checkpoints_seen += c.seen.count("CKPT committed")
        round_acked = c.acked()
        assert round_acked == list(range(next_batch, next_batch + len(round_acked)))
        acked += round_acked
        last = round_acked[-1] if round_acked else next_batch - 1
        # Reopen in the parent: nothing corrupted, every acknowledged key kept.
        with DedupStore.open(path) as store:
            check_acknowledged(store, acked)
            # The batch in progress at the kill is absent, claimed or done, never wrong;
            # nothing exists beyond it.
            check_unacknowledged(store, last + 1)
            for key in batch_keys(last + 2)[:50]:
                assert store.get(key, namespace=NS) is None
        # The next round continues in the same directory, past the interrupted batch
        # (whose claims may hold leases).
        next_batch = last + 2
    assert stalled_kills == 3
    assert checkpoints_seen > 0, "no checkpoint ran during the rounds"
    assert len(acked) >= 12
    # A last reopen after everything: the whole history is still there.
    with DedupStore.open(path) as store:
        check_acknowledged(store, acked)


def _held_run(path: Path, *, batches: int, lease: float, manual: int = 0) -> tuple[int, int]:
    """Runs a child that acks ``batches`` batches, then holds one NEW batch; kills it.

    Returns (held batch, its token)."""
    args = [str(path), "0", "--hold-after", str(batches), "--lease", str(lease)]
    if manual:
        args += ["--manual-checkpoint", str(manual)]
    with child(*args) as c:
        assert c.next() == "READY"
        while not c.seen[-1].startswith("HELD"):
            c.next()
        c.kill_here()
    assert c.acked() == list(range(batches))
    _, held, token = c.seen[-1].split()
    return int(held), int(token)


@pytest.mark.parametrize("damage", ["torn", "flipped"])
def test_damaged_last_log_record_reopens_to_the_last_valid_record(
    tmp_path: Path, damage: str
) -> None:
    """The newest segment ends with the held batch's PROCESSING claims (checkpoints are
    manual, after batches 3 and 6); its last record is torn or has a flipped byte.

    Reopening cuts exactly that record and keeps everything before it: acknowledged keys
    are all DUPLICATE; of the held batch a prefix is still claimed (IN_PROGRESS, same
    token) and the suffix that was in the cut record, which ends with its last key, is
    unknown again (one key if the store logs a record per key, all if one per batch)."""
    path = tmp_path / "data"
    held, token = _held_run(path, batches=7, lease=30.0, manual=3)
    segment = newest_segment(path)
    frames = segment_frames(segment)
    assert frames, "the newest segment holds no record"
    held_keys = batch_keys(held)
    _lsn, start, end, payload = frames[-1]
    # The last record is the held claim's: it names the held batch's last key's digest.
    assert dkeys.digest(NS.encode(), held_keys[-1]) in payload
    # After it, only the zeros written ahead of the appends (the kill left them).
    assert not any(segment.read_bytes()[end:])
    rng = random.Random(7 if damage == "torn" else 8)
    if damage == "torn":
        os.truncate(segment, end - rng.randint(1, min(19, end - start - 1)))
    else:
        data = bytearray(segment.read_bytes())
        data[rng.randrange(start + 12, end - 8)] ^= 0x41  # inside the payload
        segment.write_bytes(bytes(data))
    with DedupStore.open(path) as store:
        check_acknowledged(store, list(range(7)))
        states = []
        for key in held_keys:
            rec = store.get(key, namespace=NS)
            states.append(None if rec is None else (rec.state, rec.token))
        kept = states.index(None) if None in states else len(states)
        assert states == [(State.PROCESSING, token)] * kept + [None] * (len(states) - kept)
        assert kept < len(held_keys), "the damaged record was not cut"
        other = store.claim_many(held_keys[:kept], namespace=NS, owner="parent")
        assert all(c.outcome is Outcome.IN_PROGRESS and c.token == token for c in other)
        lost = store.claim_many(held_keys[kept:], namespace=NS)
        assert all(c.outcome is Outcome.NEW and c.token == 1 for c in lost)
        # The cut log takes new records after the last valid one.
        store.complete(held_keys[-1], 1, namespace=NS, result=b"again")
    with DedupStore.open(path) as store:
        check_acknowledged(store, list(range(7)))
        assert store.claim(held_keys[-1], namespace=NS).result == b"again"


def test_claims_of_a_killed_owner_are_taken_over_once_after_their_lease(tmp_path: Path) -> None:
    """A child holds NEW claims (lease 1 s) and is SIGKILLed. After reopening, the claims
    are IN_PROGRESS for other owners until a fresh lease runs out; the same owner gets its
    claim back; then exactly one of several threads takes each key over with token + 1,
    and the dead owner's token is fenced."""
    path = tmp_path / "data"
    held, token = _held_run(path, batches=2, lease=1.0)
    keys = batch_keys(held)
    mine, contested = keys[0], keys[1:]
    with DedupStore.open(path) as store:
        before = store.claim_many(contested, namespace=NS, owner="someone-else")
        assert all(c.outcome is Outcome.IN_PROGRESS and c.token == token for c in before)
        back = store.claim(mine, namespace=NS, owner=store_child.HOLD_OWNER)
        assert back.outcome is Outcome.NEW and back.token == token and not back.takeover
        time.sleep(1.3)  # past the fresh lease given at reopen
        results: dict[int, list] = {}
        barrier = threading.Barrier(6)

        def contend(n: int) -> None:
            order = contested[:]
            random.Random(n).shuffle(order)
            barrier.wait()
            results[n] = [
                c
                for i in range(0, len(order), 100)
                for c in store.claim_many(order[i : i + 100], namespace=NS, owner=f"t{n}")
            ]

        threads = [threading.Thread(target=contend, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        new = [(n, c) for n, cs in results.items() for c in cs if c.outcome is Outcome.NEW]
        assert Counter(c.key for _, c in new) == Counter(contested)  # exactly one each
        assert all(c.token == token + 1 and c.takeover for _, c in new)
        losers = [c for cs in results.values() for c in cs if c.outcome is not Outcome.NEW]
        assert all(c.outcome is Outcome.IN_PROGRESS for c in losers)
        with pytest.raises(StaleTokenError):
            store.complete(contested[0], token, namespace=NS, result=b"late")
        with pytest.raises(StaleTokenError):
            store.release(contested[1], token, namespace=NS)
        by_owner: dict[int, list] = {}
        for n, c in new:
            by_owner.setdefault(n, []).append((c.key, c.token, f"t{n}"))
        for items in by_owner.values():
            store.complete_many(items, namespace=NS)
        store.complete(mine, token, namespace=NS, result=b"mine")
        check_acknowledged(store, [0, 1])
    with DedupStore.open(path) as store:
        claims = store.claim_many(contested, namespace=NS)
        assert all(c.outcome is Outcome.DUPLICATE and c.token == token + 1 for c in claims)
        assert {c.result for c in claims} <= {f"t{n}" for n in range(6)}
        assert store.claim(mine, namespace=NS).result == b"mine"


# ------------------------------------------------------------------- races ---


def test_eight_threads_claim_the_same_100k_keys_one_new_each_while_a_process_is_refused(
    tmp_path: Path,
) -> None:
    """8 threads claim the same 100,000 keys in shuffled orders (batches of 1000), with
    checkpoints running meanwhile; a second process tries to open the directory during
    the race and is refused with the owner's pid; the owner answers right afterwards."""
    path = tmp_path / "data"
    keys = [f"race-{i:06d}".encode() for i in range(100_000)]
    store = DedupStore.open(path, checkpoint_records=25_000, checkpoint_interval=0.3)
    try:
        news: list[list[bytes]] = [[] for _ in range(8)]
        errors: list[BaseException] = []
        barrier = threading.Barrier(9)

        def worker(n: int) -> None:
            order = keys[:]
            random.Random(n).shuffle(order)
            barrier.wait()
            try:
                for i in range(0, len(order), 1000):
                    for c in store.claim_many(order[i : i + 1000], namespace=NS):
                        if c.outcome is Outcome.NEW:
                            assert c.token == 1
                            news[n].append(c.key)
                        else:
                            assert c.outcome is Outcome.IN_PROGRESS, c
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        barrier.wait()
        # While the threads race: another process opening the directory for writing.
        with child(str(path), "lockcheck", keys[0].decode()) as c:
            locked = c.next(timeout=120)
            c.next(timeout=120)  # its read-only attempt (checked below, after the race)
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert locked.startswith("LOCKED"), locked
        assert str(os.getpid()) in locked and "dedupcore serve" in locked, locked
        counts = Counter(k for per in news for k in per)
        assert len(counts) == len(keys)
        assert set(counts.values()) == {1}, counts.most_common(3)
        assert sum(len(per) for per in news) == len(keys)
        # The owner is unaffected: it completes, answers and checkpoints as usual.
        store.complete_many([(k, 1, k[-6:]) for k in keys[:5000]], namespace=NS)
        again = store.claim_many(keys[:6000], namespace=NS, owner="later")
        assert [c.outcome for c in again[:5000]] == [Outcome.DUPLICATE] * 5000
        assert [c.result for c in again[:5000]] == [k[-6:] for k in keys[:5000]]
        assert all(c.outcome is Outcome.IN_PROGRESS for c in again[5000:])
        assert store.claim("after-the-race", namespace=NS).outcome is Outcome.NEW
        store.checkpoint()
        # Once the owner is idle, a second process is still refused, may open the
        # directory read-only and sees the owner's checkpointed completion.
        with child(str(path), "lockcheck", keys[0].decode()) as c:
            locked = c.next(timeout=120)
            ro = c.next(timeout=120)
        assert locked.startswith("LOCKED") and str(os.getpid()) in locked, locked
        assert ro == f"RO PROCESSED {keys[0][-6:]!r}", ro
        assert store.claim(keys[0], namespace=NS).outcome is Outcome.DUPLICATE
        lock_owner = (path / "LOCK").read_text().strip()
        assert lock_owner == str(os.getpid())  # the refused opens left the lock file alone
    finally:
        store.close()
    with DedupStore.open(path) as store:
        assert all(
            c.outcome is Outcome.DUPLICATE for c in store.claim_many(keys[:5000], namespace=NS)
        )


def test_read_only_inspection_sees_logged_records_of_a_killed_and_of_a_running_owner(
    tmp_path: Path,
) -> None:
    """A second process may open a directory read-only for inspection (docs/architecture.md,
    "The embedded store"). It
    must see what the log holds past the last checkpoint too: the records of a killed
    owner, and those of an owner that is running."""
    path = tmp_path / "data"
    # A killed owner: batches 0-2 checkpointed into LMDB, 3-4 only in the log, 5 held.
    held, token = _held_run(path, batches=5, lease=30.0, manual=3)
    ro = DedupStore.open(path, readonly=True)
    try:
        for b in range(5):
            for key in batch_keys(b)[:10]:
                rec = ro.get(key, namespace=NS)
                assert rec is not None, (b, key)
                assert (rec.state, rec.result) == (State.PROCESSED, result_for(key)), (b, rec)
        rec = ro.get(batch_keys(held)[0], namespace=NS)
        assert rec is not None and (rec.state, rec.token) == (State.PROCESSING, token)
        assert ro.get(batch_keys(held + 1)[0], namespace=NS) is None
        with pytest.raises(DedupError, match="read-only"):
            ro.claim(batch_keys(held + 1)[0], namespace=NS)
    finally:
        ro.close()
    # A running owner (this process) with a completion only in its log; another
    # process inspects it.
    with DedupStore.open(path, checkpoint_records=10**9, checkpoint_interval=1e9) as owner:
        check_acknowledged(owner, list(range(5)))
        c = owner.claim("logged-only", namespace=NS)
        owner.complete("logged-only", c.token, namespace=NS, result=b"x")
        with child(str(path), "lockcheck", "logged-only") as inspector:
            locked = inspector.next(timeout=120)
            seen = inspector.next(timeout=120)
        assert locked.startswith("LOCKED") and str(os.getpid()) in locked, locked
        assert seen == "RO PROCESSED b'x'", seen
        assert owner.claim("logged-only", namespace=NS).result == b"x"
