"""What every benchmark report shares: reading pytest-benchmark JSON, formatting, output.

``python -m benchmarks.report SUITE`` reads the rows of the suite's operations
from pytest-benchmark JSONs (:func:`load_run`), and the suite's module in
``benchmarks/reports/`` prints its tables and checks its targets with what is
here. A row's ``ns_per_key`` is its fastest round (the least disturbed one on a
shared machine), ``ns_per_key_median`` its median round.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"

Rows = dict[tuple[str, str], "Row"]


@dataclass
class Row:
    """One benchmark: ``(operation, library)`` with its per-key times and ``extra_info``."""

    library: str
    operation: str
    n_keys: int
    ns_per_key: float
    ns_per_key_median: float
    call: str
    rounds: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def keys_per_s(self) -> float:
        return 1e9 / self.ns_per_key

    @property
    def keys_per_s_median(self) -> float:
        return 1e9 / self.ns_per_key_median


def rows_of(data: dict[str, Any], keep: Callable[[str], bool] | None = None) -> Rows:
    """The rows of the benchmarks whose ``extra_info`` names an operation (kept by ``keep``)
    and a library; a later benchmark of the same pair replaces an earlier one."""
    rows: Rows = {}
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if "operation" not in info or "library" not in info:
            continue
        if keep is not None and not keep(info["operation"]):
            continue
        stats = bench["stats"]
        n = int(info["n_keys"])
        rows[(info["operation"], info["library"])] = Row(
            library=info["library"],
            operation=info["operation"],
            n_keys=n,
            ns_per_key=stats["min"] / n * 1e9,
            ns_per_key_median=stats["median"] / n * 1e9,
            call=info.get("call", ""),
            rounds=int(stats.get("rounds", 0)),
            extra=info,
        )
    return rows


def load(path: Path, keep: Callable[[str], bool] | None = None) -> tuple[dict[str, Any], Rows]:
    """The JSON of ``path`` and its rows (see :func:`rows_of`)."""
    data = json.loads(path.read_text())
    return data, rows_of(data, keep)


@dataclass
class Run:
    """One pytest-benchmark JSON: its path, its data and the rows of one suite."""

    path: Path
    data: dict[str, Any]
    rows: Rows

    @property
    def info(self) -> dict[str, Any]:
        """The ``extra_info`` of one row: what every row of the run records alike."""
        return next(iter(self.rows.values())).extra

    def config(self, key: str) -> dict[str, Any]:
        """The suite's sizes, as its rows record them under ``key``."""
        return dict(self.info.get(key, {}))


def load_run(path: Path, keep: Callable[[str], bool], what: str) -> Run:
    """The rows of ``path`` whose operation ``keep`` accepts; SystemExit naming ``what``
    when there are none (or no file)."""
    try:
        data, rows = load(path, keep)
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such file; run {what} first") from None
    except ValueError:
        raise SystemExit(f"{path}: not a pytest-benchmark JSON (did {what} fail?)") from None
    if not rows:
        raise SystemExit(f"{path}: no rows of {what} in it")
    return Run(path, data, rows)


def loads_of(rows: Rows) -> list[float]:
    """Every 1-minute load average the benchmarks recorded."""
    return [x for r in rows.values() for x in r.extra.get("loadavg_1min", [])]


def print_provenance(out: Out, run: Run) -> None:
    """Where the figures come from: the file, when, the CPU, the code measured (commit,
    local changes, digest), the interpreter, and the load average during the run."""
    data, info = run.data, run.info
    cpu = data.get("machine_info", {}).get("cpu", {}).get("brand_raw", "?")
    out.line(f"source: {run.path}  ({data.get('datetime', '?')}, {cpu})")
    dirty = info.get("git_dirty")
    out.line(
        f"dedupcore at {info.get('git_rev', '?')}"
        + (f" with local changes in {', '.join(dirty)}" if dirty else "")
        + f", code sha256 {info.get('dedupcore_sha256', '?')}; Python {info.get('python', '?')}, "
        f"event loop {info.get('event_loop', '?')}, SQLite {info.get('sqlite_version', '?')}"
    )
    loads = loads_of(run.rows)
    if loads:
        out.line(
            f"1-minute load average during the run: {min(loads):.2f} .. {max(loads):.2f} on "
            f"{info.get('cpus', '?')} CPUs; only ratios within one run mean much"
        )
    e = next((r.extra for r in run.rows.values() if "redis_version" in r.extra), None)
    if e is not None:
        out.line(
            f"Redis {e['redis_version']} (AOF {'on' if e.get('redis_aof_enabled') else 'off'}, "
            f"redis-py parser {e.get('redis_parser', '?')})"
        )


