"""``dedupcore bench`` (deprecated): says where the benchmarks run, and exits 2.

The benchmarks need the repository's ``benchmarks/`` and run from a clone with
``./dev bench SUITE`` (docs/performance.md); an installed package has none. The
command stays for a release so that a script calling it learns where they went
(docs/compatibility.md), and goes in 0.3.0.
"""

from __future__ import annotations

import sys


def run_bench() -> int:
    """Prints where the benchmarks run; returns 2 (nothing was run)."""
    print(
        "dedupcore bench is deprecated and will be removed in 0.3.0: the benchmarks run "
        "from a clone of the repository, with ./dev bench SUITE (docs/performance.md)",
        file=sys.stderr,
    )
    return 2
