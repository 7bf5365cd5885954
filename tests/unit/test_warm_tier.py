"""The embedded store's warm tier in time slices (docs/warm-tier.md).

Small slices (a few hundred records) make every path run in a unit test:
roll-over by count and by age, newest version first across slices, a slice
dropped whole past the exact window with its PROCESSED keys in the cold
archive and its in-flight records moved, pages reused, slice filters damaged
or missing and rebuilt, sealed slices compacted (and killed mid-compaction).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import dedupcore.keys as _keys
from dedupcore.config import Retention
from dedupcore.record import State
from dedupcore.store import DedupStore, Outcome

NS = "warm/ns"


def _open(path: Path, **kw: object) -> DedupStore:
    settings: dict[str, object] = {
        "slice_records": 500,
        "checkpoint_records": 10_000_000,
        "checkpoint_interval": 3600.0,
        "sweep_interval": 3600.0,
        "retention": Retention(exact_window=100.0, cold_window=10_000.0),
        "compact_slices": False,  # the compaction tests below run it themselves
    }
    settings.update(kw)
    return DedupStore.open(path, **settings)  # type: ignore[arg-type]


def _fill(store: DedupStore, keys: list[str], *, batch: int = 250) -> None:
    for i in range(0, len(keys), batch):
        part = keys[i : i + batch]
        claims = store.claim_many(part, namespace=NS)
        assert all(c.outcome is Outcome.NEW for c in claims)
        store.complete_many([(c.key, c.token, f"r-{c.key}") for c in claims], namespace=NS)
        store.checkpoint()


def test_slices_roll_over_by_count_and_every_key_stays_exact(tmp_path: Path) -> None:
    keys = [f"k{i}" for i in range(2000)]
    with _open(tmp_path) as store:
        _fill(store, keys)
        slices = store.stats()["lmdb"]["slices"]
        assert len(slices) >= 4
        assert all(s["records"] <= 500 for s in slices)
        assert [s["sealed"] for s in slices][:-1] == [True] * (len(slices) - 1)
    with _open(tmp_path) as store:
        for c in store.claim_many(keys, namespace=NS):
            assert (c.outcome, c.exact, c.result) == (Outcome.DUPLICATE, True, f"r-{c.key}")
        assert store.stats()["lmdb"]["records"] == 2000


def test_slices_grow_with_what_the_tier_holds(tmp_path: Path) -> None:
    """A slice is sealed at slice_records records or a 32nd of all the slices hold,
    whichever is more: past 32 x slice_records, slices grow with the tier."""
    keys = [f"g{i}" for i in range(20_000)]
    with _open(tmp_path, slice_records=200) as store:
        _fill(store, keys, batch=100)
        slices = store.stats()["lmdb"]["slices"]
    sizes = [s["records"] for s in slices]
    assert sum(sizes) == len(keys)
    held = 0
    for size in sizes[:-1]:  # sealed: the next checkpoint's 100 records did not fit
        target = max(200, (held + size) // 32)
        assert target - 100 < size <= target, (held, size)
        held += size
    assert sizes[0] == 200 and max(sizes) > 500
    assert len(sizes) < 100  # 200 records each would have been 100 slices


def test_slices_roll_over_by_age(tmp_path: Path) -> None:
    with _open(tmp_path, slice_seconds=0.05) as store:
        _fill(store, ["a0", "a1"])
        time.sleep(0.1)
        _fill(store, ["b0", "b1"])
        assert len(store.stats()["lmdb"]["slices"]) == 2


def test_the_newest_version_of_a_key_wins_across_slices(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        held = store.claim("held", namespace=NS)
        store.checkpoint()  # PROCESSING, in slice 1
        _fill(store, [f"f{i}" for i in range(1000)])  # slices 1-3 fill up
        store.complete("held", held.token, namespace=NS, result="late")
        store.checkpoint()  # PROCESSED, in a later slice
        assert len(store.stats()["lmdb"]["slices"]) >= 3
    with _open(tmp_path) as store:
        rec = store.get("held", namespace=NS)
        assert rec is not None and (rec.state, rec.result) == (State.PROCESSED, "late")
        assert store.claim("held", namespace=NS).outcome is Outcome.DUPLICATE


def test_one_batch_reads_each_key_from_the_newest_slice_that_holds_it(tmp_path: Path) -> None:
    """A batch whose keys live in different slices, some in two (an old PROCESSING
    version and a newer PROCESSED one): each answer comes from the key's newest
    record, and a key no slice holds is NEW."""
    held = [f"h{i}" for i in range(300)]
    filler = [f"f{i}" for i in range(1000)]
    with _open(tmp_path) as store:
        claims = store.claim_many(held, namespace=NS)
        store.checkpoint()  # PROCESSING, in the first slice
        _fill(store, filler)  # later slices
        store.complete_many([(c.key, c.token, f"done-{c.key}") for c in claims[::2]], namespace=NS)
        store.checkpoint()  # PROCESSED, in the newest slice
        assert len(store.stats()["lmdb"]["slices"]) >= 3
    with _open(tmp_path) as store:
        answers = store.claim_many(held + filler[::7] + ["fresh"], namespace=NS)
        reads = store.stats()["lmdb"]["reads"]
    done = answers[: len(held)][::2]
    open_ = answers[: len(held)][1::2]
    assert [(a.outcome, a.result) for a in done] == [
        (Outcome.DUPLICATE, f"done-{k}") for k in held[::2]
    ]
    assert {a.outcome for a in open_} == {Outcome.IN_PROGRESS}  # loaded in flight at open
    assert [(a.outcome, a.result) for a in answers[len(held) : -1]] == [
        (Outcome.DUPLICATE, f"r-{k}") for k in filler[::7]
    ]
    assert answers[-1].outcome is Outcome.NEW
    assert reads >= 150 + len(filler[::7])


def test_the_front_filter_takes_a_key_when_a_checkpoint_writes_its_record(
    tmp_path: Path,
) -> None:
    """Claims and completions add nothing to the front filter (their records are in
    the table); the checkpoint that writes them to LMDB adds their keys before the
    table lets them go, so every one is still answered from LMDB afterwards."""
    keys = [f"k{i}" for i in range(600)]
    hashes = _keys.front_hashes(_keys.digests(NS.encode(), [k.encode() for k in keys]))
    with _open(tmp_path) as store:
        claims = store.claim_many(keys, namespace=NS)
        assert not any(store._front.contains_many(hashes))
        store.complete_many([(c.key, c.token, f"r-{c.key}") for c in claims], namespace=NS)
        assert not any(store._front.contains_many(hashes))
        assert all(c.outcome is Outcome.DUPLICATE for c in store.claim_many(keys, namespace=NS))
        store.checkpoint()
        assert all(store._front.contains_many(hashes))
        assert store.stats()["recent_records"] == 0  # all of them left the table
        again = store.claim_many(keys, namespace=NS)
        assert [(c.outcome, c.result) for c in again] == [
            (Outcome.DUPLICATE, f"r-{k}") for k in keys
        ]
        assert store.stats()["lmdb"]["reads"] >= 600


def test_a_slice_past_the_window_is_dropped_whole_into_the_cold_archive(tmp_path: Path) -> None:
    old = [f"old{i}" for i in range(1200)]
    with _open(tmp_path) as store:
        _fill(store, old)
        before = store.stats()["lmdb"]
        assert before["records"] == 1200
        demoted = store.sweep(now=time.time() + 200)
        after = store.stats()["lmdb"]
        assert demoted == 1200
        assert after["records"] == 0 and after["slices"] == []
        for c in store.claim_many(old, namespace=NS):
            assert (c.outcome, c.exact) == (Outcome.DUPLICATE, False)
        disk = after["disk_bytes"]
        _fill(store, [f"new{i}" for i in range(1200)])
        # The dropped slices' pages are reused: the file does not grow by another fill.
        assert store.stats()["lmdb"]["disk_bytes"] <= disk + 8 * 4096
    with _open(tmp_path) as store:  # and it all holds after reopening
        assert store.claim("old5", namespace=NS).exact is False
        assert store.claim("new5", namespace=NS).exact is True


def test_slices_dropped_into_one_cold_slice_size_it_for_all_of_them(tmp_path: Path) -> None:
    """The first drop into a cold slice counts the records of every warm slice
    that drops before that cold slice ends, so the cold slice is one filter of
    that size (not the configured guess, grown by doubling)."""
    old = [f"old{i}" for i in range(2000)]
    with _open(tmp_path, cold_slice_capacity=300) as store:
        _fill(store, old)
        store.claim("open", namespace=NS, lease=3600.0)  # in flight: moves, never cold
        store.checkpoint()
        assert len(store.stats()["lmdb"]["slices"]) == 5
        assert store.sweep(now=time.time() + 200) == 2000
        (ring,) = store.stats()["cold"].values()
        (cold,) = ring["slices"]
        assert cold["subfilters"] == 1
        assert 2000 <= cold["capacity"] <= 2000 * 1.05 + 2
        assert cold["count"] == 2000
        assert ring["estimated_fpr"] <= store.config.cold_error_rate
        assert all(not c.exact for c in store.claim_many(old, namespace=NS))


def test_a_sealed_cold_slice_is_rebuilt_as_a_fuse_filter_by_the_sweep(tmp_path: Path) -> None:
    """The sweep that starts a new cold slice rebuilds the one it sealed from its
    key log (docs/warm-tier.md, "Sealed slices become fuse filters"); the keys it
    demoted are still answered, before and after reopening."""
    first = [f"first{i}" for i in range(1200)]
    second = [f"second{i}" for i in range(1200)]
    now = time.time()
    with _open(tmp_path) as store:
        _fill(store, first)
        assert store.sweep(now=now + 200) == 1200
        _fill(store, second)
        # 1300 s later: the next cold slice (cold_window / 8 = 1250 s).
        assert store.sweep(now=now + 1500) == 1200
        (ring,) = store.stats()["cold"].values()
        assert [s["kind"] for s in ring["slices"]] == ["fuse", "bloom"]
        assert [s["count"] for s in ring["slices"]] == [1200, 1200]
        for c in store.claim_many(first + second, namespace=NS):
            assert (c.outcome, c.exact) == (Outcome.DUPLICATE, False)
    (cold_dir,) = [d for d in (tmp_path / "cold").iterdir() if d.is_dir()]
    names = sorted(p.name for p in cold_dir.iterdir())
    assert [n for n in names if n.endswith(".fuse")] and len(
        [n for n in names if n.endswith(".keys")]
    ) == 1  # only the open slice keeps its log
    with _open(tmp_path) as store:
        for c in store.claim_many(first + second, namespace=NS):
            assert (c.outcome, c.exact) == (Outcome.DUPLICATE, False)


def test_a_recent_slice_is_kept_and_an_old_one_goes(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        _fill(store, [f"a{i}" for i in range(600)])
        cut = time.time()
        time.sleep(0.05)
        _fill(store, [f"b{i}" for i in range(600)])
        # 100 s after the first fill, before 100 s after the second: only the
        # slices whose newest record predates the cut go.
        store.sweep(now=cut + 100.01)
        left = store.stats()["lmdb"]["slices"]
        assert left and all(s["first"] >= cut - 1 for s in left)
        assert all(c.exact for c in store.claim_many([f"b{i}" for i in range(600)], namespace=NS))


def test_an_in_flight_record_in_a_dropped_slice_moves_to_the_newest(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        held = store.claim("held", namespace=NS, lease=3600.0)
        store.checkpoint()
        _fill(store, [f"f{i}" for i in range(600)])
        store.sweep(now=time.time() + 200)
        assert store.stats()["lmdb"]["records"] == 1  # only the in-flight record is left
    # Reopened (its lease restarts): still held, and completing it works.
    with _open(tmp_path) as store:
        assert store.claim("held", namespace=NS).outcome is Outcome.IN_PROGRESS
        store.complete("held", held.token, namespace=NS)
        assert store.claim("held", namespace=NS).outcome is Outcome.DUPLICATE


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_a_sealed_slice_filter_that_is_missing_or_damaged_is_rebuilt(
    tmp_path: Path, damage: str
) -> None:
    keys = [f"k{i}" for i in range(1200)]
    with _open(tmp_path) as store:
        _fill(store, keys)
    files = sorted((tmp_path / "slices").glob("*.bloom"))
    assert files
    for f in files:
        if damage == "missing":
            f.unlink()
        else:
            f.write_bytes(b"\x00" * 200)
    with _open(tmp_path) as store:
        assert {c.outcome for c in store.claim_many(keys, namespace=NS)} == {Outcome.DUPLICATE}
    assert sorted((tmp_path / "slices").glob("*.bloom")) == files  # saved again


def test_a_read_only_open_builds_missing_filters_in_memory_and_leaves_the_files(
    tmp_path: Path,
) -> None:
    """A read-only store neither writes a rebuilt sealed filter nor takes away the
    open slice's saved one: the directory is as it was, and every record is found."""
    keys = [f"k{i}" for i in range(1200)]  # slices 1 and 2 sealed (500 each), 3 open (200)
    with _open(tmp_path) as store:
        _fill(store, keys)
    sealed = sorted((tmp_path / "slices").glob("0000000[12].bloom"))
    assert len(sealed) == 2
    sealed[0].unlink()
    sealed[1].write_bytes(b"\x00" * 200)
    assert len(_saved_open_filters(tmp_path)) == 1
    before = {f.name: f.read_bytes() for f in (tmp_path / "slices").iterdir()}
    with _open(tmp_path, readonly=True) as ro:
        assert all(ro.get(k, namespace=NS) is not None for k in keys)
    assert {f.name: f.read_bytes() for f in (tmp_path / "slices").iterdir()} == before
    with _open(tmp_path) as store:  # writable: the sealed ones are saved again
        assert {c.outcome for c in store.claim_many(keys, namespace=NS)} == {Outcome.DUPLICATE}
    assert sorted((tmp_path / "slices").glob("0000000[12].bloom")) == sealed


