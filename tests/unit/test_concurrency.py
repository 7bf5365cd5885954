"""Concurrency: shared read-only maps across processes, batch adds and reads across threads."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from dedupcore import BloomFilter


def _keys(prefix: str, start: int, stop: int) -> list[bytes]:
    return [b"%s-%d" % (prefix.encode(), i) for i in range(start, stop)]


def _check_mapped(args: tuple[str, int, int]) -> tuple[int, bytes, bool, int]:
    """Child process: opens the file memory-mapped; returns (missing, probe answers, ro, count)."""
    path, start, stop = args
    bf = BloomFilter.open(path, mmap=True)
    flags = bf.contains_many(_keys("present", start, stop))
    missing = len(flags) - sum(flags)
    missing += sum(1 for k in _keys("present", start, stop)[::97] if k not in bf)
    probes = bytes(bf.contains_many(_keys("probe", 0, 20_000)))
    return missing, probes, bf.readonly, bf.count


def test_processes_share_a_mapped_file(tmp_path: Path) -> None:
    n_keys, n_procs = 200_000, 4
    bf = BloomFilter(n_keys, 0.001)
    bf.add_many(_keys("present", 0, n_keys))
    path = tmp_path / "shared.bloom"
    bf.save(path)
    expected_probes = bytes(bf.contains_many(_keys("probe", 0, 20_000)))
    step = n_keys // n_procs
    jobs = [(str(path), i * step, (i + 1) * step) for i in range(n_procs)]
    jobs.append((str(path), 0, n_keys))  # one child checks everything
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(len(jobs)) as pool:
        results = pool.map(_check_mapped, jobs, chunksize=1)
    for missing, probes, readonly, count in results:
        assert missing == 0
        assert probes == expected_probes
        assert readonly
        assert count == bf.count


@pytest.mark.parametrize("overlap", [False, True])
def test_threads_adding_batches_lose_no_key(overlap: bool) -> None:
    n_threads, per_thread, batch = 4, 40_000, 1_000
    bf = BloomFilter(1_000_000, 0.001)
    new_counts = [0] * n_threads
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def worker(t: int) -> None:
        try:
            # With overlap every thread adds the same keys (in a different batch order).
            base = 0 if overlap else t * per_thread
            starts = list(range(base, base + per_thread, batch))
            if overlap and t % 2:
                starts.reverse()
            barrier.wait()
            for s in starts:
                new_counts[t] += sum(bf.add_many(_keys("k", s, s + batch)))
                bf.add(b"single-%d-%d" % (t, s))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    distinct = per_thread if overlap else n_threads * per_thread
    all_keys = _keys("k", 0, distinct)
    assert all(bf.contains_many(all_keys))
    total_new = sum(new_counts)
    # A new key can only be reported not-new through a false positive.
    assert distinct - max(5, distinct * 0.001) <= total_new <= distinct
    # The bits are a union: the same whatever the interleaving.
    sequential = BloomFilter(1_000_000, 0.001)
    sequential.add_many(all_keys)
    for t in range(n_threads):
        base = 0 if overlap else t * per_thread
        for s in range(base, base + per_thread, batch):
            sequential.add(b"single-%d-%d" % (t, s))
    assert bf == sequential
    singles = n_threads * (per_thread // batch)
    assert bf.count <= distinct + singles
    assert bf.count >= total_new


def test_readers_see_every_published_key_while_a_writer_adds() -> None:
    bf = BloomFilter(500_000, 0.001)
    preloaded = _keys("pre", 0, 50_000)
    bf.add_many(preloaded)
    n_batches, batch = 100, 2_000
    published = [-1]  # index of the last batch whose add_many returned
    stop = threading.Event()
    failures: list[str] = []
    errors: list[BaseException] = []
    rounds = [0, 0]

    def writer() -> None:
        try:
            for i in range(n_batches):
                bf.add_many(_keys("w", i * batch, (i + 1) * batch))
                published[0] = i
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)
        finally:
            stop.set()

    def reader(r: int) -> None:
        try:
            while True:
                done = stop.is_set()
                last = published[0]
                if not all(bf.contains_many(preloaded[r::7])):
                    failures.append("a preloaded key went missing")
                if last >= 0:
                    visible = _keys("w", 0, (last + 1) * batch)[r::5]
                    if not all(bf.contains_many(visible)):
                        failures.append(f"a key of batch <= {last} went missing")
                rounds[r] += 1
                if done:
                    return
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=writer)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert not failures, failures[:3]
    assert all(n >= 1 for n in rounds)
    assert all(bf.contains_many(_keys("w", 0, n_batches * batch)))


def test_threads_union_and_add_do_not_lose_keys(make_keys: Callable[..., list[bytes]]) -> None:
    target = BloomFilter(200_000, 0.001)
    sources = []
    for i in range(4):
        src = BloomFilter(200_000, 0.001)
        src.add_many(make_keys(10_000, f"src{i}"))
        sources.append(src)
    direct = make_keys(20_000, "direct")

    def union_worker(src: BloomFilter) -> None:
        nonlocal target
        for _ in range(3):
            target |= src

    def add_worker() -> None:
        for s in range(0, len(direct), 500):
            target.add_many(direct[s : s + 500])

    threads = [threading.Thread(target=union_worker, args=(s,)) for s in sources]
    threads.append(threading.Thread(target=add_worker))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i in range(4):
        assert all(target.contains_many(make_keys(10_000, f"src{i}")))
    assert all(target.contains_many(direct))


def test_save_and_to_bytes_while_another_thread_adds(tmp_path: Path) -> None:
    # A checkpoint taken while consumers keep adding must be a consistent snapshot: it
    # passes its own checksums and holds every key added before it started. The writer
    # stops at a fixed number of keys: unbounded, it outran the checks, whose key lists
    # grow with what it wrote, until the process ran out of memory on a loaded machine.
    bf = BloomFilter(1_000_000, 0.001)
    stop = threading.Event()
    published = [0]  # keys w-0 .. w-(published-1) are in the filter
    errors: list[BaseException] = []
    most = 600_000

    def writer() -> None:
        try:
            i = 0
            while not stop.is_set() and i < most:
                bf.add_many(_keys("w", i, i + 2_000))
                i += 2_000
                published[0] = i
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    th = threading.Thread(target=writer)
    th.start()
    try:
        for n in range(8):
            before = published[0]
            path = tmp_path / f"snap-{n}.bloom"
            bf.save(path)
            data = bf.to_bytes()
            for snap in (BloomFilter.open(path, mmap=False), BloomFilter.from_bytes(data)):
                assert all(snap.contains_many(_keys("w", 0, before)))
    finally:
        stop.set()
        th.join()
    assert not errors
