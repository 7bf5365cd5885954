"""What the benchmark suites share: sizes, keys, result rows, the peers' servers, the daemon.

Every suite (``benchmarks/test_*.py``, run with ``./dev bench SUITE``: benchmarks/README.md)
compares dedupcore with what users would pick instead on the same keys in the same run
(this machine is shared and noisy: only ratios taken within one run mean much). What
they have in common is here, once:

- sizes from ``DEDUPCORE_BENCH_*`` variables, with the small sizes of ``--quick``
  (``DEDUPCORE_BENCH_QUICK=1``) where a suite names them;
- random 16-byte keys from a seed (``DEDUPCORE_BENCH_SEED``);
- a benchmark's row in the pytest-benchmark JSON (:func:`record`): what it measured,
  per-key figures, the load average and the code measured;
- timed single calls and their percentiles;
- Redis: a flushed db of the local server, a private ``appendfsync always`` server,
  the pipelined ``SET NX PX`` peer;
- the embedded store in fresh temporary directories, ``claim_many`` in batches;
- ``dedupcore serve`` in a fresh directory per round, its CPU by thread, the
  processes that load it with big batches;
- PostgreSQL, MariaDB and SQLite: dedupcore's and the peer's tables, raw connections.

Only correctness is ever asserted in the suites (outcomes, zero errors), never timings.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
KEY_BYTES = 16

# -- sizes ------------------------------------------------------------------------------------

#: ``./dev bench SUITE --quick``: every size a suite gives a quick value takes it (seconds
#: instead of minutes; the figures are then indicative only).
QUICK = os.environ.get("DEDUPCORE_BENCH_QUICK", "") not in ("", "0")


def env_int(name: str, default: int, quick: int | None = None, minimum: int = 1) -> int:
    """An integer of at least ``minimum`` from the environment (``_`` allowed as in
    ``1_000``); unset: ``quick`` under ``--quick`` when given, else ``default``."""
    raw = os.environ.get(name, "").replace("_", "").strip()
    if not raw:
        return quick if QUICK and quick is not None else default
    value = int(raw)
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}")
    return value


def env_str(name: str, default: str) -> str:
    """A string from the environment; unset or empty: ``default``."""
    return os.environ.get(name, "") or default


SEED = env_int("DEDUPCORE_BENCH_SEED", 20240601)


@dataclass(frozen=True)
class SuiteConfig:
    """What the store, daemon and tiers suites size alike, from ``DEDUPCORE_BENCH_<SUITE>_*``:
    ``N`` keys of the batch benchmarks, ``SINGLE`` timed single calls, ``BATCH`` keys per
    batch (1000), ``ROUNDS`` (3), ``REDIS_DB`` (the suite's db of the Redis at
    ``DEDUPCORE_BENCH_REDIS_URL``); the seed, and the ``PX`` of the Redis peers' ``SET``.
    A suite's config adds its own sizes."""

    n: int
    single: int
    batch: int
    rounds: int
    seed: int
    redis_url: str
    redis_db: int
    px_ms: int

    @staticmethod
    def common(
        suite: str, *, n: tuple[int, int], single: tuple[int, int], redis_db: int
    ) -> dict[str, Any]:
        """The shared fields of ``suite`` (STORE, DAEMON, TIER); ``n`` and ``single`` are
        (default, ``--quick``) sizes."""
        prefix = f"DEDUPCORE_BENCH_{suite}"
        return {
            "n": env_int(f"{prefix}_N", n[0], quick=n[1]),
            "single": env_int(f"{prefix}_SINGLE", single[0], quick=single[1]),
            "batch": env_int(f"{prefix}_BATCH", 1000),
            "rounds": env_int(f"{prefix}_ROUNDS", 3),
            "seed": SEED,
            "redis_url": env_str("DEDUPCORE_BENCH_REDIS_URL", "redis://127.0.0.1:6379"),
            "redis_db": env_int(f"{prefix}_REDIS_DB", redis_db, minimum=0),
            "px_ms": 30_000,
        }