_CRASHING_CHILD = """
import os, sys
sys.path[:0] = [{repo!r}, {here!r}]
from test_warm_tier import _fill, _open  # this module, by its directory
store = _open(__import__("pathlib").Path({path!r}))
_fill(store, [f"k{{i}}" for i in range({n})])
sys.stdout.write(open(os.path.join({path!r}, "front", "covers_lsn")).read())
sys.stdout.flush()
os._exit(0)  # no close: the front stays as the last slice change left it
"""


def test_a_front_saved_once_per_slice_catches_up_from_the_newer_slices_after_a_crash(
    tmp_path: Path,
) -> None:
    """Checkpoints save the front only when a new slice is open; a process that dies
    after checkpoints without a front save leaves the front behind LMDB, and the next
    open adds the keys of the slices from the one the front names: every key is
    DUPLICATE (none "definitely new" from a stale front)."""
    import subprocess
    import sys

    repo = str(Path(__file__).resolve().parents[2])
    here = str(Path(__file__).resolve().parent)
    n = 1650  # 7 checkpoints of 250 into slices of 500: the last ones save no front
    code = _CRASHING_CHILD.format(repo=repo, here=here, path=str(tmp_path), n=n)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    covers_lsn, covers_slice = (int(x) for x in out.stdout.split())
    keys = [f"k{i}" for i in range(n)]
    with _open(tmp_path) as store:
        assert covers_lsn < store._lmdb.checkpoint_lsn(), "the front was saved at every checkpoint"
        assert 1 <= covers_slice <= store._lmdb.newest_slice_id
        for c in store.claim_many(keys, namespace=NS):
            assert (c.outcome, c.exact) == (Outcome.DUPLICATE, True)


