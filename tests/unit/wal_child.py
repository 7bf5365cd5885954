"""Child process of the WAL crash test: appends batches forever, printing each acknowledged LSN.

Usage: python wal_child.py DIR SYNC_MODE SEED

Prints ``ready <last_lsn>`` after opening, then one line per acknowledged
batch: the LSN of its last record, written only after ``append`` returned.
Payloads are derived from their LSN (``payload_for``) so that the parent can
check every replayed record. The parent kills this process with SIGKILL.
"""

from __future__ import annotations

import random
import sys


def payload_for(lsn: int) -> bytes:
    """The payload the crash test stores at ``lsn``: 0..96 bytes, some empty."""
    size = lsn * 2654435761 % 97
    return (lsn.to_bytes(8, "little") * (size // 8 + 1))[:size]


def main() -> None:
    from dedupcore.wal import WriteAheadLog

    path, sync, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    wal = WriteAheadLog.open(path, sync=sync, segment_bytes=4096)  # type: ignore[arg-type]
    nxt = wal.last_lsn + 1
    sys.stdout.write(f"ready {wal.last_lsn}\n")
    sys.stdout.flush()
    while True:
        n = rng.randint(1, 16)
        last = wal.append([payload_for(lsn) for lsn in range(nxt, nxt + n)])
        if last != nxt + n - 1:
            raise SystemExit(f"append returned {last}, expected {nxt + n - 1}")
        sys.stdout.write(f"{last}\n")
        sys.stdout.flush()
        nxt = last + 1
        if rng.random() < 0.02:
            wal.rotate()


if __name__ == "__main__":
    main()
