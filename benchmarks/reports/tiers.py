"""The shared tiers' report (``python -m benchmarks.report tiers``): tables, targets, spread.

Figures use each benchmark's median round (the fastest is shown beside it);
"ratio" is the peer's time over dedupcore's on the same keys in the same run,
so above 1.0 means dedupcore is faster. Given several JSONs (repeated runs),
it prints each run and then the spread of every ratio over the runs; the
verdicts of the spread table use the median run.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.reporting import (
    Out,
    Row,
    Run,
    Verdict,
    fmt_ns,
    fmt_rate,
    fmt_x,
)

# (operation, dedupcore library, peer library, target ratio or None, what)
COMPARISONS: list[tuple[str, str, str, float | None, str]] = [
    (
        "tier_redis_fresh",
        "dedupcore-redis",
        "redis-pipelined",
        3.0,
        "Redis authority, claim_many fresh keys vs redis-py pipelined SET NX PX",
    ),
    (
        "tier_redis_duplicate",
        "dedupcore-redis",
        "redis-pipelined",
        None,
        "Redis authority, all-DUPLICATE batches vs pipelined SET NX PX on existing keys",
    ),
    (
        "tier_postgresql_fresh",
        "dedupcore-postgresql",
        "postgresql-executemany",
        2.0,
        "PostgreSQL authority, claim_many fresh keys vs executemany INSERT .. ON CONFLICT DO "
        "NOTHING + commit per batch",
    ),
    (
        "tier_postgresql_duplicate",
        "dedupcore-postgresql",
        "postgresql-executemany",
        5.0,
        "PostgreSQL authority, all-DUPLICATE batches vs the same executemany on the same "
        "(existing) keys",
    ),
    (
        "tier_mariadb_fresh",
        "dedupcore-mariadb",
        "mariadb-executemany",
        None,
        "MariaDB authority, fresh keys vs executemany INSERT .. ON DUPLICATE KEY UPDATE",
    ),
    (
        "tier_mariadb_duplicate",
        "dedupcore-mariadb",
        "mariadb-executemany",
        None,
        "MariaDB authority, all-DUPLICATE batches vs the same executemany",
    ),
    (
        "tier_sqlite_fresh",
        "dedupcore-sqlite",
        "sqlite-executemany",
        None,
        "SQLite authority, fresh keys vs executemany INSERT .. ON CONFLICT DO NOTHING",
    ),
    (
        "tier_sqlite_duplicate",
        "dedupcore-sqlite",
        "sqlite-executemany",
        None,
        "SQLite authority, all-DUPLICATE batches vs the same executemany",
    ),
]
TITLES = {
    "tier_redis_fresh": "Redis: claim_many of N fresh keys",
    "tier_redis_duplicate": "Redis: the same N keys again (claimed and completed: DUPLICATE)",
    "tier_postgresql_fresh": "PostgreSQL: claim_many of N fresh keys (table emptied per round)",
    "tier_postgresql_duplicate": "PostgreSQL: the same N keys again (completed: DUPLICATE)",
    "tier_mariadb_fresh": "MariaDB: claim_many of N fresh keys",
    "tier_mariadb_duplicate": "MariaDB: the same N keys again (DUPLICATE)",
    "tier_sqlite_fresh": "SQLite: claim_many of N fresh keys",
    "tier_sqlite_duplicate": "SQLite: the same N keys again (DUPLICATE)",
}


def keep(operation: str) -> bool:
    """The operations of benchmarks/test_tiers.py."""
    return operation.startswith("tier_")


def finish(out: Out, runs: list[Run], png: Path | None) -> None:
    """Given several runs, the spread of each ratio over them."""
    if len(runs) > 1:
        print_spread(out, [(run.path, run.rows) for run in runs])


def median_ns(r: Row) -> float:
    """ns/key of the median round (report.load's ns_per_key is the fastest round)."""
    return r.ns_per_key_median


def ratio(rows: dict[tuple[str, str], Row], op: str, dc: str, peer: str) -> float | None:
    a, b = rows.get((op, dc)), rows.get((op, peer))
    if a is None or b is None:
        return None
    return median_ns(b) / median_ns(a)


def _peer_of(op: str, lib: str) -> str | None:
    for o, dc, peer, _, _ in COMPARISONS:
        if o == op and (lib == dc or lib.startswith("dedupcore-alt-")):
            return peer
    return None


def print_run(out: Out, run: Run) -> None:
    rows = run.rows
    cfg = run.config("tier_bench")
    out.heading(
        f"{run.path.name}: N={cfg.get('n', 0):,} 16-byte keys, batches of "
        f"{cfg.get('batch', 0):,}, {cfg.get('rounds', '?')} rounds after "
        f"{cfg.get('warmup', '?')} warm-up" + (" (QUICK)" if cfg.get("quick") else "")
    )
    servers = {
        r.extra["server"]: r.extra.get("server_settings")
        for r in rows.values()
        if "server" in r.extra
    }
    for server, settings in servers.items():
        out.line(f"{server}: {settings}")
    for op, title in TITLES.items():
        libs = sorted(lib for (o, lib) in rows if o == op)
        if not libs:
            continue
        table = []
        for lib in libs:
            r = rows[(op, lib)]
            peer = _peer_of(op, lib)
            x = ratio(rows, op, lib, peer) if peer else None
            server = r.extra.get("server_ns_per_key")
            table.append(
                [
                    lib,
                    fmt_rate(1e9 / median_ns(r)),
                    fmt_ns(median_ns(r)),
                    fmt_ns(r.ns_per_key),
                    fmt_ns(server) if server is not None else "",
                    fmt_x(x),
                ]
            )
        first = rows[(op, libs[0])]
        out.table(
            f"{op}: {title} ({first.n_keys:,} keys, {first.rounds} rounds)",
            ["library", "keys/s", "ns/key", "fastest ns/key", "server ns/key", "ratio vs peer"],
            table,
            [False, True, True, True, True, True],
        )
    single = {lib: r for (o, lib), r in rows.items() if o == "tier_redis_single"}
    if single:
        rtt = single.get("redis-single")
        table = []
        for lib in sorted(single):
            e = single[lib].extra
            table.append(
                [
                    lib,
                    fmt_ns(e["p50_ns"]),
                    fmt_ns(e["p90_ns"]),
                    fmt_ns(e["p99_ns"]),
                    fmt_ns(e["mean_ns"]),
                    fmt_x(e["p50_ns"] / rtt.extra["p50_ns"]) if rtt else "-",
                ]
            )
        first = next(iter(single.values())).extra
        out.table(
            f"tier_redis_single: one key per call ({first['calls']:,} calls after "
            f"{first.get('warmup', 0)} warm-up calls)",
            ["library", "p50", "p90", "p99", "mean", "p50 / SET NX p50"],
            table,
            [False, True, True, True, True, True],
        )
    calls = {lib: r.call for (_, lib), r in rows.items()}
    out.line("calls (B = batch size):")
    for lib in sorted(calls):
        out.line(f"  {lib:<28} {calls[lib]}")


def evaluate(run: Run) -> list[Verdict]:
    rows = run.rows
    verdicts = []
    for op, dc, peer, target, what in COMPARISONS:
        a, b = rows.get((op, dc)), rows.get((op, peer))
        if a is None or b is None:
            if target is not None:
                verdicts.append(Verdict(None, f"{what}: not measured"))
            continue
        x = median_ns(b) / median_ns(a)
        x_min = b.ns_per_key / a.ns_per_key
        n = a.extra.get("tier_bench", {}).get("n", a.n_keys)
        text = (
            f"{what}: dedupcore {fmt_rate(1e9 / median_ns(a))} ({fmt_ns(median_ns(a))}/key) vs "
            f"{peer} {fmt_rate(1e9 / median_ns(b))} ({fmt_ns(median_ns(b))}/key) = {x:.2f}x "
            f"(fastest rounds {x_min:.2f}x)"
        )
        if op == "tier_postgresql_duplicate":
            fresh = rows.get(("tier_postgresql_fresh", peer))
            if fresh is not None:
                text += (
                    f"; vs the baseline on fresh batches ({fmt_ns(median_ns(fresh))}/key): "
                    f"{median_ns(fresh) / median_ns(a):.2f}x"
                )
        if target is None:
            text += f" [reference, no target; N={n:,}]"
            verdicts.append(Verdict(None, text))
        else:
            verdicts.append(Verdict(x >= target, text + f"; target >= {target:g}x [N={n:,}]"))
        for (o, lib), alt in rows.items():
            if o == op and lib.startswith("dedupcore-alt-"):
                y = median_ns(b) / median_ns(alt)
                verdicts.append(
                    Verdict(
                        None if target is None else y >= target,
                        f"  {lib} (alternative code, same run): {fmt_ns(median_ns(alt))}/key "
                        f"= {y:.2f}x the peer, {median_ns(a) / median_ns(alt):.2f}x "
                        "the current code",
                    )
                )
    return verdicts


def print_spread(out: Out, runs: list[tuple[Path, dict[tuple[str, str], Row]]]) -> None:
    out.heading(f"spread over {len(runs)} runs (ratio = peer median / dedupcore median)")
    table = []
    for op, _dc, peer, target, _ in COMPARISONS:
        libs = sorted(
            {lib for _, rows in runs for (o, lib) in rows if o == op and lib.startswith("dedup")}
        )
        for lib in libs:
            xs = [ratio(rows, op, lib, peer) for _, rows in runs]
            got = [x for x in xs if x is not None]
            if not got:
                continue
            dc_ns = [median_ns(rows[(op, lib)]) for _, rows in runs if (op, lib) in rows]
            peer_ns = [median_ns(rows[(op, peer)]) for _, rows in runs if (op, peer) in rows]
            mid = statistics.median(got)
            verdict = "" if target is None else ("MET" if mid >= target else "MISSED")
            table.append(
                [
                    op.removeprefix("tier_"),
                    lib,
                    " ".join(fmt_x(x) for x in xs),
                    f"{min(got):.2f} .. {max(got):.2f}",
                    fmt_x(mid),
                    f"{fmt_ns(min(dc_ns))} .. {fmt_ns(max(dc_ns))}",
                    f"{fmt_ns(min(peer_ns))} .. {fmt_ns(max(peer_ns))}" if peer_ns else "-",
                    "-" if target is None else f">= {target:g}x",
                    verdict,
                ]
            )
    out.table(
        "ratios per run, their range and median; dedupcore's and the peer's median ns/key range",
        [
            "operation",
            "library",
            "ratio per run",
            "range",
            "median",
            "dedupcore ns/key",
            "peer ns/key",
            "target",
            "verdict",
        ],
        table,
        [False, False, False, True, True, True, True, True, False],
    )
