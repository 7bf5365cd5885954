"""The demo's accounting: consumer processes, a daemon and SIGKILLs, checked end to end.

Act one claims and completes through ``dedupcore serve``; act two writes the
dedup row and the effect in one SQLite transaction. Both run the same stream
and the same kill plan (docs/demo.md).
"""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
from collections import Counter
from multiprocessing.sharedctypes import RawArray
from pathlib import Path
from typing import Any

import pytest

from dedupcore.cli import demo
from dedupcore.cli.demo import KILL_POINTS, DemoResult, simulate, simulate_transactional

#: Small sizes: 5000 ids, 12 kills (3 at each point) over 4 consumers, batches of 50.
SMALL: dict[str, Any] = {
    "keys": 5000,
    "duplicate_rate": 0.2,
    "seed": 11,
    "consumers": 4,
    "batch": 50,
    "kills": 12,
}


@pytest.fixture(scope="module")
def result() -> DemoResult:
    return simulate(**SMALL)


@pytest.fixture(scope="module")
def act_two() -> DemoResult:
    return simulate_transactional(**SMALL)


def test_every_message_applied_and_only_the_window_twice(result: DemoResult) -> None:
    r = result
    assert r.ok, r
    assert r.missing == 0
    assert r.effects_twice_unexplained == 0
    assert r.effects_applied == r.unique_messages + r.effects_twice_window


def test_stream_figures(result: DemoResult) -> None:
    r = result
    assert r.unique_messages == 5000
    assert r.producer_retries == 1250  # 20 % of what is published
    assert r.published == 6250
    # No kill lands between two counters: every delivery past the first is a redelivery.
    assert r.deliveries - r.redeliveries == r.published
    # producer retries and completed redeliveries are suppressed, not applied
    assert r.duplicates_suppressed + r.same_batch >= r.producer_retries - r.effects_twice_window
    assert r.crashes == 0


def test_kills_hit_every_point_and_show_both_windows(result: DemoResult) -> None:
    r = result
    # Consumers kill themselves where the plan says: every planned kill happens.
    assert r.kills == {name: 3 for name in KILL_POINTS.values()}, r
    assert r.redeliveries > 0, r
    # killed between the effect and complete: the effect is applied again (the
    # window only an atomic business write closes) ...
    assert r.kills[KILL_POINTS[demo.AFTER_EFFECT]] >= 1
    assert r.effects_twice_window >= r.kills[KILL_POINTS[demo.AFTER_EFFECT]], r
    # ... killed between complete and the ack: the redelivery is DUPLICATE
    assert r.kills[KILL_POINTS[demo.AFTER_COMPLETE]] >= 1
    assert r.redelivered_duplicates > 0, r


def test_act_two_applies_every_message_exactly_once(act_two: DemoResult) -> None:
    """The same stream and kills with the dedup row and the effect in one transaction:
    the effects table holds one row per id and the balances are the exactly-once sums."""
    r = act_two
    assert r.transactional
    assert r.ok, r
    assert r.effects_applied == r.unique_messages == 5000, r
    assert r.effects_twice == 0 and r.missing == 0 and r.balances_wrong == 0, r
    assert r.crashes == 0
    assert (r.producer_retries, r.published) == (1250, 6250)
    assert r.deliveries - r.redeliveries == r.published
    # every retry and every redelivery of a committed message is answered DUPLICATE
    assert r.duplicates_suppressed >= r.producer_retries
    # killed between the commit and the ack: the redelivered batch is DUPLICATE
    assert r.redelivered_duplicates > 0, r


@pytest.mark.parametrize("act", ["result", "act_two"])
def test_every_planned_kill_happens_in_both_acts(act: str, request: pytest.FixtureRequest) -> None:
    r: DemoResult = request.getfixturevalue(act)
    assert r.planned_kills == {name: 3 for name in KILL_POINTS.values()}
    assert r.kills == r.planned_kills and r.all_kills_done, r
    assert r.redeliveries > 0


