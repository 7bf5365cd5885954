"""Each benchmark suite's tables and targets, for ``python -m benchmarks.report SUITE``.

A suite's module has ``keep(operation)`` (the rows it reads), ``print_run(out, run)``,
``evaluate(run)`` (its targets' verdicts) and may have ``finish(out, runs, png)``;
the rendering they share is benchmarks/reporting.py.
"""
