"""The demo's act two: the dedup row and the effect in one SQLite transaction."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dedupcore.cli.demo.broker as broker
from dedupcore.cli.demo.summary import (
    DemoResult,
    _counters,
    _finished,
    _ids,
)

#: Act two's business database: the accounts a message credits.
ACCOUNTS = 16
_BUSINESS_DB, _DEDUP_DB = "business.sqlite", "dedup.sqlite"


def _ledger_entry(key: bytes) -> tuple[int, int]:
    """Act two's effect of a message: ``(account, amount)`` to credit, from its id."""
    n = int(key.rsplit(b"-", 1)[1])
    return n % ACCOUNTS, n % 97 + 1


def _connect(path: Path) -> sqlite3.Connection:
    """A connection to one of act two's SQLite files, as every process opens it.

    The files are in WAL mode (set once when they are made); a writer waits
    up to 60 s for the writer lock. ``synchronous=NORMAL`` does not sync the
    log at each commit: a commit survives the death of its process, which is
    what the demo does, not a power loss.
    """
    conn = sqlite3.connect(path, timeout=60.0)
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


@broker._consumer_process
def _table_consumer(
    partition: int,
    incarnation: int,
    tmp_dir: str,
    shared: Any,
    batch_size: int,
    plan: list[broker.Kill],
    atomic: bool,
) -> None:
    """Act two's consumer of one partition: per message, the dedup row and the effect in
    one transaction (:func:`dedupcore.patterns.table.consume`); the batch is
    acknowledged after its last commit.

    It SIGKILLs itself where ``plan`` says; a kill inside a transaction lands
    on the first NEW message of the batch's second half. With ``atomic``
    False the effect is committed on a database of its own before the dedup
    row (a split transaction, to show what the count then finds).
    """
    from dedupcore.patterns.table import consume

    base, tmp, messages = broker._partition(tmp_dir, partition)
    s = shared
    business = _connect(tmp / _BUSINESS_DB)
    conn = business if atomic else _connect(tmp / _DEDUP_DB)
    consumer = f"consumer-{partition}/{incarnation}"
    while (delivery := broker._deliver(s, base, messages, batch_size)) is not None:
        offset, batch, redelivered = delivery
        broker._kill_point(s, base, plan, offset, broker.BEFORE_CLAIM)
        second_half = len(batch) // 2
        for i, key in enumerate(batch):
            with consume(conn, broker.NAMESPACE, key) as c:
                if c.new:
                    here = i >= second_half
                    if here:
                        broker._kill_point(s, base, plan, offset, broker.AFTER_CLAIM)
                    account, amount = _ledger_entry(key)
                    business.execute(
                        "UPDATE accounts SET balance = balance + ? WHERE id = ?",
                        (amount, account),
                    )
                    if here:
                        broker._kill_point(s, base, plan, offset, broker.MID_EFFECT)
                    business.execute(
                        "INSERT INTO effects (key, account, amount, consumer) VALUES (?, ?, ?, ?)",
                        (key, account, amount, consumer),
                    )
                    if not atomic:
                        business.commit()
                    if here:
                        broker._kill_point(s, base, plan, offset, broker.AFTER_EFFECT)
            # committed: the dedup row with the effect, or (DUPLICATE) nothing
            if c.new:
                s[base + broker._REDELIVERED_NEW] += key in redelivered
            else:
                s[base + broker._DUPLICATE] += 1
                s[base + broker._REDELIVERED_DUPLICATE] += key in redelivered
        broker._kill_point(s, base, plan, offset, broker.AFTER_COMPLETE)
        s[base + broker._COMMITTED] = offset + len(batch)  # the ack


def simulate_transactional(
    *,
    keys: int,
    duplicate_rate: float,
    seed: int,
    consumers: int = 4,
    batch: int | None = None,
    kills: int | None = None,
    atomic: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
) -> DemoResult:
    """Runs act two (the dedup row and the effect in one SQLite transaction; see the module
    docstring) and returns its accounting.

    The stream and the kill plan are :func:`simulate`'s for the same
    arguments. ``atomic=False`` splits the transaction: the effect commits
    in a database of its own before the dedup row, and the effects counted
    twice show it.
    """
    from dedupcore.patterns.table import ensure_table

    run = broker._prepare(keys, duplicate_rate, seed, consumers, batch, kills)
    shared, tmp = broker._stage(run)
    started = time.perf_counter()
    try:
        _make_business_db(tmp / _BUSINESS_DB)
        with contextlib.closing(_connect(tmp / (_BUSINESS_DB if atomic else _DEDUP_DB))) as db:
            db.execute("PRAGMA journal_mode=WAL")
            ensure_table(db)
        kill_counts, crashes = broker._supervise(
            run, tmp, _table_consumer, (atomic,), shared, progress
        )
        result = _account_table(tmp / _BUSINESS_DB, run, shared)
        return _finished(result, run, kill_counts, crashes, started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_business_db(path: Path) -> None:
    """Act two's business tables: account balances, and one row per effect applied.

    ``effects`` has no unique key on purpose: an effect applied twice is two
    rows, for the count to find.
    """
    with contextlib.closing(_connect(path)) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL)")
        db.executemany("INSERT INTO accounts VALUES (?, 0)", [(a,) for a in range(ACCOUNTS)])
        db.execute(
            "CREATE TABLE effects (key BLOB NOT NULL, account INTEGER NOT NULL, "
            "amount INTEGER NOT NULL, consumer TEXT NOT NULL)"
        )
        db.commit()


def _account_table(business: Path, run: broker._Stream, shared: Any) -> DemoResult:
    """Act two: counts the effects per id in the business database and checks the balances.

    With the effect and the dedup row in one transaction nothing explains an
    effect applied twice: every repeat counts as unexplained.
    """
    with contextlib.closing(sqlite3.connect(business)) as db:
        applied: dict[bytes, int] = dict(
            db.execute("SELECT key, count(*) FROM effects GROUP BY key").fetchall()
        )
        balances: dict[int, int] = dict(db.execute("SELECT id, balance FROM accounts").fetchall())
    ids = _ids(run.keys)
    expected = Counter[int]()
    for key in ids:
        account, amount = _ledger_entry(key)
        expected[account] += amount
    return DemoResult(
        unique_messages=run.keys,
        producer_retries=run.retries,
        published=len(run.stream),
        effects_applied=sum(applied.values()),
        effects_twice_window=0,
        effects_twice_unexplained=sum(n - 1 for n in applied.values())
        + sum(n for key, n in applied.items() if key not in ids),
        missing=len(ids - applied.keys()),
        consumers=run.consumers,
        transactional=True,
        balances_wrong=sum(balances.get(a, 0) != expected[a] for a in range(ACCOUNTS)),
        **_counters(shared, run.consumers),
    )
