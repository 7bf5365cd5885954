"""The interfaces a stacked store is built from.

A stack (:class:`dedupcore.stack.TieredStore`) is, from the top:

- the **front filter**, an in-process Bloom ring: "definitely never seen
  here" skips every read below;
- an optional **cache** (:class:`CacheTier`, e.g. Redis), which holds only
  PROCESSED records and is written through after the authority has them;
- the **authority** (:class:`Authority`), the one exact tier where a NEW
  claim is created atomically and races are decided: the embedded
  :class:`~dedupcore.DedupStore` (LMDB), :class:`~dedupcore.tiers.sql.SqlStore`
  or :class:`~dedupcore.tiers.redis.RedisStore`;
- an optional **cold archive** (:class:`~dedupcore.tiers.archive.ColdArchive`)
  of keys demoted from the authority.

An authority is any claim API with ``close()``; a cache implements the two
template methods below. A cache or front that fails is skipped (slower, never
wrong); an authority that fails raises :class:`~dedupcore.errors.UnavailableError`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from dedupcore.api import Claim, KeyRecord

__all__ = ["Authority", "CacheTier", "Cached"]


@runtime_checkable
class Authority(Protocol):
    """An exact tier that decides claims: the claim API plus ``close``."""

    def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[Claim]: ...

    def complete_many(self, items: Iterable[Any], *, namespace: str) -> None: ...

    def release_many(self, items: Iterable[tuple[bytes | str, int]], *, namespace: str) -> None: ...

    def get(self, key: bytes | str, *, namespace: str) -> KeyRecord | None: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Cached:
    """A PROCESSED record as a cache holds it.

    ``fingerprint_known`` is False when the record was filled from an answer
    that did not carry the fingerprint; such an entry cannot settle a claim
    that brings a fingerprint (the authority has to check it).
    """

    token: int
    result: bytes | None
    fingerprint: bytes | None = None
    fingerprint_known: bool = False


class CacheTier(ABC):
    """A cache of PROCESSED records in front of the authority.

    Subclasses implement :meth:`_get_many` and :meth:`_put_many`; errors
    they raise are caught by the stack, counted, logged and the cache is
    skipped for ``retry_after`` seconds.
    """

    name = "cache"

    @abstractmethod
    def _get_many(self, namespace: bytes, keys: Sequence[bytes]) -> list[Cached | None]:
        """The cached record of each key (None when absent)."""

    @abstractmethod
    def _put_many(
        self, namespace: bytes, entries: Sequence[tuple[bytes, Cached]], ttl: float
    ) -> None:
        """Stores records that the authority holds as PROCESSED, for ``ttl`` seconds."""

    def get_many(self, namespace: bytes, keys: Sequence[bytes]) -> list[Cached | None]:
        """The cached records of checked keys of one namespace."""
        if not keys:
            return []
        found = self._get_many(namespace, keys)
        if len(found) != len(keys):
            raise RuntimeError(f"{self.name}: {len(found)} answers for {len(keys)} keys")
        return found

    def put_many(
        self, namespace: bytes, entries: Sequence[tuple[bytes, Cached]], ttl: float
    ) -> None:
        """Writes PROCESSED records through to the cache."""
        if entries:
            self._put_many(namespace, entries, ttl)

    def close(self) -> None:  # noqa: B027 - a cache without resources needs nothing
        """Releases the cache's connections."""

    def stats(self) -> dict[str, Any]:
        return {}

    #: Exceptions that mean "the cache cannot answer now" (skipped, not raised).
    unavailable: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, OSError)
