"""dedupcore.metrics on the embedded store: exact counts, labels, stats collectors, rates, docs.

Each test has its own ``CollectorRegistry``, so counts start at zero and
tests do not see each other. :func:`run_script` is the scripted sequence the
integration tests replay on Redis, PostgreSQL and the daemon.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dedupcore.api import Outcome
from dedupcore.api.deferred import DeferredStore
from dedupcore.metrics import (
    BUCKETS,
    DaemonCollector,
    InstrumentedStore,
    Metrics,
    MissingExtraError,
    instrument,
    metric_names,
    rates,
    sample_rates,
    serve_daemon_metrics,
    store_figures,
)
from dedupcore.stack import ShardedStore, TieredStore
from dedupcore.store import DedupStore
from dedupcore.writebehind import MemoryTable, WriteBehindStore
from tests.support.metrics import (
    EXPECTED_CLAIMS,
    check_script_counts,
    run_script,
    value,
)
from tests.support.stores import take_over

ROOT = Path(__file__).resolve().parents[2]
NS = "orders/billing"


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DedupStore]:
    s = DedupStore.open(tmp_path / "data")
    yield s
    s.close()


def test_the_scripted_sequence_is_counted_exactly(
    store: DedupStore, registry: CollectorRegistry
) -> None:
    api = instrument(store, Metrics(registry, region="eu-1"))
    run_script(api, NS)
    check_script_counts(registry, NS, "eu-1")
    # The store's own count of the outcomes agrees with the wrapper's.
    counts = store.stats()["namespaces"][NS]
    for outcome in ("new", "duplicate", "in_progress"):
        assert counts[outcome] == EXPECTED_CLAIMS[outcome]


def test_a_takeover_is_counted_once(store: DedupStore, registry: CollectorRegistry) -> None:
    api = instrument(store, Metrics(registry))
    first = api.claim("k", namespace=NS, owner="a", lease=0.05)
    c = take_over(api, "k", NS, owner="b")  # the lease runs out on this process's clock
    assert c.takeover and c.token == first.token + 1
    assert value(registry, "dedupcore_lease_takeovers_total", namespace=NS, region="") == 1
    assert value(registry, "dedupcore_claims_total", namespace=NS, outcome="new", region="") == 2
    busy = value(registry, "dedupcore_claims_total", namespace=NS, outcome="in_progress", region="")
    assert busy == store.stats()["namespaces"][NS]["in_progress"]
    assert store.stats()["lease_takeovers"] == 1


def test_region_and_namespace_labels(tmp_path: Path, registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, region="eu", namespace_label=False)
    with (
        instrument(DedupStore.open(tmp_path / "one"), metrics) as eu,
        instrument(DedupStore.open(tmp_path / "two"), metrics, region="us") as us,
    ):
        assert isinstance(eu, InstrumentedStore) and eu.region == "eu" and us.region == "us"
        eu.claim_many(["a", "b"], namespace="n1")
        eu.claim("c", namespace="n2")
        us.claim("a", namespace="n1")
        new = {"namespace": "", "outcome": "new"}
        assert value(registry, "dedupcore_claims_total", region="eu", **new) == 3
        assert value(registry, "dedupcore_claims_total", region="us", **new) == 1
        text = generate_latest(registry).decode()
        assert 'namespace="n1"' not in text
        # Each store's front filter answered its fresh keys alone: one series per region.
        assert value(registry, "dedupcore_front_skips_total", region="eu") == 3
        assert value(registry, "dedupcore_front_skips_total", region="us") == 1
    # Closed stores are no longer read: the scrape still works and leaves them out.
    assert value(registry, "dedupcore_front_skips_total", region="eu") == 0
    assert "dedupcore_claims_total" in generate_latest(registry).decode()


def test_processing_and_the_decorator_go_through_the_counters(
    store: DedupStore, registry: CollectorRegistry
) -> None:
    api = instrument(store, Metrics(registry))
    with api.processing("p", namespace=NS) as c:
        c.result = 1
    with pytest.raises(RuntimeError), api.processing("q", namespace=NS):
        raise RuntimeError("the work failed")

    @api.idempotent(namespace=NS, key="id")
    def handle(msg: dict[str, Any]) -> str:
        return f"done {msg['id']}"

    assert handle({"id": "m"}) == handle({"id": "m"}) == "done m"
    assert value(registry, "dedupcore_claims_total", namespace=NS, outcome="new", region="") == 3
    assert (
        value(registry, "dedupcore_claims_total", namespace=NS, outcome="duplicate", region="") == 1
    )
    assert value(registry, "dedupcore_completes_total", namespace=NS, region="") == 2
    assert value(registry, "dedupcore_releases_total", namespace=NS, region="") == 1


def test_other_attributes_are_the_stores(store: DedupStore, registry: CollectorRegistry) -> None:
    api = instrument(store, Metrics(registry))
    assert api.config is store.config
    # Served by a daemon, the wrapper takes the ordinary path through its counters.
    assert isinstance(store, DeferredStore) and not isinstance(api, DeferredStore)
    assert api.durability() == store.durability()
    c = api.claim("g", namespace=NS)
    record = api.get("g", namespace=NS)
    assert record is not None and record.token == c.token
    assert value(registry, "dedupcore_operation_seconds_count", operation="get", region="") == 1
    assert api.stats()["namespaces"][NS]["new"] == 1
    with pytest.raises(AttributeError):
        _ = api.no_such_attribute


def test_stacks_and_write_behind_are_instrumented(
    tmp_path: Path, registry: CollectorRegistry
) -> None:
    metrics = Metrics(registry)
    tiered = instrument(TieredStore(DedupStore.open(tmp_path / "auth")), metrics, region="t")
    sharded = instrument(
        ShardedStore([DedupStore.open(tmp_path / "s1"), DedupStore.open(tmp_path / "s2")]),
        metrics,
        region="s",
    )
    behind = instrument(WriteBehindStore(MemoryTable()), metrics, region="w")
    try:
        for region, api in (("t", tiered), ("s", sharded), ("w", behind)):
            new = api.claim_many([f"k{i}" for i in range(10)], namespace=NS)
            api.complete_many([(c.key, c.token) for c in new], namespace=NS)
            assert all(c.outcome is Outcome.DUPLICATE for c in api.claim_many(["k0"], namespace=NS))
            labels = {"namespace": NS, "region": region}
            assert value(registry, "dedupcore_claims_total", outcome="new", **labels) == 10
            assert value(registry, "dedupcore_claims_total", outcome="duplicate", **labels) == 1
            assert value(registry, "dedupcore_completes_total", **labels) == 10
        # The stack's front filter and its authority's both answered the fresh keys alone.
        assert value(registry, "dedupcore_front_skips_total", region="t") == 20
        assert value(registry, "dedupcore_front_skips_total", region="s") == 10
        lmdb = store_figures(tiered.stats()).tier_hits["lmdb"]
        assert value(registry, "dedupcore_tier_hits_total", tier="lmdb", region="t") == lmdb
    finally:
        tiered.close()
        sharded.close()
        behind.close()


def test_store_figures_of_nested_stats() -> None:
    embedded = {
        "namespaces": {"n": {"new": 4, "duplicate": 1, "in_progress": 0, "duplicate_rate": 0.2}},
        "lease_takeovers": 2,
        "front": {"negative": 3, "positive": 1},
        "lmdb": {"reads": 1, "records": 7, "disk_bytes": 4096},
        "in_flight": 2,
    }
    sql = {"engine": "postgresql", "table": "t", "new": 5, "duplicate": 2, "takeovers": 1}
    stack = {
        "namespaces": {"n": {"new": 9, "duplicate": 4, "in_progress": 1}},
        "counts": {"cache_hits": 2, "cold_hits": 1, "front_negative": 6},
        "authority": embedded,
    }
    fig = store_figures({"namespaces": {}, "shards": [stack, sql]})
    assert fig.claims == {}  # the outermost count is the one: nothing claimed through it
    fig = store_figures(stack)
    assert fig.claims == {("n", "new"): 9, ("n", "duplicate"): 4, ("n", "in_progress"): 1}
    assert fig.takeovers == 2
    assert fig.tier_hits == {"lmdb": 1, "cache": 2, "cold": 1}
    assert fig.front_skips == 9
    assert (fig.in_flight, fig.lmdb_records, fig.lmdb_bytes) == (2, 7, 4096)
    bare_sql = store_figures(sql)
    assert bare_sql.claims[("", "new")] == 5 and bare_sql.takeovers == 1
    local = {"namespaces": embedded["namespaces"]}
    behind = store_figures({"write_behind": {"pushes": 3}, "local": local})
    assert behind.claims[("n", "new")] == 4
    with pytest.raises(TypeError):
        store_figures([])  # type: ignore[arg-type]


def test_the_daemon_collector_reads_the_stores_figures(
    store: DedupStore, registry: CollectorRegistry
) -> None:
    registry.register(DaemonCollector(store, region="r"))
    run_script(store, NS)
    for outcome in ("new", "duplicate", "in_progress"):
        assert (
            value(registry, "dedupcore_claims_total", namespace=NS, outcome=outcome, region="r")
            == EXPECTED_CLAIMS[outcome]
        )
    assert value(registry, "dedupcore_in_flight", region="r") == 1  # "f" is still claimed
    assert value(registry, "dedupcore_front_skips_total", region="r") > 0
    assert value(registry, "dedupcore_lease_takeovers_total", namespace="", region="r") == 0
    store.close()  # a failed or closed store: the scrape shows nothing of it, and works
    assert value(registry, "dedupcore_claims_total", namespace=NS, outcome="new", region="r") == 0


def test_rates_between_two_samples() -> None:
    def ns(new: int, dup: int, busy: int = 0) -> dict[str, Any]:
        return {"namespaces": {"n": {"new": new, "duplicate": dup, "in_progress": busy}}}

    got = rates(ns(10, 0), ns(30, 20, 10), 2.0)
    assert got == {"n": {"claims_per_second": 25.0, "duplicate_rate": 0.4}}
    assert rates(ns(10, 0), ns(10, 0), 1.0) == {
        "n": {"claims_per_second": 0.0, "duplicate_rate": 0.0}
    }
    samples = iter([ns(1, 0), ns(2, 1)])
    latest, per_ns = sample_rates(lambda: next(samples), 0.01)
    assert latest == ns(2, 1) and per_ns["n"]["duplicate_rate"] == 0.5
    assert per_ns["n"]["claims_per_second"] > 0
    once, none = sample_rates(lambda: ns(1, 0), 0)
    assert once == ns(1, 0) and none == {}


def test_bad_arguments_raise_precise_errors(store: DedupStore, registry: CollectorRegistry) -> None:
    with pytest.raises(TypeError, match="CollectorRegistry"):
        Metrics("registry")
    with pytest.raises(TypeError, match="region"):
        Metrics(registry, region=3)  # type: ignore[arg-type]
    for bad in ("eu west", "x" * 129, "é"):
        with pytest.raises(ValueError, match="region"):
            Metrics(registry, region=bad)
    with pytest.raises(TypeError, match="namespace_label"):
        Metrics(registry, namespace_label="yes")  # type: ignore[arg-type]
    metrics = Metrics(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Metrics(registry)  # one Metrics per registry
    with pytest.raises(TypeError, match="claim store"):
        instrument(object(), metrics)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Metrics"):
        instrument(store, registry)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="region"):
        instrument(store, metrics, region="no spaces")
    api = instrument(store, metrics)
    with pytest.raises(TypeError, match="instrumented already"):
        instrument(api, metrics)
    with pytest.raises(ValueError, match="> 0"):
        rates({}, {}, 0)
    with pytest.raises(TypeError):
        rates({}, {}, "1")  # type: ignore[arg-type]
    for interval in (-1, 3601):
        with pytest.raises(ValueError, match="interval"):
            sample_rates(dict, interval)
    with pytest.raises(TypeError, match="interval"):
        sample_rates(dict, True)
    with pytest.raises(TypeError, match="port"):
        serve_daemon_metrics(store, "9100")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port"):
        serve_daemon_metrics(store, 70000)
    with pytest.raises(ValueError, match="region"):
        DaemonCollector(store, region="a b")


def test_buckets_span_50_microseconds_to_5_seconds() -> None:
    assert BUCKETS[0] == 50e-6 and BUCKETS[-1] == 5.0
    assert list(BUCKETS) == sorted(set(BUCKETS))


def _exported(text: str) -> set[str]:
    return set(re.findall(r"\bdedupcore_[a-z_]+\b", text))


def test_dashboard_expressions_use_exported_names() -> None:
    dashboard = json.loads((ROOT / "docs" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "expr" in t]
    assert len(exprs) >= 5
    used = set().union(*(_exported(e) for e in exprs))
    assert used and used <= metric_names(), used - metric_names()


def test_alert_rules_use_exported_names() -> None:
    text = (ROOT / "docs" / "alerts.yml").read_text()
    try:
        import yaml
    except ImportError:
        exprs = re.findall(r"^\s*expr:\s*(.+)$", text, re.M)
    else:
        doc = yaml.safe_load(text)
        rules = [r for g in doc["groups"] for r in g["rules"]]
        assert all({"alert", "expr", "labels", "annotations"} <= set(r) for r in rules)
        exprs = [str(r["expr"]) for r in rules]
    assert exprs
    used = set().union(*(_exported(e) for e in exprs))
    assert used and used <= metric_names(), used - metric_names()


def test_docs_name_every_metric_and_the_registry_holds_them(registry: CollectorRegistry) -> None:
    Metrics(registry)
    documented = _exported((ROOT / "docs" / "metrics.md").read_text())
    histogram = "dedupcore_operation_seconds"
    table = (metric_names() - {f"{histogram}_{s}" for s in ("bucket", "sum", "count")}) | {
        histogram
    }
    assert documented - {f"{histogram}_bucket"} == table
    # Every in-process family is registered before anything was counted (the
    # daemon's gauges are the daemon's).
    families = {m.name for m in registry.collect()}
    counters = {n.removesuffix("_total") for n in metric_names() if n.endswith("_total")}
    assert counters | {histogram} <= families


def test_without_prometheus_client_instrument_names_the_extra(tmp_path: Path) -> None:
    from test_optional_deps import _run

    out = _run(
        """
        import json
        import sys

        import dedupcore.metrics as m
        from dedupcore import DedupStore

        with DedupStore.open(sys.argv[1] + "/data") as store:
            try:
                m.instrument(store)
            except m.MissingExtraError as exc:
                print(json.dumps([isinstance(exc, ImportError), str(exc)]))
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    is_import_error, message = json.loads(out.stdout)
    assert is_import_error and "pip install 'dedupcore[cli]'" in message
    assert issubclass(MissingExtraError, ImportError)
