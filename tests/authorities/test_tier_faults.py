"""Faults of the shared tiers with real servers: paused, stopped and restarted servers.

Every server that a test pauses, stops or reconfigures is a private instance
(free loopback port, temporary directory), so other test runs on the
machine's shared Redis/PostgreSQL are not disturbed. Connection kills on the
shared MariaDB/PostgreSQL end only this test's own connections.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.errors import DedupError, UnavailableError
from dedupcore.factory import open_store
from dedupcore.record import State
from dedupcore.redis import RedisStore
from dedupcore.sql import SqlStore
from dedupcore.stack import TieredStore
from dedupcore.tiers.cache import RedisCache
from tests.support.cluster import RedisServer, free_port, redis_server
from tests.support.procs import call_in_thread
from tests.support.stores import SqlTable, counting_store, sql_table

NS = "orders/billing"

# -- Redis -------------------------------------------------------------------------


def _client(server: RedisServer, timeout: float = 2.0) -> Any:
    """A client that gives up quickly: one retry, short backoff (the caller's deadline)."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return server.client(
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 1),
    )


def test_redis_paused_past_the_socket_timeout_fails_closed(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        store = RedisStore(_client(server, timeout=0.5))
        done = [f"done{i}" for i in range(50)]
        claims = store.claim_many(done, namespace=NS)
        store.complete_many([(c.key, c.token, "r") for c in claims], namespace=NS)
        server.pause()
        try:
            for call in (
                lambda: store.claim("paused", namespace=NS, owner="w"),
                lambda: store.claim_many(done, namespace=NS),
                lambda: store.complete("done0", 1, namespace=NS),
                lambda: store.get("done0", namespace=NS),
            ):
                with pytest.raises(UnavailableError):
                    call_in_thread(call)
        finally:
            server.resume()
        # The store answers again on the same client; nothing acknowledged was lost.
        again = call_in_thread(lambda: store.claim_many(done, namespace=NS))
        assert {(c.outcome, c.result) for c in again} == {(Outcome.DUPLICATE, "r")}
        # A timed-out claim may still reach the server after SIGCONT: then it is held
        # for its owner, never NEW to anyone else.
        rec = store.get("paused", namespace=NS)
        if rec is not None:
            assert (rec.state, rec.owner) == (State.PROCESSING, b"w")
            assert store.claim("paused", namespace=NS, owner="other").outcome is (
                Outcome.IN_PROGRESS
            )
            assert store.claim("paused", namespace=NS, owner="w").token == rec.token
        else:
            assert store.claim("paused", namespace=NS, owner="w").outcome is Outcome.NEW


def test_redis_from_url_has_timeouts_so_a_paused_server_fails_closed(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        store = open_store(url, timeout=0.5)
        assert isinstance(store, RedisStore)
        assert store.claim("before", namespace=NS).outcome is Outcome.NEW
        server.pause()
        try:
            for call in (
                lambda: store.claim("paused", namespace=NS),
                lambda: store.complete("before", 1, namespace=NS),
                lambda: store.get("before", namespace=NS),
            ):
                with pytest.raises(UnavailableError):
                    call_in_thread(call, limit=30)  # returns: ~2 x 0.5 s, never a hang
        finally:
            server.resume()
        store.complete("before", 1, namespace=NS)
        assert store.claim("before", namespace=NS).outcome is Outcome.DUPLICATE
        store.close()


def test_redis_timeouts_are_defaults_that_urls_and_options_override() -> None:
    def pool_options(store: Any) -> dict[str, Any]:
        options: dict[str, Any] = store.client.connection_pool.connection_kwargs
        return options

    url = f"redis://127.0.0.1:{free_port()}/0"
    defaults = pool_options(RedisStore.from_url(url))
    assert (defaults["socket_timeout"], defaults["socket_connect_timeout"]) == (5.0, 5.0)
    assert defaults["socket_keepalive"] is True and defaults["retry"].get_retries() == 1
    assert pool_options(RedisStore.from_url(url, timeout=2))["socket_timeout"] == 2.0
    by_url = pool_options(RedisStore.from_url(url + "?socket_timeout=0.25", timeout=2))
    assert (by_url["socket_timeout"], by_url["socket_connect_timeout"]) == (0.25, 2.0)
    own = pool_options(RedisStore.from_url(url, client_options={"socket_keepalive": False}))
    assert own["socket_keepalive"] is False
    for bad in (0, -1, float("inf"), 1e39):
        with pytest.raises(ValueError, match="timeout"):
            RedisStore.from_url(url, timeout=bad)


def test_redis_store_opens_while_its_server_is_down(tmp_path: Path) -> None:
    server = RedisServer(free_port(), tmp_path)
    try:
        store = open_store(f"redis://127.0.0.1:{server.port}/0", timeout=1)
        assert isinstance(store, RedisStore)
        with pytest.raises(UnavailableError):
            call_in_thread(lambda: store.claim("k", namespace=NS))
        server.start()
        c = store.claim("k", namespace=NS)
        assert c.outcome is Outcome.NEW
        store.complete("k", c.token, namespace=NS)
        assert store.claim("k", namespace=NS).outcome is Outcome.DUPLICATE
        store.close()
    finally:
        server.kill()


def test_redis_warns_on_first_contact_and_when_the_server_restarted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with redis_server(tmp_path) as server:
        with caplog.at_level(logging.INFO, logger="dedupcore"):
            store = RedisStore.from_url(f"redis://127.0.0.1:{server.port}/0", timeout=1)
            assert caplog.records == []  # nothing was sent
            claims = store.claim_many([f"k{i}" for i in range(10)], namespace=NS)
            store.complete_many([(c.key, c.token) for c in claims], namespace=NS)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "can lose acknowledged claims: no AOF" in warned[0]
        assert store.stats()["restarts"] == 0
        caplog.clear()
        server.cli("shutdown", "nosave")
        server.wait_exit()
        server.start()
        with caplog.at_level(logging.WARNING, logger="dedupcore"):
            try:
                got = store.claim_many([f"k{i}" for i in range(10)], namespace=NS)
            except UnavailableError:  # the pooled connection died with the server
                got = store.claim_many([f"k{i}" for i in range(10)], namespace=NS)
        # The restart lost every record: the keys are NEW again, and the log says why.
        assert {c.outcome for c in got} == {Outcome.NEW}
        (restart,) = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
        assert "run_id changed" in restart and "no AOF" in restart
        assert store.stats()["restarts"] == 1


def test_redis_with_fsync_always_does_not_warn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with redis_server(tmp_path, "--appendonly", "yes", "--appendfsync", "always") as server:
        with caplog.at_level(logging.INFO, logger="dedupcore"):
            store = RedisStore(_client(server))
            assert store.claim("k", namespace=NS).outcome is Outcome.NEW
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        assert "appendfsync always" in caplog.records[0].getMessage()


def test_stacks_report_their_authority_s_and_their_weakest_shard_s_durability(
    tmp_path: Path,
) -> None:
    with (
        redis_server(tmp_path / "a", "--appendonly", "yes", "--appendfsync", "always") as safe,
        redis_server(tmp_path / "b") as bare,
    ):
        urls = [f"redis://127.0.0.1:{server.port}/0" for server in (safe, bare)]
        with open_store(urls[0], archive=tmp_path / "cold") as stack:
            assert isinstance(stack, TieredStore)
            assert stack.durability().startswith("appendfsync always: survives a Redis crash")
        with open_store(urls) as sharded:
            said = sharded.durability()
            assert said.startswith("shard 1 of 2 (the weakest): no AOF")
            assert "processed keys can come back NEW" in said
        with open_store(urls[::-1], cache=RedisCache.from_url(urls[0])) as stacks:
            assert stacks.durability().startswith("shard 0 of 2 (the weakest): no AOF")
        with open_store(urls[:1] * 2) as both_safe:
            assert both_safe.durability().startswith("shard 0 of 2 (the weakest): appendfsync")


def _stopped_server_is_unavailable(store: RedisStore) -> None:
    for call in (
        lambda: store.claim("fresh", namespace=NS),
        lambda: store.complete("done0", 1, namespace=NS),
        lambda: store.get("done0", namespace=NS),
        lambda: store.durability(),
        lambda: store.expiring(NS, within=60),
    ):
        with pytest.raises(UnavailableError):
            call_in_thread(call)
    assert "unavailable" in call_in_thread(store.stats)  # metrics do not raise


def test_redis_stopped_without_persistence_loses_what_durability_says(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        store = RedisStore(_client(server))
        said = store.durability()
        assert said.startswith("no AOF") and "processed keys can come back NEW" in said
        done = [f"done{i}" for i in range(20)]
        claims = store.claim_many(done, namespace=NS)
        store.complete_many([(c.key, c.token) for c in claims], namespace=NS)
        server.cli("shutdown", "nosave")
        server.wait_exit()
        _stopped_server_is_unavailable(store)
        server.start()
        # As durability() said: the records are gone and the keys are NEW again.
        assert {c.outcome for c in store.claim_many(done, namespace=NS)} == {Outcome.NEW}


@pytest.mark.parametrize("stop", ["shutdown nosave", "SIGKILL"])
def test_redis_with_fsync_always_aof_keeps_acknowledged_keys(tmp_path: Path, stop: str) -> None:
    with redis_server(tmp_path, "--appendonly", "yes", "--appendfsync", "always") as server:
        store = RedisStore(_client(server))
        assert store.durability().startswith("appendfsync always: survives a Redis crash")
        done = [f"done{i}" for i in range(200)]
        claims = store.claim_many(done, namespace=NS)
        store.complete_many([(c.key, c.token, c.key) for c in claims], namespace=NS)
        held = store.claim_many(["held"], namespace=NS, owner="w")[0]
        if stop == "SIGKILL":
            server.kill()
        else:
            server.cli("shutdown", "nosave")
            server.wait_exit()
        _stopped_server_is_unavailable(store)
        server.start()
        again = store.claim_many(done, namespace=NS)
        assert [(c.outcome, c.result) for c in again] == [(Outcome.DUPLICATE, k) for k in done]
        assert store.claim("held", namespace=NS).outcome is Outcome.IN_PROGRESS
        assert store.claim("held", namespace=NS, owner="w").token == held.token


def test_redis_that_can_evict_is_refused(tmp_path: Path) -> None:
    with redis_server(tmp_path, "--maxmemory-policy", "allkeys-lru") as server:
        client = server.client()
        refused = RedisStore(client)  # nothing is sent before the first call
        for call in (
            lambda: refused.claim("k", namespace=NS),
            lambda: refused.complete("k", 1, namespace=NS),
            lambda: refused.get("k", namespace=NS),
        ):
            with pytest.raises(DedupError, match="maxmemory-policy is 'allkeys-lru'"):
                call()
        assert refused.stats()["maxmemory_policy"] == "allkeys-lru"
        store = RedisStore(client, allow_eviction=True)
        assert store.stats()["maxmemory_policy"] == "allkeys-lru"
        assert store.claim("k", namespace=NS).outcome is Outcome.NEW


def test_redis_without_config_says_durability_is_unknown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Managed Redis services often disable CONFIG: nothing can be promised.
    with redis_server(tmp_path, "--rename-command", "CONFIG", '""') as server:
        with caplog.at_level(logging.WARNING, logger="dedupcore"):
            store = RedisStore(server.client())
            assert caplog.text == ""  # nothing is sent before the first call
            assert store.claim("k", namespace=NS).outcome is Outcome.NEW
        assert "maxmemory-policy and persistence are unknown" in caplog.text
        assert "can lose acknowledged claims: unknown" in caplog.text
        assert store.durability().startswith("unknown")


# -- PostgreSQL, private instance ----------------------------------------------------


class PrivatePostgres:
    """A throwaway PostgreSQL cluster: initdb into a temp dir, pg_ctl on a free port."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            pytest.fail("PostgreSQL server binaries are not installed (scripts/services.sh)")
        self.bin = Path(found[-1]).parent
        self.root = os.geteuid() == 0
        # initdb refuses to run as root: run the server as the postgres OS user,
        # in a directory that user owns (pytest's tmp_path is private to root).
        self.dir = Path(tempfile.mkdtemp(prefix="dedupcore-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        if self.root:
            shutil.chown(self.dir, "postgres", "postgres")

    def run(self, *args: str, timeout: float = 120) -> None:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if self.root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {out.stdout.decode()} {out.stderr.decode()}")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        self.run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.dir / "log"),
            "-w",
            "start",
            "-o",
            self._options(),
        )

    def _options(self) -> str:
        return (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
            "-c shared_buffers=16MB -c max_connections=20"
        )

    def restart(self, mode: str) -> None:
        self.run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.dir / "log"),
            "-w",
            "-m",
            mode,
            "restart",
            "-o",
            self._options(),
        )

    def processes(self) -> list[int]:
        """The postmaster and its children (backends and auxiliary processes)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                text = Path(stat).read_text()
                if int(text[text.rindex(")") + 2 :].split()[1]) == postmaster:
                    children.append(int(text.split()[0]))
        return [postmaster, *children]

    def pause(self) -> list[int]:
        """SIGSTOPs the whole server; the pids to resume."""
        pids = self.processes()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return pids

    @staticmethod
    def resume(pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run("pg_ctl", "-D", str(self.data), "-w", "-m", "immediate", "stop", timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def private_pg() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()
    try:
        pg.run(
            "initdb",
            "-D",
            str(pg.data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        pg.start()
        yield pg
    finally:
        pg.stop()


def test_postgresql_restarted_mid_batch(private_pg: PrivatePostgres) -> None:
    with SqlStore.from_url(private_pg.url, retries=2) as setup:
        setup.init_schema()
    store = SqlStore.from_url(private_pg.url, retries=2, connect_args={"connect_timeout": 2})
    acked: list[list[str]] = []  # batches whose claims were returned
    completed: list[str] = []  # completions acknowledged
    failed: list[list[str]] = []  # batches that raised UnavailableError
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker() -> None:
        i = 0
        try:
            while not stop.is_set():
                batch = [f"b{i}-{j}" for j in range(300)]
                i += 1
                try:
                    claims = store.claim_many(batch, namespace=NS, owner="w", lease=600)
                except UnavailableError:
                    failed.append(batch)
                    time.sleep(0.05)
                    continue
                assert all(c.outcome is Outcome.NEW for c in claims)
                acked.append(batch)
                half = batch[:150]
                with contextlib.suppress(UnavailableError):
                    store.complete_many([(k, 1, k) for k in half], namespace=NS)
                    completed.extend(half)
        except BaseException as exc:
            errors.append(exc)

    def wait_for_batches(n: int) -> None:
        deadline = time.monotonic() + 120  # only a guard against a hang
        while len(acked) < n and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        for mode in ("fast", "immediate"):
            wait_for_batches(len(acked) + 3)
            private_pg.restart(mode)
        wait_for_batches(len(acked) + 3)  # the store reconnected and answers again
    finally:
        stop.set()
        thread.join(120)
    assert not errors, errors
    print(
        f"batches acknowledged {len(acked)}, failed {len(failed)}, "
        f"completions acknowledged {len(completed)}, store stats {store.stats()}"
    )
    assert failed, "no batch ran into a restart"
    assert store.stats()["unavailable"] >= 1
    done = set(completed)
    with SqlStore.from_url(private_pg.url) as other:
        for batch in acked:
            got = other.claim_many(batch, namespace=NS, owner="other")
            for c in got:
                if c.key in done:
                    assert c.outcome is Outcome.DUPLICATE and c.result == c.key, c
                else:
                    # Acknowledged to "w" and not completed: still held for "w".
                    assert c.outcome in (Outcome.IN_PROGRESS, Outcome.DUPLICATE), c
                    assert c.outcome is Outcome.DUPLICATE or c.token == 1
        for batch in failed:
            # Unknown whether the cut-off transaction committed: held for "w" or absent,
            # never processed.
            for key in batch:
                rec = other.get(key, namespace=NS)
                assert rec is None or (rec.state, rec.owner) == (State.PROCESSING, b"w")
    store.close()


def test_postgresql_paused_fails_closed_within_the_timeout(private_pg: PrivatePostgres) -> None:
    url = private_pg.url
    with SqlStore.from_url(url, table="paused") as setup:
        setup.init_schema()
    store = SqlStore.from_url(url, table="paused", timeout=1)
    assert store.claim("before", namespace=NS).outcome is Outcome.NEW
    pids = private_pg.pause()
    try:
        # The open connection waits for a reply the stopped server never sends: it is cut
        # after 2 x timeout. Later calls cannot connect (connect_timeout). Generous limits:
        # the point is that each call returns.
        for call in (
            lambda: store.claim("paused", namespace=NS),
            lambda: store.complete("before", 1, namespace=NS),
            lambda: store.get("before", namespace=NS),
        ):
            with pytest.raises(UnavailableError):
                call_in_thread(call, limit=60)
        assert store.stats()["cut_connections"] == 1
        # A store opened now opens at once (nothing is sent) and fails closed.
        late = SqlStore.from_url(url, table="paused", timeout=1)
        with pytest.raises(UnavailableError):
            call_in_thread(lambda: late.claim("late", namespace=NS), limit=60)
    finally:
        private_pg.resume(pids)
    store.complete("before", 1, namespace=NS)
    assert store.claim("before", namespace=NS).outcome is Outcome.DUPLICATE
    assert late.claim("late", namespace=NS).outcome is Outcome.NEW
    assert store.get("paused", namespace=NS) is None  # the cut claim never ran
    store.close()
    late.close()


def test_postgresql_timeouts_are_defaults_that_the_url_overrides(
    private_pg: PrivatePostgres,
) -> None:
    def setting(store: SqlStore, name: str) -> str:
        value: str = store._tx(lambda cur: cur.execute(f"SHOW {name}").fetchone()[0], write=False)
        return value

    with SqlStore.from_url(private_pg.url) as default:
        assert setting(default, "statement_timeout") == "5s"
        assert default.timeout == 5.0 and default._watchdog is not None  # one deadline a call
    with SqlStore.from_url(private_pg.url, timeout=0.5) as short:
        assert setting(short, "statement_timeout") == "500ms"
    given = private_pg.url + "?options=-c%20statement_timeout%3D1234&keepalives_idle=7"
    with SqlStore.from_url(given) as by_url:
        assert setting(by_url, "statement_timeout") == "1234ms"
        conn = by_url._conn
        assert conn.info.get_parameters()["keepalives_idle"] == "7"
        assert conn.info.get_parameters()["keepalives"] == "1"


# -- MariaDB and PostgreSQL (shared servers, own table, own connections) ---------------


def test_mariadb_over_long_key_is_refused_before_any_sql(tmp_path: Path) -> None:

    engine = sql_table("mysql", tmp_path)
    with engine.store() as s:
        s.init_schema()
    try:
        store, conns = counting_store(engine)
        del conns[0].statements[:]
        # 256 two-byte characters fill the VARBINARY(512) column exactly; one more does not.
        with pytest.raises(ValueError, match=r"514 bytes.*max_key_bytes=512"):
            store.claim("é" * 257, namespace=NS)
        with pytest.raises(ValueError, match="max_key_bytes=512"):
            store.complete_many([("é" * 257, 1)], namespace=NS)
        assert conns[0].statements == []
        exact = store.claim("é" * 256, namespace=NS)
        assert exact.outcome is Outcome.NEW
        store.complete("é" * 256, exact.token, namespace=NS)
        # Nothing was truncated: a key that shares the first 510 bytes is another key.
        assert store.claim("é" * 255 + "e", namespace=NS).outcome is Outcome.NEW
        assert store.claim("é" * 256, namespace=NS).outcome is Outcome.DUPLICATE
        rows = engine.execute(f"SELECT LENGTH(`key`) FROM {engine.table} ORDER BY 1")
        assert [r[0] for r in rows] == [511, 512]
        with (
            engine.store(max_key_bytes=64) as small,
            pytest.raises(ValueError, match="max_key_bytes=64"),
        ):
            small.claim(b"k" * 65, namespace=NS)
        store.close()
    finally:
        engine.execute(f"DROP TABLE IF EXISTS {engine.table}")


@pytest.mark.parametrize("name", ["postgresql", "mysql"])
def test_completion_survives_a_dropped_connection(
    name: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Extends test_sql_store's dropped-connection test: the same store retries and wins."""

    if name == "postgresql":  # the private server: the shared one may be out of connections
        pg: PrivatePostgres = request.getfixturevalue("private_pg")
        engine = SqlTable(name, pg.url, f"dedup_t_{uuid.uuid4().hex[:12]}")
    else:
        engine = sql_table(name, tmp_path)
    with engine.store() as s:
        s.init_schema()
    try:
        store, conns = engine.tracked_store()
        keys = [f"k{i}" for i in range(20)]
        claims = store.claim_many(keys, namespace=NS)
        engine.kill(conns[-1])  # dropped between claim and complete
        try:
            store.complete_many([(c.key, c.token, "r") for c in claims], namespace=NS)
        except UnavailableError:
            # Not applied (the connection was gone before the transaction began):
            # the same store reconnects and the retried completion goes through.
            store.complete_many([(c.key, c.token, "r") for c in claims], namespace=NS)
        assert len(conns) == 2
        # Dropped after the completion was acknowledged: it is kept.
        engine.kill(conns[-1])
        with pytest.raises(UnavailableError):
            store.claim_many(keys, namespace=NS)
        again = store.claim_many(keys, namespace=NS)
        assert {(c.outcome, c.result) for c in again} == {(Outcome.DUPLICATE, "r")}
        with engine.store() as other:
            assert {other.get(k, namespace=NS).state for k in keys} == {State.PROCESSED}  # type: ignore[union-attr]
        store.close()
    finally:
        engine.execute(f"DROP TABLE IF EXISTS {engine.table}")
