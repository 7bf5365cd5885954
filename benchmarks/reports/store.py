"""The embedded store's report (``python -m benchmarks.report store``): tables and targets.

Throughput figures use each benchmark's fastest round (the least disturbed one
on a shared machine; the median is shown next to it); "speed-up" is the peer's
time over dedupcore's on the same keys in the same run, so above 1.0 means
dedupcore is faster. Latencies are percentiles of individually timed single
calls.
"""

from __future__ import annotations

from typing import Any

from benchmarks.reporting import (
    Out,
    Row,
    Run,
    Verdict,
    fmt_ns,
    fmt_rate,
    fmt_x,
    order_key,
    size_note,
)

DC = "dedupcore"
REDIS = "redis-pipelined"
SQLITE_DURABLE = "sqlite-wal-full"
SQLITE_NORMAL = "sqlite-wal-normal"
OPS = [
    ("store_claim_many_fresh", "claim_many of N fresh keys"),
    ("store_claim_many_duplicate", "claim_many of the same N keys again (all DUPLICATE)"),
    ("store_complete_many", "complete_many of N claimed keys (redis: pipelined SET XX)"),
    ("store_sustained", "sustained: BIG fresh keys, one round, checkpoints during the run"),
]
LIB_ORDER = [
    DC,
    "dedupcore-in-memory",
    "dedupcore-durable",
    "dedupcore-power-loss-unsafe",
    REDIS,
    "redis-single",
    SQLITE_DURABLE,
    SQLITE_NORMAL,
    "sqlite-wal-full-returning",
]

TARGET_N = 1_000_000
TARGET_BIG = 10_000_000
TARGET_FRESH_VS_REDIS = 10.0
TARGET_FRESH_VS_SQLITE = 3.0
TARGET_DUP_VS_REDIS = 20.0
TARGET_COMPLETE_VS_REDIS = 10.0
TARGET_SUSTAINED_VS_REDIS = 3.0
TARGET_UNSAFE_VS_RTT = 0.1
TARGET_LMDB_BYTES = 100.0
TARGET_FRONT_BYTES = 2.5


lib_key = order_key(LIB_ORDER)


def keep(operation: str) -> bool:
    """The operations of benchmarks/test_store.py."""
    return operation.startswith("store_")


def print_run(out: Out, run: Run) -> None:
    print_tables(out, run.rows, run.config("store_bench"))


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    if b >= 1 << 20:
        return f"{b / (1 << 20):,.1f} MiB"
    if b >= 1 << 10:
        return f"{b / (1 << 10):,.1f} KiB"
    return f"{b:,.0f} B"


def fmt_per_key(b: float | None) -> str:
    return "-" if b is None else f"{b:,.2f}"


def speedup(rows: dict[tuple[str, str], Row], op: str, peer: str) -> tuple[float, float] | None:
    """(peer/dedupcore on fastest rounds, on medians) or None."""
    dc, p = rows.get((op, DC)), rows.get((op, peer))
    if dc is None or p is None:
        return None
    return p.ns_per_key / dc.ns_per_key, p.ns_per_key_median / dc.ns_per_key_median


# ---------------------------------------------------------------- tables --


