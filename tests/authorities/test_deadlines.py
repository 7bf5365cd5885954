"""One deadline per call (docs/timeouts.md), against real servers that stop answering.

Redis: a private redis-server that is SIGSTOPped. PostgreSQL and MariaDB:
the machine's shared servers behind a small TCP proxy in the test process
that stops forwarding (a blackhole), since stopping the shared servers
would break other tests. SQLite: another connection holding the write lock.

Each store gets ``timeout=1.0``. A call started while the server does not
answer must raise :class:`UnavailableError`, and no wait inside it (a
connect, a send, a reply, the watchdog's cut, a retry) may have been given
more than was left of the call's deadline when it was given: a retry or a
reconnect with a fresh full timeout fails that. What is asserted is the time
each wait was given (:class:`Waits`), never how long the call took, so a
loaded machine cannot fail it. After the server answers again the store
serves, and no key acknowledged before the pause comes back NEW.
"""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from dedupcore.api import Outcome
from dedupcore.errors import UnavailableError
from dedupcore.factory import open_store
from dedupcore.record import State
from dedupcore.redis import RedisStore
from dedupcore.retry import RETRY_FLOOR, Deadline, current_deadline
from dedupcore.sql import SqlStore, transactions
from dedupcore.sql.dialects.mysql import MySQLDialect
from dedupcore.sql.dialects.sqlite import SQLiteDialect
from dedupcore.sql.watchdog import Watchdog
from tests.support.cluster import redis_cluster, redis_server
from tests.support.procs import call_in_thread
from tests.support.servers import SERVERS, address, require_server

NS = "deadline/test"
TIMEOUT = 1.0
#: The hot cache's own deadline (``RedisCache.from_url``'s default).
CACHE_TIMEOUT = 0.5
DONE = [f"done{i}" for i in range(20)]

# -- what each wait of a call was given ----------------------------------------------------


class Waits:
    """Records, for each wait of a call, the time it was given and when it was given.

    Every wait a store's drivers are given inside a call is recorded in the thread
    that waits: each blocking operation on a Python socket (redis-py, PyMySQL) with
    the socket's timeout, the connect of a SQL store (``connect_within``), the
    driver's own waits set by ``Dialect.arm`` (PyMySQL, SQLite's busy wait), the
    watchdog's cut time (psycopg) and each retry's decision (``Deadline.retry_wait``).
    ``since[thread]`` is the end of the thread's previous recorded step: a wait is
    computed after it, so what was left of the call's deadline when the wait was
    given is at least ``at - since``. Checking ``given <= at - since`` needs no clock
    margin: it holds on any load, and it fails for a retry or reconnect that is given a
    fresh full timeout after an earlier wait of the same call.
    """

    def __init__(self) -> None:
        self.start = 0.0
        #: (timeout, when it ends) of each deadline taken, as it was taken
        self.deadlines: list[tuple[float, float]] = []
        #: (what, seconds given or None for no limit, the end of the step before it)
        self.given: list[tuple[str, float | None, float]] = []
        #: (cut time the watchdog was given)
        self.cuts: list[float] = []
        #: (sleep allowed or None, the end of the step before it)
        self.retries: list[tuple[float | None, float]] = []
        self.since: dict[int, float] = {}

    def reset(self) -> None:
        self.start = time.monotonic()
        self.deadlines.clear()
        self.given.clear()
        self.cuts.clear()
        self.retries.clear()
        self.since.clear()

    def before(self) -> float:
        return self.since.get(threading.get_ident(), self.start)

    def stepped(self) -> None:
        self.since[threading.get_ident()] = time.monotonic()

    def check(self, timeout: float = TIMEOUT, only: str | tuple[str, ...] = "") -> None:
        """Asserts that no wait of the call was given more than was left of its deadline
        (the first one of ``timeout`` seconds it took), and that no retry started with
        less than the retry floor left. ``only``: the waits whose name starts with it (a
        SQL store's sockets keep the timeout armed for the whole transaction)."""
        mine = [at for t, at in self.deadlines if t == timeout]
        assert mine, f"the call took no deadline of {timeout} s"
        at = min(mine)  # a later one (a fresh timeout) never extends the call
        given_ = [g for g in self.given if g[0].startswith(only)]
        assert given_ or self.cuts, "no wait of the call was seen"
        for what, given, since in given_:
            left = at - since
            assert given is not None, f"{what} was given no time limit ({left:.3f} s were left)"
            assert given <= left + EPS, f"{what} was given {given:.3f} s, {left:.3f} s were left"
        for until in self.cuts:
            assert until <= at, f"the watchdog cuts {until - at:.3f} s after the deadline"
        for wait, since in self.retries:
            if wait is not None:  # the retry starts after ``wait``: the floor is left then
                room = at - since - timeout * RETRY_FLOOR
                assert wait <= room + EPS, "a retry started with less than the floor left"


