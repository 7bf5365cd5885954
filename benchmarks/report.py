"""The benchmarks' report: tables, targets and charts of a suite's pytest-benchmark JSON.

    python -m benchmarks.report SUITE [--json PATH ...] [--png PATH] [--plain]

``./dev bench SUITE`` runs the suite into ``benchmarks/results/SUITE.json`` and
then this. Without ``--json`` it reads that file; several ``--json`` (repeated
runs) are printed one after another, and the tiers report ends with the spread
of every ratio over them, the scale report merges them into one chart. Each
suite's tables and targets are in ``benchmarks/reports/`` (benchmarks/README.md
says what each measures).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.reporting import RESULTS_DIR, Out, load_run, print_provenance, print_verdicts

#: Suite name -> its module under benchmarks/reports/ (and its benchmarks/test_*.py). A
#: module has ``keep(operation)`` (the rows it reads), ``print_run(out, run)``,
#: ``evaluate(run)`` (the verdicts of its targets) and may have ``finish(out, runs, png)``
#: (what spans the runs: a chart, the spread of repeated runs).
SUITES = {
    "bloom": "bloom",
    "store": "store",
    "daemon": "daemon",
    "tiers": "tiers",
    "scale": "scale",
    "sql-partitions": "sql_partitions",
    "metrics": "metrics",
}
#: The suites that draw a chart (``--png``, default benchmarks/results/SUITE.png).
CHARTS = {"bloom", "scale"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("suite", choices=list(SUITES), metavar="SUITE", help=", ".join(SUITES))
    parser.add_argument(
        "--json",
        type=Path,
        action="append",
        help="a pytest-benchmark JSON of the suite (repeat for several runs; default: "
        "benchmarks/results/SUITE.json)",
    )
    parser.add_argument(
        "--png",
        type=Path,
        help=f"where the chart goes ({', '.join(sorted(CHARTS))}; default: "
        "benchmarks/results/SUITE.png)",
    )
    parser.add_argument("--plain", action="store_true", help="plain text even if rich is installed")
    args = parser.parse_args(argv)
    if args.png is not None and args.suite not in CHARTS:
        parser.error(f"--png: the {args.suite} report draws no chart")

    module = importlib.import_module(f"benchmarks.reports.{SUITES[args.suite]}")
    what = f"./dev bench {args.suite}"
    paths = args.json or [RESULTS_DIR / f"{args.suite}.json"]
    runs = [load_run(path, module.keep, what) for path in paths]
    out = Out(plain=args.plain)
    for run in runs:
        print_provenance(out, run)
        module.print_run(out, run)
        verdicts = module.evaluate(run)
        if verdicts:
            print_verdicts(out, verdicts)
    finish = getattr(module, "finish", None)
    if finish is not None:
        png = (args.png or RESULTS_DIR / f"{args.suite}.png") if args.suite in CHARTS else None
        finish(out, runs, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
