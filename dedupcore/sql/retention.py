"""Retention of a SQL store: bounded deletes driven by ``updated``, or whole partitions dropped.

An unpartitioned table is kept by :func:`purge`: per namespace policy, one
short transaction turns claims abandoned longer than the exact window into
tombstones (their token keeps growing for one more window, as the embedded
store's sweep does), then deletes PROCESSED rows and tombstones whose last
change is older than the window, at most ``limit`` of each, on the
server's clock (the ``updated`` index). A partitioned table is kept by
:func:`drop_partitions` (docs/sql-partitions.md): the horizon moves past
the old partitions, their PROCESSED keys go to the hook, and each is
dropped whole.

Both take ``before_delete(namespace, keys)``, the demotion hook a stack
gives to copy PROCESSED keys into its cold archive before they are gone
(the copy must be idempotent: a retried transaction or a failed drop passes
the same keys again). Tombstones are never passed: their work was never
done, so a cold archive must not answer them DUPLICATE.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from dedupcore.sql.dialects import Dialect
from dedupcore.sql.dialects.base import PROCESSED, PROCESSING, RELEASED
from dedupcore.sql.partitions import Partitions
from dedupcore.sql.transactions import Transactions

__all__ = ["BeforeDelete", "check_purge", "drop_partitions", "purge"]

#: ``before_delete(namespace, keys)`` of :func:`purge` and :func:`drop_partitions`.
BeforeDelete = Callable[[str, list[bytes]], None]


def check_purge(limit: object, before_delete: object) -> None:
    """ValueError or TypeError for a bad ``limit`` or ``before_delete``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= 1_000_000:
        raise ValueError(f"limit must be an int in 1..1000000, got {limit!r}")
    if before_delete is not None and not callable(before_delete):
        raise TypeError("before_delete must be callable(namespace, keys)")


def purge(
    tx: Transactions,
    table: str,
    policies: list[tuple[str | None, float]],
    limit: int,
    before_delete: BeforeDelete | None,
) -> int:
    """Applies each ``(namespace, exact_window)`` policy once; returns the rows deleted.

    The namespace None is every namespace without a policy of its own.
    """
    d = tx.dialect
    skip = sorted(ns for ns, _ in policies if ns is not None)
    deleted = 0
    for ns, window in policies:

        def body(cur: Any, ns: str | None = ns, window: float = window) -> tuple[int, int]:
            return _purge(d, cur, table, ns, skip, window, limit, before_delete)

        tombstoned, gone = tx.run(body)
        deleted += gone
        with tx.lock:
            tx.counts["purged"] += gone
            tx.counts["tombstoned"] += tombstoned
    return deleted


def _purge(
    d: Dialect,
    cur: Any,
    table: str,
    ns: str | None,
    skip: list[str],
    window: float,
    limit: int,
    before_delete: BeforeDelete | None,
) -> tuple[int, int]:
    """Tombstones abandoned claims, then deletes finished rows; ``(tombstoned, deleted)``.

    The conditions are in the outer ``WHERE`` too, so a row claimed again
    while the statement waited for its lock is re-checked and left alone.
    With ``before_delete`` the rows are first selected (oldest first) and
    locked, the callback gets each namespace's PROCESSED keys (it raises: the
    transaction is rolled back), and then exactly those rows are deleted,
    each only if still finished and old.
    """
    p, t = d.ph, d.q(table)
    scope: list[str] = []
    params: list[Any] = []
    if ns is not None:
        scope.append(f"namespace = {p}")
        params.append(ns)
    elif skip:
        scope.append(f"namespace NOT IN ({', '.join([p] * len(skip))})")
        params += skip
    old = f"updated < {d.ago(window)}"
    abandoned = " AND ".join([*scope, old, f"state = {PROCESSING}", f"lease_until < {d.now}"])
    cur.execute(
        d.limited(
            f"UPDATE {t} SET state = {RELEASED}, result = NULL, updated = {d.now}",
            table,
            abandoned,
            limit,
        ),
        params * d.where_repeats,
    )
    tombstoned = int(cur.rowcount)
    done = f"state IN ({PROCESSED}, {RELEASED})"
    finished = " AND ".join([*scope, old, done])
    if before_delete is None:
        cur.execute(d.limited(f"DELETE FROM {t}", table, finished, limit), params * d.where_repeats)
        return tombstoned, int(cur.rowcount)
    k = d.q("key")
    cur.execute(
        f"SELECT namespace, {k}, state FROM {t} WHERE {finished} "
        f"ORDER BY updated LIMIT {int(limit)}{d.for_update}",
        params,
    )
    chosen: dict[str, tuple[list[bytes], list[bytes]]] = {}
    for name, key, state in cur.fetchall():
        rows, processed = chosen.setdefault(str(name), ([], []))
        rows.append(bytes(key))
        if int(state) == PROCESSED:
            processed.append(bytes(key))
    for name, (_, processed) in sorted(chosen.items()):
        if processed:
            before_delete(name, processed)  # raises: the transaction is rolled back
    deleted = 0
    for name, (rows, _) in sorted(chosen.items()):
        deleted += d.delete_keys(cur, table, name, rows, f"{old} AND {done}")
    return tombstoned, deleted


