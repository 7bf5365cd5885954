"""``dedupcore serve`` against what users would pick instead (benchmarks/README.md).

Peers, on the same 16-byte keys, in the same run:

- ``claim_many`` through the daemon (sync ``dedupcore.Client``, batches of
  1000, fresh keys, the store's default ``durability="durable"``: a reply is
  sent after the fdatasync of the write-ahead log) against redis-py pipelined
  ``SET key 1 NX PX 30000`` (``pipeline(transaction=False)``, one ``execute``
  per 1000) on the same keys. For reference, the same batches into an
  in-process ``DedupStore`` (no socket, no protocol): the difference is what
  the daemon adds.
- one ``claim`` round trip, timed call by call with ``perf_counter_ns``
  (p50/p99), against one redis-py ``SET key 1 NX PX 30000`` round trip; for
  reference the in-process ``store.claim`` and a daemon started with
  ``--durability power-loss-unsafe`` (no fdatasync; the local Redis persists
  nothing either). The same for a claim+complete pair (two durable round
  trips) against redis-py ``SET NX PX`` then ``SET XX`` of a "done" value.
  The durable peers are the same commands against a private Redis started
  for the run with ``appendonly yes``, ``appendfsync always`` (it fsyncs its
  AOF before it answers), its files in the same directory as the daemon's;
  the ``power-loss-unsafe`` daemon is compared with the shared Redis, which
  persists nothing.
- one claim at a time while four other client processes send 100k-key
  ``claim_many`` batches (``latency-under-batches``): the single claim's
  p50/p99, against the same single ``SET NX PX`` while four processes send
  pipelines of 100k against the ``appendfsync always`` Redis.
- P client processes at once (``multiprocessing`` "spawn", default 8, each
  claiming its own slice of the fresh keys in batches of 1000, all released
  by one barrier once connected) against one client process alone with the
  same total keys, through the same harness: aggregate keys/s. Errors in
  the children are counted and must be zero (a correctness check).
- ``codec-client`` / ``codec-daemon``: the protocol work (msgpack, Claim
  objects) of claim_many on each side, with no socket and no store (where
  the daemon's time goes, next to the in-process store).

Every round of a daemon benchmark gets a fresh daemon (``python -m dedupcore
serve``) on a fresh data directory, started in the untimed setup; the
round's outcomes (all NEW), the daemon's own request time and the CPU of its
threads (event loop vs the rest, from /proc) are read before it is stopped.
Redis uses db ``DEDUPCORE_BENCH_DAEMON_REDIS_DB`` (11), FLUSHDB'd before
every round.

Sizes come from the environment (``--quick``: the second figure)::

    DEDUPCORE_BENCH_DAEMON_N       keys of the claim_many and concurrency benchmarks
                                   (200_000; 50_000)
    DEDUPCORE_BENCH_DAEMON_SINGLE  timed single claims per round of the latency benchmark
                                   (5000; 2000)
    DEDUPCORE_BENCH_DAEMON_PROCS   client processes of the concurrency benchmark (8)
    DEDUPCORE_BENCH_DAEMON_BATCH   keys per batch (1000)
    DEDUPCORE_BENCH_DAEMON_ROUNDS  rounds of each benchmark (3)
    DEDUPCORE_BENCH_DAEMON_LOAD_BATCH  keys per batch of the loaders of the latency
                                   under batches (100_000)
    DEDUPCORE_BENCH_REDIS_URL      redis://127.0.0.1:6379
    DEDUPCORE_BENCH_DAEMON_REDIS_DB  Redis db to use and FLUSHDB (11)

Every benchmark stores ``library``, ``operation``, ``n_keys``, ``call`` and
its figures (``ns_per_key``, ``keys_per_s``, ``p50_us``/``p99_us``...) in
``extra_info``; ``python -m benchmarks.report daemon`` prints the table and
the verdicts. Only correctness is asserted (outcomes, zero errors), never
timings.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import pytest

from benchmarks._support import (
    Daemon,
    PrivateRedis,
    SuiteConfig,
    Workspace,
    claim_batches,
    env_int,
    loader,
    outcomes,
    percentiles,
    random_keys,
    record,
    redis_claim_batches,
    redis_db,
    redis_info,
    timed_calls,
)

NS = "bench/daemon"
WARMUP = 500  # untimed single calls before the latency measurement
START_TIMEOUT = 60.0  # seconds for children to reach the barrier
CHILD_TIMEOUT = 600.0  # seconds for all children to report


@dataclass(frozen=True)
class DaemonBenchConfig(SuiteConfig):
    procs: int


DCFG = DaemonBenchConfig(
    procs=env_int("DEDUPCORE_BENCH_DAEMON_PROCS", 8),
    **SuiteConfig.common("DAEMON", n=(200_000, 50_000), single=(5000, 2000), redis_db=11),
)
_record = functools.partial(record, daemon_bench=asdict(DCFG))
CALLS = {
    "dedupcore-daemon": "Client(sock).claim_many(keys[i:i+B], namespace=ns)  "
    "(durability='durable')",
    "dedupcore-in-process": "DedupStore.open(d).claim_many(keys[i:i+B], namespace=ns)  "
    "(durability='durable', no daemon)",
    "redis-pipelined": "pipe=r.pipeline(transaction=False); pipe.set(k,1,nx=True,px=30000)×B; "
    "pipe.execute()",
    "dedupcore-daemon-single": "Client(sock).claim(k, namespace=ns)  (one round trip)",
    "dedupcore-daemon-single-unsafe": "Client(sock).claim(k, namespace=ns)  "
    "(serve --durability power-loss-unsafe: no fdatasync, like this Redis)",
    "dedupcore-in-process-single": "store.claim(k, namespace=ns)  (no daemon)",
    "redis-single": "r.set(k, 1, nx=True, px=30000)  (one round trip)",
    "redis-single-always": "r.set(k, 1, nx=True, px=30000)  (appendfsync always: fsync before "
    "the reply)",
    "dedupcore-daemon-pair-unsafe": "claim + complete  (serve --durability power-loss-unsafe)",
    "dedupcore-aio-single-unsafe": "await aio.Client(sock).claim(k, namespace=ns)  (asyncio "
    "event loop; serve --durability power-loss-unsafe)",
    "redis-aio-single": "await redis.asyncio.Redis(...).set(k, 1, nx=True, px=30000)  (asyncio "
    "event loop)",
    "redis-pair-always": "SET NX PX; SET XX  (appendfsync always)",
    "under-batches-dedupcore": "Client(sock).claim(k) while 4 processes send claim_many of 100k",
    "under-batches-redis-always": "r.set(k, 1, nx=True, px=30000) while 4 processes send "
    "pipelines of 100k SET NX PX (appendfsync always)",
    "dedupcore-daemon-pair": "c = Client(sock).claim(k, namespace=ns); "
    "complete(k, c.token, namespace=ns)  (two durable round trips)",
    "redis-pair": "r.set(k, 1, nx=True, px=30000); r.set(k, b'done', xx=True, px=30000)  "
    "(two round trips)",
    "clients": "P spawn processes, each Client(sock).claim_many(slice[i:i+B]) after one barrier",
    "clients-single": "P spawn processes, each Client(sock).claim_many([k]) per key of its slice "
    "(one durable claim per round trip) after one barrier",
    "codec-client": "_core.claim_frame; decode_response + "
    "claims_from_reply of a columns reply  (per batch of B, no socket)",
    "codec-daemon": "decode_request; columns_payload(store columns) + encode_response  "
    "(per batch of B, no socket, no store)",
}


# ---------------------------------------------------------------- keys --


@pytest.fixture(scope="module")
def daemon_keys() -> list[bytes]:
    """N fresh 16-byte keys, shared by the claim_many and concurrency benchmarks."""
    keys = random_keys(DCFG.n, DCFG.seed + 20)
    yield keys
    gc.collect()


@pytest.fixture(scope="module")
def single_keys() -> list[bytes]:
    """WARMUP + SINGLE keys of the latency benchmark."""
    return random_keys(WARMUP + DCFG.single, DCFG.seed + 21)


# -------------------------------------------------------------- daemon --


class Rounds:
    """A fresh daemon per round; the previous round's figures are read before it stops."""

    def __init__(self, durability: str = "durable") -> None:
        self.durability = durability
        self.daemon: Daemon | None = None
        self.figures: list[dict[str, Any]] = []

    def fresh(self) -> Daemon:
        self.close()
        self.daemon = Daemon(self.durability)
        return self.daemon

    def close(self) -> None:
        if self.daemon is not None:
            try:
                self.figures.append(self.daemon.finish(NS))
            finally:
                self.daemon.stop()
                self.daemon = None

    def summary(self, keys_per_round: int) -> dict[str, Any]:
        """Per-key daemon figures of the measured rounds (all rounds here)."""
        if not self.figures:
            return {}
        req = sum(f["requests"] for f in self.figures)
        req_s = sum(f["request_seconds"] for f in self.figures)
        loop = sum(f["cpu_event_loop_s"] for f in self.figures)
        other = sum(f["cpu_other_threads_s"] for f in self.figures)
        keys = keys_per_round * len(self.figures)
        return {
            "daemon_rounds": self.figures,
            "daemon_requests": req,
            "daemon_request_ns_per_key": req_s / keys * 1e9,
            "daemon_cpu_event_loop_ns_per_key": loop / keys * 1e9,
            "daemon_cpu_other_threads_ns_per_key": other / keys * 1e9,
            "daemon_cpu_ns_per_key": (loop + other) / keys * 1e9,
        }


