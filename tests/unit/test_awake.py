"""The event loop's polling after a reply (dedupcore/daemon/awake.py; docs/daemon.md,
"Polling for the reply"), driven with a recorded ready queue and a clock of its own."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from dedupcore.daemon.awake import Awake


class _Loop:
    """The ready queue of an event loop, run by hand."""

    def __init__(self) -> None:
        self.ready: list[Callable[[], Any]] = []

    def call_soon(self, fn: Callable[[], Any]) -> None:
        self.ready.append(fn)

    def run_pass(self) -> None:
        ready, self.ready = self.ready, []
        for fn in ready:
            fn()


def _awake(monkeypatch: pytest.MonkeyPatch) -> tuple[Awake, _Loop, list[float], list[int]]:
    counters = {"polled_requests": 0}
    awake = Awake(0.001, counters)  # a fixed millisecond of polling after each reply
    loop = _Loop()
    awake.loop = loop  # type: ignore[assignment]
    now = [100.0]
    awake._clock = lambda: now[0]  # type: ignore[assignment]
    yields: list[int] = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    return awake, loop, now, yields


def test_an_idle_pass_gives_the_core_away_and_a_busy_one_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the loop polls, a pass that read nothing yields the core before the next;
    a pass that read a request goes straight on (the loop has work, not a core to
    give), and the request is counted as polled. The polling ends with its budget."""
    awake, loop, now, yields = _awake(monkeypatch)
    awake.replied()
    assert len(loop.ready) == 1
    loop.run_pass()  # nothing arrived
    assert yields == [1] and len(loop.ready) == 1
    awake.arrived()  # a request read in this pass
    loop.run_pass()
    assert yields == [1] and len(loop.ready) == 1
    assert awake._counters["polled_requests"] == 1
    loop.run_pass()  # idle again
    assert yields == [1, 1] and len(loop.ready) == 1
    now[0] += 0.002  # past the budget: the loop may sleep
    loop.run_pass()
    assert loop.ready == [] and yields == [1, 1]


def test_a_reply_while_polling_extends_the_polling_without_a_second_callback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replies made while the loop polls move its end later; one callback polls."""
    awake, loop, now, _ = _awake(monkeypatch)
    awake.replied()
    now[0] += 0.0008
    awake.replied()
    assert len(loop.ready) == 1
    now[0] += 0.0008  # past the first reply's budget, within the second's
    loop.run_pass()
    assert len(loop.ready) == 1
    now[0] += 0.0008
    loop.run_pass()
    assert loop.ready == []