#: Where temporary stores, daemons, Redis and SQLite files go (``DEDUPCORE_BENCH_DIR``; a real
#: disk: fdatasync is measured).
TMP_DIR = env_str("DEDUPCORE_BENCH_DIR", tempfile.gettempdir())

# -- keys ---------------------------------------------------------------------------------------


def random_keys(count: int, seed: int) -> list[bytes]:
    """``count`` random 16-byte keys, the same for the same seed."""
    buf = random.Random(seed).randbytes(KEY_BYTES * count)
    return [buf[i : i + KEY_BYTES] for i in range(0, KEY_BYTES * count, KEY_BYTES)]


class Tenths:
    """When a run of ``n`` keys passes each tenth of them: its throughput over time."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.offsets = sorted({min(n, round(n * i / 10)) for i in range(1, 11)})
        self.start = 0.0
        self.marks: list[float] = []
        self._todo: list[int] = []

    def begin(self) -> None:
        """Called right before the timed run."""
        self.marks.clear()
        self._todo = list(self.offsets)
        self.start = time.perf_counter()

    def passed(self, done: int) -> None:
        """Called after each batch with the keys done so far."""
        if self._todo and done >= self._todo[0]:
            self._todo.pop(0)
            self.marks.append(time.perf_counter())

    def rates(self) -> list[float]:
        """Keys per second in each tenth."""
        bounds, offsets = [self.start, *self.marks], [0, *self.offsets]
        return [
            (offsets[i + 1] - offsets[i]) / (bounds[i + 1] - bounds[i])
            for i in range(min(len(bounds), len(offsets)) - 1)
        ]


def claim_batches(
    api: Any, keys: list[bytes], batch: int, namespace: str, tenths: Tenths | None = None
) -> None:
    """``api.claim_many`` per batch of ``batch`` keys (a store or a client; the outcomes are
    checked afterwards, from ``stats()``)."""
    claim_many = api.claim_many
    for i in range(0, len(keys), batch):
        claim_many(keys[i : i + batch], namespace=namespace)
        if tenths is not None:
            tenths.passed(i + batch)


def claim_and_complete(api: Any, keys: list[bytes], batch: int, namespace: str) -> None:
    """Claims and completes every key, a batch at a time (an untimed setup: afterwards
    every key answers DUPLICATE)."""
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        claims = api.claim_many(chunk, namespace=namespace)
        api.complete_many(
            [(k, c.token) for k, c in zip(chunk, claims, strict=True)], namespace=namespace
        )


def outcomes(api: Any, namespace: str) -> dict[str, int]:
    """NEW, DUPLICATE and IN_PROGRESS answers of ``namespace`` so far, from ``stats()``."""
    counts = api.stats()["namespaces"].get(namespace, {})
    return {k: counts.get(k, 0) for k in ("new", "duplicate", "in_progress")}


# -- rows ---------------------------------------------------------------------------------------

_LOAD_AT_START: list[float] = []


def note_load_start() -> None:
    """Keeps the 1-minute load average as a benchmark starts (a noisy-machine hint)."""
    _LOAD_AT_START[:] = [os.getloadavg()[0]]


@functools.cache
def provenance() -> dict[str, Any]:
    """What was measured: the commit, the files of dedupcore/ and ext/ changed since, a
    digest of the package's code byte for byte, and the interpreter and its libraries."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "sqlite_version": sqlite3.sqlite_version,
        "cpus": os.cpu_count(),
    }
    try:
        info["git_rev"] = _git("rev-parse", "--short", "HEAD").strip()
        dirty = _git("status", "--porcelain", "--", "dedupcore", "ext").split("\n")
        info["git_dirty"] = sorted(line[3:] for line in dirty if line.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    digest = hashlib.sha256()
    package = REPO / "dedupcore"
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.so")]):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    info["dedupcore_sha256"] = digest.hexdigest()[:16]
    try:
        import uvloop  # noqa: F401
    except ImportError:
        info["event_loop"] = "asyncio"
    else:
        info["event_loop"] = "uvloop"
    return info


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout


def record(
    benchmark: Any, *, library: str, operation: str, n_keys: int, call: str, **extra: Any
) -> dict[str, Any]:
    """A benchmark's row: writes what it measured into its ``extra_info`` with the load
    average at its start and end, :func:`provenance` and the per-key figures of its
    fastest and median rounds; returns the dict for more figures.

    The reports (``python -m benchmarks.report SUITE``) read the rows by ``operation``
    and ``library``."""
    info: dict[str, Any] = benchmark.extra_info
    info.update(
        library=library,
        operation=operation,
        n_keys=n_keys,
        call=call,
        loadavg_1min=[*_LOAD_AT_START, os.getloadavg()[0]],
        **provenance(),
        **extra,
    )
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if stats is not None and n_keys:
        info["ns_per_key"] = stats.min / n_keys * 1e9
        info["ns_per_key_median"] = stats.median / n_keys * 1e9
        info["keys_per_s"] = n_keys / stats.min
        info["keys_per_s_median"] = n_keys / stats.median
        if len(stats.data) <= 100:  # a pedantic run's rounds, not an automatic calibration's
            info["round_seconds"] = list(stats.data)
    return info


# -- single calls -------------------------------------------------------------------------------


def timed_calls(call: Callable[[bytes], Any], keys: Sequence[bytes]) -> list[int]:
    """One call per key, each timed with ``perf_counter_ns``."""
    clock = time.perf_counter_ns
    out: list[int] = []
    append = out.append
    for k in keys:
        t0 = clock()
        call(k)
        append(clock() - t0)
    return out


def percentiles(samples_ns: list[int], unit: str = "ns") -> dict[str, float]:
    """p50 .. p99.9, max and mean of ``samples_ns`` in ``unit`` (``ns`` or ``us``), and
    the number of calls."""
    scale = {"ns": 1.0, "us": 1e-3}[unit]
    s = sorted(samples_ns)
    n = len(s)

    def q(p: float) -> float:
        return s[min(n - 1, int(p * n))] * scale

    return {
        f"p50_{unit}": q(0.50),
        f"p90_{unit}": q(0.90),
        f"p99_{unit}": q(0.99),
        f"p999_{unit}": q(0.999),
        f"max_{unit}": s[-1] * scale,
        f"mean_{unit}": statistics.fmean(s) * scale,
        "calls": n,
    }


# -- Redis --------------------------------------------------------------------------------------

#: The key prefix of the Redis peers (a suite refuses a db holding other keys).
REDIS_PREFIX = b"dcbench:"


def redis_db(url: str, db: int, prefix: bytes | None = REDIS_PREFIX) -> Iterator[Any]:
    """A redis-py client of ``db`` at ``url``, flushed before and after (a fixture's body).

    Skips when redis-py is missing, no Redis answers, or (with ``prefix``) the db holds
    a key without it: a db this suite did not write to."""
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(url, db=db)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {url}: {exc}")
    if prefix is not None:
        for key in client.scan_iter(count=1000):
            if not key.startswith(prefix):
                pytest.skip(
                    f"Redis db {db} holds keys without the {prefix!r} prefix (e.g. {key!r}); "
                    "point the suite at an unused db"
                )
            break
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def redis_info(client: Any) -> dict[str, Any]:
    """The Redis measured: version, AOF and fsync settings, redis-py's reply parser."""
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        HIREDIS_AVAILABLE = False
    persistence = client.info("persistence")
    return {
        "redis_version": client.info("server").get("redis_version"),
        "redis_aof_enabled": persistence.get("aof_enabled"),
        "redis_appendfsync": client.config_get("appendfsync").get("appendfsync"),
        "redis_parser": "hiredis" if HIREDIS_AVAILABLE else "python",
    }


def redis_claim_batches(
    client: Any, keys: list[bytes], batch: int, px: int, tenths: Tenths | None = None
) -> int:
    """The peer of ``claim_many``: pipelined ``SET k 1 NX PX px`` per batch (one
    ``execute`` each); returns how many keys were new."""
    fresh = 0
    for i in range(0, len(keys), batch):
        pipe = client.pipeline(transaction=False)
        set_ = pipe.set
        for k in keys[i : i + batch]:
            set_(k, 1, nx=True, px=px)
        fresh += pipe.execute().count(True)
        if tenths is not None:
            tenths.passed(i + batch)
    return fresh


def _wait(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    """Until ``ready()`` (errors count as not yet), or RuntimeError when ``proc`` exits
    or 60 s pass."""
    deadline = time.monotonic() + 60.0
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if ready():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within 60 s")
        time.sleep(0.02)


class PrivateRedis:
    """A redis-server of the run's own: ``appendonly yes``, ``appendfsync always`` (every
    write is fsynced before its reply, the durability a durable claim has), its files in
    the benchmarks' temporary directory, so both wait for the same disk."""

    def __init__(self) -> None:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (needed for the appendfsync-always peer)")
        self.root = Path(tempfile.mkdtemp(prefix="dcr", dir=TMP_DIR))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        argv = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root)]
        argv += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}"
        self.client = redis.Redis.from_url(self.url)
        try:
            _wait(self.client.ping, self.proc, "the private redis-server")
        except RuntimeError:
            self.close()
            raise
        assert self.client.config_get("appendfsync")["appendfsync"] == "always"

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


