"""Child process of the store crash tests: claims and completes batches, reporting each ack.

Usage: python store_child.py DIR START [options]   (see ``--help``)

Opens a DedupStore in DIR, prints ``READY``, then for batch numbers START,
START+1, ...: ``claim_many`` the batch's BATCH keys (``batch_keys``),
``complete_many`` them with ``result_for(key)`` and, only after
``complete_many`` returned, prints ``ACK <batch>``. The parent SIGKILLs it.

``--hold-after N`` stops after N acknowledged batches, claims one more batch
without completing it (owner ``child``, lease ``--lease``), prints
``HELD <batch> <token>`` and sleeps until killed.

``--trace-checkpoints`` prints ``CKPT begin`` / ``CKPT committed`` /
``CKPT dropped`` around the LMDB checkpoint and the log truncation that
follows it; ``--stall PHASE`` (``begin`` or ``committed``) also sleeps 30 s
right after printing that phase, so that a kill lands inside the checkpoint.

``--durability power-loss-unsafe`` opens the store without fdatasync (which must
still survive a process crash). ``--manual-checkpoint K`` turns the automatic
checkpoints off and calls ``store.checkpoint()`` after every K acknowledged batches.

``mapgrow`` mode (``DIR mapgrow SECONDS``): a stress of LMDB map growth
during checkpoints while another thread claims keys that are read from LMDB;
prints ``OK <rounds>`` or ``ERROR <traceback>``.

``lockcheck`` mode (``DIR lockcheck``): tries to open DIR for writing (prints
``LOCKED <message>`` or ``OPENED``), then read-only, printing ``RO <state>``
for the key given as third argument, or ``RO-ERROR <message>``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

NS = "crash/test"
BATCH = 500
HOLD_OWNER = "child"


def batch_keys(batch: int) -> list[bytes]:
    """The deterministic keys of one batch."""
    return [f"b{batch:06d}-k{i:04d}".encode() for i in range(BATCH)]


def result_for(key: bytes) -> list[object]:
    """The result a batch's key is completed with (derived from the key)."""
    return [key[::-1], len(key) * 7, key.decode()[-4:]]