#: Float rounding of a socket's timeout (kept in whole nanoseconds), not a clock margin.
EPS = 1e-6

_SOCKET_WAITS = ("connect", "sendall", "send", "recv", "recv_into")


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> Waits:
    spy = Waits()
    deadline_init = Deadline.__init__

    def init(self: Deadline, *args: Any, **kwargs: Any) -> None:
        deadline_init(self, *args, **kwargs)
        spy.deadlines.append((self.timeout, self.at))  # as taken: nothing may move it later

    monkeypatch.setattr(Deadline, "__init__", init)

    retry_wait = Deadline.retry_wait

    def spied_retry_wait(self: Deadline, backoff: float) -> float | None:
        since = spy.before()
        wait = retry_wait(self, backoff)
        spy.retries.append((wait, since))
        spy.stepped()
        return wait

    monkeypatch.setattr(Deadline, "retry_wait", spied_retry_wait)

    def socket_wait(name: str) -> Callable[..., Any]:
        real = getattr(socket.socket, name)

        def wait(sock: socket.socket, *args: Any, **kwargs: Any) -> Any:
            if current_deadline() is None:  # not a call's thread (the proxy, a connect thread)
                return real(sock, *args, **kwargs)
            given = sock.gettimeout()
            if given != 0.0:  # 0: a poll that does not wait
                spy.given.append((f"socket.{name}", given, spy.before()))
            try:
                return real(sock, *args, **kwargs)
            finally:
                spy.stepped()

        return wait

    for name in _SOCKET_WAITS:
        monkeypatch.setattr(socket.socket, name, socket_wait(name))

    connect = transactions.connect_within

    def spied_connect(factory: Callable[[], Any], wait: float) -> Any:
        spy.given.append(("the SQL connect", wait, spy.before()))
        try:
            return connect(factory, wait)
        finally:
            spy.stepped()

    monkeypatch.setattr(transactions, "connect_within", spied_connect)

    for dialect in (MySQLDialect, SQLiteDialect):
        arm = dialect.arm

        def spied_arm(self: Any, conn: Any, wait: float, arm: Any = arm) -> None:
            spy.given.append((f"{type(self).__name__}.arm", wait, spy.before()))
            arm(self, conn, wait)
            spy.stepped()

        monkeypatch.setattr(dialect, "arm", spied_arm)

    guard = Watchdog.guard

    def spied_guard(self: Watchdog, fd: int | None, until: float | None = None) -> Any:
        if until is not None and fd is not None:
            spy.cuts.append(until)
        return guard(self, fd, until)

    monkeypatch.setattr(Watchdog, "guard", spied_guard)
    return spy


#: The waits of a SQL store: PyMySQL's socket timeouts are armed once a transaction
#: (``Dialect.arm``), and the watchdog cuts what is still waiting at the deadline.
SQL_WAITS = ("the SQL connect", "MySQLDialect.arm", "SQLiteDialect.arm")


def _fails_within_the_deadline(
    waits: Waits, call: Callable[[], Any], only: str | tuple[str, ...] = ""
) -> None:
    """Runs ``call``, which must raise UnavailableError after giving no wait more than
    was left of its deadline (``only``: the waits checked, see :meth:`Waits.check`)."""
    waits.reset()
    with pytest.raises(UnavailableError):
        call_in_thread(call)
    waits.check(only=only)


def _acknowledge(store: Any) -> None:
    """Claims and completes DONE (acknowledged before the pause)."""
    claims = store.claim_many(DONE, namespace=NS)
    assert {c.outcome for c in claims} == {Outcome.NEW}
    store.complete_many([(c.key, c.token, "r") for c in claims], namespace=NS)