def print_tables(out: Out, rows: dict[tuple[str, str], Row], cfg: dict[str, Any]) -> None:
    out.heading(
        f"dedupcore embedded store benchmarks: N={cfg.get('n', 0):,}, BIG={cfg.get('big', 0):,} "
        f"16-byte keys, batches of {cfg.get('batch', 0):,}, {cfg.get('rounds', '?')} rounds "
        f"(sustained: 1), {cfg.get('single', 0):,} single calls"
    )
    out.line(
        "claims/s and ns/key: fastest round (median beside it); speed-up = peer time / "
        "dedupcore time on the same keys in the same run (above 1 = dedupcore faster)."
    )
    headers = ["library", "claims/s", "ns/key", "median ns/key", "speed-up", "(medians)"]
    right = [False, True, True, True, True, True]
    calls: dict[str, str] = {}
    for op, title in OPS:
        libs = sorted((lib for (o, lib) in rows if o == op), key=lib_key)
        if not libs:
            continue
        table_rows = []
        for lib in libs:
            r = rows[(op, lib)]
            calls.setdefault(lib, r.call)
            s = speedup(rows, op, lib) if lib != DC else None
            table_rows.append(
                [
                    lib,
                    fmt_rate(1e9 / r.ns_per_key),
                    fmt_ns(r.ns_per_key),
                    fmt_ns(r.ns_per_key_median),
                    fmt_x(s[0]) if s else "",
                    fmt_x(s[1]) if s else "",
                ]
            )
        first = rows[(op, libs[0])]
        out.table(
            f"{op}: {title} ({first.n_keys:,} keys, {first.rounds} round(s))",
            headers,
            table_rows,
            right,
        )
        if op == "store_sustained":
            for lib in libs:
                e = rows[(op, lib)].extra
                tenths = e.get("tenths_claims_per_s") or []
                if tenths:
                    out.line(
                        f"  {lib}: claims/s per tenth of the run: "
                        + ", ".join(f"{t / 1000:,.0f}k" for t in tenths)
                    )
                if "checkpoints_during_run" in e:
                    out.line(
                        f"  {lib}: {e['checkpoints_during_run']} checkpoints during the run "
                        f"({e['checkpoint_seconds_during_run']:.1f} s of checkpoint work in "
                        f"the background thread), {e['recent_records_at_end']:,} records still "
                        f"in memory at the end (final checkpoint {e['final_checkpoint_s']:.1f} s, "
                        "untimed)"
                    )

    lat = {lib: r for (o, lib), r in rows.items() if o == "store_claim_latency"}
    if lat:
        rtt = lat.get("redis-single")
        table_rows = []
        for lib in sorted(lat, key=lib_key):
            e = lat[lib].extra
            ratio = e["p50_ns"] / rtt.extra["p50_ns"] if rtt else None
            table_rows.append(
                [
                    lib,
                    fmt_ns(e["p50_ns"]),
                    fmt_ns(e["p90_ns"]),
                    fmt_ns(e["p99_ns"]),
                    fmt_ns(e["p999_ns"]),
                    fmt_ns(e["mean_ns"]),
                    fmt_x(ratio),
                ]
            )
            calls.setdefault(lib, lat[lib].call)
        first = next(iter(lat.values()))
        out.table(
            f"store_claim_latency: one key per call, each call timed with perf_counter_ns "
            f"({first.extra['calls']:,} calls after {first.extra.get('warmup', 0):,} warm-up "
            "calls)",
            ["library", "p50", "p90", "p99", "p99.9", "mean", "p50 / redis p50"],
            table_rows,
            [False, True, True, True, True, True, True],
        )
    if calls:
        out.line("calls (B = batch size):")
        for lib in sorted(calls, key=lib_key):
            out.line(f"  {lib:<28} {calls[lib]}")

    table_rows = []
    for op, what in (("store_claim_many_fresh", "N"), ("store_sustained", "BIG")):
        r = rows.get((op, DC))
        if r is None or "lmdb_disk_bytes" not in r.extra:
            continue
        e = r.extra
        table_rows.append(
            [
                f"dedupcore after {op.removeprefix('store_')} ({what})",
                f"{e['footprint_keys']:,}",
                fmt_bytes(e["lmdb_disk_bytes"]),
                fmt_per_key(e["lmdb_bytes_per_key"]),
                fmt_bytes(e["front_nbytes"]),
                fmt_per_key(e["front_bytes_per_key"]),
                f"{e['front_estimated_fpr']:.4f}",
                fmt_bytes(e.get("store_dir_allocated_bytes")),
            ]
        )
    peers = [
        (REDIS, "redis_bytes_per_key", "used_memory delta, RAM"),
        (SQLITE_DURABLE, "sqlite_bytes_per_key", "db + wal files"),
    ]
    for lib, field, note in peers:
        r = rows.get(("store_claim_many_fresh", lib))
        if r is not None and field in r.extra:
            table_rows.append(
                [
                    f"{lib} after claim_many_fresh (N) — {note}",
                    f"{r.n_keys:,}",
                    fmt_bytes(r.extra[field] * r.n_keys),
                    fmt_per_key(r.extra[field]),
                    "-",
                    "-",
                    "-",
                    "-",
                ]
            )
    if table_rows:
        out.table(
            "footprint (dedupcore: after a checkpoint, stats()['lmdb']['disk_bytes'] and "
            "stats()['front']['nbytes'])",
            [
                "store",
                "keys",
                "LMDB / data",
                "bytes/key",
                "front",
                "front bytes/key",
                "front est. FPR",
                "whole dir on disk",
            ],
            table_rows,
            [False, True, True, True, True, True, True, True],
        )


# -------------------------------------------------------------- verdicts --


def _ratio_verdict(
    rows: dict[tuple[str, str], Row],
    op: str,
    peer: str,
    target: float,
    what: str,
    note: str,
) -> Verdict:
    s = speedup(rows, op, peer)
    if s is None:
        return Verdict(None, f"{what}: not measured")
    dc, p = rows[(op, DC)], rows[(op, peer)]
    dc_rate = 1e9 / dc.ns_per_key
    p_rate = 1e9 / p.ns_per_key
    return Verdict(
        s[0] >= target,
        f"{what}: dedupcore {dc_rate:,.0f} claims/s ({fmt_ns(dc.ns_per_key)}/key) vs {peer} "
        f"{p_rate:,.0f}/s ({fmt_ns(p.ns_per_key)}/key) = {s[0]:.2f}x "
        f"(medians {s[1]:.2f}x; target >= {target:g}x){note}",
    )


