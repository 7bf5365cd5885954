"""The native claim engine against the pure reference decision, side by side.

Hypothesis drives dedupcore._engine.ClaimTable and dedupcore.decision over the
same operations on a small key space (claims with owners, fingerprints,
leases and cold hits; completes and releases with current, stale and wrong
tokens; clock steps; checkpoints that evict and reload records through the
stored format) and compares every answer, error and record. The stored
format is checked for round trips and for damage: every flipped byte fails
the checksum.
"""

from __future__ import annotations

import random
import struct
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dedupcore import _engine
from dedupcore import decision as ref
from dedupcore.record import State

DIGESTS = [struct.pack("<QQ", 0x1000 + i, 0xABCDEF00 + i * 7919) for i in range(6)]
OWNERS = [None, b"a", b"b"]
FPS = [None, b"fp-1", b"fp-2"]
RESULTS = [None, b"\xa2ok", b"\x01", b"x" * 300]


def _ref_rec(t: tuple[Any, ...]) -> ref.Rec:
    state, ns_id, token, created, updated, lease, owner, fp, result, _lsn, deadline = t
    return ref.Rec(
        State(state),
        ns_id,
        token,
        created,
        updated,
        lease,
        deadline if state == State.PROCESSING else 0.0,
        owner,
        fp,
        result,
    )


def _ms(x: float) -> float:
    return round(x * 1000) / 1000


def _rows_of(columns: tuple[Any, ...], n: int) -> list[tuple[Any, ...]]:
    """FORM_COLUMNS answers as the FORM_CLAIMS tuples the test's claim_type builds:
    (key, namespace, outcome, token, result, exact, takeover)."""
    outcomes, tokens, result_index, results, cold, takeovers = columns
    assert len(outcomes) == n and len(tokens) == 8 * n
    toks = struct.unpack(f"={n}Q", tokens)
    by_index = dict(zip(result_index, results, strict=True))
    names = ("NEW", "DUP", "BUSY")
    assert all(o < 3 for o in outcomes)
    assert sorted(set(result_index)) == result_index and sorted(set(cold)) == cold
    assert not set(cold) & set(by_index) and not set(takeovers) & set(cold)
    return [
        (i, "ns", names[outcomes[i]], toks[i], by_index.get(i), i not in cold, i in takeovers)
        for i in range(n)
    ]


