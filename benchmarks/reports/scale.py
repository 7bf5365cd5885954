"""The scale run's report (``python -m benchmarks.report scale``): tenths, peers, targets, chart.

The run (benchmarks/test_scale.py) is one benchmark whose ``extra_info["scale"]``
holds every figure. Several JSONs (a store run and a peers run, say) are merged,
a later run's parts replacing an earlier one's, and drawn together.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks.reporting import Out, Run, Verdict, size_note

TARGET_N = 100_000_000
TARGET_FLAT = 0.75  # the last tenth's claims/s over the first's, at least
TARGET_DISK_BYTES = 64.0  # the data directory after a checkpoint, per key
TARGET_OPEN_S = 2.0  # after a clean close
TARGET_OPEN_KILLED_S = 10.0  # after a SIGKILL
TARGET_RSS = 1.5 * (1 << 30)  # anonymous RSS at the end
TARGET_COLD_BYTES = 2.5  # the cold archive, per key
TARGET_COLD_FPR = 0.001  # fresh keys answered DUPLICATE by the cold archive
TARGET_COLD_RATE = 0.75  # fresh claims after the cold fill over the rate before it


def keep(operation: str) -> bool:
    """The one operation of benchmarks/test_scale.py."""
    return operation == "scale"


def merged(runs: list[Run]) -> dict[str, Any]:
    """The figures of every run, a later run's non-empty parts replacing an earlier one's."""
    out: dict[str, Any] = {}
    for run in runs:
        for row in run.rows.values():
            out.update({k: v for k, v in row.extra.get("scale", {}).items() if v})
    return out


def print_run(out: Out, run: Run) -> None:
    print_tables(out, merged([run]))


def evaluate(run: Run) -> list[Verdict]:
    return verdicts(merged([run]))


def finish(out: Out, runs: list[Run], png: Path | None) -> None:
    """The chart of every run together."""
    results = merged(runs)
    series = results.get("dedupcore") or results.get("redis")
    if png is not None and series and chart(results, png):
        out.line(f"\nchart: {png}")


def print_tables(out: Out, results: dict[str, Any]) -> None:
    out.heading(
        f"dedupcore at scale: N={results.get('n', 0):,} fresh keys claimed and completed in "
        f"batches of {results.get('batch', '?')}, durable; peers up to "
        f"{results.get('peer_n', 0):,} keys"
    )
    rows = results.get("dedupcore") or results.get("cold_store") or []
    if rows:
        out.table(
            "dedupcore per tenth of the run",
            ["keys held", "claims/s", "disk B/key", "LMDB B/key", "RSS anon", "slices (compacted)"],
            [
                [
                    f"{r['keys']:,}",
                    f"{r['claims_per_s']:,.0f}",
                    f"{r['disk_bytes_per_key']:.1f}",
                    f"{r['lmdb_bytes_per_key']:.1f}",
                    f"{r['rss_anon_bytes'] / (1 << 20):,.0f} MiB",
                    f"{r['slices']} ({r['compacted']})",
                ]
                for r in rows
            ],
            [True, True, True, True, True, True],
        )
        last = rows[-1]
        if "lmdb_bytes_per_key_compacted" in last:
            out.line(
                f"after the pending compaction ({last['compact_rest_seconds']:.1f} s): LMDB "
                f"{last['lmdb_bytes_per_key_compacted']:.1f} bytes/key"
            )
    if "open_after_close_s" in results:
        out.line(f"open after a clean close: {results['open_after_close_s']:.2f} s")
    if "open_after_sigkill_s" in results:
        out.line(f"open after a SIGKILL: {results['open_after_sigkill_s']:.2f} s")
    cold = results.get("billion")
    if cold:
        out.line(
            f"cold archive: {cold['cold_keys']:,} keys filled in {cold['fill_seconds']:.0f} s, "
            f"{cold['cold_bytes_per_key']:.3f} bytes/key; fresh claims "
            f"{cold['claims_per_s_before']:,.0f}/s before"
            + (
                f" ({cold['claims_per_s_before_fill']:,.0f}/s right before the fill)"
                if "claims_per_s_before_fill" in cold
                else ""
            )
            + f", {cold['claims_per_s']:,.0f}/s after"
            + (
                f" ({cold['claims_per_s_probes_off']:,.0f}/s with its probes off; the probe "
                f"alone {cold['cold_probe_ns_per_key']:.0f} ns/key)"
                if "claims_per_s_probes_off" in cold
                else ""
            )
            + (
                f", {cold['claims_per_s_again']:,.0f}/s with the probes on again"
                if "claims_per_s_again" in cold
                else ""
            )
            + "; "
            f"{cold['fresh_keys_answered_cold']:,} fresh keys answered DUPLICATE "
            f"(FPR {cold['measured_cold_fpr']:.5f})"
        )
    for name, key, what in (
        ("redis", "memory_bytes_per_key", "RAM B/key"),
        ("sqlite", "disk_bytes_per_key", "disk B/key"),
    ):
        peer = results.get(name) or []
        if peer:
            out.table(
                f"{name} per tenth",
                ["keys held", "claims/s", what],
                [[f"{r['keys']:,}", f"{r['claims_per_s']:,.0f}", f"{r[key]:.1f}"] for r in peer],
                [True, True, True],
            )


def verdicts(results: dict[str, Any]) -> list[Verdict]:
    verdicts: list[Verdict] = []
    note = size_note(results.get("n"), TARGET_N, "N")
    rows = results.get("dedupcore") or []
    if rows:
        first, last = rows[0], rows[-1]
        flat = last["claims_per_s"] / first["claims_per_s"]
        slowest = min(rows, key=lambda r: r["claims_per_s"])
        verdicts.append(
            Verdict(
                flat >= TARGET_FLAT,
                f"flat cost: the last tenth {last['claims_per_s']:,.0f}/s = {flat:.2f}x the first "
                f"{first['claims_per_s']:,.0f}/s (slowest tenth {slowest['claims_per_s']:,.0f}/s "
                f"at {slowest['keys']:,}; target >= {TARGET_FLAT:g}x){note}",
            )
        )
        disk = last["disk_bytes_per_key"]
        verdicts.append(
            Verdict(
                disk <= TARGET_DISK_BYTES,
                f"disk: the data directory {disk:.1f} bytes/key after a checkpoint (LMDB "
                f"{last['lmdb_bytes_per_key']:.1f}; target <= {TARGET_DISK_BYTES:g}){note}",
            )
        )
        rss = last["rss_anon_bytes"]
        verdicts.append(
            Verdict(
                rss <= TARGET_RSS,
                f"memory: anonymous RSS {rss / (1 << 20):,.0f} MiB at the end (target <= "
                f"{TARGET_RSS / (1 << 30):g} GiB){note}",
            )
        )
    else:
        verdicts.append(Verdict(None, "flat cost, disk and memory: not measured"))
    for key, target, what in (
        ("open_after_close_s", TARGET_OPEN_S, "open after a clean close"),
        ("open_after_sigkill_s", TARGET_OPEN_KILLED_S, "open after a SIGKILL"),
    ):
        if key in results:
            s = results[key]
            verdicts.append(Verdict(s <= target, f"{what}: {s:.2f} s (target <= {target:g} s)"))
        else:
            verdicts.append(Verdict(None, f"{what}: not measured"))
    cold = results.get("billion")
    if cold:
        verdicts.append(
            Verdict(
                cold["cold_bytes_per_key"] <= TARGET_COLD_BYTES,
                f"cold archive {cold['cold_bytes_per_key']:.3f} bytes/key for "
                f"{cold['cold_keys']:,} keys (target <= {TARGET_COLD_BYTES:g})",
            )
        )
        ratio = cold["claims_per_s"] / cold["claims_per_s_before"]
        just_before = (
            f" ({cold['claims_per_s'] / cold['claims_per_s_before_fill']:.2f}x the rate "
            "right before the fill)"
            if "claims_per_s_before_fill" in cold
            else ""
        )
        verdicts.append(
            Verdict(
                ratio >= TARGET_COLD_RATE,
                f"fresh claims after the cold fill: {ratio:.2f}x the rate before{just_before} "
                f"(target >= {TARGET_COLD_RATE:g}x)",
            )
        )
        verdicts.append(
            Verdict(
                cold["measured_cold_fpr"] <= TARGET_COLD_FPR,
                f"cold archive: {cold['measured_cold_fpr']:.5f} of fresh keys answered "
                f"DUPLICATE (target <= {TARGET_COLD_FPR:g})",
            )
        )
    else:
        verdicts.append(Verdict(None, "cold archive: not measured"))
    return verdicts


def chart(results: dict[str, Any], png: Path) -> Path | None:
    """Claims/s and bytes/key against keys held, dedupcore beside its peers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart", file=sys.stderr)
        return None

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, key in (
        ("dedupcore", "disk_bytes_per_key"),
        ("sqlite", "disk_bytes_per_key"),
        ("redis", "memory_bytes_per_key"),
    ):
        rows = results.get(name) or []
        if not rows:
            continue
        xs = [r["keys"] / 1e6 for r in rows]
        a.plot(xs, [r["claims_per_s"] / 1e3 for r in rows], marker="o", label=name)
        b.plot(
            xs,
            [r[key] for r in rows],
            marker="o",
            label=f"{name} ({'memory' if name == 'redis' else 'disk'})",
        )
    a.set_xlabel("keys held (millions)")
    a.set_ylabel("claim + complete, thousand keys/s")
    a.set_title("throughput as the store grows")
    b.set_xlabel("keys held (millions)")
    b.set_ylabel("bytes per key")
    b.set_title("footprint")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