# -- compaction (docs/warm-tier.md, "Compaction") ------------------------------


def _names_in(env: Any) -> set[bytes]:
    """The named databases of an LMDB environment (the keys of its main database)."""
    with env.begin() as txn:
        return {bytes(k) for k in txn.cursor().iternext(keys=True, values=False)}


def _db_names(path: Path) -> set[bytes]:
    """The named databases of a closed store's LMDB environment."""
    import lmdb

    env = lmdb.open(str(path / "lmdb"), readonly=True, lock=False, max_dbs=8)
    try:
        return _names_in(env)
    finally:
        env.close()


def _db_names_open(store: DedupStore) -> set[bytes]:
    return _names_in(store._lmdb.env)


def _leaf_pages(store: DedupStore) -> dict[int, int]:
    tier = store._lmdb
    with tier.env.begin() as txn:
        return {s.id: int(txn.stat(s.db)["leaf_pages"]) for s in tier._slices if s.sealed}


def _answers(store: DedupStore, keys: list[str]) -> list[tuple[object, ...]]:
    return [(c.key, c.outcome, c.exact, c.result) for c in store.claim_many(keys, namespace=NS)]


def test_compaction_rewrites_sealed_slices_in_key_order_and_every_key_answers_alike(
    tmp_path: Path,
) -> None:
    keys = [f"k{i}" for i in range(4000)]
    with _open(tmp_path, slice_records=2000) as store:
        held = store.claim("held", namespace=NS)
        store.checkpoint()  # PROCESSING, in slice 1
        _fill(store, keys, batch=100)  # slices of 2000 records, each written in 20 pieces
        store.complete("held", held.token, namespace=NS, result="late")
        store.checkpoint()  # PROCESSED, in a newer slice: the newest version wins
        before = _leaf_pages(store)
        assert len(before) >= 2
        assert store._lmdb.format == b"3"  # a new environment starts at the current format
        copied = store.compact()
        assert copied == sum(s["records"] for s in store.stats()["lmdb"]["slices"][:-1])
        slices = store.stats()["lmdb"]["slices"]
        assert [s["compacted"] for s in slices] == [True] * (len(slices) - 1) + [False]
        after = _leaf_pages(store)
        # Appended in key order: every leaf page but the last full (a 4 KiB page
        # holds 4080 bytes of nodes: 8-byte header, key and value, 2-byte
        # pointer), where full means the next node did not fit: more than
        # 4080 - (largest node) bytes. Values vary in length (varints), so the
        # bound takes the largest node of the slice.
        for sid in before:
            sizes = [10 + len(d) + len(v) + len(v) % 2 for d, v in store._lmdb.scan_slice(sid)]
            full = 4080 - max(sizes) + 1
            assert after[sid] <= sum(sizes) // full + 1 < before[sid], (sid, before, after)
        assert store.compact() == 0 and not store._lmdb.compaction_pending()
        want = [(k, Outcome.DUPLICATE, True, f"r-{k}") for k in keys]
        assert _answers(store, keys) == want
        rec = store.get("held", namespace=NS)
        assert rec is not None and (rec.state, rec.result) == (State.PROCESSED, "late")
    names = _db_names(tmp_path)
    assert not {n for n in names if n.startswith(b"s:")} - {b"s:%08d" % slices[-1]["id"]}
    with _open(tmp_path, slice_records=2000) as store:  # reopened: the copies are the slices
        assert _answers(store, keys) == want
        assert store.stats()["lmdb"]["records"] == 4002  # "held" is in two slices


