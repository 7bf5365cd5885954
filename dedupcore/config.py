"""Configuration of a dedup store: keyword-only, with documented defaults."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "DURABILITY_MODES",
    "MAX_LEASE_SECONDS",
    "MIN_LEASE_SECONDS",
    "Retention",
    "StoreConfig",
    "policies",
]

DAY = 86400.0

#: ``"durable"``: an acknowledged claim or completion survives a process crash
#: and a power loss (group-committed write-ahead log, fdatasync before the
#: answer). ``"power-loss-unsafe"``: no fdatasync; survives a process crash
#: (the log is in the OS page cache) but not a power loss or kernel crash.
DURABILITY_MODES = ("durable", "power-loss-unsafe")


@dataclass(frozen=True, kw_only=True)
class Retention:
    """How long a namespace's keys are remembered.

    ``exact_window``: seconds the authority keeps exact records after their
    last change (default 7 days). ``cold_window``: seconds a demoted key stays
    in the cold Bloom archive, answering DUPLICATE with ``exact=False``
    (default 30 days; 0 disables the archive). ``hot_window`` is the Redis TTL
    when a Redis hot tier is configured (default 1 hour).
    """

    exact_window: float = 7 * DAY
    cold_window: float = 30 * DAY
    hot_window: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("exact_window", "hot_window"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name} must be a number of seconds")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        cold = self.cold_window
        if not isinstance(cold, (int, float)) or isinstance(cold, bool):
            raise TypeError("cold_window must be a number of seconds")
        if not math.isfinite(cold) or cold < 0:
            raise ValueError(f"cold_window must be >= 0 seconds, got {cold!r}")


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Settings of an embedded :class:`~dedupcore.DedupStore` (all keyword-only).

    - ``lease`` (30.0): default seconds a NEW claim is owned before another
      claim may take it over.
    - ``max_key_bytes`` (512), ``max_result_bytes`` (65536): input limits.
    - ``durability`` ("durable"): see :data:`DURABILITY_MODES`.
    - ``retention`` (:class:`Retention` defaults) and ``namespaces`` (a
      mapping of namespace to its own :class:`Retention`).
    - ``map_size`` (64 MiB): initial LMDB map; doubles when full.
    - ``front_error_rate`` (0.01): false-positive rate of the front filter; a
      false positive only costs one LMDB read.
    - ``front_slice_capacity`` (1,000,000) and ``cold_slice_capacity``
      (1,000,000): keys expected per time slice; slices grow past it.
    - ``cold_error_rate`` (0.001): false-positive rate of the cold archive;
      this is the error of an ``exact=False`` DUPLICATE answer.
    - ``checkpoint_records`` (200,000) and ``checkpoint_interval`` (30.0 s):
      when recent records are written into LMDB and the log is truncated.
    - ``sweep_interval`` (60.0 s): cadence of demotion to the cold archive.
    - ``slice_records`` (1,000,000) and ``slice_seconds`` (None: an eighth of
      the longest exact window): the warm tier writes into one time slice
      until it holds this many records (or a 32nd of all the tier holds, when
      that is more) or is this old, then starts the next; a slice past the
      exact window is dropped whole (docs/warm-tier.md).
    - ``slice_error_rate`` (0.01): false-positive rate of each slice's
      filter; a false positive costs one LMDB read in that slice.
    - ``compact_slices`` (True): the background thread rewrites each sealed
      slice in key order, in steps, while no checkpoint is due (full B-tree
      pages: about 40 bytes per record instead of 58; docs/warm-tier.md,
      "Compaction"). False leaves it to :meth:`DedupStore.compact`.
    """

    lease: float = 30.0
    max_key_bytes: int = 512
    max_result_bytes: int = 65536
    durability: str = "durable"
    retention: Retention = field(default_factory=Retention)
    namespaces: Mapping[str, Retention] = field(default_factory=dict)
    map_size: int = 64 << 20
    front_error_rate: float = 0.01
    front_slice_capacity: int = 1_000_000
    cold_error_rate: float = 0.001
    cold_slice_capacity: int = 1_000_000
    checkpoint_records: int = 200_000
    checkpoint_interval: float = 30.0
    sweep_interval: float = 60.0
    slice_records: int = 1_000_000
    slice_seconds: float | None = None
    slice_error_rate: float = 0.01
    compact_slices: bool = True

    def __post_init__(self) -> None:
        check_lease(self.lease)
        for name in (
            "max_key_bytes",
            "max_result_bytes",
            "map_size",
            "front_slice_capacity",
            "cold_slice_capacity",
            "checkpoint_records",
            "slice_records",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_result_bytes > 16 << 20 or self.max_key_bytes > 65536:
            raise ValueError("max_result_bytes is at most 16 MiB and max_key_bytes at most 64 KiB")
        if self.durability not in DURABILITY_MODES:
            raise ValueError(
                f"durability must be one of {DURABILITY_MODES}, got {self.durability!r}"
            )
        for name in ("front_error_rate", "cold_error_rate", "slice_error_rate"):
            value = getattr(self, name)
            if not isinstance(value, float) or not 0.0 < value < 1.0:
                raise ValueError(f"{name} must be a float in (0, 1), got {value!r}")
        for name in ("checkpoint_interval", "sweep_interval"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        if self.slice_seconds is not None and (
            isinstance(self.slice_seconds, bool)
            or not isinstance(self.slice_seconds, (int, float))
            or not self.slice_seconds > 0
        ):
            raise ValueError(
                f"slice_seconds must be > 0 seconds or None, got {self.slice_seconds!r}"
            )
        if not isinstance(self.compact_slices, bool):
            raise TypeError(
                f"compact_slices must be a bool, not {type(self.compact_slices).__name__}"
            )
        if not isinstance(self.retention, Retention):
            raise TypeError("retention must be a Retention")
        for ns, policy in self.namespaces.items():
            if not isinstance(policy, Retention):
                raise TypeError(f"namespaces[{ns!r}] must be a Retention")

    def retention_for(self, namespace: str) -> Retention:
        """The retention policy of a namespace."""
        return self.namespaces.get(namespace, self.retention)

    def slice_span(self) -> float:
        """Seconds a warm-tier slice takes writes before the next one starts."""
        if self.slice_seconds is not None:
            return float(self.slice_seconds)
        return self.longest_exact_window() / 8

    def longest_exact_window(self) -> float:
        """The longest exact window of any namespace (the front filter's span)."""
        return max(p.exact_window for p in policies(self.retention, self.namespaces))


def policies(retention: Retention, namespaces: Mapping[str, Retention]) -> list[Retention]:
    """The default policy and every namespace's own: all the windows a store must cover."""
    return [retention, *namespaces.values()]


#: Bounds of a lease, shared by every store, the daemon and the CLI. A lease
#: is how long one attempt at the work may take before another consumer takes
#: the key over; 30 days is far beyond any sane attempt and still fits every
#: record format (the embedded log, Redis' integer milliseconds, SQL
#: intervals). A millisecond is the resolution every authority keeps.
MAX_LEASE_SECONDS = 30 * 86400.0
MIN_LEASE_SECONDS = 0.001


def check_lease(lease: object) -> float:
    """A lease in seconds within [MIN_LEASE_SECONDS, MAX_LEASE_SECONDS], or ValueError/TypeError."""
    if isinstance(lease, bool) or not isinstance(lease, (int, float)):
        raise TypeError(f"lease must be a number of seconds, not {type(lease).__name__}")
    if not math.isfinite(lease) or not MIN_LEASE_SECONDS <= lease <= MAX_LEASE_SECONDS:
        raise ValueError(
            f"lease must be between {MIN_LEASE_SECONDS} and {MAX_LEASE_SECONDS:.0f} seconds "
            f"(30 days), got {lease!r}"
        )
    return float(lease)