def test_a_split_transaction_shows_in_the_count() -> None:
    """The count is not vacuous: with the effect committed on its own before the dedup
    row, each kill between the two applies an effect twice, and act two fails."""
    r = simulate_transactional(**SMALL, atomic=False)
    assert r.kills == r.planned_kills, r
    assert r.kills[KILL_POINTS[demo.AFTER_EFFECT]] == 3
    assert r.effects_twice >= 3, r
    assert r.effects_applied == r.unique_messages + r.effects_twice, r
    assert r.balances_wrong > 0 and not r.ok, r


def _business_db(path: Path, rows: list[bytes]) -> None:
    demo._make_business_db(path)
    with contextlib.closing(sqlite3.connect(path)) as db:
        for key in rows:
            account, amount = demo._ledger_entry(key)
            db.execute("UPDATE accounts SET balance = balance + ? WHERE id = ?", (amount, account))
            db.execute("INSERT INTO effects VALUES (?, ?, ?, 'c')", (key, account, amount))
        db.commit()


def test_act_two_accounting_counts_repeats_missing_ids_and_balances(tmp_path: Path) -> None:
    run = demo._prepare(4, 0.0, 1, 2, None, 0)
    shared = RawArray("q", 2 * demo._FIELDS)
    ids = [b"order-%08d" % i for i in range(4)]
    _business_db(tmp_path / "ok.sqlite", ids)
    r = demo._account_table(tmp_path / "ok.sqlite", run, shared)
    assert (r.effects_applied, r.effects_twice, r.missing, r.balances_wrong) == (4, 0, 0, 0)
    assert r.ok

    _business_db(tmp_path / "bad.sqlite", [ids[0], ids[1], ids[1], ids[2]])
    r = demo._account_table(tmp_path / "bad.sqlite", run, shared)
    assert r.effects_applied == 4
    assert (r.effects_twice_window, r.effects_twice_unexplained) == (0, 1)
    assert r.missing == 1  # ids[3]
    assert r.balances_wrong == 2  # ids[1]'s account once too much, ids[3]'s once too little
    assert not r.ok


def test_kill_plan_is_drawn_from_the_seed_and_leaves_batches_after_each_kill() -> None:
    sizes = [1563, 1563, 1562, 1562]
    plan = demo._kill_plan(sizes, 50, 12, random.Random(11))
    assert plan == demo._kill_plan(sizes, 50, 12, random.Random(11))
    assert [len(kills) for kills in plan] == [3, 3, 3, 3]
    points = Counter(point for kills in plan for _, point, _ in kills)
    assert points == {point: 3 for point in KILL_POINTS}
    for size, kills in zip(sizes, plan, strict=True):
        offsets = [offset for offset, _, _ in kills]
        assert offsets == sorted(offsets) and all(o % 50 == 0 for o in offsets)
        assert offsets[0] > 0 and offsets[-1] <= size * 3 // 4
        for _, point, moment in kills:
            if point == demo.RANDOM:
                assert moment in demo._RANDOM_MOMENTS
            else:
                assert moment == point
    # A partition of a single batch still gets its kills (at its only batch).
    (small,) = demo._kill_plan([20], 50, 4, random.Random(1))
    assert [offset for offset, _, _ in small] == [0, 0, 0, 0]


def _write(path: Path, lines: list[str]) -> None:
    path.write_bytes("".join(line + " .\n" for line in lines).encode())