def _print(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _trace_checkpoints(stall: str | None) -> None:
    from dedupcore.tiers.lmdb import LmdbTier
    from dedupcore.wal import WriteAheadLog

    real_checkpoint = LmdbTier.checkpoint
    real_drop = WriteAheadLog.drop_through

    def checkpoint(self: LmdbTier, *args: Any, **kwargs: Any) -> None:
        _print("CKPT begin")
        if stall == "begin":
            time.sleep(30)
        real_checkpoint(self, *args, **kwargs)
        _print("CKPT committed")
        if stall == "committed":
            time.sleep(30)

    def drop_through(self: WriteAheadLog, lsn: int) -> int:
        n = real_drop(self, lsn)
        _print("CKPT dropped")
        return n

    LmdbTier.checkpoint = checkpoint  # type: ignore[method-assign]
    WriteAheadLog.drop_through = drop_through  # type: ignore[method-assign]


def run(argv: list[str]) -> None:
    from dedupcore.store import DedupStore

    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("start", type=int)
    p.add_argument("--checkpoint-records", type=int, default=2000)
    p.add_argument("--checkpoint-interval", type=float, default=0.2)
    p.add_argument("--manual-checkpoint", type=int, default=0)
    p.add_argument("--hold-after", type=int, default=-1)
    p.add_argument("--lease", type=float, default=30.0)
    p.add_argument("--trace-checkpoints", action="store_true")
    p.add_argument("--stall", choices=["begin", "committed"])
    p.add_argument("--durability", default="durable")
    args = p.parse_args(argv)
    if args.trace_checkpoints or args.stall:
        _trace_checkpoints(args.stall)
    settings: dict[str, object] = {
        "checkpoint_records": args.checkpoint_records,
        "checkpoint_interval": args.checkpoint_interval,
    }
    if args.manual_checkpoint:
        settings = {"checkpoint_records": 10**9, "checkpoint_interval": 1e9}
    settings["durability"] = args.durability
    store = DedupStore.open(args.path, **settings)  # type: ignore[arg-type]
    _print("READY")
    batch = args.start
    acked = 0
    while True:
        keys = batch_keys(batch)
        if acked == args.hold_after:
            claims = store.claim_many(keys, namespace=NS, owner=HOLD_OWNER, lease=args.lease)
            tokens = {c.token for c in claims}
            if any(c.outcome.name != "NEW" for c in claims) or len(tokens) != 1:
                raise SystemExit(f"held batch {batch} was not all NEW: {claims[:3]}")
            _print(f"HELD {batch} {tokens.pop()}")
            while True:
                time.sleep(60)
        claims = store.claim_many(keys, namespace=NS)
        fresh = [c for c in claims if c.outcome.name == "NEW"]
        if len(fresh) != len(keys):
            raise SystemExit(f"batch {batch}: only {len(fresh)} of {len(keys)} keys were NEW")
        store.complete_many([(c.key, c.token, result_for(c.key)) for c in fresh], namespace=NS)
        _print(f"ACK {batch}")
        acked += 1
        batch += 1
        if args.manual_checkpoint and acked % args.manual_checkpoint == 0:
            store.checkpoint()


def mapgrow(path: str, seconds: float) -> None:
    """LMDB map growth in checkpoints while another thread's claims read LMDB."""
    import threading
    import traceback
    from pathlib import Path

    from dedupcore.store import DedupStore, Outcome

    deadline = time.monotonic() + seconds
    errors: list[str] = []
    rounds = 0
    while time.monotonic() < deadline and not errors:
        rounds += 1
        store = DedupStore.open(
            Path(path) / f"r{rounds}",
            map_size=65536,
            front_slice_capacity=100_000,
            checkpoint_records=10**9,
            checkpoint_interval=1e9,
        )
        base = [f"base-{i}".encode() for i in range(20_000)]
        claims = store.claim_many(base, namespace=NS)
        store.complete_many([(c.key, c.token, 1) for c in claims], namespace=NS)
        store.checkpoint()
        stop = threading.Event()

        def reader(
            s: DedupStore = store, stop: threading.Event = stop, base: list[bytes] = base
        ) -> None:
            while not stop.is_set():
                try:
                    out = s.claim_many(base, namespace=NS)
                except Exception:
                    errors.append(traceback.format_exc())
                    return
                wrong = [c for c in out if c.outcome is not Outcome.DUPLICATE or c.result != 1]
                if wrong:
                    errors.append(f"wrong answers while the map grew: {wrong[:3]}")
                    return

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for b in range(8):
                keys = [f"n{b}-{i}".encode() for i in range(200)]
                claims = store.claim_many(keys, namespace=NS)
                big = b"x" * min(2000 << b, 60_000)
                store.complete_many([(c.key, c.token, big) for c in claims], namespace=NS)
                store.checkpoint()  # LMDB runs out of map space here, and grows
        except Exception:
            errors.append(traceback.format_exc())
        stop.set()
        thread.join()
        store.close()
    if errors:
        _print("ERROR " + errors[0].replace("\n", "\\n"))
    else:
        _print(f"OK {rounds}")


def lockcheck(path: str, key: str) -> None:
    from dedupcore.store import DedupStore, StoreLockedError

    try:
        DedupStore.open(path).close()
        _print("OPENED")
    except StoreLockedError as exc:
        _print("LOCKED " + str(exc).replace("\n", " "))
    try:
        ro = DedupStore.open(path, readonly=True)
        try:
            rec = ro.get(key, namespace=NS)
            _print(f"RO {None if rec is None else rec.state.name} {rec and rec.result!r}")
        finally:
            ro.close()
    except Exception as exc:  # reported to the parent, which fails the test
        _print(f"RO-ERROR {type(exc).__name__}: {exc}".replace("\n", " "))


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[2] == "mapgrow":
        mapgrow(sys.argv[1], float(sys.argv[3]))
    elif len(sys.argv) >= 3 and sys.argv[2] == "lockcheck":
        lockcheck(sys.argv[1], sys.argv[3])
    else:
        run(sys.argv[1:])


if __name__ == "__main__":
    main()
