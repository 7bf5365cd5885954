"""Faults and bad input of the embedded store: failing log writes (full or read-only disk),
failing checkpoints, LMDB map growth, damaged LMDB, front and cold files, invalid batch
input, and threads mixing claim/complete/release on the same keys.

Damage that could crash the interpreter (a truncated LMDB file is memory-mapped) is
opened in a child process, so that a crash fails the test instead of the test run.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore.config import Retention
from dedupcore.errors import CorruptFileError, DedupError, StaleTokenError
from dedupcore.record import State
from dedupcore.store import DedupStore, Outcome
from dedupcore.tiers.lmdb import LmdbTier
from tests.support.procs import PATIENCE, LineProcess, child_env, load_script

CHILD = Path(__file__).with_name("store_child.py")
store_child = load_script(CHILD)
batch_keys: Callable[[int], list[bytes]] = store_child.batch_keys
result_for: Callable[[bytes], list[object]] = store_child.result_for
CHILD_NS: str = store_child.NS

NS = "faults/ns"
NO_AUTO_CHECKPOINT = {"checkpoint_records": 10**9, "checkpoint_interval": 1e9}


def done_keys(store: DedupStore, keys: list[str], ns: str = NS) -> None:
    """Claims and completes keys, each with the result ``"r:" + key``."""
    claims = store.claim_many(keys, namespace=ns)
    assert all(c.outcome is Outcome.NEW for c in claims)
    store.complete_many([(c.key, c.token, "r:" + str(c.key)) for c in claims], namespace=ns)


def assert_duplicates(store: DedupStore, keys: list[str], ns: str = NS) -> None:
    claims = store.claim_many(keys, namespace=ns)
    wrong = [
        (c.key, c.outcome, c.result)
        for c in claims
        if c.outcome is not Outcome.DUPLICATE or c.result != "r:" + str(c.key)
    ]
    assert not wrong, f"{len(wrong)} of {len(keys)} acknowledged keys lost, e.g. {wrong[:3]}"


def _under(fd: int, directory: Path) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory) + os.sep)
    except OSError:
        return False


def _fail_on(
    monkeypatch: pytest.MonkeyPatch, name: str, directory: Path, err: int
) -> Callable[[], int]:
    """Makes ``os.<name>(fd, ...)`` fail with ``err`` for files under ``directory``.

    Returns a function giving how many calls failed."""
    real = getattr(os, name)
    failed = [0]

    def failing(fd: int, *args: Any) -> Any:
        if _under(fd, directory):
            failed[0] += 1
            raise OSError(err, os.strerror(err))
        return real(fd, *args)

    monkeypatch.setattr(os, name, failing)
    return lambda: failed[0]


# ------------------------------------------------------- failing log writes ---


@pytest.mark.parametrize(
    ("syscall", "err"),
    [("write", errno.ENOSPC), ("fdatasync", errno.EROFS), ("fdatasync", errno.EIO)],
)
def test_failed_log_write_is_an_error_never_an_ack_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, syscall: str, err: int
) -> None:
    path = tmp_path / "data"
    checkpointed = [f"ck-{i}" for i in range(300)]
    logged = [f"log-{i}" for i in range(300)]
    held = [f"held-{i}" for i in range(50)]
    fresh = [f"fresh-{i}" for i in range(20)]
    store = DedupStore.open(path, **NO_AUTO_CHECKPOINT)
    try:
        done_keys(store, checkpointed)
        store.checkpoint()
        done_keys(store, logged)
        held_claims = store.claim_many(held, namespace=NS, owner="w")
        restore = monkeypatch.context()
        with restore as m:
            failures = _fail_on(m, syscall, path / "wal", err)
            with pytest.raises(OSError) as info:
                store.claim_many(fresh, namespace=NS)
            assert info.value.errno == err
            assert failures() >= 1
        # The disk works again, but the store's log tail is unknown: it refuses to
        # acknowledge anything until it is reopened.
        for call in (
            lambda: store.claim_many(fresh, namespace=NS),
            lambda: store.claim("another", namespace=NS),
            lambda: store.complete(held[0], held_claims[0].token, namespace=NS, result=1),
            lambda: store.release(held[1], held_claims[1].token, namespace=NS),
            store.checkpoint,
        ):
            with pytest.raises(DedupError, match="reopen"):
                call()
    finally:
        store.close()
    with DedupStore.open(path) as store:
        assert_duplicates(store, checkpointed + logged)
        again = store.claim_many(held, namespace=NS, owner="other")
        assert all(c.outcome is Outcome.IN_PROGRESS for c in again)
        store.complete_many([(c.key, c.token, "r:" + c.key) for c in held_claims], namespace=NS)
        assert_duplicates(store, held)
        after = store.claim_many(fresh, namespace=NS)
        if syscall == "write":
            assert all(c.outcome is Outcome.NEW and c.token == 1 for c in after)
        else:  # written, not synced: like a commit whose reply was lost
            assert {c.outcome for c in after} <= {Outcome.NEW, Outcome.IN_PROGRESS}


def test_failed_completion_write_keeps_the_acknowledged_claims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "data"
    store = DedupStore.open(path, **NO_AUTO_CHECKPOINT)
    try:
        claims = store.claim_many([f"k{i}" for i in range(100)], namespace=NS, owner="w")
        with monkeypatch.context() as m:
            _fail_on(m, "write", path / "wal", errno.ENOSPC)
            with pytest.raises(OSError, match="No space"):
                store.complete_many([(c.key, c.token, 1) for c in claims], namespace=NS)
    finally:
        store.close()
    with DedupStore.open(path) as store:
        # Claimed (acknowledged) and not completed: still held, by the same owner.
        again = store.claim_many([c.key for c in claims], namespace=NS, owner="w")
        assert all(c.outcome is Outcome.NEW and c.token == 1 and not c.takeover for c in again)
        assert all(
            store.get(c.key, namespace=NS).state is State.PROCESSING  # type: ignore[union-attr]
            for c in claims
        )


# ------------------------------------------------------- failing checkpoints ---


def test_front_filter_save_failing_in_a_checkpoint_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The front filter's files are written during a checkpoint; when that fails (full
    disk), the checkpoint fails, and the records it was about to write must stay
    served and logged until a later checkpoint writes them."""
    path = tmp_path / "data"
    first = [f"first-{i}" for i in range(500)]
    second = [f"second-{i}" for i in range(500)]
    store = DedupStore.open(path, **NO_AUTO_CHECKPOINT)
    try:
        done_keys(store, first)
        with monkeypatch.context() as m:
            failures = _fail_on(m, "fsync", path / "front", errno.ENOSPC)
            with pytest.raises(OSError):
                store.checkpoint()
            assert failures() >= 1
        assert_duplicates(store, first)
        # The disk has room again; the store goes on and checkpoints.
        done_keys(store, second)
        store.checkpoint()
        assert_duplicates(store, first + second)
    finally:
        store.close()
    with DedupStore.open(path) as store:
        assert_duplicates(store, first + second)