def evaluate(run: Run) -> list[Verdict]:
    rows, cfg = run.rows, run.config("store_bench")
    verdicts: list[Verdict] = []
    n_note = size_note(cfg.get("n"), TARGET_N, "N")
    big_note = size_note(cfg.get("big"), TARGET_BIG, "BIG")
    fresh, dup = "store_claim_many_fresh", "store_claim_many_duplicate"
    verdicts.append(
        _ratio_verdict(
            rows,
            fresh,
            REDIS,
            TARGET_FRESH_VS_REDIS,
            "claim_many fresh vs redis-py pipelined SET NX PX",
            n_note,
        )
    )
    verdicts.append(
        _ratio_verdict(
            rows,
            fresh,
            SQLITE_DURABLE,
            TARGET_FRESH_VS_SQLITE,
            "claim_many fresh vs SQLite INSERT OR IGNORE (WAL, synchronous=FULL: durable)",
            n_note,
        )
    )
    verdicts.append(
        _ratio_verdict(
            rows,
            fresh,
            SQLITE_NORMAL,
            TARGET_FRESH_VS_SQLITE,
            "claim_many fresh vs SQLite INSERT OR IGNORE (WAL, synchronous=NORMAL: "
            "not power-loss durable)",
            n_note,
        )
    )
    verdicts.append(
        _ratio_verdict(
            rows,
            "store_complete_many",
            REDIS,
            TARGET_COMPLETE_VS_REDIS,
            "complete_many vs redis-py pipelined SET XX PX",
            n_note,
        )
    )
    v = _ratio_verdict(
        rows,
        dup,
        REDIS,
        TARGET_DUP_VS_REDIS,
        "claim_many all-DUPLICATE (records checkpointed into LMDB) vs redis-py pipelined",
        n_note,
    )
    mem, redis = rows.get((dup, "dedupcore-in-memory")), rows.get((dup, REDIS))
    if v.met is not None and mem and redis:
        v.text += (
            f"; with the records still in memory: {redis.ns_per_key / mem.ns_per_key:.2f}x "
            f"({fmt_ns(mem.ns_per_key)}/key)"
        )
    verdicts.append(v)
    verdicts.append(
        _ratio_verdict(
            rows,
            "store_sustained",
            REDIS,
            TARGET_SUSTAINED_VS_REDIS,
            "sustained fresh keys, one round, durable, checkpoints during the run, vs redis-py "
            f"pipelined (BIG={cfg.get('big', 0):,})",
            big_note,
        )
    )

    lat = {lib: r.extra for (o, lib), r in rows.items() if o == "store_claim_latency"}
    rtt = lat.get("redis-single")
    for lib, factor, what in (
        ("dedupcore-durable", 1.0, "one durable claim p50 <= one redis-py SET NX round trip p50"),
        (
            "dedupcore-power-loss-unsafe",
            TARGET_UNSAFE_VS_RTT,
            f"one power-loss-unsafe claim p50 <= {TARGET_UNSAFE_VS_RTT:g}x the round trip p50",
        ),
    ):
        e = lat.get(lib)
        if e is None or rtt is None:
            verdicts.append(Verdict(None, f"{what}: not measured"))
            continue
        limit = rtt["p50_ns"] * factor
        verdicts.append(
            Verdict(
                e["p50_ns"] <= limit,
                f"{what}: {fmt_ns(e['p50_ns'])} (p99 {fmt_ns(e['p99_ns'])}) vs limit "
                f"{fmt_ns(limit)} (redis p50 {fmt_ns(rtt['p50_ns'])}, p99 "
                f"{fmt_ns(rtt['p99_ns'])}) = {e['p50_ns'] / rtt['p50_ns']:.3f}x the round trip",
            )
        )

    fp = rows.get(("store_sustained", DC))
    fp_note = big_note
    if fp is None or "lmdb_disk_bytes" not in fp.extra:
        fp = rows.get(("store_claim_many_fresh", DC))
        fp_note = size_note(fp.n_keys if fp else None, TARGET_BIG, "keys")
    if fp is None or "lmdb_disk_bytes" not in fp.extra:
        verdicts.append(Verdict(None, "LMDB bytes/key: not measured"))
        verdicts.append(Verdict(None, "front bytes/key: not measured"))
    else:
        e = fp.extra
        verdicts.append(
            Verdict(
                e["lmdb_bytes_per_key"] <= TARGET_LMDB_BYTES,
                f"LMDB on disk {e['lmdb_bytes_per_key']:.1f} bytes/key <= {TARGET_LMDB_BYTES:g} "
                f"({e['lmdb_disk_bytes']:,} bytes for {e['lmdb_records']:,} records){fp_note}",
            )
        )
        verdicts.append(
            Verdict(
                e["front_bytes_per_key"] <= TARGET_FRONT_BYTES,
                f"front filter {e['front_bytes_per_key']:.2f} bytes/key <= "
                f"{TARGET_FRONT_BYTES:g} ({e['front_nbytes']:,} bytes, {e['front_slices']} "
                f"slice(s), for {e['footprint_keys']:,} keys){fp_note}",
            )
        )
    return verdicts
