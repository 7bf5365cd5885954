"""The metrics wrapper's report (``python -m benchmarks.report metrics``): its cost per call.

Each operation of benchmarks/test_metrics.py runs on the embedded store bare and
wrapped by ``instrument()``; the table shows each call's median time and what
the wrapper adds. It is a reference: no targets.
"""

from __future__ import annotations

from benchmarks.reporting import Out, Run, Verdict, fmt_ns

BARE, INSTRUMENTED = "dedupcore bare", "dedupcore instrumented"


def keep(operation: str) -> bool:
    """The operations of benchmarks/test_metrics.py."""
    return operation.startswith(("claim (", "claim_many ("))


def evaluate(run: Run) -> list[Verdict]:
    return []  # a reference: no targets


def print_run(out: Out, run: Run) -> None:
    table = []
    for op in sorted({op for op, _ in run.rows}):
        bare, wrapped = run.rows.get((op, BARE)), run.rows.get((op, INSTRUMENTED))
        per_call = {
            lib: r.ns_per_key_median * r.n_keys
            for lib, r in ((BARE, bare), (INSTRUMENTED, wrapped))
            if r is not None
        }
        extra = per_call[INSTRUMENTED] - per_call[BARE] if len(per_call) == 2 else None
        table.append(
            [op, fmt_ns(per_call.get(BARE)), fmt_ns(per_call.get(INSTRUMENTED)), fmt_ns(extra)]
        )
    out.table(
        "median time per call, the embedded store bare and instrumented (power-loss-unsafe)",
        ["call", "bare", "instrumented", "instrument() adds"],
        table,
        [False, True, True, True],
    )