def test_accounting_flags_a_double_effect_after_a_confirmed_complete(tmp_path: Path) -> None:
    """The checker is not vacuous: an effect applied after a completion is caught."""
    shared = RawArray("q", 2 * demo._FIELDS)
    ids = [f"order-{i:08d}" for i in range(4)]
    _write(
        tmp_path / "effects-0",
        [
            f"E 1 1 100 {ids[0]}",
            f"E 1 1 100 {ids[1]}",
            "C 1 1 110",  # both completed at t=110
            f"E 1 2 120 {ids[2]}",  # never completed: the consumer died here
            f"E 2 1 200 {ids[2]}",  # the restart applies it again: the window
            "C 2 1 210",
        ],
    )
    _write(
        tmp_path / "effects-1",
        [
            f"E 1 1 300 {ids[0]}",  # after ids[0]'s completion returned: a real double
            "C 1 1 310",
        ],
    )
    r = demo._account(tmp_path, 2, 4, 0, 4, shared)
    assert r.effects_applied == 5
    assert r.effects_twice_window == 1
    assert r.effects_twice_unexplained == 1
    assert r.missing == 1  # ids[3] never applied
    assert not r.ok

    os.remove(tmp_path / "effects-1")
    _write(tmp_path / "effects-1", [f"E 1 1 300 {ids[3]}", "C 1 1 310"])
    with open(tmp_path / "effects-1", "ab") as f:
        f.write(f"\nE 1 2 400 {ids[1]}".encode())  # torn by a SIGKILL: not an effect
        f.write(b"\nC 1 2 41")
    r = demo._account(tmp_path, 2, 4, 0, 4, shared)
    assert (r.effects_applied, r.effects_twice_window, r.effects_twice_unexplained) == (5, 1, 0)
    assert r.missing == 0 and r.ok


def test_run_demo_prints_both_acts(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.run_demo(keys=3000, duplicate_rate=0.2, seed=3) == 0
    out = capsys.readouterr().out
    for text in (
        "act one",
        "act two",
        "deliveries to consumers",
        "duplicates suppressed",
        "effects applied",
        "unique messages",
        "effects applied twice",
        "died between effect and complete",
        "rolled back",
        "balances off the exactly-once sums",
        "Act two has 0",
        "transactional pattern",
    ):
        assert text in out, text
    assert "not reached" not in out
    assert "does not add up" not in out


def _result(**changes: Any) -> DemoResult:
    fields: dict[str, Any] = {
        "unique_messages": 10,
        "producer_retries": 0,
        "published": 10,
        "deliveries": 10,
        "redeliveries": 0,
        "duplicates_suppressed": 0,
        "redelivered_duplicates": 0,
        "redelivered_new": 0,
        "in_progress": 0,
        "same_batch": 0,
        "effects_applied": 10,
        "effects_twice_window": 0,
        "effects_twice_unexplained": 0,
        "missing": 0,
        "consumers": 4,
    }
    fields.update(changes)
    return DemoResult(**fields)


@pytest.mark.parametrize(
    ("one", "two"),
    [
        # act one: an effect applied twice that the window does not explain
        (_result(effects_applied=11, effects_twice_unexplained=1), _result(transactional=True)),
        # act two: any effect applied twice
        (
            _result(effects_applied=11, effects_twice_window=1),
            _result(transactional=True, effects_applied=11, effects_twice_unexplained=1),
        ),
        # act two: a balance off
        (_result(), _result(transactional=True, balances_wrong=1)),
    ],
)
def test_run_demo_fails_when_the_accounting_does_not_add_up(
    one: DemoResult,
    two: DemoResult,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(demo, "simulate", lambda **kw: one)
    monkeypatch.setattr(demo, "simulate_transactional", lambda **kw: two)
    assert demo.run_demo(keys=10, duplicate_rate=0.2, seed=1) == 1
    assert "does not add up" in capsys.readouterr().out


def test_run_demo_passes_on_the_window_alone_and_refuses_bad_sizes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    one = _result(effects_applied=12, effects_twice_window=2)
    monkeypatch.setattr(demo, "simulate", lambda **kw: one)
    monkeypatch.setattr(demo, "simulate_transactional", lambda **kw: _result(transactional=True))
    assert demo.run_demo(keys=10, duplicate_rate=0.2, seed=1) == 0
    assert "does not add up" not in capsys.readouterr().out
    assert demo.run_demo(keys=0, duplicate_rate=0.2, seed=1) == 2


def test_a_window_repeat_in_act_two_is_not_ok() -> None:
    assert _result(effects_applied=11, effects_twice_window=1).ok
    assert not _result(transactional=True, effects_applied=11, effects_twice_window=1).ok
