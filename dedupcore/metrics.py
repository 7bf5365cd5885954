"""Prometheus metrics of a claim store, in this process or in the daemon (docs/metrics.md).

:func:`instrument` wraps any store (:class:`~dedupcore.store.DedupStore`,
``RedisStore``, ``SqlStore``, ``TieredStore``, ``ShardedStore``,
``WriteBehindStore``, the daemon ``Client``) in a :class:`~dedupcore.api.ClaimAPI`
that counts what each batch call answered and how long it took. Counters the
stores keep themselves (tier hits, front filter skips) are read from
``stats()`` when Prometheus scrapes, by a collector, so no store code counts
twice. ``dedupcore serve --metrics-port`` exports the same names from the
daemon's store figures (:class:`DaemonCollector`).

The module imports without ``prometheus-client`` (the ``cli`` extra);
:class:`Metrics` and :func:`instrument` then raise :class:`MissingExtraError`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dedupcore.api import Claim, ClaimAPI, KeyRecord, Outcome, batches
from dedupcore.errors import ConflictError, MissingExtraError
from dedupcore.wrapper import StoreWrapper

T = TypeVar("T")

__all__ = [
    "BUCKETS",
    "DaemonCollector",
    "InstrumentedStore",
    "Metrics",
    "MissingExtraError",
    "StoreFigures",
    "default_metrics",
    "instrument",
    "metric_names",
    "rates",
    "sample_rates",
    "serve_daemon_metrics",
    "store_figures",
    "store_parts",
]

log = logging.getLogger("dedupcore.metrics")

#: Latency buckets (seconds): an in-memory duplicate (~50 µs) to a stalled remote (5 s).
BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)

#: Metric families (as exported: counters end in ``_total``) and their labels.
COUNTERS: dict[str, tuple[str, ...]] = {
    "dedupcore_claims": ("namespace", "outcome", "region"),
    "dedupcore_completes": ("namespace", "region"),
    "dedupcore_releases": ("namespace", "region"),
    "dedupcore_lease_takeovers": ("namespace", "region"),
    "dedupcore_errors": ("operation", "error", "region"),
    "dedupcore_tier_hits": ("tier", "region"),
    "dedupcore_front_skips": ("region",),
}
HISTOGRAM = "dedupcore_operation_seconds"
HISTOGRAM_LABELS = ("operation", "region")
#: The daemon's gauges: figures of its store, not events.
GAUGES: dict[str, tuple[str, ...]] = {
    "dedupcore_in_flight": ("region",),
    "dedupcore_lmdb_records": ("region",),
    "dedupcore_lmdb_bytes": ("region",),
}
#: ``outcome`` of a claim batch refused whole because a key had another fingerprint.
CONFLICT = "conflict"

_HELP = {
    "dedupcore_claims": "keys claimed, by namespace and outcome (new, duplicate, in_progress, "
    "conflict)",
    "dedupcore_completes": "keys completed",
    "dedupcore_releases": "keys released",
    "dedupcore_lease_takeovers": "NEW claims that took over an expired lease",
    "dedupcore_errors": "calls that raised, by operation and exception class",
    "dedupcore_tier_hits": "keys answered or read by a tier (cache, cold, lmdb), from stats()",
    "dedupcore_front_skips": "keys the front filter answered alone (definitely new), from stats()",
    HISTOGRAM: "duration of one batch call, by operation",
    "dedupcore_in_flight": "keys claimed and not yet completed or released",
    "dedupcore_lmdb_records": "exact records in LMDB",
    "dedupcore_lmdb_bytes": "bytes of LMDB pages in use",
}

_LABEL_RE = re.compile(r"[A-Za-z0-9._:/-]{0,128}\Z")
_INSTALL = "pip install 'dedupcore[cli]'"


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise MissingExtraError(
            f"dedupcore.metrics needs prometheus-client, which is not installed: {_INSTALL}"
        ) from exc
    return prometheus_client


def metric_names() -> frozenset[str]:
    """Every sample name this module exports (counters with ``_total``, the histogram's
    ``_bucket``/``_sum``/``_count``), for checking dashboards and alert rules."""
    names = {f"{name}_total" for name in COUNTERS}
    names |= {f"{HISTOGRAM}{suffix}" for suffix in ("_bucket", "_sum", "_count")}
    return frozenset(names | set(GAUGES))


def _check_region(region: object) -> str:
    if not isinstance(region, str):
        raise TypeError(f"region must be str, not {type(region).__name__}")
    if not _LABEL_RE.match(region):
        raise ValueError(
            f"region must be 0..128 characters of [A-Za-z0-9._:/-], got {region!r:.80}"
        )
    return region


class Metrics:
    """The counters and the latency histogram, registered in one Prometheus registry.

    ``registry``: a ``prometheus_client.CollectorRegistry`` (default: the
    global ``REGISTRY``, which ``start_http_server`` serves); one
    :class:`Metrics` per registry. ``region``: the ``region`` label of every
    sample (default ""; :func:`instrument` may give each store its own).
    ``namespace_label=False`` leaves the ``namespace`` label empty, for
    deployments with so many namespaces that one series each would be too
    many. The stores given to :func:`instrument` with this object have their
    ``stats()`` read at each scrape for the tier and front filter counters.
    """

    def __init__(
        self, registry: Any = None, region: str = "", namespace_label: bool = True
    ) -> None:
        prom = _prometheus()
        if not isinstance(namespace_label, bool):
            raise TypeError(f"namespace_label must be a bool, not {type(namespace_label).__name__}")
        if registry is not None and not isinstance(registry, prom.CollectorRegistry):
            raise TypeError(
                f"registry must be a prometheus_client.CollectorRegistry, not "
                f"{type(registry).__name__}"
            )
        self.region = _check_region(region)
        self.namespace_label = namespace_label
        self.registry = prom.REGISTRY if registry is None else registry
        self._lock = threading.Lock()
        self._sources: dict[int, tuple[ClaimAPI, str]] = {}
        # The stats collector first: a registry that already has these names refuses
        # it before any counter of this object is registered.
        self._collector = _StatsCollector(self)
        self.registry.register(self._collector)
        counters = {
            name: prom.Counter(name, _HELP[name], labels, registry=self.registry)
            for name, labels in COUNTERS.items()
            if name not in _StatsCollector.NAMES
        }
        self.claims = counters["dedupcore_claims"]
        self.completes = counters["dedupcore_completes"]
        self.releases = counters["dedupcore_releases"]
        self.takeovers = counters["dedupcore_lease_takeovers"]
        self.errors = counters["dedupcore_errors"]
        self.seconds = prom.Histogram(
            HISTOGRAM, _HELP[HISTOGRAM], HISTOGRAM_LABELS, buckets=BUCKETS, registry=self.registry
        )

    def namespace(self, namespace: str) -> str:
        """The ``namespace`` label value of a namespace."""
        return namespace if self.namespace_label else ""

    def watch(self, store: ClaimAPI, region: str) -> None:
        """Reads ``store.stats()`` at each scrape for the tier and front filter counters."""
        with self._lock:
            self._sources[id(store)] = (store, region)

    def unwatch(self, store: ClaimAPI) -> None:
        """Stops reading ``store.stats()`` (its counters leave the scrape)."""
        with self._lock:
            self._sources.pop(id(store), None)

    def sources(self) -> list[tuple[ClaimAPI, str]]:
        with self._lock:
            return list(self._sources.values())


_default: Metrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> Metrics:
    """The :class:`Metrics` of the global Prometheus registry (made on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Metrics()
        return _default


# -- what the stores count themselves, read from stats() -----------------------------


@dataclass(slots=True)
class StoreFigures:
    """Counters read from a store's ``stats()`` (nested stacks, shards, local tables
    and the daemon's answer included)."""

    claims: Counter[tuple[str, str]] = field(default_factory=Counter)
    takeovers: int = 0
    tier_hits: Counter[str] = field(default_factory=Counter)
    front_skips: int = 0
    in_flight: int = 0
    lmdb_records: int = 0
    lmdb_bytes: int = 0


def store_parts(st: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """A store's stats and those of the stores inside it (authority, shards, local table)."""
    yield st
    for name in ("authority", "local"):
        sub = st.get(name)
        if isinstance(sub, Mapping):
            yield from store_parts(sub)
    for sub in st.get("shards", ()):
        if isinstance(sub, Mapping):
            yield from store_parts(sub)


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def store_figures(st: Mapping[str, Any]) -> StoreFigures:
    """The counters of one ``stats()`` answer, whatever kind of store gave it.

    Claims per namespace and outcome come from the outermost ``namespaces``
    (a stack or shard set counts every claim once, at the top), or, for a bare
    ``SqlStore`` that counts outcomes without namespaces, under namespace "".
    Takeovers are the embedded store's ``lease_takeovers`` and a SQL store's
    ``takeovers``. Tier hits: ``lmdb`` (keys the embedded store read from LMDB),
    ``cache`` and ``cold`` (a stack's cache and cold archive answers); front
    skips are keys a front filter answered alone.
    """
    if not isinstance(st, Mapping):
        raise TypeError(f"stats must be a mapping, not {type(st).__name__}")
    out = StoreFigures()
    claims_found = False
    for part in store_parts(st):
        per_ns = part.get("namespaces")
        if not claims_found and isinstance(per_ns, Mapping):
            claims_found = True
            for ns, counts in per_ns.items():
                for o in Outcome:
                    out.claims[(str(ns), o.value)] += _int(counts.get(o.value))
        out.takeovers += _int(part.get("lease_takeovers"))
        if "engine" in part:  # SqlStore
            out.takeovers += _int(part.get("takeovers"))
        front = part.get("front")
        lmdb = part.get("lmdb")
        if isinstance(lmdb, Mapping):  # the embedded store
            out.tier_hits["lmdb"] += _int(lmdb.get("reads"))
            out.lmdb_records += _int(lmdb.get("records"))
            out.lmdb_bytes += _int(lmdb.get("disk_bytes"))
            out.in_flight += _int(part.get("in_flight"))
            if isinstance(front, Mapping):
                out.front_skips += _int(front.get("negative"))
        counts = part.get("counts")
        if isinstance(counts, Mapping):  # a TieredStore
            out.tier_hits["cache"] += _int(counts.get("cache_hits"))
            out.tier_hits["cold"] += _int(counts.get("cold_hits"))
            out.front_skips += _int(counts.get("front_negative"))
    if not claims_found:
        for part in store_parts(st):
            if "engine" in part:
                for o in Outcome:
                    out.claims[("", o.value)] += _int(part.get(o.value))
    return out


def _families() -> dict[str, Any]:
    from prometheus_client import core

    fams: dict[str, Any] = {}
    for name, labels in COUNTERS.items():
        fams[name] = core.CounterMetricFamily(name, _HELP[name], labels=labels)
    for name, labels in GAUGES.items():
        fams[name] = core.GaugeMetricFamily(name, _HELP[name], labels=labels)
    return fams


class _StatsCollector:
    """Exports the watched stores' own counters (tier hits, front skips) at each scrape."""

    NAMES = ("dedupcore_tier_hits", "dedupcore_front_skips")

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._prom = _prometheus()

    def describe(self) -> list[Any]:
        fams = _families()
        return [fams[name] for name in self.NAMES]

    def collect(self) -> Iterator[Any]:
        hits: Counter[tuple[str, str]] = Counter()
        skips: Counter[str] = Counter()
        for store, region in self._metrics.sources():
            try:
                fig = store_figures(store.stats())
            except Exception as exc:  # a closed or unreachable store: left out of this scrape
                log.debug("stats() of %r failed: %s", store, exc)
                continue
            for tier, n in fig.tier_hits.items():
                hits[(tier, region)] += n
            skips[region] += fig.front_skips
        fams = _families()
        for (tier, region), n in sorted(hits.items()):
            fams["dedupcore_tier_hits"].add_metric([tier, region], n)
        for region, n in sorted(skips.items()):
            fams["dedupcore_front_skips"].add_metric([region], n)
        yield fams["dedupcore_tier_hits"]
        yield fams["dedupcore_front_skips"]


class DaemonCollector:
    """The daemon's metrics: the same counter names, read from its store's ``stats()``.

    Claims per namespace and outcome, takeovers (namespace label ""), tier
    hits and front skips, and the gauges ``dedupcore_in_flight``,
    ``dedupcore_lmdb_records`` and ``dedupcore_lmdb_bytes``. Completions,
    releases, errors and latencies are not among the store's figures, so the
    daemon does not export them (docs/metrics.md).
    """

    def __init__(self, store: Any, region: str = "") -> None:
        self._prom = _prometheus()
        self.store = store
        self.region = _check_region(region)

    def describe(self) -> list[Any]:
        fams = _families()
        return [fams[name] for name in (*_DAEMON_COUNTERS, *GAUGES)]

    def collect(self) -> Iterator[Any]:
        try:
            fig = store_figures(self.store.stats())
        except Exception as exc:  # a failed store: the scrape shows nothing of it
            log.warning("metrics: stats() failed: %s", exc)
            return
        fams = _families()
        r = self.region
        for (ns, outcome), n in sorted(fig.claims.items()):
            fams["dedupcore_claims"].add_metric([ns, outcome, r], n)
        fams["dedupcore_lease_takeovers"].add_metric(["", r], fig.takeovers)
        for tier, n in sorted(fig.tier_hits.items()):
            fams["dedupcore_tier_hits"].add_metric([tier, r], n)
        fams["dedupcore_front_skips"].add_metric([r], fig.front_skips)
        fams["dedupcore_in_flight"].add_metric([r], fig.in_flight)
        fams["dedupcore_lmdb_records"].add_metric([r], fig.lmdb_records)
        fams["dedupcore_lmdb_bytes"].add_metric([r], fig.lmdb_bytes)
        for name in (*_DAEMON_COUNTERS, *GAUGES):
            yield fams[name]


_DAEMON_COUNTERS = (
    "dedupcore_claims",
    "dedupcore_lease_takeovers",
    "dedupcore_tier_hits",
    "dedupcore_front_skips",
)


def serve_daemon_metrics(
    store: Any, port: int, *, region: str = "", host: str = "127.0.0.1"
) -> Any:
    """Serves the daemon's metrics on ``host``:``port`` (an IPv4 or IPv6 address or a
    host name; default 127.0.0.1) from a registry of their own; returns the registry.
    OSError when the address cannot be bound."""
    prom = _prometheus()
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int, not {type(port).__name__}")
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    registry = prom.CollectorRegistry()
    registry.register(DaemonCollector(store, region))
    # What the global registry served before: the process's CPU, memory, descriptors, GC.
    prom.ProcessCollector(registry=registry)
    prom.PlatformCollector(registry=registry)
    prom.GCCollector(registry=registry)
    prom.start_http_server(port, addr=host, registry=registry)
    return registry


# -- the instrumented store -------------------------------------------------------------


class InstrumentedStore(StoreWrapper):
    """A store whose batch calls are counted and timed (see :func:`instrument`).

    Every other attribute (``sweep``, ``purge``, ``flush``, ``config``...) is
    the store's own. ``close()`` closes the store and stops reading its stats.
    """

    def __init__(self, store: ClaimAPI, metrics: Metrics, region: str) -> None:
        super().__init__(store)
        self.metrics = metrics
        self.region = region
        # The label children, looked up once per (name, labels): a batch call then
        # costs a dict lookup per counter it moves.
        self._children: dict[tuple[object, ...], Any] = {}
        metrics.watch(store, region)

    def __repr__(self) -> str:
        return f"InstrumentedStore({self.store!r}, region={self.region!r})"

    def _child(self, metric: Any, *labels: str) -> Any:
        index = (id(metric), *labels)
        child = self._children.get(index)
        if child is None:
            child = self._children[index] = metric.labels(*labels)
        return child

    def _count_error(self, operation: str, exc: Exception) -> None:
        self._child(self.metrics.errors, operation, type(exc).__name__, self.region).inc()

    def _refused(self, operation: str, exc: Exception) -> None:
        """A call its arguments' check refused: counted as the store's own errors are,
        with no time spent in the store."""
        self._took(operation, time.perf_counter())
        self._count_error(operation, exc)

    def _took(self, operation: str, started: float) -> None:
        self._child(self.metrics.seconds, operation, self.region).observe(
            time.perf_counter() - started
        )

    def _claim_batch(self, batch: batches.ClaimBatch) -> list[Claim]:
        """The store's decision of a checked batch; counts each answer by outcome, and
        takeovers."""
        try:
            claims = self._timed("claim", lambda: self.store._claim_batch(batch))
        except ConflictError:
            ns = self.metrics.namespace(batch.namespace)
            self._child(self.metrics.claims, ns, CONFLICT, self.region).inc()
            raise
        if claims:
            ns = self.metrics.namespace(batch.namespace)
            new = dup = busy = takeovers = 0
            for c in claims:
                if c.outcome is Outcome.NEW:
                    new += 1
                    takeovers += c.takeover
                elif c.outcome is Outcome.DUPLICATE:
                    dup += 1
                else:
                    busy += 1
            for outcome, n in ((Outcome.NEW, new), (Outcome.DUPLICATE, dup)):
                if n:
                    self._child(self.metrics.claims, ns, outcome.value, self.region).inc(n)
            if busy:
                self._child(self.metrics.claims, ns, "in_progress", self.region).inc(busy)
            if takeovers:
                self._child(self.metrics.takeovers, ns, self.region).inc(takeovers)
        return claims

    def _change_batch(self, batch: batches.ChangeBatch) -> None:
        """The store's completion or release of a checked batch; counts its keys."""
        operation, metric = (
            ("complete", self.metrics.completes)
            if batch.completing
            else ("release", self.metrics.releases)
        )
        self._timed(operation, lambda: self.store._change_batch(batch))
        if len(batch):
            self._child(metric, self.metrics.namespace(batch.namespace), self.region).inc(
                len(batch)
            )

    def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        """The store's record, timed."""
        return self._timed("get", lambda: self.store._get_record(ns, key))

    def _extend_batch(self, batch: batches.ExtendBatch) -> None:
        """The store's renewal of a checked batch, timed as operation ``extend``."""
        self._timed("extend", lambda: self.store._extend_batch(batch))

    def _timed(self, operation: str, call: Callable[[], T]) -> T:
        """``call()``, timed as ``operation``; what it raises is counted, then raised."""
        started = time.perf_counter()
        try:
            return call()
        except Exception as exc:
            self._count_error(operation, exc)
            raise
        finally:
            self._took(operation, started)

    def close(self) -> None:
        """Closes the store; its stats are no longer read."""
        self.metrics.unwatch(self.store)
        self.store.close()


def instrument(
    store: ClaimAPI, metrics: Metrics | None = None, region: str | None = None
) -> InstrumentedStore:
    """``store`` with Prometheus counters and latencies (docs/metrics.md).

    ``metrics``: where to count (default :func:`default_metrics`, the global
    registry). ``region``: this store's ``region`` label (default the
    ``metrics``' own). Raises :class:`MissingExtraError` without
    prometheus-client, TypeError for something that is not a claim store.
    """
    if not isinstance(store, ClaimAPI):
        raise TypeError(
            f"instrument() takes a claim store (a ClaimAPI), not {type(store).__name__}"
        )
    if isinstance(store, InstrumentedStore):
        raise TypeError("this store is instrumented already: its calls would count twice")
    if metrics is None:
        metrics = default_metrics()
    elif not isinstance(metrics, Metrics):
        raise TypeError(f"metrics must be a Metrics, not {type(metrics).__name__}")
    return InstrumentedStore(
        store, metrics, metrics.region if region is None else _check_region(region)
    )


# -- rates between two stats samples (``dedupcore stats``) ---------------------------


def rates(
    before: Mapping[str, Any], after: Mapping[str, Any], seconds: float
) -> dict[str, dict[str, float]]:
    """Per namespace, claims per second and the duplicate rate between two ``stats()``
    samples taken ``seconds`` apart (a namespace without claims in between: rate 0)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"seconds must be a number, not {type(seconds).__name__}")
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    a = store_figures(before).claims
    b = store_figures(after).claims
    out: dict[str, dict[str, float]] = {}
    for ns in sorted({ns for ns, _ in b}):
        delta = {o.value: max(0, b[(ns, o.value)] - a[(ns, o.value)]) for o in Outcome}
        total = sum(delta.values())
        out[ns] = {
            "claims_per_second": total / seconds,
            "duplicate_rate": delta["duplicate"] / total if total else 0.0,
        }
    return out


def sample_rates(
    stats: Callable[[], Mapping[str, Any]], interval: float
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """The latest of two ``stats()`` samples ``interval`` seconds apart, and the
    :func:`rates` between them (``interval`` 0: one sample, no rates)."""
    if isinstance(interval, bool) or not isinstance(interval, (int, float)):
        raise TypeError(f"interval must be a number of seconds, not {type(interval).__name__}")
    if not 0 <= interval <= 3600:
        raise ValueError(f"interval must be 0..3600 seconds, got {interval}")
    first = dict(stats())
    if not interval:
        return first, {}
    started = time.monotonic()
    time.sleep(interval)  # the measuring window itself, not a wait for an event
    second = dict(stats())
    return second, rates(first, second, time.monotonic() - started)