def _calls(store: Any) -> list[Callable[[], Any]]:
    """Every kind of call of a store: claims, a completion, a read."""
    return [
        lambda: store.claim("paused", namespace=NS, owner="w"),
        lambda: store.claim_many(DONE, namespace=NS),
        lambda: store.complete("done0", 1, namespace=NS),
        lambda: store.get("done0", namespace=NS),
    ]


def _serves_again(store: Any) -> None:
    """After the pause: nothing acknowledged comes back NEW, and new claims work."""
    again = call_in_thread(lambda: store.claim_many(DONE, namespace=NS))
    assert {(c.outcome, c.result) for c in again} == {(Outcome.DUPLICATE, "r")}
    # A claim cut off at its deadline may still have run: then it is held for its
    # owner, never NEW to anyone else.
    rec = store.get("paused", namespace=NS)
    if rec is not None:
        assert (rec.state, rec.owner) == (State.PROCESSING, b"w")
        assert store.claim("paused", namespace=NS, owner="other").outcome is Outcome.IN_PROGRESS
    fresh = store.claim(f"fresh-{uuid.uuid4().hex}", namespace=NS)
    assert fresh.outcome is Outcome.NEW


# -- Redis -------------------------------------------------------------------------------


def test_redis_calls_end_within_the_timeout_while_the_server_is_paused(
    tmp_path: Path, waits: Waits
) -> None:
    with redis_server(tmp_path) as server:
        store = RedisStore.from_url(f"redis://127.0.0.1:{server.port}/0", timeout=TIMEOUT)
        _acknowledge(store)
        server.pause()
        try:
            for call in _calls(store):
                _fails_within_the_deadline(waits, call)
            # A call that has to connect anew: the connect and the handshake share it.
            store.client.connection_pool.disconnect()
            _fails_within_the_deadline(waits, _calls(store)[0])
        finally:
            server.resume()
        _serves_again(store)
        store.close()


def test_redis_cluster_calls_end_within_the_timeout_while_a_master_is_paused(
    tmp_path: Path, waits: Waits
) -> None:
    with redis_cluster(tmp_path, 3) as cluster:
        url = f"redis://127.0.0.1:{cluster.ports[0]}/0"
        store = RedisStore.from_url(url, cluster=True, timeout=TIMEOUT)
        _acknowledge(store)
        # Pause the master of one acknowledged key (not the node the URL names).
        from redis.crc import key_slot

        names = {k: store._names(NS.encode(), [k.encode()])[0] for k in DONE}
        port_of = {k: cluster.node_of_slot(key_slot(n)) for k, n in names.items()}
        key = next(k for k, p in port_of.items() if p != cluster.ports[0])
        node = next(n for n in cluster.nodes if n.port == port_of[key])
        node.pause()
        try:
            _fails_within_the_deadline(waits, lambda: store.claim(key, namespace=NS))
            _fails_within_the_deadline(waits, lambda: store.claim_many(DONE, namespace=NS))
            _fails_within_the_deadline(waits, lambda: store.get(key, namespace=NS))
        finally:
            node.resume()
        again = call_in_thread(lambda: store.claim_many(DONE, namespace=NS))
        assert {(c.outcome, c.result) for c in again} == {(Outcome.DUPLICATE, "r")}
        store.close()


def test_a_stack_skips_its_paused_redis_cache_within_the_cache_s_deadline(
    tmp_path: Path, waits: Waits
) -> None:
    """The hot cache of a stack is one call with its own deadline (0.5 s by default)."""
    with redis_server(tmp_path / "cache") as server:
        store = open_store(
            f"sqlite:///{tmp_path / 'auth.db'}",
            cache=f"redis://127.0.0.1:{server.port}/0",
            init_schema=True,
            timeout=TIMEOUT,
        )
        _acknowledge(store)
        assert {c.outcome for c in store.claim_many(DONE, namespace=NS)} == {Outcome.DUPLICATE}
        server.pause()
        try:
            # The acknowledged keys pass the front filter and ask the cache first: it does
            # not answer, so it is skipped after its deadline and the authority answers.
            waits.reset()
            again = call_in_thread(lambda: store.claim_many(DONE, namespace=NS))
            assert {(c.outcome, c.result) for c in again} == {(Outcome.DUPLICATE, "r")}
            # The cache's waits (its sockets) kept the cache's deadline.
            waits.check(CACHE_TIMEOUT, only="socket.")
        finally:
            server.resume()
        _serves_again(store)
        store.close()


# -- PostgreSQL and MariaDB behind a proxy that can stop forwarding ----------------------


