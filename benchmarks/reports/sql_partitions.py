"""Day partitions' report (``python -m benchmarks.report sql-partitions``): ns/key by day.

The run (benchmarks/test_sql_partitions.py, docs/sql-partitions.md) keeps each
day's seconds of claims on both tables, fresh keys and the same keys again;
the table shows ns/key for the first, second, middle and last days and over
the whole run. It is a reference: no targets.
"""

from __future__ import annotations

from benchmarks.reporting import Out, Run, Verdict

COLUMNS = ("fresh_flat_s", "fresh_day_s", "duplicate_flat_s", "duplicate_day_s")


def keep(operation: str) -> bool:
    """The one operation of benchmarks/test_sql_partitions.py."""
    return operation == "sql_partitions"


def print_run(out: Out, run: Run) -> None:
    for row in run.rows.values():
        print_days(out, row.extra)


def evaluate(run: Run) -> list[Verdict]:
    return []  # a reference: no targets


def print_days(out: Out, e: dict[str, object]) -> None:
    days: list[dict[str, float]] = e["days"]  # type: ignore[assignment]
    keys = int(e["keys_per_day"])  # type: ignore[call-overload]
    out.heading(
        f"PostgreSQL, {keys:,} keys per day, batches of {e['batch']}, claim_many only timed"
    )
    out.line("ns/key: fresh keys (flat, day-partitioned), the same keys again (flat, day)")
    last = len(days)
    shown = sorted({1, 2, max(1, last // 2), last})

    def ns(seconds: float, n: int) -> str:
        return f"{seconds / n * 1e9:,.0f}"

    table = [
        [str(d["day"]), str(d["partitions"]), *(ns(d[c], keys) for c in COLUMNS)]
        for d in days
        if d["day"] in shown
    ]
    table.append(
        [
            "all",
            str(days[-1]["partitions"]),
            *(ns(sum(d[c] for d in days), keys * last) for c in COLUMNS),
        ]
    )
    out.table(
        "claims per day as partitions accumulate",
        ["day", "partitions", "fresh flat", "fresh day", "dup flat", "dup day"],
        table,
        [True] * 6,
    )