def test_a_format_2_directory_opens_as_it_is_and_goes_to_format_3_when_compacted(
    tmp_path: Path,
) -> None:
    import lmdb

    keys = [f"k{i}" for i in range(1200)]
    with _open(tmp_path) as store:
        _fill(store, keys)
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"2", db=env.open_db(b"meta", txn=txn))
    env.close()
    with _open(tmp_path) as store:
        assert store._lmdb.format == b"2"
        assert _answers(store, keys[:50]) == [
            (k, Outcome.DUPLICATE, True, f"r-{k}") for k in keys[:50]
        ]
        store.compact()
        assert store._lmdb.format == b"3"
    with _open(tmp_path) as store:
        assert store._lmdb.format == b"3"
        assert {c.outcome for c in store.claim_many(keys, namespace=NS)} == {Outcome.DUPLICATE}


_COMPACTING_CHILD = """
import os, signal, sys
sys.path[:0] = [{repo!r}, {here!r}]
from pathlib import Path
from test_warm_tier import _fill, _open  # this module, by its directory
store = _open(Path({path!r}), slice_records=2000)
_fill(store, [f"k{{i}}" for i in range(5000)], batch=500)
if {between_switch_and_drop!r}:
    tier = store._lmdb
    write = tier._write
    def dying_write(apply):
        if apply.__name__ == "drop":  # the copy has taken the slice's place: die now
            os.kill(os.getpid(), signal.SIGKILL)
        write(apply)
    tier._write = dying_write
    store.compact()
else:
    store.compact(max_records={partial})
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("between_switch_and_drop", [False, True])
def test_a_compaction_killed_midway_resumes_and_loses_nothing(
    tmp_path: Path, between_switch_and_drop: bool
) -> None:
    """SIGKILL after 2500 of the sealed slices' 4000 records were copied (slice 1
    compacted, slice 2 half copied), or after the first copy took its slice's place
    but before the old tree was dropped: the next open answers every key from the
    slices as they were, drops a leftover old tree, and compaction resumes after
    the last key copied."""
    import subprocess
    import sys

    repo = str(Path(__file__).resolve().parents[2])
    here = str(Path(__file__).resolve().parent)
    code = _COMPACTING_CHILD.format(
        repo=repo,
        here=here,
        path=str(tmp_path),
        partial=2500,
        between_switch_and_drop=between_switch_and_drop,
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    names = _db_names(tmp_path)
    if between_switch_and_drop:
        assert {b"k:00000001", b"s:00000001"} <= names  # the copy and the tree it replaced
    else:
        assert {b"k:00000002", b"s:00000002"} <= names and b"s:00000001" not in names
    keys = [f"k{i}" for i in range(5000)]
    want = [(k, Outcome.DUPLICATE, True, f"r-{k}") for k in keys]
    with _open(tmp_path, slice_records=2000) as store:
        assert b"s:00000001" not in _db_names_open(store)
        assert _answers(store, keys) == want
        slices = store.stats()["lmdb"]["slices"]
        assert slices[0]["compacted"] is True
        # What is left: all of slice 2, or the 1500 records of it not yet copied.
        assert store.compact() == (2000 if between_switch_and_drop else 1500)
        assert [s["compacted"] for s in store.stats()["lmdb"]["slices"]][:2] == [True, True]
        assert _answers(store, keys) == want
    names = _db_names(tmp_path)
    assert not {b"s:00000001", b"s:00000002"} & names


def test_a_slice_dropped_while_its_copy_is_under_way_takes_the_copy_with_it(
    tmp_path: Path,
) -> None:
    old = [f"old{i}" for i in range(1200)]
    with _open(tmp_path) as store:
        _fill(store, old)
        store.compact(max_records=100)  # slice 1 a fifth copied
        assert b"k:00000001" in _db_names_open(store)
        store.sweep(now=time.time() + 200)
        assert not {n for n in _db_names_open(store) if n[:2] in (b"s:", b"k:")}
        for c in store.claim_many(old, namespace=NS):
            assert (c.outcome, c.exact) == (Outcome.DUPLICATE, False)


def test_the_background_thread_compacts_sealed_slices_while_claims_go_on(
    tmp_path: Path,
) -> None:
    keys = [f"k{i}" for i in range(3000)]
    with _open(tmp_path, compact_slices=True) as store:
        _fill(store, keys)
        deadline = time.monotonic() + 60.0
        while store._lmdb.compaction_pending():
            # Claims (all DUPLICATE) read the slices while the copies are made.
            assert {c.outcome for c in store.claim_many(keys[:500], namespace=NS)} == {
                Outcome.DUPLICATE
            }
            assert time.monotonic() < deadline, "the background thread compacted nothing"
            time.sleep(0.05)
        slices = store.stats()["lmdb"]["slices"]
        assert all(s["compacted"] for s in slices if s["sealed"]) and len(slices) >= 5
        assert _answers(store, keys) == [(k, Outcome.DUPLICATE, True, f"r-{k}") for k in keys]


# -- the open slice's filter across a clean close ------------------------------


def _saved_open_filters(path: Path) -> list[Path]:
    return sorted((path / "slices").glob("*.open-*.bloom"))


def test_a_clean_close_saves_the_open_slice_filter_and_the_next_open_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dedupcore.tiers.slice_filters import SliceFilters

    keys = [f"k{i}" for i in range(700)]  # slice 1 sealed (500), slice 2 open (200)
    with _open(tmp_path) as store:
        _fill(store, keys, batch=100)
    (saved,) = _saved_open_filters(tmp_path)
    assert saved.name.startswith("00000002.open-") and saved.name.endswith("-200.bloom")
    built: list[int] = []
    real = SliceFilters.build
    monkeypatch.setattr(
        SliceFilters,
        "build",
        lambda self, digests, cap: built.append(cap) or real(self, digests, cap),
    )
    with _open(tmp_path) as store:
        assert built == []  # no slice read key by key
        assert _saved_open_filters(tmp_path) == []  # taken into memory: saved again at close
        assert _answers(store, keys) == [(k, Outcome.DUPLICATE, True, f"r-{k}") for k in keys]
        _fill(store, ["late"])  # the open slice keeps taking keys into that filter
    with _open(tmp_path) as store:
        assert built == []
        assert store.claim("late", namespace=NS).outcome is Outcome.DUPLICATE


@pytest.mark.parametrize("damage", ["stale", "garbage"])
def test_a_saved_open_slice_filter_that_does_not_cover_the_slice_is_not_used(
    tmp_path: Path, damage: str
) -> None:
    """A filter saved at an earlier close (put back after later checkpoints), or a
    damaged one under the right name: the slice's filter is rebuilt from its keys,
    and every key written since is still found."""
    first = [f"a{i}" for i in range(600)]
    later = [f"b{i}" for i in range(150)]
    with _open(tmp_path) as store:
        _fill(store, first, batch=100)
    (old,) = _saved_open_filters(tmp_path)
    kept = old.read_bytes()
    with _open(tmp_path) as store:
        _fill(store, later, batch=50)  # into the same open slice (100 + 150 records)
    (new,) = _saved_open_filters(tmp_path)
    assert new.name != old.name
    if damage == "stale":
        new.unlink()
        old.write_bytes(kept)
    else:
        new.write_bytes(b"\x00" * len(new.read_bytes()))
    with _open(tmp_path) as store:
        want = [(k, Outcome.DUPLICATE, True, f"r-{k}") for k in first + later]
        assert _answers(store, first + later) == want


def test_a_close_that_cannot_save_the_open_slice_filter_still_closes_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dedupcore.bloom import BloomFilter

    keys = [f"k{i}" for i in range(700)]
    store = _open(tmp_path)
    _fill(store, keys, batch=100)
    save = BloomFilter.save

    def full_disk(self: BloomFilter, path: Path) -> None:
        if ".open-" in Path(path).name:  # the disk fills up just then
            raise OSError(28, "No space left on device")
        save(self, path)

    monkeypatch.setattr(BloomFilter, "save", full_disk)
    store.close()  # no exception: the filter is only a faster next open
    assert "could not save the open slice's filter" in caplog.text
    monkeypatch.undo()
    assert _saved_open_filters(tmp_path) == []
    with _open(tmp_path) as store:
        assert _answers(store, keys) == [(k, Outcome.DUPLICATE, True, f"r-{k}") for k in keys]


# ---------------------------------------------------- memory after a checkpoint ---


def test_a_large_checkpoint_gives_lmdb_s_pages_back_and_every_key_still_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMDB keeps every page a write transaction changed until its environment
    closes: a checkpoint of many records is followed by a close and reopen of the
    environment (docs/warm-tier.md, "Memory after a checkpoint"). The slices, the
    in-flight index and the metadata are read and written through the new handles."""
    import dedupcore.store.maintenance as maintenance
    from dedupcore.tiers.lmdb import LmdbTier

    monkeypatch.setattr(maintenance, "_RELEASE_PAGES_RECORDS", 400)
    releases: list[int] = []
    real = LmdbTier.release_pages

    def counted(self: LmdbTier) -> None:
        releases.append(len(self.slice_infos()))
        real(self)

    monkeypatch.setattr(LmdbTier, "release_pages", counted)
    keys = [f"k{i}" for i in range(2000)]
    with _open(tmp_path) as store:
        _fill(store, keys[:300])  # checkpoints of 300 records: below the threshold
        assert releases == []
        assert store.stats()["lmdb"]["reopens"] == 0
        _fill(store, keys[300:], batch=500)  # 500, 500, 500 and 200 records
        assert len(releases) == 3 and releases[-1] >= 3  # several slices reopened
        assert store.stats()["lmdb"]["reopens"] == 3
        open_claims = store.claim_many(["open-1", "open-2"], namespace=NS)
        store.checkpoint()  # the in-flight index, through its new handle
        for c in store.claim_many(keys, namespace=NS):
            assert (c.outcome, c.result) == (Outcome.DUPLICATE, f"r-{c.key}")
    with _open(tmp_path) as store:
        assert store.stats()["lmdb"]["records"] == 2002
        assert store._lmdb.inflight_digests() == b"".join(
            sorted(_keys.digest(NS.encode(), c.key.encode()) for c in open_claims)
        )
        for c in store.claim_many(keys, namespace=NS):
            assert (c.outcome, c.result) == (Outcome.DUPLICATE, f"r-{c.key}")


