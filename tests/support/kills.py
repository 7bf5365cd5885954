"""SIGKILL of a server process mid-request, at a point the handler names; the retry
on a fresh server process (docs/http.md, "Where exactly once holds, and where not").

Both sides of the kill tests of the HTTP integrations (tests/idempotency/test_http_kills.py
for Starlette and FastAPI, tests/integrations/test_django_kills.py for Django):

- in the server process, :func:`effect`: a handler's effect, one row in PostgreSQL,
  written plainly (``plain``: its own committed statement) or with the transactional
  table (``ledger``: ``consume(...)`` keyed by the request's store key, in the same
  transaction as the row). The request's ``X-Pause`` header names the point at which
  the handler prints ``PAUSED <tag> <point>`` and waits to be killed (:data:`POINTS`);
- in the test, :class:`KillLab`: the tables, the server processes (started by
  ``python -m tests.support.kill_app FORM``, which prints ``READY <port>``), the
  rounds of requests killed at their points, and the retries with the same
  Idempotency-Key on a fresh process.

What the client sees on its retry: while the dead process's claim holds, 409 (its
heartbeat stopped with it, so the claim ends a lease after its last renewal); then
the request runs again. A plain effect is then applied a second time if the kill
came after it; a ledger effect never is: the re-run finds the key consumed and
answers the result committed with the first effect (``X-Consumed: duplicate``), the
same body the first attempt would have sent.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.procs import LineProcess, child_env, wait_until
from tests.support.servers import SERVERS, pg_connect, uid

#: Where the handler may wait to be killed, per kind of effect: before or after the
#: plain row is committed; after the ledger row is written (the transaction still
#: open) or after it committed with the consumed key.
POINTS = {"plain": ("before_effect", "after_effect"), "ledger": ("in_tx", "committed")}
#: The points after which a killed plain request has applied its effect.
APPLIED = {"after_effect", "committed"}
#: The claims' lease in the server processes (renewed by their heartbeat while alive).
LEASE = 1.5
#: The consume() namespace of the ledger effects.
LEDGER_NS = "http/ledger"
PATIENCE = 60.0
CREDENTIALS = {"Authorization": "Bearer kills-client"}


# -- in the server process -----------------------------------------------------------------


def _pause(tag: str, point: str, wanted: str | None) -> None:
    if point == wanted:
        os.write(1, f"PAUSED {tag} {point}\n".encode())  # one write: lines never interleave
        threading.Event().wait()  # until the test kills the process


def effect(mode: str, tag: str, dedup_key: str, pause: str | None) -> tuple[dict[str, Any], str]:
    """The handler's effect (in a worker thread): the answer and how it was decided
    ("plain", "new", or "duplicate": the ledger found the key consumed)."""
    import psycopg

    from dedupcore.patterns.table import consume

    nonce = uuid.uuid4().hex
    insert = (
        f"INSERT INTO {os.environ['DC_KILL_EFFECTS']} (tag, nonce) VALUES (%s, %s) RETURNING id"
    )
    with psycopg.connect(os.environ["DC_KILL_PG"], autocommit=mode == "plain") as conn:
        if mode == "plain":
            _pause(tag, "before_effect", pause)
            row = conn.execute(insert, (tag, nonce)).fetchone()
            _pause(tag, "after_effect", pause)
            return {"row": row[0] if row else 0, "nonce": nonce}, "plain"
        with consume(conn, LEDGER_NS, dedup_key, table=os.environ["DC_KILL_CONSUMED"]) as c:
            if c.new:
                row = conn.execute(insert, (tag, nonce)).fetchone()
                c.result = {"row": row[0] if row else 0, "nonce": nonce}
                _pause(tag, "in_tx", pause)
        _pause(tag, "committed", pause)
        return dict(c.result), "new" if c.new else "duplicate"


# -- in the test ----------------------------------------------------------------------------


@dataclass
class Killed:
    """One request killed at ``point``: the answer to its retry on a fresh process, the
    answer to a retry after that, and the effect rows of its tag (id, nonce)."""

    tag: str
    point: str
    retry: httpx.Response
    busy: int  # the retries answered 409 before it (the dead process's claim held)
    again: httpx.Response | None = None
    effects: list[tuple[int, str]] = field(default_factory=list)


def post(url: str, path: str, tag: str, pause: str | None = None) -> httpx.Response:
    """The request of ``tag`` (its Idempotency-Key, its body), held at ``pause`` if given."""
    headers = {**CREDENTIALS, "Idempotency-Key": tag, "X-Tag": tag}
    if pause is not None:
        headers["X-Pause"] = pause
    with httpx.Client(base_url=url, timeout=PATIENCE) as client:
        return client.post(path, content=f"order {tag}".encode(), headers=headers)


def answered(url: str, path: str, tag: str) -> tuple[httpx.Response, int]:
    """The retry of ``tag``, sent again while it is 409 (the dead process's claim holds),
    and how many times it was 409."""
    found: list[httpx.Response] = []

    def done() -> bool:
        found.append(post(url, path, tag))
        return found[-1].status_code != 409

    wait_until(done, f"the retry of {tag} to be answered", step=0.2)
    return found[-1], len(found) - 1


def plan_rounds(mode: str, rounds: int, per_round: int) -> list[dict[str, str]]:
    """Rounds of requests (tag -> point), the points taken in turn, the later point
    first: kills on both sides of the effect."""
    points = POINTS[mode][::-1]
    tags = [uuid.uuid4().hex for _ in range(rounds * per_round)]
    plans = [tags[i * per_round : (i + 1) * per_round] for i in range(rounds)]
    return [{tag: points[tags.index(tag) % len(points)] for tag in plan} for plan in plans]


class KillLab:
    """The tables (on the shared PostgreSQL) and the server processes of one kill test.

    ``env`` is what the server process needs besides the tables (the daemon's socket,
    the form's settings); ``form`` is the argument of ``tests.support.kill_app``.
    """

    def __init__(self, form: str, env: dict[str, str], pg_tables: list[str]) -> None:
        from dedupcore.patterns.table import ensure_table

        self.form = form
        self.effects_table, self.consumed_table = uid("dc_http_effects"), uid("dc_http_consumed")
        pg_tables.extend([self.effects_table, self.consumed_table])
        with pg_connect() as conn:
            conn.execute(
                f"CREATE TABLE {self.effects_table} "
                "(id serial PRIMARY KEY, tag text NOT NULL, nonce text NOT NULL)"
            )
            ensure_table(conn, self.consumed_table)
            conn.commit()
        self.env = {
            **child_env(),
            **env,
            "DC_KILL_PG": SERVERS.postgresql,
            "DC_KILL_EFFECTS": self.effects_table,
            "DC_KILL_CONSUMED": self.consumed_table,
        }
        self.starts = 0

    def start(self) -> tuple[LineProcess, str]:
        """A fresh server process, and its URL once it listens."""
        self.starts += 1
        argv = [sys.executable, "-m", "tests.support.kill_app", self.form]
        proc = LineProcess(argv, env=self.env, name=f"{self.form} server {self.starts}")
        port = proc.expect("READY ")
        return proc, f"http://127.0.0.1:{port}"

    def effects(self, tag: str) -> list[tuple[int, str]]:
        with pg_connect() as conn:
            rows = conn.execute(
                f"SELECT id, nonce FROM {self.effects_table} WHERE tag = %s ORDER BY id", (tag,)
            ).fetchall()
        return [(int(i), str(n)) for i, n in rows]

    def consumed(self) -> int:
        with pg_connect() as conn:
            row = conn.execute(f"SELECT count(*) FROM {self.consumed_table}").fetchone()
        return int(row[0]) if row else 0

    def verify(self, mode: str, path: str) -> list[Killed]:
        """:meth:`run`, its window printed, and :func:`check_plain` or :func:`check_ledger`."""
        killed = self.run(mode, path)
        print(f"{self.form} {path}: {window(killed)}")
        if mode == "plain":
            check_plain(killed)
        else:
            check_ledger(killed, self.consumed())
        return killed

    def run(self, mode: str, path: str, rounds: int = 2, per_round: int = 3) -> list[Killed]:
        """``rounds`` times: ``per_round`` requests to ``path``, each paused at its point
        (:func:`plan_rounds`), the server SIGKILLed, a fresh one started, and each
        request retried with its key until it is answered; then each once more."""
        killed: list[Killed] = []
        proc, url = self.start()
        try:
            for plan in plan_rounds(mode, rounds, per_round):
                kill_round(proc, url, path, plan)
                proc.close()
                proc, url = self.start()
                killed += [Killed(t, p, *answered(url, path, t)) for t, p in plan.items()]
            for k in killed:
                k.again = post(url, path, k.tag)
        finally:
            proc.close()
        for k in killed:
            k.effects = self.effects(k.tag)
        return killed


def kill_round(proc: LineProcess, url: str, path: str, plan: dict[str, str]) -> None:
    """Sends the plan's requests, waits until each is paused at its point, SIGKILLs the
    server; every client sees its connection drop without an answer."""
    with ThreadPoolExecutor(len(plan)) as pool:
        sent: dict[str, Future[httpx.Response]] = {
            tag: pool.submit(post, url, path, tag, point) for tag, point in plan.items()
        }
        paused = {}
        for _ in plan:
            tag, point = proc.expect("PAUSED ").split()
            paused[tag] = point
        assert paused == plan
        proc.sigkill()
        for future in sent.values():
            error = future.exception(PATIENCE)
            assert isinstance(error, httpx.TransportError), error


def window(killed: list[Killed]) -> str:
    """What the kills showed: kills per point, and how many applied the effect twice."""
    by_point: dict[str, list[Killed]] = {}
    for k in killed:
        by_point.setdefault(k.point, []).append(k)
    return "; ".join(
        f"{point}: {len(ks)} kills, {sum(len(k.effects) > 1 for k in ks)} applied twice, "
        f"retries answered 409 {[k.busy for k in ks]} times first"
        for point, ks in sorted(by_point.items())
    )


def check_plain(killed: list[Killed]) -> None:
    """A plain effect: every retry answered and recorded; a kill after the effect
    applied it twice (the window), a kill before it did not."""
    for k in killed:
        assert k.retry.status_code == 201, (k.point, k.retry.text)
        assert k.retry.headers.get("idempotent-replayed") is None  # nothing was recorded
        assert k.again is not None and k.again.headers.get("idempotent-replayed") == "true"
        assert k.again.json() == k.retry.json()
        assert len(k.effects) == (2 if k.point in APPLIED else 1), (k.point, k.effects)


def check_ledger(killed: list[Killed], consumed: int) -> None:
    """A ledger effect: never applied twice; the retry answers the one committed row."""
    for k in killed:
        assert k.retry.status_code == 201, (k.point, k.retry.text)
        assert len(k.effects) == 1, (k.point, k.effects)
        row, nonce = k.effects[0]
        assert k.retry.json() == {"row": row, "nonce": nonce}
        # Committed before the kill: the re-run found the key consumed; else it ran anew.
        decided = "duplicate" if k.point in APPLIED else "new"
        assert k.retry.headers["x-consumed"] == decided, k.point
        assert k.again is not None and k.again.headers.get("idempotent-replayed") == "true"
        assert k.again.json() == k.retry.json()
    assert consumed == len(killed)
