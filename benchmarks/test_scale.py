"""Scale: claims and completions as the store grows to 100M keys, next to its peers.

Opt-in and slow (never part of the test run; ``benchmarks/`` is not collected
by ``pytest tests``). Run it on a quiet machine::

    DEDUPCORE_BENCH_SCALE_N=100000000 ./dev bench scale -s

(``-s`` shows a row per tenth as it goes). The whole run is one benchmark of
one round; its figures are in ``extra_info["scale"]``, and
``python -m benchmarks.report scale`` prints them and draws the chart
(``--png``; several ``--json`` runs, e.g. a store run and a peers run, are
drawn together):

- dedupcore (embedded, durable): fresh 16-byte random keys through
  ``claim_many`` then ``complete_many`` in batches of 1000, the background
  checkpoints running as they would. Per tenth: claims/s (claim + complete
  of a key counts once; the time is that of the two calls only, not the key
  generation), on-disk bytes per key (LMDB + log + slice filters + front +
  cold, after a checkpoint), anonymous RSS (``RssAnon``, not page cache).
- Redis pipelined ``SET NX PX`` then ``SET XX`` (the complete) and SQLite
  ``INSERT OR IGNORE`` then ``UPDATE`` (WAL, synchronous=FULL), on the same
  kind of keys, up to ``DEDUPCORE_BENCH_SCALE_PEER_N`` keys (they hold every
  key in memory or in one B-tree).
- Open time of the 100M-key store after a clean close, and after a SIGKILL
  in the middle of claims (a child process is killed after its acknowledged
  batches).
- A billion-key history: ``DEDUPCORE_BENCH_SCALE_COLD`` (default 900M) keys
  put into the cold archive through ``ColdArchive.add_many`` (the path a
  dropped slice's keys take), spread over the time slices of one cold
  window, then fresh claims measured again.

``DEDUPCORE_BENCH_SCALE_N`` keys (100_000_000; ``--quick`` 200_000),
``DEDUPCORE_BENCH_SCALE_PEER_N`` peer keys (20_000_000; 50_000; 0: none),
``DEDUPCORE_BENCH_SCALE_COLD`` cold keys (900_000_000; 2_000_000; 0: none),
``DEDUPCORE_BENCH_SCALE_PARTS`` which parts run (``store,cold,peers``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._support import TMP_DIR, env_int, env_str, record

N = env_int("DEDUPCORE_BENCH_SCALE_N", 100_000_000, quick=200_000)
PEER_N = env_int("DEDUPCORE_BENCH_SCALE_PEER_N", 20_000_000, quick=50_000, minimum=0)
COLD = env_int("DEDUPCORE_BENCH_SCALE_COLD", 900_000_000, quick=2_000_000, minimum=0)
BATCH = 1000
#: Which parts run: store (the N-key run and open times), cold, peers.
PARTS = set(os.environ.get("DEDUPCORE_BENCH_SCALE_PARTS", "store,cold,peers").split(","))
COLD_CHUNK = 100_000_000  # hashes per ColdArchive.add_many (each call saves the ring)
NS = "bench/scale"
DIR = Path(TMP_DIR)


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def keys_of(rng: np.random.Generator, n: int) -> list[bytes]:
    raw = rng.bytes(16 * n)
    return [raw[i : i + 16] for i in range(0, 16 * n, 16)]


def run_dedupcore(path: Path, n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    from dedupcore import DedupStore

    rows = []
    step = max(n // 10, BATCH)
    store = DedupStore.open(path)
    spent = 0.0
    done = 0
    perf = time.perf_counter
    try:
        while done < n:
            target = min(done + step, n)
            t_step = 0.0
            while done < target:
                keys = keys_of(rng, BATCH)
                t0 = perf()
                claims = store.claim_many(keys, namespace=NS)
                store.complete_many([(c.key, c.token) for c in claims], namespace=NS)
                t_step += perf() - t0
                done += BATCH
            spent += t_step
            store.checkpoint()
            row = {
                "keys": done,
                "claims_per_s": step / t_step,
                "disk_bytes_per_key": tree_bytes(path) / done,
                "lmdb_bytes_per_key": store.stats()["lmdb"]["disk_bytes"] / done,
                "rss_anon_bytes": rss_anon(),
                "slices": len(store.stats()["lmdb"]["slices"]),
                # Sealed slices the background thread has rewritten in key order so far.
                "compacted": sum(s["compacted"] for s in store.stats()["lmdb"]["slices"]),
            }
            rows.append(row)
            print("dedupcore", json.dumps(row), flush=True)
        # The compaction still pending at the end, finished now: the footprint once
        # the background thread has caught up.
        t0 = perf()
        store.compact()
        rows[-1]["compact_rest_seconds"] = perf() - t0
        rows[-1]["lmdb_bytes_per_key_compacted"] = store.stats()["lmdb"]["disk_bytes"] / done
        print("dedupcore after compaction", json.dumps(rows[-1]), flush=True)
    finally:
        t0 = perf()
        store.close()
        print("close seconds", perf() - t0, flush=True)
    return rows


def run_redis(n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    import redis

    client = redis.Redis.from_url(
        env_str("DEDUPCORE_BENCH_REDIS_URL", "redis://127.0.0.1:6379"), db=15
    )
    client.flushdb()
    rows = []
    step = max(n // 10, BATCH)
    done = 0
    perf = time.perf_counter
    try:
        while done < n:
            t_step = 0.0
            target = min(done + step, n)
            while done < target:
                keys = keys_of(rng, BATCH)
                t0 = perf()
                pipe = client.pipeline(transaction=False)
                for k in keys:
                    pipe.set(k, 1, nx=True, px=86_400_000)
                pipe.execute()
                pipe = client.pipeline(transaction=False)
                for k in keys:
                    pipe.set(k, 2, xx=True, px=86_400_000)
                pipe.execute()
                t_step += perf() - t0
                done += BATCH
            row = {
                "keys": done,
                "claims_per_s": step / t_step,
                "memory_bytes_per_key": client.info("memory")["used_memory"] / done,
            }
            rows.append(row)
            print("redis", json.dumps(row), flush=True)
    finally:
        client.flushdb()
    return rows


def run_sqlite(path: Path, n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE dedup (k BLOB PRIMARY KEY, state INTEGER) WITHOUT ROWID")
    rows = []
    step = max(n // 10, BATCH)
    done = 0
    perf = time.perf_counter
    while done < n:
        t_step = 0.0
        target = min(done + step, n)
        while done < target:
            keys = [(k,) for k in keys_of(rng, BATCH)]
            t0 = perf()
            conn.execute("BEGIN")
            conn.executemany("INSERT OR IGNORE INTO dedup (k, state) VALUES (?, 1)", keys)
            conn.execute("COMMIT")
            conn.execute("BEGIN")
            conn.executemany("UPDATE dedup SET state = 2 WHERE k = ?", keys)
            conn.execute("COMMIT")
            t_step += perf() - t0
            done += BATCH
        row = {
            "keys": done,
            "claims_per_s": step / t_step,
            "disk_bytes_per_key": tree_bytes(path.parent) / done,
        }
        rows.append(row)
        print("sqlite", json.dumps(row), flush=True)
    conn.close()
    return rows


def open_seconds(path: Path) -> float:
    code = (
        "import sys,time; from dedupcore import DedupStore; t=time.perf_counter(); "
        "s=DedupStore.open(sys.argv[1]); print(time.perf_counter()-t); s._closed=True"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def killed_open_seconds(path: Path) -> float:
    """Claims in a child until it has acknowledged 200 batches, SIGKILL, then reopen."""
    code = (
        "import os,sys; from dedupcore import DedupStore; s=DedupStore.open(sys.argv[1]);\n"
        "for i in range(10**9):\n"
        "    s.claim_many([os.urandom(16) for _ in range(1000)], namespace='bench/scale')\n"
        "    if i == 200: print('acked', flush=True)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "acked"
    child.send_signal(signal.SIGKILL)
    child.wait()
    return open_seconds(path)


def fresh_claims(store: Any, rng: np.random.Generator) -> tuple[float, int]:
    """Claims and completes 1000 batches of fresh keys: (claims/s, answers not exact)."""
    spent = 0.0
    inexact = 0
    for _ in range(1000):
        keys = keys_of(rng, BATCH)
        t1 = time.perf_counter()
        claims = store.claim_many(keys, namespace=NS)
        # A fresh key the cold archive holds by its false-positive rate comes
        # back DUPLICATE, exact=False: only the NEW ones are completed.
        store.complete_many(
            [(c.key, c.token) for c in claims if c.outcome.value == "new"], namespace=NS
        )
        spent += time.perf_counter() - t1
        inexact += sum(1 for c in claims if not c.exact)
    return 1000 * BATCH / spent, inexact


def cold_probe_ns(cold: Any, window: float, batches: int = 300) -> float:
    """ns per key of the cold archive's probe alone, for batches of 1000 fresh digests."""
    spent = 0
    for _ in range(batches):
        joined = os.urandom(16 * BATCH)
        t0 = time.perf_counter_ns()
        cold.contains_digests(window, joined)
        spent += time.perf_counter_ns() - t0
    return spent / (batches * BATCH)