class Blackhole:
    """A TCP proxy on a free loopback port in front of ``target``.

    :meth:`hold` stops it forwarding, both ways, on every connection, and
    new connections are accepted but not forwarded: to the client the server
    looks paused (the kernel still accepts and acknowledges). :meth:`release`
    forwards again, including what was held back.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._open = threading.Event()
        self._open.set()
        self._closed = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed = True
        self._open.set()
        with self._lock:
            socks, self._socks = [self._listener, *self._socks], []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.append(s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._track(client)
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._open.wait()  # a held proxy does not even reach the server
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        self._track(upstream)
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                self._open.wait()  # held: keep what was read until released
                if not data or self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def blackhole(server: str) -> Iterator[Blackhole]:
    """A proxy in front of the shared ``server`` ("postgresql" or "mariadb")."""
    proxy = Blackhole(address(server))
    try:
        yield proxy
    finally:
        proxy.close()


def _sql_store_behind_a_blackhole(
    url: str, proxy: Blackhole, table: str, **options: Any
) -> SqlStore:
    with SqlStore.from_url(url, table=table) as setup:
        setup.init_schema()
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    here = f"127.0.0.1:{proxy.port}"
    proxied = urlunsplit(parts._replace(netloc=f"{user}@{here}" if user else here))
    return SqlStore.from_url(proxied, table=table, timeout=TIMEOUT, **options)


def _drop_table(url: str, table: str) -> None:
    with SqlStore.from_url(url, table=table) as s:
        quoted = f"`{table}`" if url.startswith("mysql") else f'"{table}"'
        s._tx(lambda cur: cur.execute(f"DROP TABLE IF EXISTS {quoted}"))


@pytest.mark.parametrize("name", ["postgresql", "mariadb"])
def test_sql_calls_end_within_the_timeout_while_the_server_does_not_answer(
    name: str, waits: Waits
) -> None:
    require_server(name)
    url = getattr(SERVERS, name)
    table = f"deadline_{uuid.uuid4().hex[:12]}"
    try:
        with blackhole(name) as proxy:
            store = _sql_store_behind_a_blackhole(url, proxy, table)
            _acknowledge(store)
            proxy.hold()
            try:
                # The first call waits on the open connection, which is cut at the
                # deadline; the later ones must connect anew, within the deadline too.
                for call in _calls(store):
                    _fails_within_the_deadline(waits, call, SQL_WAITS)
                assert store.stats()["cut_connections"] >= 1
            finally:
                proxy.release()
            _serves_again(store)
            store.close()
    finally:
        _drop_table(url, table)


def test_sql_deadlock_retries_stay_within_the_deadline_of_the_call(waits: Waits) -> None:
    """A deadlock retry's backoff and its new attempt share the call's deadline."""
    require_server("postgresql")
    table = f"deadline_{uuid.uuid4().hex[:12]}"
    try:
        with blackhole("postgresql") as proxy:
            store = _sql_store_behind_a_blackhole(SERVERS.postgresql, proxy, table, retries=100)
            _acknowledge(store)
            attempts = []

            def body(cur: Any) -> None:
                attempts.append(time.monotonic())
                if len(attempts) == 3:
                    proxy.hold()  # the third attempt finds the server gone
                # The server reports a deadlock (40P01): the transaction is retried.
                cur.execute(
                    "DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40P01'; END $$"
                )

            try:
                _fails_within_the_deadline(waits, lambda: store._tx(body), SQL_WAITS)
            finally:
                proxy.release()
            assert len(attempts) == 3
            _serves_again(store)
            store.close()
    finally:
        _drop_table(SERVERS.postgresql, table)


# -- SQLite: the busy wait for another writer's lock ---------------------------------------


def test_sqlite_busy_wait_ends_within_the_timeout(tmp_path: Path, waits: Waits) -> None:
    path = tmp_path / "dedup.db"
    store = SqlStore.from_url(f"sqlite:///{path}", timeout=TIMEOUT)
    store.init_schema()
    _acknowledge(store)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the lock
    try:
        _fails_within_the_deadline(waits, lambda: store.claim("paused", namespace=NS, owner="w"))
        _fails_within_the_deadline(waits, lambda: store.complete("done0", 1, namespace=NS))
    finally:
        other.execute("ROLLBACK")
        other.close()
    _serves_again(store)
    store.close()
