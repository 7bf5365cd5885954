"""dedupcore.metrics over real servers: Redis, PostgreSQL, and the daemon's /metrics endpoint.

The scripted sequence of tests/unit/test_metrics.py runs against an
instrumented RedisStore, SqlStore on PostgreSQL and daemon Client, each with
a registry of its own, and must leave the same counts. The daemon is a real
``dedupcore serve --metrics-port`` process (tests/support/daemon.py); its
endpoint is scraped over HTTP. Each test uses its own Redis prefix, table,
namespace or daemon.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dedupcore.api import ClaimAPI, Outcome
from dedupcore.metrics import GAUGES, Metrics, instrument, metric_names
from dedupcore.redis import RedisStore
from dedupcore.sql import SqlStore
from dedupcore.stack import TieredStore
from dedupcore.tiers.cache import RedisCache
from tests.support.cluster import free_port
from tests.support.daemon import Lab
from tests.support.metrics import EXPECTED_CLAIMS, check_script_counts, run_script, value
from tests.support.procs import PATIENCE, child_env, run_cli
from tests.support.servers import connect_redis, forget_redis_keys, require_server
from tests.support.stores import Stores, take_over, unique_ns


def _redis() -> redis.Redis:
    require_server("redis")
    return connect_redis("conformance")


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[Stores]:
    with Stores(tmp_path, "conformance") as s:
        yield s


@pytest.fixture
def redis_store(stores: Stores) -> RedisStore:
    store: RedisStore = stores.open("redis")
    return store


@pytest.fixture
def pg_store(stores: Stores) -> SqlStore:
    store: SqlStore = stores.open("postgresql")
    return store


@pytest.mark.parametrize("which", ["redis_store", "pg_store"])
def test_scripted_sequence_on_a_server(which: str, request: pytest.FixtureRequest) -> None:
    store: ClaimAPI = request.getfixturevalue(which)
    registry = CollectorRegistry()
    api = instrument(store, Metrics(registry, region="r1"))
    ns = unique_ns("m")
    run_script(api, ns)
    check_script_counts(registry, ns, "r1")


@pytest.mark.parametrize("which", ["redis_store", "pg_store"])
def test_a_takeover_on_the_servers_clock_is_counted(
    which: str, request: pytest.FixtureRequest
) -> None:
    store: ClaimAPI = request.getfixturevalue(which)
    registry = CollectorRegistry()
    api = instrument(store, Metrics(registry))
    ns = unique_ns("m")
    first = api.claim("k", namespace=ns, owner="a", lease=0.2)
    second = take_over(api, "k", ns, owner="b")
    assert second.takeover and second.token == first.token + 1
    assert value(registry, "dedupcore_lease_takeovers_total", namespace=ns, region="") == 1
    assert value(registry, "dedupcore_claims_total", namespace=ns, outcome="new", region="") == 2


def test_a_stack_over_postgresql_with_a_redis_cache(pg_store: SqlStore) -> None:
    client = _redis()
    prefix = f"metricscache{uuid.uuid4().hex[:12]}"
    stack = TieredStore(pg_store, cache=RedisCache(client, prefix=prefix))
    registry = CollectorRegistry()
    api = instrument(stack, Metrics(registry, region="r2"))
    ns = unique_ns("m")
    try:
        new = api.claim_many(["a", "b"], namespace=ns)
        api.complete_many([(c.key, c.token) for c in new], namespace=ns)
        again = api.claim_many(["a", "b"], namespace=ns)
        assert [c.outcome for c in again] == [Outcome.DUPLICATE] * 2
        labels = {"namespace": ns, "region": "r2"}
        assert value(registry, "dedupcore_claims_total", outcome="new", **labels) == 2
        assert value(registry, "dedupcore_claims_total", outcome="duplicate", **labels) == 2
        # The completions were written through to the cache, which answered the repeats;
        # the fresh keys were answered "new" by the front filter without a cache read.
        assert value(registry, "dedupcore_tier_hits_total", tier="cache", region="r2") == 2
        assert value(registry, "dedupcore_front_skips_total", region="r2") == 2
    finally:
        forget_redis_keys(client, prefix)
        stack.cache.close()  # type: ignore[union-attr]


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The daemon's samples: name -> sorted labels -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=PATIENCE) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_the_daemon_serves_the_same_names_and_counts(lab: Lab) -> None:
    port = free_port()
    daemon = lab.daemon("--metrics-port", str(port))
    ns = unique_ns("m")
    registry = CollectorRegistry()
    with daemon.client(timeout=60.0) as client:
        api = instrument(client, Metrics(registry, region="client"))
        run_script(api, ns)
    check_script_counts(registry, ns, "client")
    scraped = _scrape(port)
    for name in (
        "dedupcore_claims_total",
        "dedupcore_lease_takeovers_total",
        "dedupcore_tier_hits_total",
        "dedupcore_front_skips_total",
        *GAUGES,
    ):
        assert name in scraped, name
    claims = scraped["dedupcore_claims_total"]
    for outcome in ("new", "duplicate", "in_progress"):
        key = (("namespace", ns), ("outcome", outcome), ("region", ""))
        assert claims[key] == EXPECTED_CLAIMS[outcome], outcome
    assert scraped["dedupcore_in_flight"][(("region", ""),)] == 1  # "f" is still claimed
    assert scraped["dedupcore_lease_takeovers_total"][(("namespace", ""), ("region", ""))] == 0
    # The in-process names and the daemon's are one set: a dashboard serves both.
    assert {n for n in scraped if n.startswith("dedupcore_")} <= metric_names()
    assert "process_open_fds" in scraped and "python_info" in scraped


def _stats(socket: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**child_env(), "COLUMNS": "240"}  # rich tables: no wrapped cells
    return run_cli("stats", "--socket", socket, *args, env=env)


def test_dedupcore_stats_shows_rates(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns("m")
    with daemon.client() as client:
        new = client.claim_many(["a", "b", "c", "d"], namespace=ns)
        client.complete_many([(c.key, c.token) for c in new], namespace=ns)
        assert client.claim("a", namespace=ns).outcome is Outcome.DUPLICATE
    out = _stats(str(daemon.socket), "--json", "--interval", "0.2")
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["namespaces"][ns]["duplicate"] == 1 and st["namespaces"][ns]["new"] == 4
    # Nothing was claimed between the two samples.
    assert st["rates"][ns] == {"claims_per_second": 0.0, "duplicate_rate": 0.0}
    table = _stats(str(daemon.socket), "--interval", "0.1")
    assert table.returncode == 0, table.stderr
    assert "claims/s" in table.stdout and ns[:10] in table.stdout
    once = _stats(str(daemon.socket), "--json", "--interval", "0")
    assert once.returncode == 0 and json.loads(once.stdout)["rates"] == {}
    bad = _stats(str(daemon.socket), "--json", "--interval", "-1")
    assert bad.returncode == 1 and "interval" in bad.stderr
