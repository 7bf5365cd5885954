"""Retention: what a key past its exact window answers, on every store whose sweep a test drives.

Each store documents its answer (docs/architecture.md, "Retention"):

- the embedded store's ``sweep(now)`` demotes a PROCESSED record older than
  ``exact_window`` to the cold archive, which then answers DUPLICATE with
  ``exact=False``; without a cold window (``cold_window=0``) the key is
  forgotten and claimable again (NEW, token 1). A released tombstone past
  the window is deleted without being archived: its work never ran.
- a SQL authority's ``sweep`` (``purge``) deletes finished rows past the
  window on the database server's clock: the key is claimable again.
- a stack over a SQL authority with a cold archive copies the PROCESSED rows
  into the archive before they are deleted: cold DUPLICATE.

Redis expires its records by TTL, which no test can drive: it is left out.
The embedded store takes ``now`` and is swept once; the SQL stores measure
the window on the server's clock, so the test polls the sweep until the row
has gone (a one-second window, a generous bound).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dedupcore.api import ClaimAPI, Outcome
from dedupcore.config import Retention
from dedupcore.record import State
from dedupcore.sql import SqlStore
from dedupcore.stack import TieredStore
from dedupcore.store import DedupStore
from tests.support.procs import wait_until
from tests.support.servers import SERVERS, require_server
from tests.support.stores import SqlTable

WINDOW = 1.0
DAY = 86400.0


@dataclass
class Retained:
    """A store with a short exact window, how to sweep it past the window, and its answer."""

    api: ClaimAPI
    #: Sweeps until ``key`` of ``ns`` is out of the exact records (polls where it must).
    sweep_past: Callable[[str, str], None]
    #: Whether a PROCESSED key past its window answers DUPLICATE (inexact) or NEW.
    cold: bool


def _embedded(tmp: Path, cold_window: float) -> Iterator[Retained]:
    store = DedupStore.open(
        tmp / "data", retention=Retention(exact_window=WINDOW, cold_window=cold_window)
    )

    def sweep_past(key: str, ns: str) -> None:
        store.sweep(now=time.time() + DAY)  # far past the window: one sweep is enough

    yield Retained(store, sweep_past, cold=cold_window > 0)
    store.close()


def _swept_until_gone(
    authority: SqlStore, sweep: Callable[[], object]
) -> Callable[[str, str], None]:
    def sweep_past(key: str, ns: str) -> None:
        def gone() -> bool:
            sweep()
            return authority.get(key, namespace=ns) is None

        wait_until(gone, f"{key!r} swept", step=0.2)

    return sweep_past


def _sql(url: str, tmp: Path, *, archive: bool) -> Iterator[Retained]:
    authority_url = url.format(tmp=tmp)
    authority = SqlStore.from_url(
        authority_url,
        table=f"retain_{uuid.uuid4().hex[:10]}",
        retention=Retention(exact_window=WINDOW),
    )
    authority.init_schema()
    try:
        if archive:
            stack = TieredStore(
                authority,
                archive=tmp / "cold",
                retention=Retention(exact_window=WINDOW, cold_window=DAY),
            )
            yield Retained(stack, _swept_until_gone(authority, stack.sweep), cold=True)
        else:
            yield Retained(authority, _swept_until_gone(authority, authority.sweep), cold=False)
    finally:
        authority.close()
        SqlTable.of(authority_url, authority.table).drop()


@pytest.fixture(
    params=[
        "store",
        "store-no-cold",
        "sql_sqlite",
        "sql_postgresql",
        "sql_mysql",
        "tiered_sqlite",
        "tiered_postgresql",
    ]
)
def retained(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Retained]:
    kind = request.param
    if kind == "store":
        yield from _embedded(tmp_path, cold_window=DAY)
        return
    if kind == "store-no-cold":
        yield from _embedded(tmp_path, cold_window=0)
        return
    engine = kind.split("_", 1)[1]
    if engine == "postgresql":
        require_server("postgresql")
        url = SERVERS.postgresql
    elif engine == "mysql":
        require_server("mariadb")
        url = SERVERS.mariadb
    else:
        url = "sqlite:///{tmp}/retain.db"
    yield from _sql(url, tmp_path, archive=kind.startswith("tiered"))


def test_a_processed_key_past_its_window_is_cold_or_claimable(retained: Retained, ns: str) -> None:
    api = retained.api
    c = api.claim("done", namespace=ns)
    api.complete("done", c.token, namespace=ns, result="r")
    kept = api.claim("kept-busy", namespace=ns, lease=3600.0)
    retained.sweep_past("done", ns)
    again = api.claim("done", namespace=ns)
    if retained.cold:
        assert again.outcome is Outcome.DUPLICATE and not again.exact
        assert again.result is None
    else:
        assert again.outcome is Outcome.NEW and again.exact and again.token == 1
    # A claim whose lease still runs is never swept away.
    assert api.claim("kept-busy", namespace=ns).outcome is Outcome.IN_PROGRESS
    api.complete("kept-busy", kept.token, namespace=ns)


def test_a_released_key_past_its_window_is_forgotten_not_archived(
    retained: Retained, ns: str
) -> None:
    api = retained.api
    c = api.claim("released", namespace=ns)
    api.release("released", c.token, namespace=ns)
    rec = api.get("released", namespace=ns)
    assert rec is not None and rec.state is State.RELEASED
    retained.sweep_past("released", ns)
    assert api.get("released", namespace=ns) is None
    again = api.claim("released", namespace=ns)
    assert again.outcome is Outcome.NEW and again.exact and again.token == 1