def drop_partitions(
    parts: Partitions, now: float | None, limit: int, before_delete: BeforeDelete | None
) -> int:
    """Drops the partitions past the exact window at ``now``; returns the rows they held.

    See ``SqlStore.drop_partitions``: the horizon moves first (waiting for
    the claims in flight), then each old partition's PROCESSED keys go to
    ``before_delete`` and the partition is dropped; a failure in between
    leaves it to the next call.
    """
    tx, table = parts.tx, parts.table
    d = tx.dialect
    t = parts.now(now)
    meta = d.q(table + "_parts")
    target = parts.oldest(t)

    def move(cur: Any) -> int:
        horizon = d.part_guard(cur, table, True)
        if target > horizon:
            cur.execute(f"UPDATE {meta} SET horizon = {int(target)} WHERE id = 1")
            return target
        return horizon

    horizon = tx.run(move)
    # The partitions ahead first: MariaDB cannot drop a table's last partition.
    parts.ensure(t)
    dropped = 0
    for start in [s for s in parts.starts() if s < horizon]:
        dropped += _copy_partition(parts, start, limit, before_delete)
        tx.run(functools.partial(d.part_drop, table=table, start=start))
        with tx.lock:
            tx.counts["partitions_dropped"] += 1
    _drop_edges(tx, table, horizon, limit)
    with tx.lock:
        tx.counts["purged"] += dropped
    return dropped


def _copy_partition(
    parts: Partitions, start: int, limit: int, before_delete: BeforeDelete | None
) -> int:
    """Passes the partition's PROCESSED keys to ``before_delete``; returns its rows."""
    tx = parts.tx
    d = tx.dialect
    src, k, p = d.part_from(parts.table, start), d.q("key"), d.ph
    rows = tx.run(
        lambda cur: (cur.execute(f"SELECT COUNT(*) FROM {src}"), cur.fetchone())[1],
        write=False,
    )
    if before_delete is None:
        return int(rows[0])
    after: tuple[str, bytes] | None = None
    while True:
        where = f"state = {PROCESSED}"
        params: list[Any] = []
        if after is not None:
            where += f" AND (namespace, {k}) > ({p}, {p})"
            params = list(after)

        def page(cur: Any, where: str = where, params: list[Any] = params) -> list[Any]:
            cur.execute(
                f"SELECT namespace, {k} FROM {src} WHERE {where} "
                f"ORDER BY namespace, {k} LIMIT {int(limit)}",
                params,
            )
            got: list[Any] = cur.fetchall()
            return got

        got = tx.run(page, write=False)
        by_ns: dict[str, list[bytes]] = {}
        for name, key in got:
            by_ns.setdefault(str(name), []).append(bytes(key))
        for name, keys in by_ns.items():
            before_delete(name, keys)  # raises: the partition stays for the next call
        if len(got) < limit:
            return int(rows[0])
        after = (str(got[-1][0]), bytes(got[-1][1]))


def _drop_edges(tx: Transactions, table: str, horizon: int, limit: int) -> None:
    """Deletes the edge rows of boundaries before the horizon (they hold no data)."""
    d = tx.dialect
    edge = table + "_edge"
    sql = d.limited(
        f"DELETE FROM {d.q(edge)}",
        edge,
        f"boundary < {int(horizon)}",
        limit,
        ("namespace", "key", "boundary"),
    )

    def body(cur: Any) -> int:
        cur.execute(sql)
        return int(cur.rowcount)

    for _ in range(100):
        if tx.run(body) < limit:
            return