def _check_outcomes(rounds: Rounds, n: int) -> None:
    for f in rounds.figures:
        assert f["outcomes"] == {"new": n, "duplicate": 0, "in_progress": 0}, f
        assert f["errors"] == 0, f


def _daemon_rounds(
    benchmark: Any,
    rounds: Rounds,
    connect: Callable[[Daemon], tuple[Callable[[bytes], Any], int]],
    run: Callable[[Callable[[bytes], Any], list[bytes]], None],
    timed: list[bytes],
    *,
    before_stop: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Timed rounds of single calls, each against a fresh daemon of ``rounds``.

    ``connect`` makes a round's call and answers the warm-up keys through it,
    returning the call and how many of them came back NEW (all: every key
    is fresh to the round's daemon). ``before_stop`` runs before each
    daemon stops (closing what is still connected to it). The daemon's
    outcomes and figures of every round are checked and returned.
    """
    new_counts: list[int] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        before_stop()
        call, new = connect(rounds.fresh())
        new_counts.append(new)
        return (call, timed), {}

    try:
        benchmark.pedantic(run, setup=setup, rounds=DCFG.rounds, iterations=1)
    finally:
        try:
            before_stop()
        finally:
            rounds.close()
    assert new_counts == [WARMUP] * DCFG.rounds
    n_keys = WARMUP + len(timed)
    _check_outcomes(rounds, n_keys)
    return {"durability": rounds.durability, **rounds.summary(n_keys)}


# --------------------------------------------------------------- redis --


@pytest.fixture(scope="module")
def redis_client() -> Any:
    yield from redis_db(DCFG.redis_url, DCFG.redis_db, prefix=None)


@pytest.fixture(scope="module")
def redis_always() -> Any:
    """The ``appendfsync always`` Redis of this module's benchmarks."""
    pytest.importorskip("redis")
    server = PrivateRedis()
    yield server
    server.close()


def _in_process(ws: Workspace, seen: list[dict[str, int]]) -> Any:
    """A fresh embedded store for a round; its outcomes go to ``seen`` when it is cleared."""
    store = ws.open_store()
    ws.on_clear(lambda: seen.append(outcomes(store, NS)))
    return store


def _redis_rounds(
    benchmark: Any,
    client: Any,
    warm_up: Callable[[], bool],
    run: Callable[[Callable[[bytes], Any], list[bytes]], None],
    call: Callable[[bytes], Any],
    timed: list[bytes],
) -> dict[str, Any]:
    """Timed rounds of single calls against the Redis db of ``client`` (synchronous),
    each from an empty db. ``warm_up`` answers the warm-up keys, True if every
    ``SET NX`` created its key; after each round the db must hold every key
    of it, warm-up and timed. Returns the server's figures."""
    sizes: list[int] = []  # keys in the db after each round
    started = [0]

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        if started[0]:  # a round ran: check it before flushing
            sizes.append(int(client.dbsize()))
        started[0] += 1
        client.flushdb()
        assert warm_up()
        return (call, timed), {}

    benchmark.pedantic(run, setup=setup, rounds=DCFG.rounds, iterations=1)
    sizes.append(int(client.dbsize()))
    assert sizes == [WARMUP + len(timed)] * DCFG.rounds, sizes
    info = redis_info(client)
    client.flushdb()
    return info


# ----------------------------------------------- claim_many, batches of B --

BATCH_PEERS = ["dedupcore-daemon", "redis-pipelined", "dedupcore-in-process"]


@pytest.mark.parametrize("name", BATCH_PEERS)
def test_claim_many(
    benchmark: Any, request: pytest.FixtureRequest, daemon_keys: list[bytes], name: str
) -> None:
    """claim_many of N fresh keys in batches of B (a fresh daemon/store/db per round)."""
    benchmark.group = "daemon_claim_many"
    n, batch = len(daemon_keys), DCFG.batch
    extra: dict[str, Any] = {}
    if name == "dedupcore-daemon":
        rounds = Rounds()
        try:

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                client = rounds.fresh().client()
                return (client, daemon_keys, batch, NS), {}

            benchmark.pedantic(claim_batches, setup=setup, rounds=DCFG.rounds, iterations=1)
        finally:
            rounds.close()
        _check_outcomes(rounds, n)
        extra.update(rounds.summary(n))
    elif name == "dedupcore-in-process":
        ws, seen = Workspace(name), []
        try:

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                return (_in_process(ws, seen), daemon_keys, batch, NS), {}

            benchmark.pedantic(claim_batches, setup=setup, rounds=DCFG.rounds, iterations=1)
        finally:
            ws.clear()
        assert seen == [{"new": n, "duplicate": 0, "in_progress": 0}] * DCFG.rounds, seen
    else:
        client = request.getfixturevalue("redis_client")
        results: list[int] = []

        def run(*args: Any) -> int:
            fresh = redis_claim_batches(*args)
            results.append(fresh)
            return fresh

        def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
            client.flushdb()
            client.ping()
            return (client, daemon_keys, batch, DCFG.px_ms), {}

        benchmark.pedantic(run, setup=setup, rounds=DCFG.rounds, iterations=1)
        assert results == [n] * DCFG.rounds, results
        extra.update(redis_info(client))
        client.flushdb()
    _record(
        benchmark,
        library=name,
        operation="claim_many",
        n_keys=n,
        call=CALLS[name],
        batch=batch,
        **extra,
    )


# ------------------------------------------------ one claim, round trip --

SINGLE_PEERS = [
    "dedupcore-daemon-single",
    "redis-single-always",
    "dedupcore-daemon-single-unsafe",
    "redis-single",
    "dedupcore-in-process-single",
    "dedupcore-daemon-pair",
    "redis-pair-always",
    "dedupcore-daemon-pair-unsafe",
    "redis-pair",
    "dedupcore-aio-single-unsafe",
    "redis-aio-single",
]


@pytest.mark.parametrize("name", SINGLE_PEERS)
def test_claim_latency(
    benchmark: Any, request: pytest.FixtureRequest, single_keys: list[bytes], name: str
) -> None:
    """SINGLE single claims per round, each timed; p50/p99 over all rounds' calls."""
    benchmark.group = "daemon_claim_latency"
    warm, timed = single_keys[:WARMUP], single_keys[WARMUP:]
    samples: list[int] = []
    extra: dict[str, Any] = {}
    per_round_p50: list[float] = []

    def run(call: Callable[[bytes], Any], keys: list[bytes]) -> None:
        lat = timed_calls(call, keys)
        samples.extend(lat)
        per_round_p50.append(percentiles(lat, "us")["p50_us"])

    if name.startswith(("dedupcore-daemon-single", "dedupcore-daemon-pair")):
        from dedupcore.api import Outcome

        unsafe = name.endswith("-unsafe")
        pair = name.startswith("dedupcore-daemon-pair")

        def connect(daemon: Daemon) -> tuple[Callable[[bytes], Any], int]:
            client = daemon.client()
            claim = client.claim
            complete = client.complete

            def call(k: bytes) -> Any:
                return claim(k, namespace=NS)

            def call_pair(k: bytes) -> Any:
                c = claim(k, namespace=NS)
                complete(k, c.token, namespace=NS)
                return c

            chosen = call_pair if pair else call
            return chosen, sum(chosen(k).outcome is Outcome.NEW for k in warm)

        rounds = Rounds("power-loss-unsafe" if unsafe else "durable")
        extra.update(_daemon_rounds(benchmark, rounds, connect, run, timed))
    elif name in ("dedupcore-aio-single-unsafe", "redis-aio-single"):
        extra.update(_async_latency(benchmark, request, name, warm, timed, samples, per_round_p50))
    elif name == "dedupcore-in-process-single":
        ws, seen = Workspace(name), []
        try:

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                claim = _in_process(ws, seen).claim

                def call(k: bytes) -> Any:
                    return claim(k, namespace=NS)

                for k in warm:
                    call(k)
                return (call, timed), {}

            benchmark.pedantic(run, setup=setup, rounds=DCFG.rounds, iterations=1)
        finally:
            ws.clear()
        expected = {"new": len(single_keys), "duplicate": 0, "in_progress": 0}
        assert seen == [expected] * DCFG.rounds, seen
    else:
        always = name.endswith("-always")
        client = (
            request.getfixturevalue("redis_always").client
            if always
            else request.getfixturevalue("redis_client")
        )
        set_ = client.set
        px = DCFG.px_ms

        if name.startswith("redis-pair"):
            # Claim, then mark done: SET NX PX, then SET XX of the "done" value.
            def call(k: bytes) -> Any:
                got = set_(k, 1, nx=True, px=px)
                set_(k, b"done", xx=True, px=px)
                return got

        else:

            def call(k: bytes) -> Any:
                return set_(k, 1, nx=True, px=px)

        def warm_up() -> bool:
            return all(call(k) is True for k in warm)

        extra.update(_redis_rounds(benchmark, client, warm_up, run, call, timed))
    extra.update(percentiles(samples, "us"))
    extra["p50_us_per_round"] = per_round_p50
    _record(
        benchmark,
        library=name,
        operation="claim_latency",
        n_keys=len(timed),
        call=CALLS[name],
        **extra,
    )


def _async_latency(
    benchmark: Any,
    request: pytest.FixtureRequest,
    name: str,
    warm: list[bytes],
    timed: list[bytes],
    samples: list[int],
    per_round_p50: list[float],
) -> dict[str, Any]:
    """One call per key awaited on an asyncio event loop (the default loop a consumer
    gets, not uvloop), each timed: the async client against redis.asyncio."""
    import asyncio

    loop = asyncio.new_event_loop()
    extra: dict[str, Any] = {}

    async def timed_awaits(call: Callable[[bytes], Any], keys: list[bytes]) -> list[int]:
        clock = time.perf_counter_ns
        out: list[int] = []
        for k in keys:
            t0 = clock()
            await call(k)
            out.append(clock() - t0)
        return out

    def run(call: Callable[[bytes], Any], keys: list[bytes]) -> None:
        lat = loop.run_until_complete(timed_awaits(call, keys))
        samples.extend(lat)
        per_round_p50.append(percentiles(lat, "us")["p50_us"])

    try:
        if name == "dedupcore-aio-single-unsafe":
            from dedupcore import aio
            from dedupcore.api import Outcome

            clients: list[Any] = []

            def close_clients() -> None:
                while clients:
                    loop.run_until_complete(clients.pop().aclose())

            def connect(daemon: Daemon) -> tuple[Callable[[bytes], Any], int]:
                client = aio.Client(daemon.socket)
                clients.append(client)

                async def call(k: bytes) -> Any:
                    return await client.claim(k, namespace=NS)

                async def warm_up() -> int:
                    return sum([(await call(k)).outcome is Outcome.NEW for k in warm])

                return call, loop.run_until_complete(warm_up())

            rounds = Rounds("power-loss-unsafe")
            extra.update(
                _daemon_rounds(benchmark, rounds, connect, run, timed, before_stop=close_clients)
            )
        else:
            import redis.asyncio as aredis

            sync = request.getfixturevalue("redis_client")
            client = aredis.Redis.from_url(DCFG.redis_url, db=DCFG.redis_db)
            px = DCFG.px_ms

            async def call(k: bytes) -> Any:
                return await client.set(k, 1, nx=True, px=px)

            async def warm_up() -> bool:
                return all([await call(k) is True for k in warm])

            try:
                extra.update(
                    _redis_rounds(
                        benchmark,
                        sync,
                        lambda: loop.run_until_complete(warm_up()),
                        run,
                        call,
                        timed,
                    )
                )
            finally:
                loop.run_until_complete(client.aclose())
    finally:
        loop.close()
    return extra


# ------------------------------------- one claim while others send big batches --

LOADERS = 4  # client processes sending big batches
LOAD_BATCH = env_int("DEDUPCORE_BENCH_DAEMON_LOAD_BATCH", 100_000)  # keys per batch of each
UNDER_LOAD_CALLS = 2000  # timed single claims (one every millisecond at most)


@pytest.mark.parametrize("name", ["under-batches-dedupcore", "under-batches-redis-always"])
def test_latency_under_batches(
    benchmark: Any, request: pytest.FixtureRequest, single_keys: list[bytes], name: str
) -> None:
    """Single claims, one at a time, while LOADERS processes send LOAD_BATCH-key batches.

    The loaders are started and have sent their first batch before the timing
    starts; the timed calls are spread over the load (a pause of 1 ms between
    calls), so they meet batches being decided, written and synced.
    """
    benchmark.group = "daemon_latency_under_batches"
    ctx = multiprocessing.get_context("spawn")
    timed = single_keys[WARMUP : WARMUP + UNDER_LOAD_CALLS]
    samples: list[int] = []
    per_round_p99: list[float] = []
    loads: list[dict[str, Any]] = []
    rounds = Rounds()
    live: list[tuple[Any, list[Any], Any]] = []

    def stop_loaders() -> None:
        while live:
            stop, procs, results = live.pop()
            stop.set()
            for _ in procs:
                loads.append(results.get(timeout=CHILD_TIMEOUT))
            for p in procs:
                p.join(timeout=60)

    def start_loaders(target: str, kind: str) -> None:
        stop, started, results = ctx.Event(), ctx.Semaphore(0), ctx.Queue()
        procs = [
            ctx.Process(
                target=loader,
                args=(target, kind, DCFG.seed + 100 + i, started, stop, results, NS, LOAD_BATCH),
                daemon=True,
            )
            for i in range(LOADERS)
        ]
        for p in procs:
            p.start()
        live.append((stop, procs, results))
        for _ in procs:
            if not started.acquire(timeout=START_TIMEOUT):
                raise RuntimeError("a loader process did not start")
        time.sleep(1.0)  # let the first batches reach the server (load, not a sync point)

    def run(call: Callable[[bytes], Any]) -> None:
        clock = time.perf_counter_ns
        lat = []
        for k in timed:
            t0 = clock()
            call(k)
            lat.append(clock() - t0)
            time.sleep(0.001)
        samples.extend(lat)
        per_round_p99.append(percentiles(lat, "us")["p99_us"])

    try:
        if name == "under-batches-dedupcore":

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                stop_loaders()
                daemon = rounds.fresh()
                client = daemon.client()
                start_loaders(daemon.socket, "dedupcore")
                claim = client.claim

                def call(k: bytes) -> Any:
                    return claim(k, namespace=NS)

                return (call,), {}

        else:
            server = request.getfixturevalue("redis_always")

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                stop_loaders()
                server.client.flushdb()
                start_loaders(server.url, "redis")
                set_ = server.client.set

                def call(k: bytes) -> Any:
                    return set_(k, 1, nx=True, px=DCFG.px_ms)

                return (call,), {}

        benchmark.pedantic(run, setup=setup, rounds=DCFG.rounds, iterations=1)
        stop_loaders()
    finally:
        for stop, procs, _ in live:
            stop.set()
            for p in procs:
                p.kill()
        live.clear()
        rounds.close()
    errors = sum(r["errors"] for r in loads)
    assert errors == 0, [r["first_error"] for r in loads if r["first_error"]][:3]
    batches = sum(r["batches"] for r in loads)
    assert batches > 0, "the loaders sent no batch"
    extra = percentiles(samples, "us")
    extra["p99_us_per_round"] = per_round_p99
    _record(
        benchmark,
        library=name,
        operation="latency_under_batches",
        n_keys=len(timed),
        call=CALLS[name],
        loaders=LOADERS,
        load_batch=LOAD_BATCH,
        load_batches=batches,
        **extra,
    )


# ----------------------------------------------- P client processes at once --


def _child(
    socket_path: str,
    blob: bytes,
    batch: int,
    barrier: Any,
    results: Any,
    index: int,
) -> None:
    """One client process: connect, wait on the barrier, claim its slice, report."""
    report: dict[str, Any] = {"index": index, "errors": 0, "new": 0, "keys": 0, "first_error": None}
    try:
        from dedupcore.api import Outcome
        from dedupcore.client import Client

        keys = [blob[i : i + 16] for i in range(0, len(blob), 16)]
        report["keys"] = len(keys)
        client = Client(socket_path)
        client.ping()
        barrier.wait()
        start = time.perf_counter()
        new = 0
        NEW = Outcome.NEW
        for i in range(0, len(keys), batch):
            try:
                claims = client.claim_many(keys[i : i + batch], namespace=NS)
            except Exception as exc:
                report["errors"] += 1
                if report["first_error"] is None:
                    report["first_error"] = repr(exc)
                continue
            new += sum(c.outcome is NEW for c in claims)
        report.update(start=start, end=time.perf_counter(), new=new)
        client.close()
    except BaseException as exc:  # reported, never lost
        report["errors"] += 1
        report["first_error"] = report["first_error"] or repr(exc)
        barrier.abort()
    results.put(report)


class Clients:
    """P spawned client processes waiting on a barrier, with their slices of the keys."""

    def __init__(self, socket_path: str, keys: list[bytes], procs: int, batch: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.barrier = ctx.Barrier(procs + 1)
        self.results = ctx.Queue()
        self.procs = []
        step = -(-len(keys) // procs)
        for i in range(procs):
            blob = b"".join(keys[i * step : (i + 1) * step])
            p = ctx.Process(
                target=_child,
                args=(socket_path, blob, batch, self.barrier, self.results, i),
                daemon=True,
            )
            p.start()
            self.procs.append(p)
        deadline = time.monotonic() + START_TIMEOUT
        while self.barrier.n_waiting < procs:
            if self.barrier.broken or any(p.exitcode is not None for p in self.procs):
                raise RuntimeError(f"a client process failed to start: {self._drain()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"client processes not ready within {START_TIMEOUT} s")
            time.sleep(0.01)

    def _drain(self) -> list[Any]:
        out = []
        while not self.results.empty():
            out.append(self.results.get_nowait())
        return out

    def run(self) -> list[dict[str, Any]]:
        """Releases the barrier and waits for every child's report (the timed part)."""
        self.barrier.wait()
        return [self.results.get(timeout=CHILD_TIMEOUT) for _ in self.procs]

    def join(self) -> list[int | None]:
        for p in self.procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.kill()
                p.join()
        return [p.exitcode for p in self.procs]


@pytest.mark.parametrize("batch", [DCFG.batch, 1], ids=["batches", "single"])
@pytest.mark.parametrize("procs", sorted({1, DCFG.procs}), ids=lambda p: f"clients-{p}")
def test_concurrent_clients(
    benchmark: Any, daemon_keys: list[bytes], procs: int, batch: int
) -> None:
    """N fresh keys claimed by P client processes at once (batches of B), same harness for
    P=1; with ``single``, SINGLE x 4 keys one claim per request (each client waits for
    its durable answer before the next: what group commit across clients amortises)."""
    single = batch == 1
    benchmark.group = "daemon_concurrent_single" if single else "daemon_concurrent_clients"
    if single:
        daemon_keys = daemon_keys[: DCFG.single * 4]
    n = len(daemon_keys)
    rounds = Rounds()
    reports: list[list[dict[str, Any]]] = []
    exitcodes: list[list[int | None]] = []
    live: list[Clients] = []

    def finish_clients() -> None:
        while live:
            exitcodes.append(live.pop().join())

    def run(clients: Clients) -> None:
        reports.append(clients.run())

    try:

        def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
            finish_clients()
            daemon = rounds.fresh()
            clients = Clients(daemon.socket, daemon_keys, procs, batch)
            live.append(clients)
            return (clients,), {}

        benchmark.pedantic(run, setup=setup, rounds=DCFG.rounds, iterations=1)
        finish_clients()
    finally:
        for clients in live:
            for p in clients.procs:
                p.kill()
        finish_clients()
        rounds.close()

    errors = sum(r["errors"] for rs in reports for r in rs)
    first = [r["first_error"] for rs in reports for r in rs if r["first_error"]]
    assert errors == 0, f"{errors} errors in client processes, e.g. {first[:3]}"
    assert all(code == 0 for codes in exitcodes for code in codes), exitcodes
    for rs in reports:
        assert sum(r["new"] for r in rs) == n
        assert sum(r["keys"] for r in rs) == n
    _check_outcomes(rounds, n)

    # Throughput from the children's own clocks (first start to last end), per round.
    spans = [max(r["end"] for r in rs) - min(r["start"] for r in rs) for rs in reports]
    _record(
        benchmark,
        library=f"clients-{procs}" + ("-single" if single else ""),
        operation="concurrent_single" if single else "concurrent_clients",
        n_keys=n,
        call=CALLS["clients-single" if single else "clients"],
        procs=procs,
        batch=batch,
        errors=errors,
        child_span_s=spans,
        child_span_keys_per_s=n / min(spans),
        child_keys_per_s=[
            [r["keys"] / (r["end"] - r["start"]) for r in sorted(rs, key=lambda r: r["index"])]
            for rs in reports
        ],
        **rounds.summary(n),
    )


# --------------------------------------------------- where the time goes --


def codec_client(keys: list[bytes], batch: int, reply_body: bytes) -> None:
    """The client's protocol work per batch, as ``Client.claim_many`` does it for plain
    keys: frame the request natively, decode the reply into Claims."""
    import dedupcore._core as _core
    from dedupcore.daemon import protocol

    for rid, i in enumerate(range(0, len(keys), batch), 1):
        keys_ = keys[i : i + batch]
        _core.claim_frame(rid, NS, keys_)
        _, _, payload = protocol.decode_response(reply_body)
        protocol.claims_from_reply(keys_, NS, payload)


def codec_daemon(bodies: list[bytes], columns: tuple[Any, ...]) -> None:
    """The daemon's protocol work per batch: decode the request, encode the columns the
    store answers in (``FORM_COLUMNS``: no Claim objects)."""
    from dedupcore.daemon import protocol

    outcomes, tokens = columns[0], columns[1]
    for body in bodies:
        req = protocol.decode_request(body)
        n = len(req.args["keys"])
        part = (outcomes[:n], tokens[: 8 * n], *columns[2:])
        protocol.encode_response(req.request_id, protocol.columns_payload(part))


@pytest.mark.parametrize("side", ["client", "daemon"])
def test_protocol_codec(benchmark: Any, daemon_keys: list[bytes], side: str) -> None:
    """msgpack and Claim work of claim_many on one side, N keys in batches, no socket or store."""
    import dedupcore._core as _core
    from dedupcore.api import Claim, Outcome
    from dedupcore.daemon import protocol

    benchmark.group = "daemon_phase"
    n, batch = len(daemon_keys), DCFG.batch
    hdr = protocol.HEADER.size
    # What the store returns for fresh keys: NEW claims with large fencing tokens.
    claims = [Claim(k, NS, Outcome.NEW, (1 << 40) + i) for i, k in enumerate(daemon_keys[:batch])]
    if side == "client":
        reply = protocol.encode_response(7, protocol.claim_columns(claims))
        args: tuple[Any, ...] = (daemon_keys, batch, reply[hdr:])
        run: Callable[..., None] = codec_client
    else:
        bodies = [  # as the clients frame a plain batch
            _core.claim_frame(rid, NS, daemon_keys[i : i + batch])[hdr:]
            for rid, i in enumerate(range(0, n, batch), 1)
        ]
        outcomes = bytes(batch)  # every key NEW
        tokens = b"".join(((1 << 40) + i).to_bytes(8, "little") for i in range(batch))
        args = (bodies, (outcomes, tokens, [], [], [], []))
        run = codec_daemon
    benchmark.pedantic(run, args=args, rounds=DCFG.rounds, iterations=1)
    _record(
        benchmark,
        library=f"codec-{side}",
        operation="protocol_codec",
        n_keys=n,
        call=CALLS[f"codec-{side}"],
        batch=batch,
    )