@pytest.mark.parametrize("err", [errno.EMFILE, errno.ENOSPC])
def test_log_rotation_failing_in_a_checkpoint_keeps_the_store_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    """Out of file descriptors (or space) for a new log segment: the checkpoint fails, but
    nothing acknowledged is in doubt, so the store goes on acknowledging claims in the
    current segment, and checkpoints once segments can be created again."""
    path = tmp_path / "data"
    first = [f"first-{i}" for i in range(500)]
    during = [f"during-{i}" for i in range(500)]
    after = [f"after-{i}" for i in range(100)]
    store = DedupStore.open(path, **NO_AUTO_CHECKPOINT)
    try:
        done_keys(store, first)
        real_open = os.open
        refused = [0]

        def no_new_segment(file: Any, flags: int, *args: Any, **kw: Any) -> int:
            if str(path / "wal") in str(file):
                refused[0] += 1
                raise OSError(err, os.strerror(err), str(file))
            return real_open(file, flags, *args, **kw)

        with monkeypatch.context() as m:
            m.setattr(os, "open", no_new_segment)
            with pytest.raises(OSError) as info:
                store.checkpoint()
            assert info.value.errno == err and refused[0] >= 1
            assert_duplicates(store, first)  # still served
            done_keys(store, during)  # and new claims are acknowledged
            with pytest.raises(OSError):
                store.checkpoint()
            assert_duplicates(store, first + during)
            # What a crash right now would leave: the log holds every acknowledged key.
            shutil.copytree(path, tmp_path / "crash-image")
        store.checkpoint()  # segments can be created again
        assert store.stats()["checkpoints"] >= 1
        done_keys(store, after)
        assert_duplicates(store, first + during + after)
    finally:
        store.close()
    with DedupStore.open(tmp_path / "crash-image") as image:
        assert_duplicates(image, first + during)
    with DedupStore.open(path) as store:
        assert_duplicates(store, first + during + after)


