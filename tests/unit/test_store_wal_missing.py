"""A write-ahead log deleted whole, or missing a segment, is refused at open, never read short.

A child process claims and completes batches of known keys with every automatic
checkpoint and sweep turned off, prints ``ACK <batch>`` after each, and is
SIGKILLed once it says ``DONE``: no checkpoint has run, so every acknowledged
key lives only in the log. The test then deletes ``wal/`` (or one segment) and
the open must raise ``CorruptFileError`` naming what is missing, change nothing,
and, once the files are back, answer every acknowledged key DUPLICATE.

In ``segment`` mode the child starts a checkpoint on a thread and holds it
inside LMDB's commit (the log was rotated to a new segment before it), then
acknowledges more batches: those live only in the newest segment.

Run as a script, this file is that child: ``python test_store_wal_missing.py
DIR BATCHES [segment]``.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import threading
from pathlib import Path

NS = "walmissing/ns"
BATCH = 200


def batch_keys(batch: int) -> list[bytes]:
    return [f"b{batch:04d}-k{i:04d}".encode() for i in range(BATCH)]


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _claim_batches(store: object, batches: range) -> None:
    for b in batches:
        claims = store.claim_many(batch_keys(b), namespace=NS)  # type: ignore[attr-defined]
        assert all(c.outcome.name == "NEW" for c in claims), b
        store.complete_many([(c.key, c.token, b) for c in claims], namespace=NS)  # type: ignore[attr-defined]
        _say(f"ACK {b}")


def child_main(path: str, batches: int, mode: str) -> None:
    from dedupcore.store import DedupStore
    from dedupcore.tiers.lmdb import LmdbTier

    store = DedupStore.open(
        path, checkpoint_records=10**9, checkpoint_interval=1e9, sweep_interval=1e9
    )
    _claim_batches(store, range(batches))
    if mode == "segment":
        inside = threading.Event()

        def held(self: LmdbTier, *args: object, **kwargs: object) -> None:
            inside.set()  # the log was rotated before LMDB's commit: hold it forever
            threading.Event().wait()

        LmdbTier.checkpoint = held  # type: ignore[method-assign,assignment]
        threading.Thread(target=store.checkpoint, daemon=True).start()
        inside.wait()
        _say("ROTATED")
        _claim_batches(store, range(batches, 2 * batches))
    _say("DONE")
    threading.Event().wait()


if __name__ == "__main__":
    child_main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")
    raise SystemExit(0)

# ------------------------------------------------------------------- tests ---

import pytest  # noqa: E402

from dedupcore.errors import CorruptFileError  # noqa: E402
from dedupcore.store import DedupStore, Outcome  # noqa: E402
from dedupcore.tiers.lmdb import LmdbTier  # noqa: E402
from tests.support.procs import LineProcess  # noqa: E402


def _run_child_and_kill(path: Path, batches: int, mode: str = "") -> list[int]:
    """Runs the child until DONE, SIGKILLs it; returns the acknowledged batches."""
    argv = [sys.executable, __file__, str(path), str(batches)] + ([mode] if mode else [])
    acked: list[int] = []
    with LineProcess(argv, name="the child") as child:
        while (line := child.next_line()) != "DONE":
            assert line is not None, f"child ended early: {child.stderr()}"
            if line.startswith("ACK "):
                acked.append(int(line.split()[1]))
        child.sigkill()
    return acked


def _checkpoint_lsn(path: Path) -> int:
    tier = LmdbTier(path / "lmdb", map_size=1 << 26, readonly=True, sync=False)
    try:
        return tier.checkpoint_lsn()
    finally:
        tier.close()


def _fingerprint(path: Path) -> dict[str, str]:
    """Every file of the directory and its content's hash (LMDB's reader table and the
    owner's lock file aside: they record who has it open, not what it holds)."""
    out = {}
    for f in sorted(path.rglob("*")):
        if f.is_file() and f.name not in ("lock.mdb", "LOCK"):
            out[str(f.relative_to(path))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _assert_all_duplicate(path: Path, batches: list[int]) -> None:
    with DedupStore.open(path) as store:
        for b in batches:
            claims = store.claim_many(batch_keys(b), namespace=NS)
            assert {c.outcome for c in claims} == {Outcome.DUPLICATE}, b
            assert {c.result for c in claims} == {b}


def test_deleted_log_with_unchecked_records_refuses_to_open(tmp_path: Path) -> None:
    path = tmp_path / "d"
    acked = _run_child_and_kill(path, 3)
    assert acked == [0, 1, 2]
    assert _checkpoint_lsn(path) == 0  # the premise: every acknowledged key is only in the log
    shutil.move(path / "wal", tmp_path / "wal.saved")
    before = _fingerprint(path)
    for readonly in (False, True):
        with pytest.raises(CorruptFileError, match="missing") as err:
            DedupStore.open(path, readonly=readonly)
        message = str(err.value)
        assert str(path / "wal") in message
        assert "wal-00000000000000000001.log" in message and "LSN 1" in message
    assert _fingerprint(path) == before  # the refused opens changed nothing
    assert not (path / "wal").exists()
    shutil.move(tmp_path / "wal.saved", path / "wal")
    _assert_all_duplicate(path, acked)


@pytest.mark.parametrize("which", ["newest", "oldest"])
def test_log_missing_a_segment_refuses_to_open(tmp_path: Path, which: str) -> None:
    path = tmp_path / "d"
    acked = _run_child_and_kill(path, 2, "segment")
    assert acked == [0, 1, 2, 3]
    assert _checkpoint_lsn(path) == 0
    segments = sorted((path / "wal").glob("wal-*.log"))
    assert len(segments) == 2  # the first batches, and those after the rotation
    gone = segments[-1] if which == "newest" else segments[0]
    first_lsn = int(gone.name[4:24])
    shutil.move(gone, tmp_path / gone.name)
    before = _fingerprint(path)
    with pytest.raises(CorruptFileError) as err:
        DedupStore.open(path)
    message = str(err.value)
    if which == "newest":
        assert gone.name in message and f"from LSN {first_lsn} on are lost" in message
    else:
        assert f"records 1..{int(segments[1].name[4:24]) - 1}" in message
    assert _fingerprint(path) == before
    shutil.move(tmp_path / gone.name, gone)
    _assert_all_duplicate(path, acked)


def test_deleted_log_after_a_clean_close_opens_and_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "d"
    with DedupStore.open(path) as store:
        for i in range(3):
            c = store.claim(f"k{i}", namespace=NS)
            store.complete(f"k{i}", c.token, namespace=NS, result=i)
    ckpt = _checkpoint_lsn(path)
    assert ckpt > 0
    shutil.rmtree(path / "wal")
    with DedupStore.open(path) as store:
        for i in range(3):
            c = store.claim(f"k{i}", namespace=NS)
            assert (c.outcome, c.result) == (Outcome.DUPLICATE, i)
        # The log goes on after the checkpoint: a new key logged now survives a crash
        # (here: a reopen that replays it).
        c = store.claim("after", namespace=NS)
        assert c.outcome is Outcome.NEW
        assert sorted(p.name for p in (path / "wal").glob("wal-*.log")) == [
            f"wal-{ckpt + 1:020d}.log"
        ]
    with DedupStore.open(path) as store:
        assert store.claim("after", namespace=NS).outcome is Outcome.IN_PROGRESS


def test_deleted_log_and_head_file_refuse_to_open(tmp_path: Path) -> None:
    path = tmp_path / "d"
    acked = _run_child_and_kill(path, 1)
    shutil.move(path / "wal", tmp_path / "wal.saved")
    shutil.move(path / "WAL_HEAD", tmp_path / "WAL_HEAD")
    with pytest.raises(CorruptFileError, match=r"WAL_HEAD.*missing"):
        DedupStore.open(path)
    shutil.move(tmp_path / "wal.saved", path / "wal")
    shutil.move(tmp_path / "WAL_HEAD", path / "WAL_HEAD")
    _assert_all_duplicate(path, acked)


def test_damaged_head_file_refuses_to_open(tmp_path: Path) -> None:
    path = tmp_path / "d"
    DedupStore.open(path).close()
    head = bytearray((path / "WAL_HEAD").read_bytes())
    head[17] ^= 0x10
    (path / "WAL_HEAD").write_bytes(bytes(head))
    with pytest.raises(CorruptFileError, match="WAL_HEAD: write-ahead log head checksum"):
        DedupStore.open(path)
