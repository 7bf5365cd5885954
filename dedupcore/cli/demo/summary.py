"""The demo's accounting: :class:`DemoResult`, the stream's counters, the table of both acts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from dedupcore.cli.demo.broker import (
    _DELIVERIES,
    _DUPLICATE,
    _FIELDS,
    _IN_PROGRESS,
    _REDELIVERED_DUPLICATE,
    _REDELIVERED_NEW,
    _REDELIVERIES,
    _SAME_BATCH,
    KILL_POINTS,
    _Stream,
)


@dataclass
class DemoResult:
    """The accounting of one act: :func:`simulate` or :func:`simulate_transactional`.

    ``transactional`` is True for act two, whose effects commit with the
    dedup row: there, any effect applied twice counts as unexplained, and
    ``balances_wrong`` counts the accounts whose balance differs from the sum
    of every message applied once. ``kills`` are the planned kills that
    happened, ``planned_kills`` the plan, both by point.
    """

    unique_messages: int
    producer_retries: int
    published: int
    deliveries: int
    redeliveries: int
    duplicates_suppressed: int
    redelivered_duplicates: int
    redelivered_new: int
    in_progress: int
    same_batch: int
    effects_applied: int
    effects_twice_window: int
    effects_twice_unexplained: int
    missing: int
    consumers: int
    kills: dict[str, int] = field(default_factory=dict)
    planned_kills: dict[str, int] = field(default_factory=dict)
    crashes: int = 0
    lease_takeovers: int = 0
    elapsed: float = 0.0
    transactional: bool = False
    balances_wrong: int = 0

    @property
    def effects_twice(self) -> int:
        """Effects applied again for an id already applied, for whatever reason."""
        return self.effects_twice_window + self.effects_twice_unexplained

    @property
    def all_kills_done(self) -> bool:
        """Every planned kill happened."""
        return self.kills == self.planned_kills

    @property
    def ok(self) -> bool:
        """Every message applied; the only extra effects are the effect/complete window's
        (act one) or none at all (act two)."""
        return (
            self.effects_applied == self.unique_messages + self.effects_twice_window
            and self.effects_twice_unexplained == 0
            and self.missing == 0
            and self.balances_wrong == 0
            and not (self.transactional and self.effects_twice_window)
        )


# -- the accounting ---------------------------------------------------------------------------


def _counters(shared: Any, consumers: int) -> dict[str, Any]:
    """The stream figures both acts count, summed over the partitions: the fields of
    :class:`DemoResult` of those names."""

    def total(f: int) -> int:
        return sum(int(shared[p * _FIELDS + f]) for p in range(consumers))

    return {
        "deliveries": total(_DELIVERIES),
        "redeliveries": total(_REDELIVERIES),
        "duplicates_suppressed": total(_DUPLICATE),
        "redelivered_duplicates": total(_REDELIVERED_DUPLICATE),
        "redelivered_new": total(_REDELIVERED_NEW),
        "in_progress": total(_IN_PROGRESS),
        "same_batch": total(_SAME_BATCH),
    }


def _finished(
    result: DemoResult,
    run: _Stream,
    kill_counts: dict[str, int],
    crashes: int,
    started: float,
) -> DemoResult:
    """``result`` with what the supervisor saw: the planned kills done and planned, the
    consumers that died otherwise, and the act's time since ``started``."""
    result.kills = kill_counts
    result.planned_kills = run.planned_kills
    result.crashes = crashes
    result.elapsed = time.perf_counter() - started
    return result


def _ids(keys: int) -> set[bytes]:
    return {b"order-%08d" % i for i in range(keys)}


