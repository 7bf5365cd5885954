"""Process bodies of the multi-process tests (spawned: importable, few imports)."""

from __future__ import annotations

import os
import time
from typing import Any


def connect(engine: str, sqlite_path: str) -> Any:
    """A transactional DB-API connection of its own."""
    if engine != "sqlite":
        from tests.support.servers import sql_connect

        return sql_connect(engine)
    import sqlite3

    conn = sqlite3.connect(sqlite_path, timeout=60.0)
    conn.execute("PRAGMA synchronous = OFF")  # speed only; locking is unchanged
    return conn


def race(
    engine: str, sqlite_path: str, table: str, business: str, keys: list[str], start: Any, out: Any
) -> None:
    """Consumes every key once; puts (pid, keys it found NEW, redeliveries) on ``out``."""
    from dedupcore.patterns.table import consume

    conn = connect(engine, sqlite_path)
    ph = "?" if engine == "sqlite" else "%s"
    new: list[str] = []
    redeliveries = 0
    start.wait(60)
    try:
        for key in keys:
            for attempt in range(20):
                try:
                    with consume(conn, "race/consumers", key, table=table) as c:
                        if c.new:
                            cur = conn.cursor()
                            cur.execute(
                                f"INSERT INTO {business} (k, pid) VALUES ({ph}, {ph})",
                                (key, os.getpid()),
                            )
                            cur.close()
                            c.result = os.getpid()
                    if c.new:
                        new.append(key)
                    break
                except Exception:  # e.g. a deadlock: rolled back, the broker redelivers
                    if attempt == 19:
                        raise
                    redeliveries += 1
                    time.sleep(0.01 * (attempt + 1))
        out.put((os.getpid(), new, redeliveries, None))
    except BaseException as exc:
        out.put((os.getpid(), new, redeliveries, repr(exc)))
    finally:
        conn.close()


def hold(engine: str, sqlite_path: str, table: str, business: str, key: str, inside: Any) -> None:
    """Consumes ``key`` (NEW), writes a business row, says so, then waits to be killed."""
    from dedupcore.patterns.table import consume

    conn = connect(engine, sqlite_path)
    ph = "?" if engine == "sqlite" else "%s"
    with consume(conn, "race/consumers", key, table=table) as c:
        assert c.new
        cur = conn.cursor()
        cur.execute(f"INSERT INTO {business} (k, pid) VALUES ({ph}, {ph})", (key, os.getpid()))
        cur.close()
        inside.set()
        time.sleep(600)
