"""The Bloom core's report (``python -m benchmarks.report bloom``): tables, targets, chart.

Per-key figures use each benchmark's fastest round (the least disturbed one
on a shared machine); ratios are dedupcore's time over the peer's, so below
1.0 means dedupcore is faster.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks.reporting import (
    Out,
    Row,
    Run,
    Verdict,
    fmt_ns,
    order_key,
)

DC = "dedupcore"
GATHER = "numpy-gather"

OPERATIONS = [
    ("add_batch", "batch add (fresh filter)"),
    ("contains_batch_present", "batch membership, present keys"),
    ("contains_batch_absent", "batch membership, absent keys"),
    ("add_single", "single-key add, per call"),
    ("contains_single_present", "single-key in, present keys"),
    ("contains_single_absent", "single-key in, absent keys"),
    ("big_add", "pre-hashed uint64: add_many vs gather"),
    ("big_contains", "pre-hashed uint64: contains_many vs gather"),
]
PHASES = [
    ("phase_hash", "hash64_many(keys): list walk + XXH64", ("add_batch", "contains_batch_present")),
    ("phase_add_prehashed", "add_many(uint64 hashes): probe/set only", ("add_batch",)),
    (
        "phase_contains_prehashed",
        "contains_many(uint64 hashes): probe only",
        ("contains_batch_present",),
    ),
]
LIB_ORDER = [
    DC,
    "abloom",
    "rbloom",
    "fastbloom-rs",
    "pybloomfiltermmap3",
    "pybloom-live",
    "set",
    GATHER,
]
NON_PEERS = {DC, "set", GATHER}  # set: exact reference, not a Bloom filter

TARGET_FPR = 0.0012
TARGET_BITS = 16.0
TARGET_ADD_VS_ABLOOM = 0.35
TARGET_CONTAINS_VS_FASTEST = 0.15
TARGET_N = 10_000_000
TARGET_BIG = 100_000_000


lib_key = order_key(LIB_ORDER)


def keep(operation: str) -> bool:
    """The operations of benchmarks/test_bloom.py."""
    return operation in {op for op, _ in OPERATIONS} | {op for op, _, _ in PHASES} | {"fpr_memory"}


def print_run(out: Out, run: Run) -> None:
    print_tables(out, run.rows, run.config("bloom_bench"))


def finish(out: Out, runs: list[Run], png: Path | None) -> None:
    """The chart of the last run."""
    if png is not None and plot(runs[-1].rows, runs[-1].config("bloom_bench"), png):
        out.line(f"\nchart: {png}")


# ------------------------------------------------------------ formatting --


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}x"


def fmt_fpr(fpr: float | None) -> str:
    return "-" if fpr is None else f"{fpr:.5f}"


def fmt_bits(bits: float | None) -> str:
    return "-" if bits is None else f"{bits:,.2f}"


# ---------------------------------------------------------------- report --


def memory_fpr(rows: dict[tuple[str, str], Row]) -> dict[str, Row]:
    return {lib: r for (op, lib), r in rows.items() if op == "fpr_memory"}


def print_tables(out: Out, rows: dict[tuple[str, str], Row], cfg: dict[str, Any]) -> None:
    mem = memory_fpr(rows)
    out.heading(
        f"dedupcore Bloom benchmarks: N={cfg.get('n', '?'):,} 16-byte keys, "
        f"error_rate={cfg.get('error_rate', '?')}, BIG={cfg.get('big', '?'):,} pre-hashed; "
        f"pybloom-live on {cfg.get('pure_n', '?'):,} keys"
    )
    out.line(
        "ns/key: fastest of the rounds; ratio = dedupcore / peer (below 1 = dedupcore "
        "faster); bits/key and FPR from the fpr_memory run."
    )
    headers = ["library", "ns/key", "median", "dedupcore/peer", "bits/key", "FPR", "keys", "call"]
    right = [False, True, True, True, True, True, True, False]
    for op, title in OPERATIONS:
        libs = sorted((lib for (o, lib) in rows if o == op), key=lib_key)
        if not libs:
            continue
        dc = rows.get((op, DC))
        table_rows = []
        for lib in libs:
            r = rows[(op, lib)]
            ratio = dc.ns_per_key / r.ns_per_key if dc and lib != DC else None
            m = mem.get(lib)
            bits = r.extra.get("bits_per_key", m.extra.get("bits_per_key") if m else None)
            fpr = m.extra.get("fpr") if m else None
            if op.startswith("big_"):
                fpr = None
                bits = r.extra.get("bits_per_key") if lib == DC else None
            table_rows.append(
                [
                    lib,
                    fmt_ns(r.ns_per_key),
                    fmt_ns(r.ns_per_key_median),
                    fmt_ratio(ratio),
                    fmt_bits(bits),
                    fmt_fpr(fpr),
                    f"{r.n_keys:,}",
                    r.call,
                ]
            )
        out.table(f"{op}: {title}", headers, table_rows, right)

    if mem:
        table_rows = []
        for lib in sorted(mem, key=lib_key):
            e = mem[lib].extra
            table_rows.append(
                [
                    lib,
                    f"{e.get('capacity', 0):,}",
                    f"{e.get('nbytes', 0):,}",
                    fmt_bits(e.get("bits_per_key")),
                    fmt_fpr(e.get("fpr")),
                    f"{e.get('false_positives', 0):,} / {mem[lib].n_keys:,}",
                ]
            )
        out.table(
            "memory and measured false-positive rate (filter full at capacity, error_rate 0.001)",
            ["library", "capacity", "bytes", "bits/key", "FPR", "false positives"],
            table_rows,
            [False, True, True, True, True, True],
        )
        if "set" in mem:
            out.line(
                "set: bytes of the hash table alone (sys.getsizeof), not counting the "
                "key objects (49 bytes each for 16-byte keys)."
            )

    phase_rows = []
    for op, title, totals in PHASES:
        phase = rows.get((op, DC))
        if phase is None:
            continue
        shares = []
        for total_op in totals:
            t = rows.get((total_op, DC))
            if t:
                shares.append(f"{phase.ns_per_key / t.ns_per_key:.0%} of {total_op}")
        phase_rows.append(
            [
                op,
                title,
                fmt_ns(phase.ns_per_key),
                fmt_ns(phase.ns_per_key_median),
                ", ".join(shares),
            ]
        )
    if phase_rows:
        out.table(
            "dedupcore phases (same N keys)",
            ["phase", "what", "ns/key", "median", "share of end-to-end"],
            phase_rows,
            [False, False, True, True, False],
        )


def _fastest_peer(rows: dict[tuple[str, str], Row], op: str) -> Row | None:
    peers = [r for (o, lib), r in rows.items() if o == op and lib not in NON_PEERS]
    return min(peers, key=lambda r: r.ns_per_key) if peers else None


def evaluate(run: Run) -> list[Verdict]:
    rows, cfg = run.rows, run.config("bloom_bench")
    verdicts: list[Verdict] = []
    n, big = cfg.get("n"), cfg.get("big")
    size_note = "" if n == TARGET_N else f"  [run at N={n:,}; the target is for N={TARGET_N:,}]"
    big_note = (
        "" if big == TARGET_BIG else f"  [run at BIG={big:,}; the target is for {TARGET_BIG:,}]"
    )

    mem = memory_fpr(rows).get(DC)
    if mem is None:
        verdicts.append(Verdict(None, "FPR / bits per key: not measured"))
    else:
        fpr, bits = mem.extra["fpr"], mem.extra["bits_per_key"]
        verdicts.append(
            Verdict(
                fpr <= TARGET_FPR,
                f"measured FPR {fpr:.5f} <= {TARGET_FPR} "
                f"({mem.extra['false_positives']:,} of {mem.n_keys:,} absent keys, "
                f"{mem.extra['capacity']:,} keys at 0.001){size_note}",
            )
        )
        verdicts.append(
            Verdict(
                bits <= TARGET_BITS, f"memory {bits:.2f} bits/key <= {TARGET_BITS:g}{size_note}"
            )
        )

    dc, ab = rows.get(("add_batch", DC)), rows.get(("add_batch", "abloom"))
    if dc and ab:
        ratio = dc.ns_per_key / ab.ns_per_key
        verdicts.append(
            Verdict(
                ratio <= TARGET_ADD_VS_ABLOOM,
                f"add_many {fmt_ns(dc.ns_per_key)}/key = {ratio:.3f}x abloom "
                f"update {fmt_ns(ab.ns_per_key)}/key (target <= "
                f"{TARGET_ADD_VS_ABLOOM}x){size_note}",
            )
        )
    else:
        verdicts.append(Verdict(None, "add_many vs abloom update: not measured"))

    for op in ("contains_batch_present", "contains_batch_absent"):
        dc, best = rows.get((op, DC)), _fastest_peer(rows, op)
        kind = op.rsplit("_", 1)[1]
        if dc and best:
            ratio = dc.ns_per_key / best.ns_per_key
            verdicts.append(
                Verdict(
                    ratio <= TARGET_CONTAINS_VS_FASTEST,
                    f"contains_many ({kind}) {fmt_ns(dc.ns_per_key)}/key = "
                    f"{ratio:.3f}x fastest peer {best.library} `{best.call}` "
                    f"{fmt_ns(best.ns_per_key)}/key (target <= "
                    f"{TARGET_CONTAINS_VS_FASTEST}x){size_note}",
                )
            )
        else:
            verdicts.append(Verdict(None, f"contains_many ({kind}): not measured"))

    for op, what in (
        ("add_single", "single-key add"),
        ("contains_single_present", "single-key in (present)"),
        ("contains_single_absent", "single-key in (absent)"),
    ):
        dc, best = rows.get((op, DC)), _fastest_peer(rows, op)
        if dc and best:
            ratio = dc.ns_per_key / best.ns_per_key
            verdicts.append(
                Verdict(
                    ratio <= 1.0,
                    f"{what} {fmt_ns(dc.ns_per_key)}/call = {ratio:.3f}x fastest "
                    f"peer {best.library} {fmt_ns(best.ns_per_key)}/call "
                    f"(target <= 1x){size_note}",
                )
            )
        else:
            verdicts.append(Verdict(None, f"{what}: not measured"))

    for op, what in (("big_add", "add_many"), ("big_contains", "contains_many")):
        dc, gather = rows.get((op, DC)), rows.get((op, GATHER))
        if dc and gather:
            ratio = dc.ns_per_key / gather.ns_per_key
            verdicts.append(
                Verdict(
                    ratio <= 1.0,
                    f"pre-hashed {what} {fmt_ns(dc.ns_per_key)}/key = {ratio:.3f}x "
                    f"numpy gather {fmt_ns(gather.ns_per_key)}/key "
                    f"(target <= 1x){big_note}",
                )
            )
        else:
            verdicts.append(Verdict(None, f"pre-hashed {what} vs numpy gather: not measured"))
    return verdicts


# ----------------------------------------------------------------- chart --


def plot(rows: dict[tuple[str, str], Row], cfg: dict[str, Any], png: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart", file=sys.stderr)
        return None

    main_ops = [(op, title) for op, title in OPERATIONS[:6] if any(o == op for o, _ in rows)]
    big_ops = [(op, title) for op, title in OPERATIONS[6:] if any(o == op for o, _ in rows)]
    phase_ops = [(op, title) for op, title, _ in PHASES if (op, DC) in rows]
    libs = sorted({lib for (o, lib) in rows if o in dict(main_ops)}, key=lib_key)
    colors = {
        DC: "#d62728",
        "abloom": "#1f77b4",
        "rbloom": "#ff7f0e",
        "fastbloom-rs": "#9467bd",
        "pybloomfiltermmap3": "#8c564b",
        "pybloom-live": "#e377c2",
        "set": "#7f7f7f",
        GATHER: "#2ca02c",
    }

    fig, (ax, ax2) = plt.subplots(
        1, 2, figsize=(17, 7.5), gridspec_kw={"width_ratios": [3.2, 1]}, constrained_layout=True
    )
    width = 0.8 / max(1, len(libs))
    for i, lib in enumerate(libs):
        xs, ys = [], []
        for j, (op, _) in enumerate(main_ops):
            r = rows.get((op, lib))
            if r:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(r.ns_per_key)
        label = lib + (f" ({cfg.get('pure_n', 0):,} keys)" if lib == "pybloom-live" else "")
        ax.bar(
            xs,
            ys,
            width,
            label=label,
            color=colors.get(lib),
            edgecolor="black" if lib == DC else None,
            linewidth=1.2 if lib == DC else 0,
        )
        for x, y in zip(xs, ys, strict=True):
            ax.text(
                x,
                y * 1.06,
                f"{y:.0f}" if y < 1e4 else f"{y / 1000:.0f}k",
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=90,
            )
    ax.set_yscale("log")
    ax.set_xticks(range(len(main_ops)))
    ax.set_xticklabels([t.replace(", ", ",\n") for _, t in main_ops], fontsize=9)
    ax.set_ylabel("ns per key (log scale; lower is better)")
    ax.set_title(f"16-byte keys, N={cfg.get('n', 0):,}, error_rate {cfg.get('error_rate')}")
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.set_axisbelow(True)
    top = max((r.ns_per_key for (o, _), r in rows.items() if o in dict(main_ops)), default=1)
    ax.set_ylim(top=top * 6)
    ax.legend(fontsize=9, ncol=4, loc="upper left")

    labels, values, cols, notes = [], [], [], []
    for op, _ in big_ops:
        gather = rows.get((op, GATHER))
        for lib in (DC, GATHER):
            r = rows.get((op, lib))
            if r:
                what = op.split("_", 1)[1]
                labels.append(f"{what}_many" if lib == DC else f"gather\n(vs {what})")
                values.append(r.ns_per_key)
                cols.append(colors[lib])
                ratio = f"\n{r.ns_per_key / gather.ns_per_key:.2f}x" if gather and lib == DC else ""
                notes.append(f"{r.ns_per_key:.1f}{ratio}")
    for op, _ in phase_ops:
        r = rows[(op, DC)]
        labels.append(op.replace("phase_", "phase:\n"))
        values.append(r.ns_per_key)
        cols.append("#ff9896")
        notes.append(f"{r.ns_per_key:.1f}")
    xs = list(range(len(values)))
    ax2.bar(xs, values, 0.7, color=cols)
    for x, y, note in zip(xs, values, notes, strict=True):
        ax2.text(x, y, note, ha="center", va="bottom", fontsize=8)
    if values:
        ax2.set_ylim(top=max(values) * 1.15)
    ax2.set_xticks(xs)
    ax2.set_xticklabels(labels, fontsize=8, rotation=45, ha="right")
    ax2.set_ylabel("ns per key")
    ax2.set_title(
        f"dedupcore: {cfg.get('big', 0):,} pre-hashed uint64\nvs numpy gather; "
        f"phases at N={cfg.get('n', 0):,}",
        fontsize=10,
    )
    ax2.grid(axis="y", alpha=0.3)
    ax2.set_axisbelow(True)
    if big_ops and phase_ops:
        ax2.axvline(
            sum(1 for op, _ in big_ops for lib in (DC, GATHER) if (op, lib) in rows) - 0.5,
            color="black",
            lw=0.8,
            ls="--",
        )

    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