class EngineVsReference(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = _engine.ClaimTable()
        self.model: dict[bytes, ref.Rec] = {}
        self.lsn = 0
        self.ckpt = 0
        self.now_w = 1_700_000_000.0
        self.now_m = 1000.0
        self.lmdb: dict[bytes, bytes] = {}
        self.log: list[tuple[int, bytes]] = []
        self.logged_at: dict[bytes, int] = {}  # digest -> log position of its last change
        self.history: list[tuple[int, bytes]] = []  # (log position, digest) of every change
        # A checkpoint split in two, as the store runs it: exported under the
        # lock, written and evicted later while other batches go on.
        self.pending: tuple[int, _engine.Changes] | None = None
        # An eviction going in steps (the checkpoint's lock released between them,
        # as the store does): (upto, step) while entries <= upto are left.
        self.evicting: tuple[int, int] | None = None
        # Clean copies loaded while that eviction goes on: a pass leaves them.
        self.loaded_in_pass: set[bytes] = set()
        self.crowded = 0  # fresh keys claimed by crowd()
        # digest -> the lease of its last logged record (a renewal's is in memory only)
        self.logged_lease: dict[bytes, float] = {}
        # A search of the records in flight going in steps: (digest -> token of the
        # records in flight when it began, digests found so far), or None.
        self.scanning: tuple[dict[bytes, int], set[bytes]] | None = None

    @rule(
        idx=st.lists(st.integers(0, len(DIGESTS) - 1), min_size=1, max_size=6),
        owner=st.sampled_from(OWNERS),
        fps=st.none() | st.lists(st.sampled_from(FPS), min_size=6, max_size=6),
        lease=st.sampled_from([0.5, 2.0, 30.0]),
        cold=st.none() | st.lists(st.booleans(), min_size=6, max_size=6),
        form=st.sampled_from([_engine.FORM_CLAIMS, _engine.FORM_COLUMNS]),
        check_first=st.booleans(),
        read=st.booleans(),
    )
    def claim(self, idx, owner, fps, lease, cold, form, check_first, read) -> None:
        ds = [DIGESTS[i] for i in idx]
        fp_list = None if fps is None else fps[: len(ds)]
        cold_list = None if cold is None else cold[: len(ds)]
        self._claim(ds, owner, fp_list, lease, cold_list, form, check_first, read)

    def _claim(
        self,
        ds,
        owner,
        fp_list,
        lease,
        cold_list,
        form=_engine.FORM_CLAIMS,
        check_first=False,
        read=False,
    ) -> tuple[int, ...]:
        """Claims ds in both, compares every answer, commits; returns the engine's counts.

        ``check_first``: the engine first decides the batch in FORM_CHECK, which must
        answer the same conflict and counts and change nothing (the claim after it is
        compared with the reference's plan made before either). ``read``: the records
        LMDB holds are given to the claim as the store gives them
        (``read_records``: the PROCESSED ones beside the table, not in it)."""
        side = self._read(ds) if read else None
        if not read:
            self._load(ds)
        plan = ref.decide_claim(
            self.model.get,
            ds,
            ns_id=3,
            lease=lease,
            owner=owner,
            fingerprints=fp_list,
            cold=cold_list,
            now_w=self.now_w,
            now_m=self.now_m,
        )

        def decide(form: int) -> tuple[Any, ...]:
            return self.table.claim(
                b"".join(ds),
                list(range(len(ds))),
                "ns",
                3,
                lease,
                owner,
                fp_list,
                None if cold_list is None else bytes(cold_list),
                self.now_w,
                self.now_m,
                lambda *a: a,
                ("NEW", "DUP", "BUSY"),
                lambda r: r,
                form,
                side,
            )

        checked = None
        if check_first:
            checked = decide(_engine.FORM_CHECK)
            assert checked[3] == [] and checked[4][4] == 0  # nothing staged, nothing to log
        answers, conflict, _dep, payloads, counts = decide(form)
        if checked is not None:
            assert checked[1] == conflict
            assert checked[4][:4] == counts[:4] and checked[4][5] == counts[5]
            assert (checked[0] is None) == (answers is None)
        if plan.conflict is not None:
            assert answers is None and conflict == plan.conflict
            return counts
        assert answers is not None and conflict == -1
        claims = answers if form == _engine.FORM_CLAIMS else _rows_of(answers, len(ds))
        codes = {0: "NEW", 1: "DUP", 2: "BUSY", 3: "NEW", 4: "DUP"}
        for c, (code, token, result) in zip(claims, plan.answers, strict=True):
            # claim_type's defaults: result None, exact True, takeover False.
            got_result, exact, takeover = c[4:] + (None, True, False)[len(c) - 4 :]
            assert c[2] == codes[code] and c[3] == token
            assert got_result == (result if code == ref.DUPLICATE else None)
            assert exact is (code != ref.DUPLICATE_COLD)
            assert takeover is (code == ref.NEW_TAKEOVER)
        assert counts[4] == len(plan.logged)
        self._commit(payloads, plan.logged, plan.renewed)
        return counts

    @rule(
        idx=st.lists(st.integers(0, len(DIGESTS) - 1), min_size=1, max_size=4),
        how=st.lists(
            st.sampled_from(["current", "current", "stale", "wrong"]), min_size=4, max_size=4
        ),
        results=st.lists(st.sampled_from(RESULTS), min_size=4, max_size=4),
        complete=st.booleans(),
    )
    def change(self, idx, how, results, complete) -> None:
        ds = [DIGESTS[i] for i in idx]
        self._load(ds)
        tokens = self._tokens(ds, how)
        state = State.PROCESSED if complete else State.RELEASED
        res = results[: len(ds)] if complete else None
        plan = ref.decide_change(self.model.get, ds, tokens, res, state=state, now_w=self.now_w)
        bad, kind, current, _dep, payloads, n = self.table.change(
            b"".join(ds), tokens, res, int(state), self.now_w
        )
        if plan.error is not None:
            assert (bad, kind, current) == plan.error
            return
        assert bad == -1 and n == len(plan.logged)
        self._commit(payloads, plan.logged, {})

    @rule(
        idx=st.lists(st.integers(0, len(DIGESTS) - 1), min_size=1, max_size=4),
        how=st.lists(
            st.sampled_from(["current", "current", "stale", "wrong"]), min_size=4, max_size=4
        ),
        lease=st.sampled_from([0.5, 2.0, 30.0]),
    )
    def extend(self, idx, how, lease) -> None:
        """A renewal: kept in memory only (nothing to log), all or nothing."""
        ds = [DIGESTS[i] for i in idx]
        self._load(ds)
        tokens = self._tokens(ds, how)
        plan = ref.decide_extend(self.model.get, ds, tokens, lease=lease, now_m=self.now_m)
        pending = self.table.pending
        bad, kind, current = self.table.extend(b"".join(ds), tokens, lease, self.now_m)
        if plan.error is not None:
            assert (bad, kind, current) == plan.error
            return
        assert bad == -1
        self._commit([], {}, plan.logged)
        assert self.table.pending == pending, "a renewal is not noted for a checkpoint"

    @precondition(lambda self: self.crowded < 1800)
    @rule()
    def crowd(self) -> None:
        """300 fresh keys claimed at once: the third grows the table past its first
        1024 slots, and the rules after it run while its records move to the new
        array a few per put (the sixth grows it again)."""
        base = 0x9000_0000 + self.crowded
        ds = [struct.pack("<QQ", base + i, i * 2654435761) for i in range(300)]
        self.crowded += 300
        assert self._claim(ds, None, None, 30.0, None)[0] == len(ds)  # all NEW

    @rule(dt=st.sampled_from([0.1, 1.0, 3.0, 40.0]))
    def advance(self, dt: float) -> None:
        self.now_m += dt
        self.now_w += dt

    @precondition(lambda self: self.pending is None and self.evicting is None)
    @rule()
    def checkpoint(self) -> None:
        """Exports what changed, stores it as LMDB would, evicts and reloads later."""
        items, inflight, settled, _newest = self.table.export()
        digests = [d for d, _ in items]
        assert digests == sorted(digests), "LMDB takes a checkpoint in digest order"
        for d, v in items:
            self.lmdb[d] = v
        assert sorted(inflight + settled) == [d for d, _ in items]
        assert inflight == [d for d in digests if self.model[d].state is State.PROCESSING]
        self.ckpt = self.lsn
        self.table.evict(self.ckpt)
        # What survives in memory is exactly the in-flight records.
        assert self.table.inflight == sum(
            1 for r in self.model.values() if r.state is State.PROCESSING
        )
        assert len(self.table) == self.table.inflight

    @precondition(lambda self: self.pending is None and self.evicting is None)
    @rule()
    def begin_checkpoint(self) -> None:
        """Takes the changes (under the store's lock, in the store); the checkpoint
        then writes them while later batches go on."""
        self.pending = (self.lsn, self.table.take_changes())
        assert self.table.pending == 0

    @precondition(lambda self: self.pending is not None)
    @rule(step=st.sampled_from([0, 1, 3]))
    def finish_checkpoint(self, step: int) -> None:
        """LMDB takes what was taken, each record's latest change once; records
        changed since stay in memory; eviction may go in steps."""
        assert self.pending is not None
        upto, changes = self.pending
        self.pending = None
        packed, n = _engine.sort_changes(changes)
        items, inflight, settled = _engine.unpack_items(packed, n)
        # The store hands LMDB the same records read in place, as often as asked.
        records = _engine.PackedRecords(packed, n)
        for _ in range(2):
            assert list(records) == items
            assert list(records.inflight) == inflight and len(records.inflight) == len(inflight)
            assert list(records.settled) == settled and len(records.settled) == len(settled)
        assert len(records) == n and records.digests() == b"".join(d for d, _ in items)
        # A record changed again since is written as it was at upto: its later
        # change stays in memory (and the log) for the next checkpoint.
        changed = sorted({d for lsn, d in self.history if self.ckpt < lsn <= upto})
        assert [d for d, _ in items] == changed
        for d, v in items:
            self.lmdb[d] = v
        self.ckpt = upto
        self.evicting = (upto, step)
        self.loaded_in_pass = set()
        self.evict_step()

    @precondition(lambda self: self.evicting is not None)
    @rule()
    def evict_step(self) -> None:
        """One step of an eviction (all of it for step 0); claims, completions and
        loads may come between two steps."""
        assert self.evicting is not None
        upto, step = self.evicting
        _dropped, more = self.table.evict_some(upto, step)
        if more:
            return
        self.evicting = None
        # Left: the records in flight, those changed since upto, and the clean
        # copies loaded while the pass went on (the next pass takes them).
        kept = {d for d, r in self.model.items() if r.state is State.PROCESSING}
        kept |= {d for d, lsn in self.logged_at.items() if lsn > upto}
        assert len(self.table) == len(kept | self.loaded_in_pass)

    @precondition(lambda self: self.pending is not None)
    @rule()
    def fail_checkpoint(self) -> None:
        """LMDB refused the checkpoint: the changes go back, the next one writes them."""
        assert self.pending is not None
        _upto, changes = self.pending
        self.pending = None
        expect = self.table.pending + changes.n
        self.table.give_back(changes)
        assert self.table.pending == expect and changes.n == 0

    @precondition(lambda self: self.scanning is None)
    @rule()
    def scan_begin(self) -> None:
        """A search of the records in flight begins (the aged scan, the sweep)."""
        self.table.scan_begin()
        began = {d: r.token for d, r in self.model.items() if r.state is State.PROCESSING}
        self.scanning = (began, set())

    @precondition(lambda self: self.scanning is not None)
    @rule(limit=st.sampled_from([1, 3, 50, 5000]), max_found=st.sampled_from([0, 1, 4]))
    def scan_step(self, limit: int, max_found: int) -> None:
        """One step of it; claims, completions, evictions and growth come between two.
        Each step visits at most ``limit`` slots and finds only records in flight; at
        the end every record in flight throughout was found."""
        assert self.scanning is not None
        began, found = self.scanning
        digests, info, visited, more = self.table.scan_step(
            float("inf"), float("inf"), limit, max_found, True
        )
        assert visited <= limit and len(digests) == 16 * len(info)
        assert len(info) <= (max_found or limit)
        for i, (ns_id, token, _updated) in enumerate(info):
            d = digests[16 * i : 16 * i + 16]
            r = self.model[d]
            assert (r.state, r.token, r.ns_id) == (State.PROCESSING, token, ns_id)
            found.add(d)
        if more:
            return
        self.scanning = None
        still = {d for d, tok in began.items() if self._in_flight(d, tok)}
        assert still <= found, "a record in flight throughout the search was missed"

    def _in_flight(self, d: bytes, token: int) -> bool:
        r = self.model.get(d)
        return r is not None and r.state is State.PROCESSING and r.token == token

    @rule()
    def crash_and_replay(self) -> None:
        """A new table from LMDB's in-flight records and the log past the checkpoint."""
        self.pending = None  # a checkpoint cut short: LMDB never took it
        self.evicting = None
        self.scanning = None
        table = _engine.ClaimTable()
        for d, v in self.lmdb.items():
            if _engine.decode_value(d, v)[0] == State.PROCESSING:
                assert table.load(_engine.pack_records([(d, v)]), self.now_m) == -1
        for lsn, payload in self.log:
            if lsn > self.ckpt:
                table.replay(payload, lsn, self.now_m)
        self.table = table
        # Deadlines restart from now with the logged lease (a renewal's is lost);
        # stored times are whole milliseconds.
        self.model = {
            d: ref.Rec(
                r.state,
                r.ns_id,
                r.token,
                _ms(r.created),
                _ms(r.updated),
                self.logged_lease[d],
                self.now_m + self.logged_lease[d] if r.state is State.PROCESSING else 0.0,
                r.owner,
                r.fingerprint,
                r.result,
            )
            for d, r in self.model.items()
        }

    def _commit(self, payloads, logged, renewed) -> None:
        if payloads:
            self.lsn += 1
            self.log.extend((self.lsn, p) for p in payloads)
        self.table.apply(self.lsn if payloads else 0)
        if payloads:
            self.logged_at.update(dict.fromkeys(logged, self.lsn))
            self.history.extend((self.lsn, d) for d in logged)
        self.model.update(logged)
        self.model.update(renewed)
        self.logged_lease.update((d, r.lease) for d, r in logged.items())

    def _tokens(self, ds: list[bytes], how: list[str]) -> list[int]:
        """Each key's current token, one below it or a wrong one, as ``how`` says."""
        tokens = []
        for d, h in zip(ds, how, strict=False):
            r = self.model.get(d)
            cur = r.token if r is not None else 1
            tokens.append({"current": cur, "stale": max(cur - 1, 1), "wrong": cur + 5}[h])
        return tokens

    def _load(self, ds: list[bytes]) -> None:
        missing = self.table.missing(b"".join(ds))
        want = [ds[i] for i in missing]
        pairs = [(d, self.lmdb[d]) for d in want if d in self.lmdb]
        assert self.table.load(_engine.pack_records(pairs), self.now_m) == -1
        if self.evicting is not None:
            self.loaded_in_pass.update(d for d, _ in pairs)

    def _read(self, ds: list[bytes]) -> _engine.ReadRecords:
        """The records of ds that LMDB holds and the table does not, read for a claim:
        the PROCESSED ones come back, every other one is put in the table."""
        missing = self.table.missing(b"".join(ds))
        # In digest order, as one slice gives them, or (an odd batch) not.
        found = sorted({ds[i] for i in missing if ds[i] in self.lmdb}, reverse=len(ds) % 2 == 1)
        side = self.table.read_records(
            _engine.pack_records([(d, self.lmdb[d]) for d in found]), self.now_m
        )
        assert isinstance(side, _engine.ReadRecords)
        processed = [d for d in found if self.model[d].state == State.PROCESSED]
        assert len(side) == len(processed)
        assert self.table.missing(b"".join(processed), side) == []
        assert self.table.missing(b"".join(processed)) == list(range(len(processed)))
        # The second look of a claim: only the keys missing before, side first.
        joined = b"".join(ds)
        still = [i for i in missing if ds[i] not in processed and self.table.get(ds[i]) is None]
        assert self.table.missing(joined, side, missing) == still
        assert self.table.missing(joined, None, missing) == [
            i for i in missing if self.table.get(ds[i]) is None
        ]
        if self.evicting is not None:
            self.loaded_in_pass.update(d for d in found if d not in processed)
        return side

    @invariant()
    def dirty_counts_changes(self) -> None:
        """The journal counts each record changed since the checkpoint once."""
        assert self.table.dirty(self.ckpt) == sum(
            1 for lsn in self.logged_at.values() if lsn > self.ckpt
        )

    @invariant()
    def records_match(self) -> None:
        for d in DIGESTS:
            got = self.table.get(d)
            if got is None and d in self.lmdb:
                # A settled record is read where it is, not loaded: a claim then
                # finds it in LMDB beside the table (read_records), as in the store.
                stored = _engine.decode_value(d, self.lmdb[d])
                if stored[0] == State.PROCESSED:
                    got = (*stored, 0, 0.0)
                else:
                    self._load([d])
                    got = self.table.get(d)
            want = self.model.get(d)
            if want is None:
                assert got is None
                continue
            assert got is not None
            g = _ref_rec(got)
            assert (g.state, g.token, g.owner, g.fingerprint, g.result, g.ns_id) == (
                want.state,
                want.token,
                want.owner,
                want.fingerprint,
                want.result,
                want.ns_id,
            )
            assert abs(g.created - want.created) <= 0.0006
            assert abs(g.updated - want.updated) <= 0.0006
            if want.state is State.PROCESSING:
                assert g.deadline == pytest.approx(want.deadline, abs=0.002)
                assert g.lease == pytest.approx(want.lease, rel=1e-6)


def test_a_stepwise_eviction_ends_while_clean_copies_keep_coming() -> None:
    """A pass visits the clean copies loaded before it began: a reader loading a
    copy between every two steps (as claims of settled keys do while the store's
    lock is let go) neither keeps it going forever nor loses what it loaded."""
    stored = [struct.pack("<QQ", 7, i) for i in range(200)]

    def value(d: bytes) -> bytes:  # a PROCESSED record as LMDB holds it
        return _engine.encode_value(
            d, int(State.PROCESSED), 1, 1, 1_700_000_000.0, 1_700_000_000.0, 30.0,
            None, None, None,
        )  # fmt: skip

    table = _engine.ClaimTable()
    assert table.load(_engine.pack_records([(d, value(d)) for d in stored[:100]]), 1000.0) == -1
    assert len(table) == table.clean == 100
    later = iter(stored[100:])
    steps, more = 0, True
    while more:
        _dropped, more = table.evict_some(0, 1)
        steps += 1
        assert steps <= 101, "the eviction chases the copies loaded after it began"
        if more:
            d = next(later)
            assert table.load(_engine.pack_records([(d, value(d))]), 1000.0) == -1
    assert steps == 100
    assert len(table) == table.clean == 99  # the copies loaded during the pass stay
    assert table.evict_some(0, 0) == (99, False)  # the next pass takes them
    assert len(table) == 0


def test_a_second_look_at_missing_keys_checks_the_indexes_it_is_given() -> None:
    """``missing(..., among=)`` looks up only the indexes given, and refuses one
    past the digests or one that is not an integer, before it answers."""
    table = _engine.ClaimTable()
    ds = [struct.pack("<QQ", 7, i) for i in range(4)]
    claims, *_ = table.claim(
        ds[1], [b"k"], "ns", 1, 30.0, None, None, None,
        1_700_000_000.0, 1000.0, lambda *a: a, ("NEW", "DUP", "BUSY"), lambda x: x,
    )  # fmt: skip
    assert claims is not None
    table.apply(1)
    joined = b"".join(ds)
    assert table.missing(joined) == [0, 2, 3]
    assert table.missing(joined, None, [3, 1, 0]) == [3, 0]
    assert table.missing(joined, None, []) == []
    with pytest.raises(IndexError):
        table.missing(joined, None, [0, 4])
    with pytest.raises(IndexError):
        table.missing(joined, None, [-1])
    with pytest.raises(TypeError):
        table.missing(joined, None, ["0"])  # type: ignore[list-item]


def test_the_table_grows_without_losing_a_record() -> None:
    """From 1024 slots to 8192 while claims, completions, checkpoints and evictions
    go on: after every step each record is found with its state and token, the
    counts hold, and the slot scans (digests, in-flight records) see each record
    once, also while the records move to a new array a few per put."""
    table = _engine.ClaimTable()
    want: dict[bytes, tuple[int, int]] = {}  # digest -> (state, token) held in memory
    lsn = 0
    now_w, now_m = 1_700_000_000.0, 1000.0
    batches: list[list[bytes]] = []

    def check() -> None:
        assert len(table) == len(want)
        assert table.inflight == sum(1 for st_, _ in want.values() if st_ == State.PROCESSING)
        held = table.digests()
        assert sorted(held[i : i + 16] for i in range(0, len(held), 16)) == sorted(want)
        inflight = {r[0] for r in table.inflight_records(float("inf"), float("inf"))}
        assert inflight == {d for d, (st_, _) in want.items() if st_ == State.PROCESSING}
        for d, (state, token) in want.items():
            got = table.get(d)
            assert got is not None and (got[0], got[2]) == (state, token), d.hex()
        assert table.missing(b"".join(want)) == []

    for r in range(48):
        ds = [struct.pack("<QQ", r, i * 0x9E3779B97F4A7C15 % 2**64) for i in range(100)]
        claims, _c, _d, _payloads, counts = table.claim(
            b"".join(ds), list(range(100)), "ns", 1, 30.0, None, None, None,
            now_w, now_m, lambda *a: a, ("NEW", "DUP", "BUSY"), lambda x: x,
        )  # fmt: skip
        assert claims is not None and counts[0] == 100
        lsn += 1
        table.apply(lsn)
        want.update((d, (State.PROCESSING, c[3])) for d, c in zip(ds, claims, strict=True))
        batches.append(ds)
        check()
        if r % 2:  # complete the batch before last, but a quarter of it
            done = batches[-2][:75]
            bad, *_rest = table.change(
                b"".join(done), [want[d][1] for d in done], None, int(State.PROCESSED), now_w
            )
            assert bad == -1
            lsn += 1
            table.apply(lsn)
            want.update((d, (State.PROCESSED, want[d][1])) for d in done)
            check()
        if r % 5 == 4:  # a checkpoint: what is settled leaves memory, in steps
            table.take_changes()
            more = True
            while more:
                _dropped, more = table.evict_some(lsn, 37)
                for d, (state, token) in want.items():  # in flight: never dropped
                    got = table.get(d)
                    assert got is not None or state != State.PROCESSING
                    assert got is None or (got[0], got[2]) == (state, token)
            want = {d: v for d, v in want.items() if v[0] == State.PROCESSING}
            check()
    assert table.nbytes >= 8192 * 72, "the table grew to 8192 slots"


def test_digests_that_share_a_home_slot_are_told_apart_by_the_whole_digest() -> None:
    """Digests with the same second half (the slot hash: one home slot for all of them)
    form one long cluster: each is found by its whole digest, through a grow,
    completions and an eviction that shifts the records after the ones it drops."""
    table = _engine.ClaimTable()
    same = [struct.pack("<QQ", i, 0xABCD_EF01_2345_6789) for i in range(150)]
    others = [struct.pack("<QQ", 7, i * 0x9E3779B97F4A7C15 % 2**64) for i in range(1500)]
    now_w, now_m = 1_700_000_000.0, 1000.0
    tokens: dict[bytes, int] = {}
    lsn = 0
    for ds in (same, others):
        claims, _c, _d, _payloads, counts = table.claim(
            b"".join(ds), list(range(len(ds))), "ns", 1, 30.0, None, None, None,
            now_w, now_m, lambda *a: a, ("NEW", "DUP", "BUSY"), lambda x: x,
        )  # fmt: skip
        assert claims is not None and counts[0] == len(ds)
        lsn += 1
        table.apply(lsn)
        tokens.update((d, c[3]) for d, c in zip(ds, claims, strict=True))
    absent = [struct.pack("<QQ", 10_000 + i, 0xABCD_EF01_2345_6789) for i in range(50)]
    assert table.missing(b"".join(absent)) == list(range(50))
    done = same[::2] + others[::3]
    bad, *_rest = table.change(
        b"".join(done), [tokens[d] for d in done], None, int(State.PROCESSED), now_w
    )
    assert bad == -1
    lsn += 1
    table.apply(lsn)
    table.take_changes()
    more = True
    while more:
        _dropped, more = table.evict_some(lsn, 64)
    gone = set(done)
    kept = [d for d in same + others if d not in gone]
    assert len(table) == len(kept)
    for d in kept:
        got = table.get(d)
        assert got is not None and (got[0], got[2]) == (State.PROCESSING, tokens[d]), d.hex()
    assert all(table.get(d) is None for d in done)
    assert table.missing(b"".join(kept)) == []
    assert table.missing(b"".join(done)) == list(range(len(done)))


EngineVsReference.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
TestEngineVsReference = EngineVsReference.TestCase


def _stored_ms(seconds: float) -> int:
    """The whole milliseconds the format stores of a time: ``llround(seconds *
    1000.0)``, ties away from zero (Python's ``round`` takes ties to even)."""
    return int(Decimal(seconds * 1000.0).to_integral_value(rounding=ROUND_HALF_UP))


@given(
    state=st.sampled_from(list(State)),
    ns_id=st.integers(0, 65535),
    token=st.integers(1, 2**63 - 1),
    created=st.floats(0, 4e9),
    delta=st.floats(-1000, 1e6),
    lease=st.sampled_from([0.001, 1.0, 30.0, 30 * 86400.0]),
    owner=st.none() | st.binary(min_size=1, max_size=255),
    fp=st.none() | st.binary(min_size=1, max_size=255),
    result=st.none() | st.binary(max_size=2000),
)
def test_stored_format_round_trips(
    state, ns_id, token, created, delta, lease, owner, fp, result
) -> None:
    d = DIGESTS[0]
    updated = created + delta if created + delta >= 0 else created
    raw = _engine.encode_value(
        d, int(state), ns_id, token, created, updated, lease, owner, fp, result
    )
    got = _engine.decode_value(d, raw)
    assert got[0] == state and got[1] == ns_id and got[2] == token
    assert got[3] == _stored_ms(created) / 1000
    assert got[4] == _stored_ms(updated) / 1000
    assert got[6:] == (owner, fp, result)
    if state is State.PROCESSING:
        assert lease <= got[5] <= lease + 0.001 + lease * 1e-6


def test_a_processed_record_without_a_result_is_a_handful_of_bytes() -> None:
    raw = _engine.encode_value(DIGESTS[0], 2, 7, 1, 1.7e9, 1.7e9, 30.0, None, None, None)
    assert len(raw) == 14


def test_every_flipped_byte_and_every_truncation_is_caught() -> None:
    d = DIGESTS[1]
    raw = _engine.encode_value(d, 2, 7, 3, 1.7e9, 1.7e9 + 5, 30.0, b"own", b"fp", b"\xa2ok")
    for i in range(len(raw)):
        for bit in range(8):
            bad = bytearray(raw)
            bad[i] ^= 1 << bit
            with pytest.raises(ValueError):
                _engine.decode_value(d, bytes(bad))
    for n in range(len(raw)):
        with pytest.raises(ValueError):
            _engine.decode_value(d, raw[:n])
    with pytest.raises(ValueError):  # the right bytes under another digest
        _engine.decode_value(DIGESTS[2], raw)


def test_a_packed_export_that_does_not_hold_its_records_is_refused() -> None:
    record = bytes(range(16)) + (3).to_bytes(4, "little") + b"\x02bc"  # a settled state
    digest = bytes(range(16))
    assert _engine.unpack_items(record * 2, 2) == ([(digest, b"\x02bc")] * 2, [], [digest] * 2)
    assert list(_engine.PackedRecords(record * 2, 2)) == [(digest, b"\x02bc")] * 2
    for packed, n in ((record[:-1], 1), (record[:19], 1), (record * 2, 1), (record, 2)):
        with pytest.raises(ValueError):
            _engine.unpack_items(packed, n)
        with pytest.raises(ValueError):
            _engine.PackedRecords(packed, n)


def test_damaged_log_payloads_are_refused() -> None:
    table = _engine.ClaimTable()
    _claims, _c, _d, payloads, _n = table.claim(
        b"".join(DIGESTS),
        list(range(6)),
        "ns",
        1,
        5.0,
        None,
        None,
        None,
        1.7e9,
        10.0,
        lambda *a: a,
        ("NEW", "DUP", "BUSY"),
        lambda r: r,
    )
    table.discard()
    (payload,) = payloads
    assert len(_engine.ClaimTable().replay(payload, 1, 10.0)) == 16 * 6
    for cut in (0, 3, 5, 20, len(payload) - 1):
        with pytest.raises(ValueError):
            _engine.ClaimTable().replay(payload[:cut], 1, 10.0)
    with pytest.raises(ValueError):
        _engine.ClaimTable().replay(payload + b"\x00", 1, 10.0)
    bad = bytearray(payload)
    bad[30] ^= 0x40
    with pytest.raises(ValueError):
        _engine.ClaimTable().replay(bytes(bad), 1, 10.0)


@given(
    keys=st.lists(
        st.binary(min_size=1, max_size=64) | st.text(min_size=1, max_size=20), max_size=50
    )
)
def test_native_digests_are_the_python_digests(keys: list[bytes | str]) -> None:
    from dedupcore import keys as _keys

    raw = [k.encode() if isinstance(k, str) else k for k in keys]
    want = b"".join(_keys.digests(b"ns/x", raw)) if raw else b""
    got, bad = _engine.digest_keys(b"ns/x", list(keys), 512, _keys.DIGEST_SEED_HI)
    assert (got, bad) == (want, -1)


def test_native_digests_hash_every_length_with_both_seeds_as_xxhash_does() -> None:
    """digest_keys makes both halves of a digest in one pass (dc_xxh64_pair): each is
    the reference XXH64 of ``namespace \\0 key``, across every length the pass
    branches on (the 32-byte stripes, the 8- and 4-byte words, the tail)."""
    import xxhash

    from dedupcore import keys as _keys

    data = random.Random(3).randbytes(300)
    seed_hi = _keys.DIGEST_SEED_HI
    for n in range(1, 300):
        key = data[:n]
        got, bad = _engine.digest_keys(b"ns", [key], 512, seed_hi)
        joined = b"ns\x00" + key
        want = xxhash.xxh64_intdigest(joined, 0).to_bytes(8, "little")
        want += xxhash.xxh64_intdigest(joined, seed_hi).to_bytes(8, "little")
        assert (got, bad) == (want, -1), n


@pytest.mark.parametrize(
    ("key", "why"),
    [
        (b"", "empty"),
        (b"x" * 513, "long"),
        (3, "type"),
        (bytearray(b"k"), "type"),
        ("\ud800", "surrogate"),
    ],
)
def test_native_digests_point_at_the_bad_key(key: object, why: str) -> None:
    got, bad = _engine.digest_keys(b"ns", [b"ok", key, b"ok"], 512, 7)
    assert (got, bad) == (b"", 1), why