def test_a_release_waits_for_the_transactions_under_way_and_they_for_it(tmp_path: Path) -> None:
    import threading

    from dedupcore.tiers.lmdb import LmdbTier

    with _open(tmp_path) as store:
        _fill(store, [f"k{i}" for i in range(100)])
        tier: LmdbTier = store._lmdb
        release_done = threading.Event()
        failures: list[BaseException] = []

        def release() -> None:
            try:
                tier.release_pages()
            except BaseException as exc:
                failures.append(exc)
            finally:
                release_done.set()

        with tier._env.txn() as txn:  # a read under way (the event loop's, say)
            worker = threading.Thread(target=release)
            worker.start()
            # The release waits for the read: the environment is not closed under it.
            assert not release_done.wait(0.2)
            assert txn.stat(tier.meta)["entries"] > 0
        assert release_done.wait(60.0)
        worker.join()
        assert not failures, failures
        # Every read of the tier goes through the databases opened again.
        assert tier.record_count() == 100
        assert tier.checkpoint_lsn() > 0
        assert tier.namespaces() == {NS.encode(): store._ns_id(NS.encode())}
        assert tier.inflight_digests() == b""
        assert len(list(tier.iter_records())) == 100
        assert sum(len(d) for d in tier._slice_digests(tier.slice_infos()[-1])) % 16 == 0