def _print_acts(console: Any, r1: DemoResult, r2: DemoResult) -> None:
    from rich.table import Table

    na = "[dim]-[/dim]"
    table = Table(title="the same at-least-once stream and the same SIGKILLs, twice")
    table.add_column("figure")
    table.add_column(
        f"act one\nclaim/complete\n(dedupcore serve)\n{r1.elapsed:.1f} s", justify="right"
    )
    table.add_column(f"act two\none transaction\n(SQLite)\n{r2.elapsed:.1f} s", justify="right")

    def row(label: str, a: str | int, b: str | int) -> None:
        table.add_row(label, *(f"{v:,}" if isinstance(v, int) else v for v in (a, b)))

    row("unique messages (business ids)", r1.unique_messages, r2.unique_messages)
    row("producer retries (an id published again)", r1.producer_retries, r2.producer_retries)
    row("messages on the broker", r1.published, r2.published)
    row("deliveries to consumers", r1.deliveries, r2.deliveries)
    row("  redeliveries after a kill (not yet acked)", r1.redeliveries, r2.redeliveries)
    for name in KILL_POINTS.values():
        row(f"SIGKILL {name}", r1.kills.get(name, 0), r2.kills.get(name, 0))
    if r1.crashes or r2.crashes:
        row("consumers that failed on their own", r1.crashes, r2.crashes)
    row("duplicates suppressed (DUPLICATE)", r1.duplicates_suppressed, r2.duplicates_suppressed)
    row(
        "  redelivered after complete, before the ack",
        r1.redelivered_duplicates,
        r2.redelivered_duplicates,
    )
    row("same id twice in a batch (claimed once)", r1.same_batch, na)
    row("IN_PROGRESS (another consumer held it; retried)", r1.in_progress, na)
    row("lease takeovers", r1.lease_takeovers, na)
    row(
        "effects applied",
        f"[bold]{r1.effects_applied:,}[/bold]",
        f"[bold]{r2.effects_applied:,}[/bold]",
    )
    row(
        "effects applied twice",
        f"[yellow]{r1.effects_twice:,}[/yellow]",
        f"[bold]{_flag(r2.effects_twice)}[/bold]",
    )
    row(
        "  died between effect and complete (the window)",
        f"[yellow]{r1.effects_twice_window:,}[/yellow]",
        "[dim]rolled back[/dim]" if r2.transactional else f"{r2.effects_twice_window:,}",
    )
    row(
        "  otherwise (must be 0)",
        _flag(r1.effects_twice_unexplained),
        _flag(r2.effects_twice_unexplained),
    )
    row("messages never applied (must be 0)", _flag(r1.missing), _flag(r2.missing))
    row("balances off the exactly-once sums (must be 0)", na, _flag(r2.balances_wrong))
    console.print(table)
    console.print(
        "Act one: a kill [bold]between complete and the ack[/bold] redelivers messages that "
        "are already completed: their claims answer DUPLICATE and the effect is not "
        "repeated -- the window dedupcore closes. A kill [bold]between the effect and "
        "complete[/bold] is different: the effect happened but the claim is still "
        "PROCESSING, so the restarted consumer gets its claim back and applies the effect "
        "again. No dedup store can know about an effect it was not told about.\n"
        "Act two has 0: the dedup row and the effect commit in one transaction (the "
        "transactional pattern), so a consumer killed before the commit leaves neither "
        "and the redelivery applies the effect once, and one killed after it leaves both "
        "and the redelivery is DUPLICATE."
    )
    for act, r in (("act one", r1), ("act two", r2)):
        if not r.all_kills_done:
            missed = {k: n - r.kills.get(k, 0) for k, n in r.planned_kills.items()}
            console.print(
                f"[yellow]{act}: planned kills not reached (too few messages after them): "
                + ", ".join(f"{n} {k}" for k, n in missed.items() if n)
                + "[/yellow]"
            )
    for act, r in (("act one", r1), ("act two", r2)):
        if r.ok and r.transactional:
            console.print(
                f"[green]{act}: effects ({r.effects_applied:,}) == unique messages "
                f"({r.unique_messages:,}), each applied exactly once[/green]"
            )
        elif r.ok:
            console.print(
                f"[green]{act}: effects ({r.effects_applied:,}) == unique messages "
                f"({r.unique_messages:,}) + effects re-applied in the effect/complete window "
                f"({r.effects_twice_window:,})[/green]"
            )
        else:
            console.print(
                f"[red]{act}: accounting does not add up: {r.effects_applied:,} effects for "
                f"{r.unique_messages:,} messages, {r.effects_twice_window:,} explained by the "
                f"effect/complete window, {r.effects_twice_unexplained:,} not, "
                f"{r.missing:,} missing, {r.balances_wrong:,} balances off[/red]"
            )


def _flag(n: int) -> str:
    return f"[green]{n:,}[/green]" if n == 0 else f"[red]{n:,}[/red]"
