"""Type stub of the native claim engine (ext/_engine.pyx); see docs/engine.md."""

from collections.abc import Callable
from typing import Any

from typing_extensions import Self, disjoint_base

PROCESSING: int
PROCESSED: int
RELEASED: int
LOG_VERSION: int
LOG_CHUNK_BYTES: int

def encode_value(
    digest: bytes,
    state: int,
    ns_id: int,
    token: int,
    created: float,
    updated: float,
    lease: float,
    owner: bytes | None,
    fingerprint: bytes | None,
    result: bytes | None,
) -> bytes: ...
def decode_value(digest: bytes, value: bytes | bytearray | memoryview) -> tuple[Any, ...]: ...

@disjoint_base
class ClaimTable:
    def __new__(cls, capacity: int = 1024) -> Self: ...
    def __len__(self) -> int: ...
    @property
    def inflight(self) -> int: ...
    @property
    def clean(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def missing(self, digests: bytes) -> list[int]: ...
    def get(self, digest: bytes) -> tuple[Any, ...] | None: ...
    def load(self, digests: list[bytes], values: list[bytes | None], now_m: float) -> int: ...
    def replay(self, payload: bytes | bytearray | memoryview, lsn: int, now_m: float) -> bytes: ...
    def claim(
        self,
        digests: bytes,
        keys: list[Any],
        namespace: str,
        ns_id: int,
        lease: float,
        owner: bytes | None,
        fingerprints: list[bytes | None] | None,
        cold: bytes | bytearray | None,
        now_w: float,
        now_m: float,
        claim_type: Callable[..., Any],
        outcomes: tuple[Any, Any, Any],
        unpack: Callable[[bytes], Any],
    ) -> tuple[list[Any] | None, int, int, list[bytes], tuple[int, int, int, int, int, int]]: ...
    def change(
        self,
        digests: bytes,
        tokens: list[int],
        results: list[bytes | None] | None,
        state: int,
        now_w: float,
    ) -> tuple[int, int, int, int, list[bytes], int]: ...
    def apply(self, lsn: int) -> None: ...
    def discard(self) -> None: ...
    def staged_digests(self) -> bytes: ...
    def export(
        self, after: int, upto: int
    ) -> tuple[list[tuple[bytes, bytes]], list[bytes], list[bytes], float]: ...
    def export_packed(self, after: int, upto: int) -> tuple[bytes, int, float]: ...
    def evict(self, upto: int) -> int: ...
    def dirty(self, after: int) -> int: ...
    def inflight_records(
        self, deadline_before: float, updated_before: float
    ) -> list[tuple[bytes, int, int, float]]: ...
    def digests(self) -> bytes: ...

def sort_packed(packed: bytes, n: int) -> bytes: ...
def unpack_items(
    packed: bytes, n: int
) -> tuple[list[tuple[bytes, bytes]], list[bytes], list[bytes]]: ...
def digest_keys(
    namespace: bytes, keys: list[Any], max_key_bytes: int, seed_hi: int
) -> tuple[bytes, int]: ...
def split_items(
    items: list[Any], with_results: bool
) -> tuple[list[Any] | None, list[int] | None, list[Any] | None, int]: ...
