"""``dedupcore stats`` against a daemon serving each kind of store: a Redis or SQL
authority (PostgreSQL, MariaDB, SQLite), a stack and shards, on the real servers.

Every store gives ``stats()`` of its own shape; the tables show what it counts and
``--json`` prints it as it came, with the rates (docs/metrics.md, ``dedupcore stats``).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.metrics import store_figures
from tests.support.daemon import Lab
from tests.support.procs import PATIENCE, child_env, run_cli
from tests.support.servers import (
    SERVERS,
    connect_redis,
    reachable,
    redis_url,
    require_server,
    sql_connect,
)
from tests.support.stores import unique_ns

REDIS_URL = redis_url("stack")


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*argv, env={**child_env(), "COLUMNS": "400"})  # rich tables: no wrapped cells


#: (servers it needs, SQL URLs to initialise, the serve options given the test's
#: directory, what the "store" row says, where the claim counts are: per namespace,
#: "" for a bare SQL authority's (all namespaces together), None for none kept)
Case = tuple[tuple[str, ...], tuple[str, ...], Callable[[Path], list[str]], str, str | None]
NS = "per namespace"
CASES: dict[str, Case] = {
    "redis": (("redis",), (), lambda d: ["--authority", REDIS_URL], "redis, 1 server", None),
    "postgresql": (
        ("postgresql",),
        (SERVERS.postgresql,),
        lambda d: ["--authority", SERVERS.postgresql],
        "postgresql table dedup",
        "",
    ),
    "mariadb": (
        ("mariadb",),
        (SERVERS.mariadb,),
        lambda d: ["--authority", SERVERS.mariadb],
        "mysql table dedup",
        "",
    ),
    "sqlite": (
        (),
        ("sqlite:///{d}/dedup.db",),
        lambda d: ["--authority", f"sqlite:///{d}/dedup.db"],
        "sqlite table dedup",
        "",
    ),
    "stacked": (
        ("postgresql", "redis"),
        (SERVERS.postgresql,),
        lambda d: [
            "--authority",
            SERVERS.postgresql,
            "--cache",
            REDIS_URL,
            "--archive",
            str(d / "cold"),
        ],
        "stack: postgresql table dedup + cache + archive + front filter",
        NS,
    ),
    "sharded": (
        ("redis", "mariadb"),
        (SERVERS.mariadb,),
        lambda d: ["--authority", REDIS_URL, "--authority", SERVERS.mariadb],
        "2 shards: redis, 1 server, mysql table dedup",
        NS,
    ),
    "sharded stacks": (
        (),
        ("sqlite:///{d}/a.db", "sqlite:///{d}/b.db"),
        lambda d: [
            "--authority",
            f"sqlite:///{d}/a.db",
            "--authority",
            f"sqlite:///{d}/b.db",
            "--archive",
            str(d / "cold"),
        ],
        "2 shards: stack: sqlite table dedup + archive + front filter each",
        NS,
    ),
}


@pytest.fixture
def ns() -> Iterator[str]:
    """A namespace of this test alone; its keys are removed from the servers after."""
    name = unique_ns("stats")
    yield name
    if reachable("redis"):
        r = connect_redis("stack")
        for key in r.scan_iter(match=f"dc*{name}*"):
            r.delete(key)
        r.close()
    if reachable("postgresql"):
        import psycopg

        with psycopg.connect(SERVERS.postgresql) as conn:
            # The table exists once a test of this module made it (not for every row).
            if conn.execute("SELECT to_regclass('dedup')").fetchone() != (None,):
                conn.execute("DELETE FROM dedup WHERE namespace = %s", (name,))
    if reachable("mariadb"):
        conn = sql_connect("mysql", autocommit=True)
        with conn.cursor() as cur:
            cur.execute("SHOW TABLES LIKE 'dedup'")
            if cur.fetchone() is not None:
                cur.execute("DELETE FROM dedup WHERE namespace = %s", (name,))
        conn.close()


def _claims(st: dict[str, Any], ns: str, where: str | None) -> dict[str, int]:
    claims = store_figures(st).claims
    key = ns if where == NS else ""
    return {o.value: claims[(key, o.value)] for o in Outcome}


@pytest.mark.parametrize("case", list(CASES))
def test_stats_tables_and_json_on_each_store(case: str, lab: Lab, ns: str) -> None:
    servers, sql_urls, options, kind, where = CASES[case]
    for server in servers:
        require_server(server)
    home = lab.tmpdir()
    for url in sql_urls:
        init = _cli("sql", "init", "--url", url.format(d=home))
        assert init.returncode == 0, init.stderr
    daemon = lab.daemon(*options(home))
    with daemon.client(timeout=PATIENCE) as client:
        new = client.claim_many(["k0", "k1", "k2"], namespace=ns)
        assert [c.outcome for c in new] == [Outcome.NEW] * 3
        client.complete_many([(c.key, c.token, b"done") for c in new], namespace=ns)
        assert client.claim("k0", namespace=ns).outcome is Outcome.DUPLICATE

    table = _cli("stats", "--socket", str(daemon.socket), "--interval", "0.1")
    assert table.returncode == 0, table.stderr
    assert "Traceback" not in table.stderr, table.stderr
    out = table.stdout
    assert "claims by namespace" in out and "store and daemon" in out, out
    assert kind in out, out
    if where is None:
        assert "this store keeps no claim counts" in out, out
    else:
        assert (ns if where == NS else "(all namespaces)") in out, out

    printed = _cli("stats", "--socket", str(daemon.socket), "--json", "--interval", "0.1")
    assert printed.returncode == 0, printed.stderr
    st = json.loads(printed.stdout)
    assert st["daemon"]["requests"] >= 3 and isinstance(st["rates"], dict)
    assert st["durability"], st
    if where is not None:
        assert _claims(st, ns, where) == {"new": 3, "duplicate": 1, "in_progress": 0}
        rates = st["rates"][ns if where == NS else ""]
        assert rates == {"claims_per_second": 0.0, "duplicate_rate": 0.0}  # none in between
