"""``dedupcore demo``: consumer processes, SIGKILLs and an at-least-once stream, in two acts.

The same stream and the same kill plan run twice (docs/demo.md):

- **act one**, ``claim -> effect -> complete`` through ``dedupcore serve`` (a
  subprocess) on the embedded default store in a temporary directory: the
  effect is a line appended to a file, the completion a call to the daemon;
- **act two**, the transactional pattern (:mod:`dedupcore.patterns.table`):
  per message, the dedup row and the effect (a balance update and a row in an
  effects table) are written in one transaction of one SQLite database that
  the consumer processes share (WAL journal, a busy timeout). No daemon.

What both acts share:

- a producer that publishes ``keys`` business ids and, like a producer whose
  acknowledgement got lost, publishes some of them again
  (``duplicate_rate`` of everything published is such a retry);
- a broker stand-in: one partition per consumer and a committed offset per
  partition in shared memory. A batch is acknowledged (the offset moves)
  only after its last completion (act one) or commit (act two); a consumer
  that dies is restarted and gets everything after the committed offset
  again;
- consumer processes (``multiprocessing``, forked by a fork server that
  imported dedupcore once, so a restart takes milliseconds), SIGKILLed and
  restarted at planned places: after the claim, between the effect and the completion,
  between the completion and the acknowledgement, and at a moment of a batch
  drawn from the seed (before the claim, halfway through the effect, or one
  of the places above). The plan is drawn from the seed before the run and
  each consumer SIGKILLs itself when it gets there, so every planned kill
  happens however loaded the machine is, and both acts get the same kills.

Act one, per batch: ``claim_many`` -> apply the effect of every NEW claim ->
``complete_many`` -> acknowledge. An id held by another consumer
(IN_PROGRESS) is retried until it is DUPLICATE or NEW. A kill between
``complete`` and the acknowledgement redelivers messages whose claims are
completed: they come back DUPLICATE and are suppressed -- the case dedupcore
closes. A kill between the effect and ``complete`` redelivers messages whose
effect happened but whose claim is still PROCESSING under the dead
consumer's owner id: the restarted consumer gets its own claim back and
applies the effect again. No dedup store can see an effect it was not told
about. The act counts those re-applied effects on their own line instead of
hiding them, and checks that every other effect happened exactly once.

Act two, per message: ``consume`` inserts the dedup row (or finds it:
DUPLICATE), the effect is written on the same connection, and the block's
exit commits both. A kill anywhere before the commit -- after the claim,
halfway through the effect, between the effect and the commit -- rolls back
the dedup row and the effect together, so the redelivery is NEW and applies
the effect once; a kill after the commit leaves both, so the redelivery is
DUPLICATE. In a batch, the kills inside a transaction land on the first NEW
message of its second half, so the messages before it are committed and
come back DUPLICATE. The act counts effects per id from the effects table and
checks the balances against the exactly-once totals: 0 effects applied
twice. ``atomic=False`` commits the effect on a database of its own before
the dedup row (a split transaction) to show that the count then finds the
repeats.

The parts: :mod:`~dedupcore.cli.demo.broker` (the stream, the kill plan, the
supervisor), :mod:`~dedupcore.cli.demo.act_one`, :mod:`~dedupcore.cli.demo.act_two`
and :mod:`~dedupcore.cli.demo.summary` (the accounting and its table); their names
are importable from here as well.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any

from dedupcore.cli.demo.act_one import _account as _account
from dedupcore.cli.demo.act_one import simulate
from dedupcore.cli.demo.act_two import _account_table as _account_table
from dedupcore.cli.demo.act_two import _ledger_entry as _ledger_entry
from dedupcore.cli.demo.act_two import _make_business_db as _make_business_db
from dedupcore.cli.demo.act_two import simulate_transactional
from dedupcore.cli.demo.broker import _FIELDS as _FIELDS
from dedupcore.cli.demo.broker import _RANDOM_MOMENTS as _RANDOM_MOMENTS
from dedupcore.cli.demo.broker import AFTER_COMPLETE as AFTER_COMPLETE
from dedupcore.cli.demo.broker import AFTER_EFFECT as AFTER_EFFECT
from dedupcore.cli.demo.broker import KILL_POINTS as KILL_POINTS
from dedupcore.cli.demo.broker import RANDOM as RANDOM
from dedupcore.cli.demo.broker import _kill_plan as _kill_plan
from dedupcore.cli.demo.broker import _prepare as _prepare
from dedupcore.cli.demo.summary import DemoResult, _print_acts

__all__ = ["DemoResult", "run_demo", "simulate", "simulate_transactional"]


# -- the command ------------------------------------------------------------------------------


def run_demo(*, keys: int, duplicate_rate: float, seed: int) -> int:
    """Runs both acts and prints their accounting side by side; returns the exit code:
    0 when act one's only repeated effects are the effect/complete window's and
    act two has none."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    if keys <= 0 or not 0.0 <= duplicate_rate < 1.0:
        console.print("[red]--keys must be > 0 and --duplicate-rate in [0, 1)[/red]")
        return 2
    consumers = 4
    console.print(
        f"[bold]dedupcore demo[/bold]: {keys:,} messages, {duplicate_rate:.0%} of what the "
        f"producer publishes are retries; {consumers} consumer processes, SIGKILLed and "
        "restarted at the same planned places in both acts.\n"
        "  act one: claim -> effect -> complete through one `dedupcore serve`\n"
        "  act two: the dedup row and the effect in one SQLite transaction "
        "(dedupcore.patterns.table)"
    )
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        one = bar.add_task("act one acked", total=None, note="starting the daemon")
        two = bar.add_task("act two acked", total=None, note="", start=False)

        def progress_of(task: Any) -> Callable[[int, int, str], None]:
            def progress(done: int, total: int, note: str) -> None:
                bar.update(task, completed=done, total=total, note=note)

            return progress

        args: dict[str, Any] = {
            "keys": keys,
            "duplicate_rate": duplicate_rate,
            "seed": seed,
            "consumers": consumers,
        }
        try:
            r1 = simulate(**args, progress=progress_of(one))
            bar.start_task(two)
            r2 = simulate_transactional(**args, progress=progress_of(two))
        except (RuntimeError, OSError, sqlite3.Error) as exc:
            console.print(f"[red]demo failed: {exc}[/red]")
            return 1
        except KeyboardInterrupt:
            console.print("[yellow]interrupted; the daemon and consumers are stopped[/yellow]")
            return 130
    _print_acts(console, r1, r2)
    return 0 if r1.ok and r2.ok else 1