def test_a_read_only_tier_releases_nothing(tmp_path: Path) -> None:
    from dedupcore.tiers.lmdb import LmdbTier

    with _open(tmp_path) as store:
        _fill(store, [f"k{i}" for i in range(10)])
        lmdb_path = store._lmdb.path
    tier = LmdbTier(lmdb_path, map_size=1 << 24, readonly=True, sync=False)
    try:
        env = tier.env
        tier.release_pages()
        assert tier.env is env and tier.record_count() == 10
    finally:
        tier.close()


def test_an_environment_that_cannot_be_opened_again_stops_the_store_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lmdb

    import dedupcore.store.maintenance as maintenance
    import dedupcore.tiers.lmdb as lmdb_tier
    from dedupcore.errors import DedupError

    monkeypatch.setattr(maintenance, "_RELEASE_PAGES_RECORDS", 1)
    keys = [f"k{i}" for i in range(50)]
    store = _open(tmp_path)
    _fill(store, keys[:25])
    claims = store.claim_many(keys[25:], namespace=NS)
    store.complete_many([(c.key, c.token, f"r-{c.key}") for c in claims], namespace=NS)

    def refused(*args: object, **kwargs: object) -> object:
        raise lmdb.Error("Too many open files")  # what an exhausted process would get

    monkeypatch.setattr(lmdb_tier.lmdb, "open", refused)
    with pytest.raises(DedupError, match="could not be opened again") as caught:
        store.checkpoint()
    assert isinstance(caught.value.__cause__, lmdb.Error)
    with pytest.raises(DedupError, match="stopped"):
        store.claim("k0", namespace=NS)
    store.close()
    monkeypatch.undo()
    with _open(tmp_path) as store:
        for c in store.claim_many(keys, namespace=NS):
            assert (c.outcome, c.result) == (Outcome.DUPLICATE, f"r-{c.key}")