# -- the embedded store -------------------------------------------------------------------------


class Workspace:
    """Fresh temporary directories, one per round; the previous one is closed and removed."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.dir: Path | None = None
        self.closers: list[Callable[[], None]] = []
        self.close_seconds: list[float] = []

    def fresh(self) -> Path:
        self.clear()
        self.dir = Path(tempfile.mkdtemp(prefix=f"dcbench-{self.tag}-", dir=TMP_DIR))
        return self.dir

    def on_clear(self, fn: Callable[[], None]) -> None:
        self.closers.append(fn)

    def clear(self) -> None:
        started = time.perf_counter()
        while self.closers:
            self.closers.pop()()
        if self.dir is not None:
            self.close_seconds.append(time.perf_counter() - started)
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def open_store(self, **config: Any) -> Any:
        """A ``DedupStore`` in a fresh directory, closed at the next :meth:`clear`."""
        from dedupcore.store import DedupStore

        store = DedupStore.open(self.fresh() / "store", **config)
        self.on_clear(store.close)
        return store


# -- the daemon ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


class Daemon:
    """One ``dedupcore serve`` subprocess on a fresh data directory, answering ping.

    ``command`` runs it (default ``python -m dedupcore``; the trace tool wraps it)."""

    def __init__(self, durability: str = "durable", command: Sequence[str] = ()) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="dcb", dir=TMP_DIR))  # 0700, a short path
        self.socket = str(self.root / "d.sock")
        self.data = self.root / "data"
        self.log = self.root / "daemon.log"
        self.clients: list[Any] = []
        path = [str(REPO), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
        argv = [*(command or (sys.executable, "-m", "dedupcore")), "serve"]
        argv += ["--data", str(self.data), "--socket", self.socket, "--durability", durability]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
            )
        try:
            _wait(self._ping, self.proc, "dedupcore serve")
        except RuntimeError as exc:
            tail = self.log.read_text(errors="replace")[-2000:]
            self.stop()
            raise RuntimeError(f"{exc}: {tail}") from None
        self.cpu_start = cpu_seconds(self.proc.pid)

    def _ping(self) -> bool:
        from dedupcore.client import Client

        with Client(self.socket, timeout=2.0, retries=0) as c:
            return bool(c.ping())

    def client(self) -> Any:
        """A connected client (the connection is made here, outside any timing)."""
        from dedupcore.client import Client

        c = Client(self.socket)
        self.clients.append(c)
        assert c.ping()
        return c

    def finish(self, namespace: str) -> dict[str, Any]:
        """The round's figures: outcomes, the daemon's request counters, CPU by thread."""
        cpu_end = cpu_seconds(self.proc.pid)
        with self.client() as c:
            st = c.stats()
        pid = self.proc.pid
        loop_cpu = cpu_end.get(pid, 0.0) - self.cpu_start.get(pid, 0.0)
        other_cpu = sum(cpu_end.values()) - sum(self.cpu_start.values()) - loop_cpu
        counts = st["namespaces"].get(namespace, {})
        d = st.get("daemon", {})
        return {
            "outcomes": {k: counts.get(k, 0) for k in ("new", "duplicate", "in_progress")},
            "requests": d.get("requests", 0),
            "request_seconds": d.get("request_seconds", 0.0),
            "errors": d.get("errors", 0) + d.get("protocol_errors", 0),
            "checkpoints": st.get("checkpoints"),
            "cpu_event_loop_s": loop_cpu,
            "cpu_other_threads_s": other_cpu,
            "threads": len(cpu_end),
        }

    def stop(self) -> None:
        # Close our connections first: the daemon's drain on SIGTERM waits
        # for open connections (up to its 30 s drain timeout when one idles).
        while self.clients:
            self.clients.pop().close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


#: How long a loader sends batches at the most, whatever the run does.
LOADER_MAX_SECONDS = 900.0


def loader(
    target: str,
    kind: str,
    seed: int,
    started: Any,
    stop: Any,
    results: Any,
    namespace: str,
    batch: int = 100_000,
    px_ms: int = 30_000,
) -> None:
    """A process that sends batches of ``batch`` fresh keys until ``stop`` is set, to the
    daemon at socket ``target`` (``kind`` dedupcore) or the Redis at URL ``target``
    (pipelined ``SET NX PX``); reports how many it sent into ``results``.

    Bounded whatever happens to the run: it stops at its first error (a daemon or Redis
    that went away), when the process that started it is gone, and after
    LOADER_MAX_SECONDS.
    """
    report: dict[str, Any] = {"batches": 0, "errors": 0, "first_error": None}
    parent = os.getppid()
    deadline = time.monotonic() + LOADER_MAX_SECONDS
    try:
        rng = random.Random(seed)
        if kind == "dedupcore":
            from dedupcore.client import Client

            api = Client(target, timeout=120.0)

            def send(keys: list[bytes]) -> None:
                api.claim_many(keys, namespace=namespace + "/load")

        else:
            import redis

            r = redis.Redis.from_url(target)

            def send(keys: list[bytes]) -> None:
                redis_claim_batches(r, keys, len(keys), px_ms)

        started.release()
        while not stop.is_set() and os.getppid() == parent and time.monotonic() < deadline:
            keys = [rng.randbytes(KEY_BYTES) for _ in range(batch)]
            try:
                send(keys)
                report["batches"] += 1
            except Exception as exc:
                report["errors"] += 1
                report["first_error"] = report["first_error"] or repr(exc)
                break
    except BaseException as exc:
        report["errors"] += 1
        report["first_error"] = report["first_error"] or repr(exc)
        started.release()
    results.put(report)


# -- SQL servers --------------------------------------------------------------------------------


@dataclass
class SqlEngine:
    """One SQL server: dedupcore's table and the peer's, raw connections, cleanup."""

    name: str  # postgresql | mariadb | sqlite
    url: str
    tag: str
    sqlite_path: Path | None = None

    @property
    def dc_table(self) -> str:
        return f"dcbench_{self.tag}_dedup"

    @property
    def peer_table(self) -> str:
        return f"dcbench_{self.tag}_peer"

    def connect(self) -> Any:
        if self.name == "postgresql":
            import psycopg

            return psycopg.connect(self.url)
        if self.name == "mariadb":
            import pymysql

            u = urlsplit(self.url)
            return pymysql.connect(
                host=u.hostname or "127.0.0.1",
                port=u.port or 3306,
                user=unquote(u.username or "root"),
                password=unquote(u.password or ""),
                database=u.path.lstrip("/") or None,
            )
        assert self.sqlite_path is not None
        conn = sqlite3.connect(self.sqlite_path, isolation_level=None, check_same_thread=False)
        assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
        return conn

    def admin(self, *statements: str) -> None:
        conn = self.connect()
        try:
            cur = conn.cursor()
            for s in statements:
                cur.execute(s)
            cur.close()
            if self.name != "sqlite":
                conn.commit()
        finally:
            conn.close()

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        conn = self.connect()
        try:
            cur = conn.cursor()
            cur.execute(sql)
            return list(cur.fetchall())
        finally:
            conn.close()

    def peer_schema(self) -> str:
        """The peer's table: the namespace and the key, as the primary key."""
        t = self.peer_table
        if self.name == "postgresql":
            return (
                f'CREATE TABLE {t} (ns text COLLATE "C" NOT NULL, k bytea NOT NULL, '
                "PRIMARY KEY (ns, k))"
            )
        if self.name == "mariadb":
            return (
                f"CREATE TABLE {t} (ns VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT "
                "NULL, k VARBINARY(512) NOT NULL, PRIMARY KEY (ns, k)) ENGINE=InnoDB"
            )
        return (
            f"CREATE TABLE {t} (ns TEXT NOT NULL, k BLOB NOT NULL, PRIMARY KEY (ns, k)) "
            "WITHOUT ROWID"
        )

    def peer_insert(self) -> str:
        """The peer's insert of one row that does nothing when the key is there."""
        t = self.peer_table
        if self.name == "postgresql":
            return f"INSERT INTO {t} (ns, k) VALUES (%s, %s) ON CONFLICT DO NOTHING"
        if self.name == "mariadb":
            return f"INSERT INTO {t} (ns, k) VALUES (%s, %s) ON DUPLICATE KEY UPDATE k = k"
        return f"INSERT INTO {t} (ns, k) VALUES (?, ?) ON CONFLICT DO NOTHING"

    def empty(self, table: str) -> None:
        self.admin(f"DELETE FROM {table}" if self.name == "sqlite" else f"TRUNCATE TABLE {table}")

    def analyze(self, table: str) -> None:
        self.admin(f"ANALYZE {'TABLE ' if self.name == 'mariadb' else ''}{table}")

    def drop(self) -> None:
        if self.name == "sqlite":
            assert self.sqlite_path is not None
            for suffix in ("", "-wal", "-shm"):
                Path(str(self.sqlite_path) + suffix).unlink(missing_ok=True)
            return
        for attempt in range(30):  # a shared server may be out of connections for a while
            try:
                self.admin(
                    f"DROP TABLE IF EXISTS {self.dc_table}",
                    f"DROP TABLE IF EXISTS {self.peer_table}",
                )
                return
            except Exception:
                if attempt == 29:
                    raise
                time.sleep(2.0)

    def version(self) -> str:
        sql = "SELECT sqlite_version()" if self.name == "sqlite" else "SELECT version()"
        return f"{self.name} {self.query(sql)[0][0]}"

    def settings(self) -> dict[str, Any]:
        """What makes a commit durable or not on this server."""
        if self.name == "sqlite":
            return {"synchronous": self.query("PRAGMA synchronous")[0][0], "journal_mode": "wal"}
        if self.name == "postgresql":
            sql = (
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('synchronous_commit', 'fsync', 'wal_sync_method', 'shared_buffers')"
            )
        else:
            sql = (
                "SHOW VARIABLES WHERE Variable_name IN ('innodb_flush_log_at_trx_commit', "
                "'sync_binlog', 'log_bin', 'innodb_buffer_pool_size')"
            )
        return {str(k): str(v) for k, v in self.query(sql)}


def sql_engine(name: str, url: str, sqlite_dir: str = TMP_DIR) -> Iterator[SqlEngine]:
    """A fixture's body: the server ``name`` at ``url`` (SQLite: a new file in
    ``sqlite_dir``), skipped when its driver is missing or it does not answer; its
    tables are dropped afterwards."""
    tag = uuid.uuid4().hex[:10]
    if name == "sqlite":
        path = Path(sqlite_dir) / f"dcbench-{tag}.db"
        eng = SqlEngine(name, f"sqlite:///{path}", tag, sqlite_path=path)
    else:
        pytest.importorskip("psycopg" if name == "postgresql" else "pymysql")
        eng = SqlEngine(name, url, tag)
        try:
            eng.version()
        except Exception as exc:  # any driver error: the server is not there
            pytest.skip(f"no {name} at {url}: {exc}")
    try:
        yield eng
    finally:
        eng.drop()
