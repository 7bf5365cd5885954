"""The search of a claim table's records in flight in bounded steps (scan_begin, scan_step).

The store runs it a step per hold of its lock (the checkpoint's aged scan, the
sweep), so the table changes between two steps: records are claimed, settled,
evicted (a backward shift moves records of a cluster up), and the table grows
(a new slot array, records moving over a few per put). A record may be found
twice, but none in flight from the search's beginning to its end is missed
(docs/engine.md, "Scans in steps").
"""

from __future__ import annotations

import struct

from dedupcore import _engine
from dedupcore.record import State

NOW_W, NOW_M = 1_700_000_000.0, 1000.0
INF = float("inf")
SLOTS = 2048  # a new table's slots (its capacity, 1024, at most half full)


class Table:
    """A ClaimTable and the log positions of what it applied."""

    def __init__(self) -> None:
        self.t = _engine.ClaimTable()
        self.lsn = 0
        self.tokens: dict[bytes, int] = {}

    def claim(self, ds: list[bytes]) -> None:
        claims, *_rest, counts = self.t.claim(
            b"".join(ds), list(range(len(ds))), "ns", 1, 30.0, None, None, None,
            NOW_W, NOW_M, lambda *a: a, ("NEW", "DUP", "BUSY"), lambda x: x,
        )  # fmt: skip
        assert claims is not None and counts[0] == len(ds)
        self.lsn += 1
        self.t.apply(self.lsn)
        self.tokens.update((d, c[3]) for d, c in zip(ds, claims, strict=True))

    def complete(self, ds: list[bytes]) -> None:
        bad, *_rest = self.t.change(
            b"".join(ds), [self.tokens[d] for d in ds], None, int(State.PROCESSED), NOW_W
        )
        assert bad == -1
        self.lsn += 1
        self.t.apply(self.lsn)
        for d in ds:
            del self.tokens[d]

    def step(self, limit: int, found: set[bytes], max_found: int = 0) -> tuple[int, bool]:
        digests, _info, visited, more = self.t.scan_step(INF, INF, limit, max_found)
        assert visited <= limit
        found.update(digests[i : i + 16] for i in range(0, len(digests), 16))
        return visited, more


def at_home(home: int, n: int, tag: int) -> list[bytes]:
    """n digests whose home slot in a table of SLOTS slots is ``home``."""
    return [struct.pack("<QQ", (tag << 32) + i, home) for i in range(n)]


def test_a_search_visits_at_most_its_limit_per_step() -> None:
    table = Table()
    ds = [struct.pack("<QQ", i, i * 0x9E3779B97F4A7C15 % 2**64) for i in range(500)]
    table.claim(ds)
    table.t.scan_begin()
    found: set[bytes] = set()
    steps, more, visits = 0, True, 0
    while more:
        visited, more = table.step(100, found)
        steps += 1
        visits += visited
        assert visited <= 100
    assert found == set(ds)
    assert steps == SLOTS // 100 + 1 and visits == SLOTS
    # A step also ends once it found max_found records.
    table.t.scan_begin()
    found.clear()
    digests, _info, visited, more = table.t.scan_step(INF, INF, SLOTS, 7)
    assert len(digests) == 7 * 16 and more and visited < SLOTS
    # Only records in flight that match: none last changed before the beginning of time.
    table.t.scan_begin()
    assert table.t.scan_step(INF, NOW_W - 1, SLOTS)[0] == b""
    table.t.scan_begin()
    assert table.t.scan_step(NOW_M, INF, SLOTS)[0] == b""  # no lease ran out
    # No search begun (or one ended): nothing, and no more.
    assert table.t.scan_step(INF, INF, SLOTS)[1:] == ([], 0, False)


def test_a_record_shifted_behind_the_search_by_an_eviction_is_found() -> None:
    """A cluster at slot 100: a settled record there, one in flight behind it at
    101. The search visits up to slot 100, the eviction drops the settled record
    and the one in flight moves up into slot 100, behind the search: the next
    step finds it all the same. (200 more in flight elsewhere keep the eviction
    from rebuilding the table smaller, which would start the search over.)"""
    table = Table()
    settled, inflight = at_home(100, 1, 1)[0], at_home(100, 1, 2)[0]
    table.claim([d for home in range(1200, 1400) for d in at_home(home, 1, 3)])
    table.claim([settled])
    table.claim([inflight])
    table.complete([settled])
    table.t.take_changes()  # a checkpoint: LMDB holds both
    table.t.scan_begin()
    found: set[bytes] = set()
    assert table.step(101, found) == (101, True)  # slots 0..100 visited
    assert found == set()  # the record in flight sits at 101, not yet visited
    assert table.t.evict_some(table.lsn, 0) == (1, False)  # the settled one leaves
    assert table.t.nbytes >= SLOTS * 72  # not rebuilt
    more = True
    while more:
        _visited, more = table.step(SLOTS, found)
    assert inflight in found and len(found) == 201


def test_a_search_finds_every_record_in_flight_while_the_table_grows() -> None:
    """Claims between every two steps grow the table twice (2048 -> 8192 slots)
    while completions and evictions go on; every record in flight from the
    beginning to the end of the search is found."""
    table = Table()
    first = [struct.pack("<QQ", 1 << 40 | i, i * 0x9E3779B97F4A7C15 % 2**64) for i in range(1000)]
    table.claim(first)
    table.complete(first[:300])
    table.t.take_changes()
    table.t.scan_begin()
    found: set[bytes] = set()
    more, step, r = True, 0, 0
    while more:
        _visited, more = table.step(64, found)
        step += 1
        if step % 3 == 0 and r < 40:  # 4000 fresh claims over the search: two grows
            r += 1
            ds = [struct.pack("<QQ", r << 40 | i, (r * 1000 + i) * 0xBF58476D1CE4E5B9 % 2**64)
                  for i in range(100)]  # fmt: skip
            table.claim(ds)
        if step % 7 == 0 and r:  # settle some, evict what LMDB holds
            table.complete([d for d in first[300 + step : 300 + step + 5] if d in table.tokens])
            table.t.take_changes()
            table.t.evict_some(table.lsn, 0)
    assert table.t.nbytes >= 8192 * 72, "the table grew during the search"
    throughout = {d for d in first if d in table.tokens}
    assert len(throughout) > 500 and throughout <= found
    assert all(d in table.tokens or d in first for d in found)


def test_a_search_given_up_half_way_ends() -> None:
    table = Table()
    table.claim([struct.pack("<QQ", i, i * 0x9E3779B97F4A7C15 % 2**64) for i in range(100)])
    table.t.scan_begin()
    assert table.step(10, set())[1]
    table.t.scan_end()
    assert table.t.scan_step(INF, INF, SLOTS) == (b"", [], 0, False)