# ------------------------------------------------------------- LMDB map full ---


def test_tiny_lmdb_map_grows_for_a_50k_record_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "data"
    keys = [f"grow-{i:05d}" for i in range(50_000)]
    with DedupStore.open(path, map_size=65536, **NO_AUTO_CHECKPOINT) as store:
        for i in range(0, len(keys), 5000):
            done_keys(store, keys[i : i + 5000])
        store.checkpoint()  # 50k records into a 64 KiB map: it has to grow
        stats = store.stats()
        assert stats["lmdb"]["records"] == 50_000
        assert stats["lmdb"]["disk_bytes"] > 65536
        assert stats["recent_records"] == 0
        assert_duplicates(store, keys)  # now read from LMDB
    with DedupStore.open(path, map_size=65536, **NO_AUTO_CHECKPOINT) as store:
        assert store.stats()["lmdb"]["records"] == 50_000
        assert_duplicates(store, keys)
        more = [f"more-{i}" for i in range(5000)]
        done_keys(store, more)
        store.checkpoint()
        assert store.stats()["lmdb"]["records"] == 55_000


def test_map_growth_while_other_threads_claim_keys_from_lmdb(tmp_path: Path) -> None:
    """Checkpoints grow the LMDB map while another thread's claims read LMDB: the readers
    must get their answers (run in a child: a broken memory map can crash the process)."""
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path), "mapgrow", "5"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert proc.returncode == 0, f"child died with {proc.returncode}: {proc.stderr[-2000:]}"
    out = proc.stdout.strip().replace("\\n", "\n")
    assert out.startswith("OK"), out


@pytest.mark.parametrize("call", ["disk_bytes", "cover_last_page", "open_db"])
def test_calls_on_the_environment_wait_for_a_map_resize(tmp_path: Path, call: str) -> None:
    """py-lmdb refuses every call on an environment while another thread resizes its
    map (EINVAL: a claim of a new namespace once failed with "mdb_env_stat: Invalid
    argument" while a checkpoint grew the map). Such calls wait for the resize, as
    transactions do: the call started during the resize ends only after it."""
    tier = LmdbTier(tmp_path / "lmdb", map_size=1 << 20, readonly=False, sync=False)
    env = tier._env
    started, resized, done = threading.Event(), threading.Event(), threading.Event()
    failures: list[BaseException] = []
    real = env.lmdb.set_mapsize

    def other_thread() -> None:
        try:
            if call == "disk_bytes":
                assert tier.disk_bytes() > 0
            elif call == "cover_last_page":  # what every write does after its commit
                env._cover_last_page()
            else:
                env.open_db(b"other", create=True)
            assert resized.is_set(), "the call ended before the resize did"
        except BaseException as exc:
            failures.append(exc)
        finally:
            done.set()

    def set_mapsize(size: int) -> None:
        worker = threading.Thread(target=other_thread)
        worker.start()
        started.set()
        # The call waits for the resize; without the wait it would be done by now
        # (or refused by py-lmdb in the middle of the resize).
        assert not done.wait(0.2)
        real(size)
        resized.set()

    env.lmdb = _EnvWith(env.lmdb, set_mapsize)
    env._grow()
    assert started.is_set() and done.wait(PATIENCE)
    assert not failures, failures
    tier.close()


class _EnvWith:
    """An LMDB environment whose ``set_mapsize`` is another function."""

    def __init__(self, env: Any, set_mapsize: Any) -> None:
        self._env = env
        self.set_mapsize = set_mapsize

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


# ---------------------------------------------------------- damaged LMDB file ---


OPEN_AND_CLAIM = """
import sys
from collections import Counter
from dedupcore.store import DedupStore
try:
    store = DedupStore.open(sys.argv[1])
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
else:
    keys = [f"k-{i}" for i in range(int(sys.argv[2]))]
    claims = store.claim_many(keys, namespace=sys.argv[3])
    print("OPENED", dict(Counter(c.outcome.name for c in claims)))
    store.close()
"""