def order_key(order: Sequence[str]) -> Callable[[str], tuple[int, str]]:
    """A sort key putting the names of ``order`` first, in that order."""

    def key(name: str) -> tuple[int, str]:
        return (order.index(name) if name in order else len(order), name)

    return key


def size_note(actual: int | None, target: int, name: str) -> str:
    """``  [run at NAME=actual; the target is for target]`` when they differ."""
    if actual is None or actual == target:
        return ""
    return f"  [run at {name}={actual:,}; the target is for {target:,}]"


# ------------------------------------------------------------ formatting --


def fmt_ns(ns: float | None) -> str:
    if ns is None or math.isnan(ns):
        return "-"
    if ns >= 1000:
        return f"{ns / 1000:,.2f} µs"
    return f"{ns:,.1f} ns"


def fmt_x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def fmt_rate(keys_per_s: float | None) -> str:
    return "-" if keys_per_s is None else f"{keys_per_s:,.0f}/s"


def fmt_us(us: float | None) -> str:
    if us is None:
        return "-"
    return f"{us:,.0f} µs" if us >= 100 else f"{us:,.1f} µs"


class Out:
    """Prints tables with rich when it is installed, as plain text otherwise."""

    def __init__(self, plain: bool = False) -> None:
        self.console: Any = None
        if not plain:
            try:
                from rich.console import Console
            except ImportError:
                pass
            else:
                probe = Console()
                width = probe.width if probe.is_terminal else 200
                self.console = Console(width=max(160, width), highlight=False)

    def heading(self, text: str) -> None:
        if self.console is not None:
            from rich.text import Text

            self.console.print()
            self.console.print(Text(text, style="bold"))
        else:
            print(f"\n{text}\n{'=' * len(text)}")

    def line(self, text: str = "", style: str | None = None) -> None:
        if self.console is not None:
            from rich.text import Text

            self.console.print(Text(text, style=style or ""))
        else:
            print(text)

    def table(
        self,
        title: str,
        headers: Sequence[str],
        rows: Sequence[Sequence[str]],
        right: Sequence[bool] | None = None,
    ) -> None:
        right = right or [False] * len(headers)
        if self.console is not None:
            from rich.table import Table
            from rich.text import Text

            t = Table(title=title, title_justify="left", show_lines=False)
            for h, r in zip(headers, right, strict=True):
                t.add_column(h, justify="right" if r else "left", no_wrap=True)
            for row in rows:
                t.add_row(*(Text(cell) for cell in row))  # no markup: calls contain [..]
            self.console.print(t)
            return
        widths = [
            max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
            for i, h in enumerate(headers)
        ]

        def cells(values: Sequence[str]) -> str:
            return "  ".join(
                v.rjust(w) if r else v.ljust(w)
                for v, w, r in zip(values, widths, right, strict=True)
            ).rstrip()

        print(f"\n{title}")
        print(cells(headers))
        print("  ".join("-" * w for w in widths))
        for row in rows:
            print(cells(row))


# -------------------------------------------------------------- verdicts --


@dataclass
class Verdict:
    met: bool | None  # None: not measured
    text: str


def print_verdicts(out: Out, verdicts: list[Verdict]) -> None:
    out.heading("targets")
    for v in verdicts:
        tag = {True: "MET", False: "MISSED", None: "N/A"}[v.met]
        style = {True: "green", False: "bold red", None: "yellow"}[v.met]
        out.line(f"{tag:<7}{v.text}", style=style)
    met = sum(v.met is True for v in verdicts)
    out.line(f"\n{met} of {len(verdicts)} targets met")
