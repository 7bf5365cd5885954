"""What a claim answers: :class:`Outcome`, :class:`Claim`, :class:`KeyRecord`, and the
per-namespace counts every store's ``stats()`` reports (docs/architecture.md, "The contract")."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import dedupcore._engine as _engine
from dedupcore.record import State

__all__ = ["Claim", "KeyRecord", "Outcome", "namespace_counts"]


class Outcome(enum.Enum):
    """What a claim found."""

    NEW = "new"  #: the caller now owns the key and must complete or release it
    DUPLICATE = "duplicate"  #: already processed; ``result`` holds the stored result
    IN_PROGRESS = "in_progress"  #: another owner holds an unexpired lease; retry later


@dataclass(slots=True)
class Claim:
    """The answer to a claim.

    For a NEW claim, ``token`` is the fencing token to pass to ``complete``
    or ``release``; inside ``store.processing(...)`` set ``result`` to what
    should be stored with the completion. ``exact`` is False only when the
    answer came from the cold Bloom archive.
    """

    key: bytes | str
    namespace: str
    outcome: Outcome
    token: int = 0
    result: Any = None
    exact: bool = True
    takeover: bool = False


# Batch answers build their Claims natively, slots filled in as __init__ would
# (docs/engine.md, "Answers"): a fraction of the cost of calling the class.
_engine.bind_record_class(Claim, tuple(f.name for f in fields(Claim)))


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A key's record as :meth:`DedupStore.get` reports it."""

    state: State
    token: int
    owner: bytes | None
    fingerprint: bytes | None
    result: Any
    created: float
    updated: float
    exact: bool = True


def namespace_counts(outcomes: Mapping[tuple[str, str], int]) -> dict[str, dict[str, Any]]:
    """``stats()["namespaces"]``: per namespace, claims per outcome and the duplicate rate.

    ``outcomes`` counts ``(namespace, outcome value)`` pairs; several stores'
    counters can be summed before they are passed in.
    """
    per_ns: dict[str, dict[str, Any]] = {}
    for (ns, outcome), n in outcomes.items():
        per_ns.setdefault(ns, {o.value: 0 for o in Outcome})[outcome] += n
    for counts in per_ns.values():
        total = sum(counts[o.value] for o in Outcome)
        counts["duplicate_rate"] = counts["duplicate"] / total if total else 0.0
    return per_ns
