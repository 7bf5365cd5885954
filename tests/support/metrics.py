"""The scripted sequence of calls that every instrumented store must count alike
(tests/unit/test_metrics.py on the embedded stores, tests/authorities/test_metrics_stores.py
on the servers and the daemon), and what it leaves in the counters."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from dedupcore.api import ClaimAPI, Outcome
from dedupcore.errors import ConflictError, StaleTokenError

#: What :func:`run_script` leaves in the counters, whatever the store.
EXPECTED_CLAIMS = {"new": 5, "in_progress": 1, "duplicate": 2, "conflict": 1}
EXPECTED_ERRORS = {
    ("claim", "ConflictError"): 1,
    ("claim", "TypeError"): 1,
    ("complete", "StaleTokenError"): 1,
    ("complete", "ValueError"): 1,
    ("release", "StaleTokenError"): 1,
    ("extend", "StaleTokenError"): 1,
}
#: Batch calls per operation (failed ones included): the histogram's ``_count``.
EXPECTED_CALLS = {"claim": 7, "complete": 4, "release": 2, "extend": 2}


def run_script(api: ClaimAPI, ns: str) -> None:
    """New, in-progress, complete, duplicate, release, re-claim, a renewal, and six refused
    calls."""
    first = api.claim_many(["a", "b", "c"], namespace=ns, owner="w1")
    assert [c.outcome for c in first] == [Outcome.NEW] * 3
    assert api.claim("a", namespace=ns, owner="w2").outcome is Outcome.IN_PROGRESS
    api.complete_many([("a", first[0].token, "ra"), ("b", first[1].token)], namespace=ns)
    dups = api.claim_many(["a", "b"], namespace=ns)
    assert [c.outcome for c in dups] == [Outcome.DUPLICATE] * 2 and dups[0].result == "ra"
    api.release("c", first[2].token, namespace=ns)
    again = api.claim("c", namespace=ns)
    assert again.outcome is Outcome.NEW
    with pytest.raises(StaleTokenError):
        api.complete("c", first[2].token, namespace=ns)
    api.complete("c", again.token, namespace=ns)
    f = api.claim("f", namespace=ns, fingerprint=b"x")
    assert f.outcome is Outcome.NEW
    api.extend("f", f.token, namespace=ns, lease=60.0)
    with pytest.raises(StaleTokenError):
        api.extend("c", again.token, namespace=ns)  # a renewal after the completion
    with pytest.raises(ConflictError):
        api.claim("f", namespace=ns, fingerprint=b"y")
    with pytest.raises(StaleTokenError):
        api.release("a", first[0].token, namespace=ns)  # a release after the completion
    with pytest.raises(TypeError):
        api.claim_many([1.5], namespace=ns)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        api.complete_many([("a", 0)], namespace=ns)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value; 0 when the series does not exist."""
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def check_script_counts(
    registry: CollectorRegistry, ns: str, region: str, *, takeovers: int = 0
) -> None:
    """The counters after :func:`run_script` (namespace ``ns``, label ``region``)."""
    for outcome, n in EXPECTED_CLAIMS.items():
        got = value(
            registry, "dedupcore_claims_total", namespace=ns, outcome=outcome, region=region
        )
        assert got == n, outcome
    assert value(registry, "dedupcore_completes_total", namespace=ns, region=region) == 3
    assert value(registry, "dedupcore_releases_total", namespace=ns, region=region) == 1
    assert (
        value(registry, "dedupcore_lease_takeovers_total", namespace=ns, region=region) == takeovers
    )
    for (operation, error), n in EXPECTED_ERRORS.items():
        got = value(
            registry, "dedupcore_errors_total", operation=operation, error=error, region=region
        )
        assert got == n, (operation, error)
    errors = [
        s
        for m in registry.collect()
        if m.name == "dedupcore_errors"
        for s in m.samples
        if s.name == "dedupcore_errors_total"
    ]
    assert sum(s.value for s in errors) == sum(EXPECTED_ERRORS.values())
    for operation, n in EXPECTED_CALLS.items():
        labels = {"operation": operation, "region": region}
        assert value(registry, "dedupcore_operation_seconds_count", **labels) == n, operation
        inf = value(registry, "dedupcore_operation_seconds_bucket", le="+Inf", **labels)
        assert inf == n
