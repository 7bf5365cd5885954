"""The embedded store: :class:`DedupStore` over one data directory.

The embedded authority. It decides the order of the tiers and never speaks
LMDB or the log format itself::

    claim ──> recent records (memory, not yet in LMDB)
          ──> front filter: "definitely new" skips the rest
          ──> LmdbTier: exact records, written in sorted checkpoint batches
          ──> cold archive: demoted keys, DUPLICATE with exact=False

Every change is a full record appended to the write-ahead log under the
store's lock (so the log order is the decision order); the caller then
waits, outside the lock, until the log is durable up to every record its
answer depends on (group commit: concurrent callers share one fdatasync).
Only then is the answer returned, so an acknowledged claim or completion
survives a crash, and no answer is ever based on a record a crash could
still take back.

Lease timeline of one key (tokens grow on every new owner)::

    owner A: claim ─ NEW t=1 ── lease ──┤ (A stalls)
    owner B:             claim ─ IN_PROGRESS      claim ─ NEW t=2 (takeover)
    owner A:                                              complete(t=1) ─ StaleTokenError

The modules, by concern (docs/architecture.md): ``store`` (:class:`DedupStore`:
open and close, claims, the log writes, figures), ``front`` (the front filter's
open, rebuild and what a saved one covers), ``maintenance`` (checkpoints,
sweeps, compaction and their schedule) and ``lockfile`` (the one-owner lock).
"""

from dedupcore.api import Claim, InProgressError, KeyRecord, Outcome
from dedupcore.errors import StoreLockedError
from dedupcore.store.store import DedupStore
from dedupcore.store.store import ReplyColumns as ReplyColumns  # the daemon's reply

__all__ = [
    "Claim",
    "DedupStore",
    "InProgressError",
    "KeyRecord",
    "Outcome",
    "StoreLockedError",
]
