"""Memory per open claim: the anonymous memory (``RssAnon``) a process grows by
while it holds N claims that are neither completed nor released, and how much of
it the claim table accounts for (``stats()["memory"]["table_bytes"]``: its slots,
journal and change buffer). The keys are made before the first reading, and the
claims the calls return are dropped, so neither counts. Read once right after the
claims (a background checkpoint may be under way) and once after a checkpoint
made by the benchmark::

    .venv/bin/python -m benchmarks.open_claims --keys 1000000

(docs/performance.md, "100 million keys, and a billion in the cold archive").
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
from pathlib import Path


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    from dedupcore import DedupStore

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1000)
    args = parser.parse_args()
    n, batch = args.keys, args.batch
    keys = [os.urandom(16) for _ in range(n)]
    with tempfile.TemporaryDirectory(prefix="dc-open-") as tmp:
        store = DedupStore.open(tmp)
        try:
            store.claim_many([b"first"], namespace="bench/open")  # the table exists
            gc.collect()
            before, table_before = rss_anon(), store.stats()["memory"]["table_bytes"]
            for i in range(0, n, batch):
                store.claim_many(keys[i : i + batch], namespace="bench/open")
            gc.collect()
            grown = rss_anon() - before
            table = store.stats()["memory"]["table_bytes"] - table_before
            # A checkpoint (whose transaction holds the pages it changes) may be under
            # way in the background: the same after one made here, once it is done.
            store.checkpoint()
            settled = rss_anon() - before
            print(
                f"{n} open claims: RssAnon +{grown / n:.1f} bytes per claim, "
                f"of which the claim table {table / n:.1f}; +{settled / n:.1f} after a "
                "checkpoint"
            )
        finally:
            store.close()


if __name__ == "__main__":
    main()
