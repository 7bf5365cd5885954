"""``dedupcore check DATA_DIR``: reads a data directory whole and reports damage.

Exit codes: 0 nothing damaged, 1 damage found, 2 usage error or the
directory cannot be checked (docs/operations.md, "Checking a data
directory"). Works offline and while a daemon serves the directory: it only
reads (:mod:`dedupcore.check`). A rich table when rich is installed, plain
text otherwise, JSON with ``--json``; a progress bar on a terminal.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from dedupcore.check import DAMAGE, CheckReport, Finding, NotADataDirectoryError, check_data_dir
from dedupcore.errors import UnsupportedFormatError

__all__ = ["run_check"]

_LABELS = {
    "records": "records",
    "slices": "warm slices",
    "slice_filters": "slice filters",
    "meta_entries": "LMDB meta entries",
    "inflight_entries": "in-flight entries",
    "front_slices": "front filter slices",
    "cold_rings": "cold archive rings",
    "cold_slices": "cold archive slices",
    "key_logs": "key logs",
    "wal_records": "log records past the checkpoint",
    "wal_bytes": "log payload bytes",
    "lock_files": "lock files",
}


def run_check(path: str, *, as_json: bool = False, out: TextIO | None = None) -> int:
    """Checks ``path`` and prints the report; returns the exit code (0, 1 or 2)."""
    out = out or sys.stdout
    try:
        with _progress(enabled=not as_json) as progress:
            report = check_data_dir(path, progress=progress)
    except (FileNotFoundError, NotADirectoryError, NotADataDirectoryError) as exc:
        return _usage_error(f"dedupcore check: {exc}", as_json, out)
    except UnsupportedFormatError as exc:
        return _usage_error(f"dedupcore check: cannot check it: {exc}", as_json, out)
    except PermissionError as exc:
        return _usage_error(f"dedupcore check: cannot read the directory: {exc}", as_json, out)
    if as_json:
        json.dump(report.to_dict(), out, indent=1)
        out.write("\n")
    else:
        _print_report(report, out)
    return 1 if report.damaged else 0


def _usage_error(message: str, as_json: bool, out: TextIO) -> int:
    if as_json:
        json.dump({"error": message}, out)
        out.write("\n")
    print(message, file=sys.stderr)
    return 2


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[str, int, int], None] | None]:
    """A rich progress bar on stderr when it is a terminal (and rich is installed)."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        yield None
        return
    bars = Progress(console=Console(stderr=True), transient=True)
    tasks: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bars.add_task(f"checking {stage}", total=max(total, done, 1))
        bars.update(tasks[stage], completed=done, total=max(total, done, 1))

    with bars:
        yield update


def _where(f: Finding) -> str:
    parts = [f.path]
    if f.slice is not None:
        parts.append(f"slice {f.slice}")
    if f.first is not None:
        span = f.first if f.first == f.last else f"{f.first}..{f.last}"
        parts.append(f"digests {span}")
    return "\n".join(parts)


def _print_report(report: CheckReport, out: TextIO) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        _print_plain(report, out)
        return
    # Not a terminal (a file, a pipe): wide enough that paths and digests stay whole.
    console = Console(file=out, soft_wrap=False, width=None if out.isatty() else 240)
    owner = f", served by process {report.owner}" if report.owner else ""
    console.print(f"[bold]{report.path}[/bold]{owner}")
    checked = Table(title="read", show_header=False)
    for key, value in report.checked.items():
        checked.add_row(_LABELS.get(key, key), f"{value:,}")
    console.print(checked)
    if report.findings:
        table = Table(title="findings")
        widest = max(len(line) for f in report.findings for line in _where(f).split("\n"))
        table.add_column("severity")
        table.add_column("kind")
        table.add_column("where", min_width=min(widest, 120), overflow="fold")
        table.add_column("count", justify="right")
        table.add_column("what", ratio=1)
        for f in report.findings:
            style = "red" if f.severity == DAMAGE else "yellow"
            table.add_row(
                f"[{style}]{f.severity}[/{style}]",
                f.kind,
                _where(f),
                str(f.count or ""),
                f.message,
            )
        console.print(table)
    console.print(_summary(report))


def _print_plain(report: CheckReport, out: TextIO) -> None:
    owner = f", served by process {report.owner}" if report.owner else ""
    print(f"{report.path}{owner}", file=out)
    for key, value in report.checked.items():
        print(f"  {_LABELS.get(key, key)}: {value}", file=out)
    for f in report.findings:
        where = _where(f).replace("\n", ", ")
        count = f" ({f.count})" if f.count else ""
        print(f"{f.severity}: {f.kind}: {where}{count}: {f.message}", file=out)
    print(_summary(report), file=out)


def _summary(report: CheckReport) -> str:
    damage = sum(f.severity == DAMAGE for f in report.findings)
    notices = len(report.findings) - damage
    if damage:
        return (
            f"DAMAGED: {damage} finding(s) of damage, {notices} notice(s); "
            "see docs/operations.md for what each means and what to do"
        )
    return f"clean: no damage found ({notices} notice(s))"