def _open_in_child(path: Path, nkeys: int) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", OPEN_AND_CLAIM, str(path), str(nkeys), NS],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    if proc.returncode < 0:
        return f"KILLED by {signal.Signals(-proc.returncode).name}"
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def lmdb_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A closed store whose 20,000 completed keys are all in LMDB."""
    path = tmp_path_factory.mktemp("lmdb") / "data"
    with DedupStore.open(path) as store:
        for i in range(0, 20_000, 5000):
            done_keys(store, [f"k-{j}" for j in range(i, i + 5000)])
    return path


@pytest.mark.parametrize("damage", ["half", "two-pages", "empty", "garbage", "zeroed-meta"])
def test_damaged_lmdb_file_is_refused_never_an_empty_store(
    lmdb_store: Path, tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "data"
    shutil.copytree(lmdb_store, path)
    assert _open_in_child(path, 20_000) == "OPENED {'DUPLICATE': 20000}"  # the baseline
    data = path / "lmdb" / "data.mdb"
    size = data.stat().st_size
    assert size > 4 * 4096
    if damage == "half":
        os.truncate(data, size // 2)
    elif damage == "two-pages":
        os.truncate(data, 8192)  # both meta pages intact, every B-tree page gone
    elif damage == "empty":
        os.truncate(data, 0)
    elif damage == "garbage":
        data.write_bytes(random.Random(5).randbytes(size))
    else:
        with open(data, "r+b") as f:
            f.write(bytes(8192))
    out = _open_in_child(path, 20_000)
    assert out.startswith("ERROR CorruptFileError"), out


# ------------------------------------------------------- damaged front filter ---


@pytest.fixture(scope="module")
def crashed_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A directory left by a SIGKILLed child: batches 0-2 checkpointed into LMDB, 3-4 only
    in the log, batch 5 claimed (not completed); the front on disk is the checkpoint's."""
    path = tmp_path_factory.mktemp("crashed") / "data"
    args = [str(CHILD), str(path), "0", "--manual-checkpoint", "3", "--hold-after", "5"]
    with LineProcess([sys.executable, *args], name="store_child.py") as child:
        held = child.expect("HELD")
        child.sigkill()
    assert held.startswith("5 "), held
    return path, int(held.split()[1])


