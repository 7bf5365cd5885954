"""The daemon's report (``python -m benchmarks.report daemon``): tables, comparisons, targets.

Throughput uses each benchmark's fastest round (the
least disturbed one on a shared machine), with the median next to it;
latencies are percentiles over every timed call of every round. The targets
(the reasons behind the design are in docs/architecture.md, "Performance"):

- ``claim_many`` through the daemon, batches of 1000: >= 10x the keys/s of
  redis-py pipelined ``SET NX PX``;
- one durable ``claim`` round trip: p50 <= one redis-py ``SET NX`` p50 against
  a Redis with ``appendfsync always`` (both wait for the disk); in
  ``power-loss-unsafe`` mode p50 <= 0.7x a ``SET NX`` against the default
  Redis (no fsync either);
- a claim+complete pair: p50 <= the same two Redis commands at the same
  durability;
- 8 client processes at once, each doing single claims (one durable claim per
  round trip): aggregate keys/s >= 4x one client, with no errors (the same with
  batches of 1000 is shown beside it);
- one claim while four other clients send 100k-key batches: p99 <= 5 ms.
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
    fmt_us,
    fmt_x,
)

OPERATIONS = {
    "concurrent_single",
    "claim_many",
    "claim_latency",
    "latency_under_batches",
    "concurrent_clients",
    "protocol_codec",
}

TARGET_BATCH_VS_REDIS = 10.0
TARGET_CLIENTS = 8
TARGET_CLIENTS_SPEEDUP = 4.0
TARGET_UNSAFE_VS_REDIS = 0.7
TARGET_PAIR_VS_REDIS = 1.0
TARGET_P99_UNDER_BATCHES_US = 5000.0

#: Each latency row's Redis peer at the same durability.
LATENCY_PEERS = {
    "dedupcore-daemon-single": "redis-single-always",
    "dedupcore-daemon-single-unsafe": "redis-single",
    "dedupcore-in-process-single": "redis-single-always",
    "redis-single-always": "redis-single-always",
    "redis-single": "redis-single",
    "dedupcore-daemon-pair": "redis-pair-always",
    "dedupcore-daemon-pair-unsafe": "redis-pair",
    "redis-pair-always": "redis-pair-always",
    "redis-pair": "redis-pair",
    "dedupcore-aio-single-unsafe": "redis-aio-single",
    "redis-aio-single": "redis-aio-single",
}
DEFAULT_N = 200_000


def keep(operation: str) -> bool:
    """The operations of benchmarks/test_daemon.py."""
    return operation in OPERATIONS


def print_run(out: Out, run: Run) -> None:
    """The tables, then one line per comparison."""
    print_tables(out, run.rows)
    out.heading("comparisons")
    for line in comparisons(run.rows):
        out.line(line)


def _cfg(rows: dict[tuple[str, str], Row]) -> dict[str, Any]:
    for r in rows.values():
        if "daemon_bench" in r.extra:
            return dict(r.extra["daemon_bench"])
    return {}


def _clients_rows(
    rows: dict[tuple[str, str], Row], operation: str = "concurrent_clients"
) -> list[Row]:
    return sorted(
        (r for (op, _), r in rows.items() if op == operation),
        key=lambda r: int(r.extra.get("procs", 0)),
    )


def print_tables(out: Out, rows: dict[tuple[str, str], Row]) -> None:
    cfg = _cfg(rows)
    out.heading(
        f"dedupcore daemon benchmarks: N={cfg.get('n', '?'):,} fresh 16-byte keys, batches of "
        f"{cfg.get('batch', '?')}, {cfg.get('single', '?'):,} single calls x "
        f"{cfg.get('rounds', '?')} rounds"
    )

    # claim_many --------------------------------------------------------------
    redis = rows.get(("claim_many", "redis-pipelined"))
    table = []
    for lib in ("dedupcore-daemon", "dedupcore-in-process", "redis-pipelined"):
        r = rows.get(("claim_many", lib))
        if r is None:
            continue
        table.append(
            [
                lib,
                fmt_rate(r.keys_per_s),
                fmt_rate(r.keys_per_s_median),
                fmt_ns(r.ns_per_key),
                fmt_x(redis.ns_per_key / r.ns_per_key if redis else None),
                f"{r.n_keys:,}",
                str(r.extra.get("call", "")),
            ]
        )
    if table:
        out.table(
            f"claim_many: fresh keys in batches of {cfg.get('batch', '?')} (fastest of "
            f"{table and rows[('claim_many', table[0][0])].rounds} rounds)",
            ["library", "keys/s", "median", "ns/key", "keys/s vs redis", "keys", "call"],
            table,
            [False, True, True, True, True, True, False],
        )

    # latency ---------------------------------------------------------------------
    table = []
    calls = []
    for lib, peer in LATENCY_PEERS.items():
        r = rows.get(("claim_latency", lib))
        if r is None:
            continue
        calls.append(lib)
        # Compared with the same Redis command(s) at the same durability.
        redis_l = rows.get(("claim_latency", peer))
        x = r.extra
        table.append(
            [
                lib,
                fmt_us(x.get("p50_us")),
                fmt_us(x.get("p90_us")),
                fmt_us(x.get("p99_us")),
                fmt_us(x.get("p999_us")),
                fmt_us(x.get("mean_us")),
                fmt_x(x["p50_us"] / redis_l.extra["p50_us"] if redis_l else None),
                ", ".join(f"{v:,.0f}" for v in x.get("p50_us_per_round", [])),
                f"{x.get('calls', 0):,}",
            ]
        )
    if table:
        out.table(
            "one claim (or claim+complete pair) per call: round-trip latency over every "
            "timed call of every round",
            [
                "library",
                "p50",
                "p90",
                "p99",
                "p99.9",
                "mean",
                "p50 vs redis (same durability)",
                "p50/round (µs)",
                "calls",
            ],
            table,
            [False, True, True, True, True, True, True, True, True],
        )
        for lib in calls:
            out.line(f"  {lib}: {rows[('claim_latency', lib)].extra.get('call', '')}")

    table = []
    loaded = rows.get(("latency_under_batches", "under-batches-dedupcore"))
    load_batch = f"{loaded.extra.get('load_batch', 100_000):,}" if loaded else "100,000"
    for lib in ("under-batches-dedupcore", "under-batches-redis-always"):
        r = rows.get(("latency_under_batches", lib))
        if r is None:
            continue
        x = r.extra
        table.append(
            [
                lib,
                fmt_us(x.get("p50_us")),
                fmt_us(x.get("p99_us")),
                fmt_us(x.get("p999_us")),
                fmt_us(x.get("max_us")),
                ", ".join(f"{v:,.0f}" for v in x.get("p99_us_per_round", [])),
                f"{x.get('load_batches', 0):,}",
                str(x.get("call", "")),
            ]
        )
    if table:
        out.table(
            f"one claim at a time while 4 other clients send batches of {load_batch} keys",
            ["library", "p50", "p99", "p99.9", "max", "p99/round (µs)", "batches", "call"],
            table,
            [False, True, True, True, True, True, True, False],
        )

    # concurrency ---------------------------------------------------------------
    crows = _clients_rows(rows)
    one = next((r for r in crows if r.extra.get("procs") == 1), None)
    table = []
    for r in crows:
        x = r.extra
        table.append(
            [
                str(x.get("procs")),
                fmt_rate(r.keys_per_s),
                fmt_rate(r.keys_per_s_median),
                fmt_rate(x.get("child_span_keys_per_s")),
                fmt_x(r.keys_per_s / one.keys_per_s if one else None),
                fmt_x(r.keys_per_s_median / one.keys_per_s_median if one else None),
                str(x.get("errors", "?")),
                fmt_ns(x.get("daemon_cpu_event_loop_ns_per_key")),
                fmt_ns(x.get("daemon_cpu_other_threads_ns_per_key")),
                f"{x.get('daemon_requests', 0) / max(1, r.rounds):,.0f}",
            ]
        )
    if table:
        out.table(
            "client processes at once (spawned, one barrier, each its own slice; same N total)",
            [
                "clients",
                "keys/s",
                "median",
                "children's span",
                "vs 1 (best)",
                "vs 1 (median)",
                "errors",
                "daemon CPU: loop",
                "daemon CPU: other",
                "requests/round",
            ],
            table,
            [False, True, True, True, True, True, True, True, True, True],
        )
        out.line(
            "keys/s: N over the time from releasing the barrier to the last child's report; "
            "children's span: N over first start to last end on the children's clocks. "
            "daemon CPU per key from /proc: the event-loop thread vs all other threads "
            "(the commit thread, background checkpoints; the worker pool for other stores)."
        )

    # where the time goes -------------------------------------------------------
    daemon = rows.get(("claim_many", "dedupcore-daemon"))
    inproc = rows.get(("claim_many", "dedupcore-in-process"))
    c_cli = rows.get(("protocol_codec", "codec-client"))
    c_dmn = rows.get(("protocol_codec", "codec-daemon"))
    if daemon:
        table = []
        total = daemon.ns_per_key
        parts = [
            ("in-process DedupStore.claim_many", inproc, "the store's own work incl. fdatasync"),
            ("protocol codec, daemon side", c_dmn, "decode_request, columns, encode_response"),
            ("protocol codec, client side", c_cli, "claim_frame, decode_response, Claims"),
        ]
        known = 0.0
        for name, r, what in parts:
            if r is None:
                continue
            known += r.ns_per_key
            table.append([name, fmt_ns(r.ns_per_key), f"{r.ns_per_key / total:.0%}", what])
        rest = total - known
        table.append(
            [
                "rest: socket, event loop, commit thread",
                fmt_ns(rest),
                f"{rest / total:.0%}",
                "daemon end-to-end minus the rows above (negative: overlap across processes)",
            ]
        )
        table.append(["daemon end-to-end (sync Client)", fmt_ns(total), "100%", ""])
        x = daemon.extra
        if "daemon_cpu_ns_per_key" in x:
            table.append(
                [
                    "  daemon CPU, event-loop thread",
                    fmt_ns(x["daemon_cpu_event_loop_ns_per_key"]),
                    f"{x['daemon_cpu_event_loop_ns_per_key'] / total:.0%}",
                    "from /proc (10 ms ticks); frames, the store's decision, columns, replies",
                ]
            )
            table.append(
                [
                    "  daemon CPU, other threads",
                    fmt_ns(x["daemon_cpu_other_threads_ns_per_key"]),
                    f"{x['daemon_cpu_other_threads_ns_per_key'] / total:.0%}",
                    "commit thread (fdatasync), background checkpoints; other stores: worker pool",
                ]
            )
            table.append(
                [
                    "  daemon request time",
                    fmt_ns(x["daemon_request_ns_per_key"]),
                    f"{x['daemon_request_ns_per_key'] / total:.0%}",
                    "the daemon's own request_seconds (decision and wait for the commit)",
                ]
            )
        out.table(
            "where the daemon's claim_many time goes "
            f"(per key, batches of {cfg.get('batch', '?')})",
            ["part", "ns/key", "share", "what"],
            table,
            [False, True, True, False],
        )
        ds = rows.get(("claim_latency", "dedupcore-daemon-single"))
        ins = rows.get(("claim_latency", "dedupcore-in-process-single"))
        if ds and ins:
            gap = ds.extra["p50_us"] - ins.extra["p50_us"]
            out.line(
                f"one claim: daemon p50 {fmt_us(ds.extra['p50_us'])} - in-process store.claim p50 "
                f"{fmt_us(ins.extra['p50_us'])} = {fmt_us(gap)}"
                f" per round trip for the socket, the protocol, the event loop and the thread "
                f"hop; daemon CPU per single claim: event loop "
                f"{fmt_us(ds.extra.get('daemon_cpu_event_loop_ns_per_key', 0) / 1000)}, other "
                f"threads {fmt_us(ds.extra.get('daemon_cpu_other_threads_ns_per_key', 0) / 1000)}."
            )
        du = rows.get(("claim_latency", "dedupcore-daemon-single-unsafe"))
        if ds and du:
            out.line(
                f"without fdatasync (serve --durability power-loss-unsafe) the daemon's p50 is "
                f"{fmt_us(du.extra['p50_us'])}: the durable commit costs "
                f"{fmt_us(ds.extra['p50_us'] - du.extra['p50_us'])} of the "
                f"{fmt_us(ds.extra['p50_us'])}."
            )


# -------------------------------------------------------------- verdicts --


def evaluate(run: Run) -> list[Verdict]:
    rows = run.rows
    cfg = _cfg(rows)
    n = cfg.get("n")
    note = "" if n in (None, DEFAULT_N) else f"  [run at N={n:,}; the default is {DEFAULT_N:,}]"
    verdicts: list[Verdict] = []

    d, r = rows.get(("claim_many", "dedupcore-daemon")), rows.get(("claim_many", "redis-pipelined"))
    if d and r:
        ratio = d.keys_per_s / r.keys_per_s
        median = d.keys_per_s_median / r.keys_per_s_median
        verdicts.append(
            Verdict(
                ratio >= TARGET_BATCH_VS_REDIS,
                f"claim_many through the daemon {fmt_rate(d.keys_per_s)} "
                f"({fmt_ns(d.ns_per_key)}/key) = {ratio:.2f}x redis-py pipelined SET NX PX "
                f"{fmt_rate(r.keys_per_s)} ({fmt_ns(r.ns_per_key)}/key); medians {median:.2f}x "
                f"(target >= {TARGET_BATCH_VS_REDIS:g}x){note}",
            )
        )
    else:
        verdicts.append(Verdict(None, "claim_many through the daemon vs redis: not measured"))

    for ours, what, target in (
        ("dedupcore-daemon-single", "one durable claim", 1.0),
        ("dedupcore-daemon-single-unsafe", "one power-loss-unsafe claim", TARGET_UNSAFE_VS_REDIS),
        ("dedupcore-daemon-pair", "durable claim+complete pair", TARGET_PAIR_VS_REDIS),
        ("dedupcore-daemon-pair-unsafe", "power-loss-unsafe pair", TARGET_PAIR_VS_REDIS),
    ):
        peer = LATENCY_PEERS[ours]
        d, r = rows.get(("claim_latency", ours)), rows.get(("claim_latency", peer))
        if d and r:
            dp, rp = d.extra["p50_us"], r.extra["p50_us"]
            verdicts.append(
                Verdict(
                    dp <= target * rp,
                    f"{what} p50 {fmt_us(dp)} (p99 {fmt_us(d.extra['p99_us'])}) vs {peer} "
                    f"p50 {fmt_us(rp)} (p99 {fmt_us(r.extra['p99_us'])}): "
                    f"{dp / rp:.2f}x (target <= {target:g}x)",
                )
            )
        else:
            verdicts.append(Verdict(None, f"{what} vs {peer}: not measured"))

    u = rows.get(("latency_under_batches", "under-batches-dedupcore"))
    if u:
        p99 = u.extra["p99_us"]
        verdicts.append(
            Verdict(
                p99 <= TARGET_P99_UNDER_BATCHES_US,
                f"one claim while 4 clients send {u.extra.get('load_batch', 100_000):,}-key "
                f"batches: p99 {fmt_us(p99)} "
                f"(p50 {fmt_us(u.extra['p50_us'])}; target p99 <= "
                f"{fmt_us(TARGET_P99_UNDER_BATCHES_US)})",
            )
        )
    else:
        verdicts.append(Verdict(None, "one claim under big batches: not measured"))

    crows = _clients_rows(rows, "concurrent_single")
    one = next((x for x in crows if x.extra.get("procs") == 1), None)
    many = max(crows, key=lambda x: int(x.extra.get("procs", 0)), default=None)
    if one and many and many is not one:
        procs = int(many.extra["procs"])
        errors = int(many.extra.get("errors", 0)) + int(one.extra.get("errors", 0))
        ratio = many.keys_per_s / one.keys_per_s
        median = many.keys_per_s_median / one.keys_per_s_median
        pnote = (
            ""
            if procs == TARGET_CLIENTS
            else f"  [run with {procs} clients, the target is for {TARGET_CLIENTS}]"
        )
        verdicts.append(
            Verdict(
                ratio >= TARGET_CLIENTS_SPEEDUP and errors == 0,
                f"{procs} client processes doing single claims {fmt_rate(many.keys_per_s)} = "
                f"{ratio:.2f}x one client "
                f"{fmt_rate(one.keys_per_s)}; medians {median:.2f}x; {errors} errors "
                f"(target >= {TARGET_CLIENTS_SPEEDUP:g}x, no errors){note}{pnote}",
            )
        )
    else:
        verdicts.append(Verdict(None, "many clients doing single claims vs one: not measured"))
    return verdicts


def comparisons(rows: dict[tuple[str, str], Row]) -> list[str]:
    """The daemon against Redis and against itself, one line each (fastest round for
    throughput, p50 over every call for latency)."""
    lines = []

    def latency(ours: str, theirs: str, what: str, theirs_what: str) -> None:
        d, r = rows.get(("claim_latency", ours)), rows.get(("claim_latency", theirs))
        if d and r:
            dp, rp = d.extra["p50_us"], r.extra["p50_us"]
            lines.append(
                f"{what} p50 {fmt_us(dp)} vs redis-py {theirs_what} p50 {fmt_us(rp)}: "
                f"{dp / rp:.2f}x"
            )
        else:
            lines.append(f"{what} vs redis-py {theirs_what}: not measured")

    latency(
        "dedupcore-daemon-single", "redis-single-always", "one durable claim", "SET NX PX (always)"
    )
    latency("dedupcore-daemon-single-unsafe", "redis-single", "one unsafe claim", "SET NX PX")
    latency(
        "dedupcore-aio-single-unsafe",
        "redis-aio-single",
        "one unsafe claim from asyncio",
        "asyncio SET NX PX",
    )
    latency(
        "dedupcore-daemon-pair",
        "redis-pair-always",
        "durable claim+complete pair",
        "SET NX + SET XX (always)",
    )
    d, r = rows.get(("claim_many", "dedupcore-daemon")), rows.get(("claim_many", "redis-pipelined"))
    if d and r:
        lines.append(
            f"claim_many through the daemon {fmt_rate(d.keys_per_s)} vs redis-py pipeline "
            f"{fmt_rate(r.keys_per_s)}: {d.keys_per_s / r.keys_per_s:.2f}x"
        )
    else:
        lines.append("claim_many through the daemon vs redis-py pipeline: not measured")
    for operation, what in (
        ("concurrent_clients", "batches of 1000"),
        ("concurrent_single", "single claims"),
    ):
        crows = _clients_rows(rows, operation)
        one = next((x for x in crows if x.extra.get("procs") == 1), None)
        many = max(crows, key=lambda x: int(x.extra.get("procs", 0)), default=None)
        if one and many and many is not one:
            lines.append(
                f"{many.extra['procs']} client processes ({what}) {fmt_rate(many.keys_per_s)} "
                f"vs one {fmt_rate(one.keys_per_s)}: {many.keys_per_s / one.keys_per_s:.2f}x"
            )
        else:
            lines.append(f"many client processes vs one ({what}): not measured")
    return lines