@contextlib.contextmanager
def _probes_off(cold: Any) -> Iterator[None]:
    """The archive answers "absent" for every digest without probing (for a comparison
    run only: keys it holds would come back NEW)."""
    cold.contains_digests = lambda window, joined: memoryview(bytearray(len(joined) // 16)).cast(
        "?"
    )
    try:
        yield
    finally:
        del cold.contains_digests


def cold_history(path: Path, n_cold: int, rng: np.random.Generator) -> dict[str, Any]:
    """Fills the cold archive with n_cold keys, then measures fresh claims again.

    The keys are the history of a whole cold window: spread evenly over the
    ring's time slices of the last ``cold_window`` seconds, oldest first, each
    slice started the way a warm-tier drop starts one (``expected`` = what
    that slice receives in all). Fresh claims are measured twice before the
    fill: the first run is the rate the target compares with; the second
    leaves the store as large as the run after the fill finds it. After the
    fill, besides the run the target takes, the archive's probes are timed
    alone (1000-digest batches, as a claim batch asks) and fresh claims run
    once more with the archive answering "absent" without probing: what the
    probes cost inside the claim path, apart from everything else; then once
    more with the probes on (is the first run after the fill the rate that
    stays?).
    """
    from dedupcore import DedupStore

    with DedupStore.open(path) as store:
        cold = store._cold  # the archive a dropped slice's keys go into
        window = store.config.retention.cold_window
        ring = cold.rings[window]
        now = time.time()
        before, _ = fresh_claims(store, rng)  # the same store, its archive empty
        before_fill, _ = fresh_claims(store, rng)  # a million keys more, still empty
        buckets = math.ceil(window / ring.slice_seconds)
        t0 = time.perf_counter()
        for b in range(buckets):
            at = now - window + (b + 0.5) * ring.slice_seconds
            share = n_cold // buckets + (1 if b < n_cold % buckets else 0)
            for i in range(0, share, COLD_CHUNK):
                size = min(COLD_CHUNK, share - i)
                hashes = rng.integers(0, 2**64, size=size, dtype=np.uint64)
                cold.add_many(window, memoryview(hashes), at, expected=share)
                del hashes
            cold.compact()  # what a sweep does next: the slice sealed by this one is rebuilt
        fill = time.perf_counter() - t0
        print("cold fill seconds", fill, flush=True)
        after, inexact = fresh_claims(store, rng)
        probe_ns = cold_probe_ns(cold, window)
        with _probes_off(cold):
            after_unprobed, _ = fresh_claims(store, rng)
        after_again, _ = fresh_claims(store, rng)  # probes on again, a million later
        stats = store.stats()["cold"]
    held = stats[f"{window:g}"]
    return {
        "cold_keys": n_cold,
        "fill_seconds": fill,
        "claims_per_s_before": before,
        "claims_per_s_before_fill": before_fill,
        "claims_per_s": after,
        "claims_per_s_probes_off": after_unprobed,
        "claims_per_s_again": after_again,
        "cold_probe_ns_per_key": probe_ns,
        "fresh_keys_answered_cold": inexact,
        "measured_cold_fpr": inexact / (1000 * BATCH),
        "cold_bytes": held["nbytes"],
        "cold_bytes_per_key": held["nbytes"] / max(1, sum(s["count"] for s in held["slices"])),
        "cold_stats": stats,
    }


def run() -> dict[str, Any]:
    rng = np.random.default_rng(20261201)
    results: dict[str, Any] = {"n": N, "peer_n": PEER_N, "batch": BATCH}
    with tempfile.TemporaryDirectory(dir=DIR, prefix="dedupcore-scale-") as tmp:
        base = Path(tmp)
        if "store" in PARTS:
            results["dedupcore"] = run_dedupcore(base / "store", N, rng)
            results["open_after_close_s"] = open_seconds(base / "store")
            print("open after clean close", results["open_after_close_s"], flush=True)
            results["open_after_sigkill_s"] = killed_open_seconds(base / "store")
            print("open after SIGKILL", results["open_after_sigkill_s"], flush=True)
        if COLD and "cold" in PARTS:
            if "store" not in PARTS:  # a store to claim in: the first tenth of the run
                results["cold_store"] = run_dedupcore(base / "store", max(N // 10, BATCH), rng)
            results["billion"] = cold_history(base / "store", COLD, rng)
            print("cold history", json.dumps(results["billion"])[:400], flush=True)
        if PEER_N and "peers" in PARTS:
            results["redis"] = run_redis(PEER_N, rng)
            (base / "sqlite").mkdir()
            results["sqlite"] = run_sqlite(base / "sqlite" / "dedup.db", PEER_N, rng)
    return results


def test_scale(benchmark: Any) -> None:
    """The whole run as one benchmark of one round (``-s`` to see the rows as they come)."""
    benchmark.group = "scale"
    results = benchmark.pedantic(run, rounds=1, iterations=1)
    record(
        benchmark,
        library="dedupcore",
        operation="scale",
        n_keys=N,
        call="claim_many + complete_many per batch of 1000, durable",
        parts=sorted(PARTS),
        scale=results,
    )