def _damage_front(front: Path, damage: str) -> None:
    blooms = sorted(front.glob("*.bloom"))
    assert blooms and (front / "ring.json").exists()
    if damage == "flip-body":
        data = bytearray(blooms[0].read_bytes())
        data[128 + len(data[128:]) // 3] ^= 0x10
        blooms[0].write_bytes(bytes(data))
    elif damage == "flip-header":
        data = bytearray(blooms[0].read_bytes())
        data[40] ^= 0x01
        blooms[0].write_bytes(bytes(data))
    elif damage == "truncated-slice":
        os.truncate(blooms[0], blooms[0].stat().st_size - 64)
    elif damage == "zeroed-slice":
        blooms[0].write_bytes(bytes(blooms[0].stat().st_size))
    elif damage == "missing-slice":
        blooms[0].unlink()
    elif damage == "no-manifest":
        (front / "ring.json").unlink()
    elif damage == "garbage-manifest":
        (front / "ring.json").write_text('{"format": 1, "window": ')
    else:
        shutil.rmtree(front)


@pytest.mark.parametrize(
    "damage",
    [
        "flip-body",
        "flip-header",
        "truncated-slice",
        "zeroed-slice",
        "missing-slice",
        "no-manifest",
        "garbage-manifest",
        "no-front-dir",
    ],
)
def test_damaged_front_filter_is_rebuilt_and_every_key_stays_duplicate(
    crashed_store: tuple[Path, int], tmp_path: Path, damage: str
) -> None:
    source, held_token = crashed_store
    path = tmp_path / "data"
    shutil.copytree(source, path)
    _damage_front(path / "front", damage)
    with DedupStore.open(path) as store:
        for b in range(5):  # LMDB (0-2) and log-only (3-4) keys
            claims = store.claim_many(batch_keys(b), namespace=CHILD_NS)
            assert all(
                c.outcome is Outcome.DUPLICATE and c.result == result_for(c.key) for c in claims
            ), (b, [c for c in claims if c.outcome is not Outcome.DUPLICATE][:3])
        held = store.claim_many(batch_keys(5), namespace=CHILD_NS, owner="someone")
        assert all(c.outcome is Outcome.IN_PROGRESS and c.token == held_token for c in held)
        fresh = store.claim_many(batch_keys(99), namespace=CHILD_NS)
        assert all(c.outcome is Outcome.NEW for c in fresh)
        assert store.stats()["front"]["negative"] > 0  # a working filter, not all-positive
    # The rebuilt front was saved: it opens cleanly next time and still knows every key.
    assert (path / "front" / "ring.json").exists()
    with DedupStore.open(path) as store:
        for b in range(5):
            claims = store.claim_many(batch_keys(b), namespace=CHILD_NS)
            assert all(c.outcome is Outcome.DUPLICATE for c in claims)


# ------------------------------------------------------------ damaged log ---


def _damage_log(wal: Path, damage: str) -> None:
    segs = sorted(wal.glob("wal-*.log"))
    assert segs
    last = segs[-1]
    if damage == "zeroed-segment":
        last.write_bytes(bytes(last.stat().st_size))
    elif damage == "empty-segment":
        os.truncate(last, 0)
    elif damage == "flipped-first-record":
        data = bytearray(last.read_bytes())
        data[32 + 20] ^= 0x40  # inside the payload of the segment's first record
        last.write_bytes(bytes(data))
    elif damage == "zeroed-first-page":
        data = bytearray(last.read_bytes())
        data[32:4096] = bytes(4096 - 32)
        last.write_bytes(bytes(data))
    elif damage == "no-segments":
        for seg in segs:
            seg.unlink()
    else:
        shutil.rmtree(wal)


@pytest.mark.parametrize(
    "damage",
    [
        "zeroed-segment",
        "empty-segment",
        "flipped-first-record",
        "zeroed-first-page",
        "no-segments",
        "no-wal-dir",
    ],
)
def test_damaged_log_is_refused_never_acknowledged_keys_coming_back_new(
    crashed_store: tuple[Path, int], tmp_path: Path, damage: str
) -> None:
    """Batches 3-4 are acknowledged and only in the log. A damaged last segment (or a
    missing log) must stop the store from opening: answering NEW for them would let
    every one of those messages be processed again."""
    source, _held_token = crashed_store
    path = tmp_path / "data"
    shutil.copytree(source, path)
    log_size = sum(f.stat().st_size for f in (path / "wal").glob("wal-*.log"))
    assert log_size > 2 * 500 * 16  # batches 3-5 are in it
    _damage_log(path / "wal", damage)
    before = sorted(
        (str(f.relative_to(path)), f.read_bytes()) for f in path.rglob("wal*") if f.is_file()
    )
    with pytest.raises(CorruptFileError) as info:
        DedupStore.open(path).close()
    assert "wal" in str(info.value)
    after = sorted(
        (str(f.relative_to(path)), f.read_bytes()) for f in path.rglob("wal*") if f.is_file()
    )
    assert after == before  # nothing cut, deleted or created
    assert (path / "wal").exists() == (damage != "no-wal-dir")


# ---------------------------------------------------------- damaged cold slice ---


@pytest.fixture(scope="module")
def cold_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A closed store whose 2000 completed keys were demoted into the cold archive."""
    path = tmp_path_factory.mktemp("cold") / "data"
    policy = Retention(exact_window=100.0, cold_window=1000.0)
    with DedupStore.open(path, retention=policy) as store:
        done_keys(store, [f"c-{i}" for i in range(2000)])
        assert store.sweep(now=time.time() + 200) == 2000
    return path


def _open_cold(path: Path) -> DedupStore:
    return DedupStore.open(path, retention=Retention(exact_window=100.0, cold_window=1000.0))


@pytest.mark.parametrize(
    "damage",
    ["flip-body", "flip-header", "truncated-slice", "missing-slice", "no-manifest", "none"],
)
def test_damaged_cold_slice_is_refused_at_open(
    cold_store: Path, tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "data"
    shutil.copytree(cold_store, path)
    cold_dirs = [d for d in (path / "cold").iterdir() if d.is_dir()]
    assert len(cold_dirs) == 1 and list(cold_dirs[0].glob("*.bloom"))
    if damage == "none":
        with _open_cold(path) as store:
            claims = store.claim_many([f"c-{i}" for i in range(2000)], namespace=NS)
            assert all(c.outcome is Outcome.DUPLICATE and not c.exact for c in claims)
        return
    _damage_front(cold_dirs[0], damage)  # the same ring format as the front
    with pytest.raises(CorruptFileError):
        _open_cold(path).close()


# ------------------------------------------------------------------ bad input ---


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DedupStore]:
    s = DedupStore.open(
        tmp_path / "data", max_key_bytes=16, max_result_bytes=100, durability="power-loss-unsafe"
    )
    yield s
    s.close()


@pytest.mark.parametrize(
    ("keys", "kwargs", "error", "match"),
    [
        ([b"ok", b""], {}, ValueError, "empty"),
        (["ok", "x" * 17], {}, ValueError, "17"),
        (["ok", "é" * 9], {}, ValueError, "18"),  # 9 characters, 18 bytes of UTF-8
        (["ok", "\ud800"], {}, ValueError, "UTF-8"),
        (["ok", 7], {}, TypeError, "int"),
        (["ok", None], {}, TypeError, "NoneType"),
        (["ok", ("t",)], {}, TypeError, "tuple"),
        (["ok"], {"namespace": ""}, ValueError, "empty"),
        (["ok"], {"namespace": "a" * 129}, ValueError, "129"),
        (["ok"], {"namespace": "has space"}, ValueError, "has space"),
        (["ok"], {"namespace": "ünï"}, ValueError, "ASCII"),
        (["ok"], {"namespace": 3}, TypeError, "int"),
        (["ok"], {"lease": 0}, ValueError, "lease"),
        (["ok"], {"lease": -0.5}, ValueError, "lease"),
        (["ok"], {"lease": float("inf")}, ValueError, "lease"),
        (["ok"], {"lease": float("nan")}, ValueError, "lease"),
        (["ok"], {"lease": True}, TypeError, "bool"),
        (["ok"], {"owner": ""}, ValueError, "owner"),
        (["ok"], {"owner": "o" * 256}, ValueError, "256"),
        (["ok", "b"], {"fingerprints": [b"f"]}, ValueError, "1 fingerprints for 2 keys"),
        (["ok"], {"fingerprints": [b""]}, ValueError, "fingerprint"),
        (["ok"], {"fingerprints": ["text"]}, TypeError, "str"),
    ],
)
def test_bad_claim_many_input_claims_nothing(
    store: DedupStore, keys: list, kwargs: dict, error: type, match: str
) -> None:
    args = {"namespace": NS, **kwargs}
    with pytest.raises(error, match=match):
        store.claim_many(keys, **args)
    assert store.get("ok", namespace=NS) is None
    assert store.claim_many(["ok", "x" * 16], namespace=NS)[0].outcome is Outcome.NEW


def test_result_size_limit_is_exact_and_refuses_the_whole_batch(store: DedupStore) -> None:
    claims = store.claim_many(["a", "b", "c"], namespace=NS)
    items = [(c.key, c.token, b"x" * 98) for c in claims]  # 98 bytes: 100 encoded
    items[1] = (claims[1].key, claims[1].token, b"x" * 99)  # 101 encoded: too big
    with pytest.raises(ValueError, match="101 bytes"):
        store.complete_many(items, namespace=NS)
    for bad in ({1, 2}, 2**70, object()):
        with pytest.raises(TypeError, match="msgpack"):
            store.complete_many([(*items[0][:2], bad)], namespace=NS)
    assert all(store.get(k, namespace=NS).state is State.PROCESSING for k in "abc")  # type: ignore[union-attr]
    store.complete_many([items[0], items[2]], namespace=NS)
    assert store.claim("a", namespace=NS).result == b"x" * 98


@pytest.mark.parametrize(
    ("item", "error"),
    [
        (("k", 0), (TypeError, ValueError)),
        (("k", -1), (TypeError, ValueError)),
        (("k", True), TypeError),
        (("k", "1"), TypeError),
        (("k", 1.0), TypeError),
        (("k", None), TypeError),
        (("k",), TypeError),
        (("k", 1, None, None), TypeError),
        ({"k": 1}, TypeError),
        (["k", 1, None, None], TypeError),
        ("k", TypeError),
        ((b"", 1), ValueError),
        (("x" * 17, 1), ValueError),
    ],
)
@pytest.mark.parametrize("method", ["complete_many", "release_many"])
def test_bad_complete_and_release_items_change_nothing(
    store: DedupStore, item: Any, error: Any, method: str
) -> None:
    c = store.claim("ok", namespace=NS)
    with pytest.raises(error):
        getattr(store, method)([("ok", c.token), item], namespace=NS)
    assert store.get("ok", namespace=NS).state is State.PROCESSING  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        getattr(store, method)([("ok", c.token)], namespace="bad namespace!")
    with pytest.raises(TypeError):
        store.release_many([("ok", c.token, b"result")], namespace=NS)
    getattr(store, method)([("ok", c.token)], namespace=NS)


def test_stale_token_in_a_batch_changes_nothing(store: DedupStore) -> None:
    claims = store.claim_many(["a", "b"], namespace=NS)
    with pytest.raises(StaleTokenError):
        store.complete_many([("a", claims[0].token), ("b", claims[1].token + 1)], namespace=NS)
    with pytest.raises(StaleTokenError):
        store.release_many([("a", claims[0].token), ("never", 1)], namespace=NS)
    assert store.get("a", namespace=NS).state is State.PROCESSING  # type: ignore[union-attr]
    store.release_many([("a", claims[0].token), ("b", claims[1].token)], namespace=NS)
    with pytest.raises(StaleTokenError):  # released twice in one batch
        store.release_many([("a", claims[0].token)], namespace=NS)


# ------------------------------------------------------- threads on the same keys ---


def test_threads_mixing_claim_complete_release_on_overlapping_keys(tmp_path: Path) -> None:
    """6 threads claim overlapping keys with short leases (takeovers happen) and complete,
    release, abandon or complete with a stale token. Only StaleTokenError may be raised;
    tokens are never handed out twice; a completed key's record is the one completion
    that succeeded first; the state survives a reopen."""
    path = tmp_path / "data"
    keys = [f"shared-{i}" for i in range(40)]
    granted: dict[tuple[str, int], set[str]] = defaultdict(set)
    completed: dict[str, set[tuple[int, str]]] = defaultdict(set)
    unexpected: list[BaseException] = []
    stale = Counter[str]()
    lock = threading.Lock()
    store = DedupStore.open(path, durability="power-loss-unsafe", checkpoint_records=2000)

    def worker(n: int) -> None:
        rng = random.Random(n)
        me = f"t{n}"
        try:
            for _ in range(250):
                batch = rng.sample(keys, 4)
                claims = store.claim_many(
                    batch, namespace=NS, owner=me, lease=rng.choice([0.002, 0.02, 1.0])
                )
                for c in claims:
                    if c.outcome is not Outcome.NEW:
                        continue
                    with lock:
                        granted[(c.key, c.token)].add(me)
                    action = rng.random()
                    try:
                        if action < 0.45:
                            if rng.random() < 0.3:
                                time.sleep(0.003)  # maybe past the lease
                            store.complete(c.key, c.token, namespace=NS, result=[me, c.token])
                            with lock:
                                completed[c.key].add((c.token, me))
                        elif action < 0.7:
                            store.release(c.key, c.token, namespace=NS)
                        elif action < 0.8:
                            store.complete(c.key, c.token + 1000, namespace=NS, result="forged")
                            raise AssertionError(
                                f"forged token {c.token + 1000} of {c.key} accepted"
                            )
                        # else: abandoned, its lease runs out
                    except StaleTokenError:
                        with lock:
                            stale[me] += 1
        except BaseException as exc:
            unexpected.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not unexpected, repr(unexpected[0])
        owners_per_token = {k: v for k, v in granted.items() if len(v) > 1}
        assert not owners_per_token, f"a token was handed to two owners: {owners_per_token}"
        assert sum(stale.values()) > 0  # the stale path was exercised
        final = {k: store.get(k, namespace=NS) for k in keys}
        for key, rec in final.items():
            tokens = [t for (k, t) in granted if k == key]
            if rec is None:
                assert not tokens
                continue
            assert rec.token == max(tokens), (key, rec, sorted(tokens))
            done = completed.get(key, set())
            if rec.state is State.PROCESSED:
                assert len({t for t, _ in done}) == 1, (key, done)  # one winning token
                ((token, owner),) = done
                assert rec.token == token and rec.result == [owner, token], (key, rec, done)
            else:
                assert not done, (key, rec, done)
    finally:
        store.close()
    with DedupStore.open(path) as again:
        for key, rec in final.items():
            now = again.get(key, namespace=NS)
            if rec is None:
                assert now is None
            else:
                assert now is not None
                assert (now.state, now.token, now.result) == (rec.state, rec.token, rec.result)
