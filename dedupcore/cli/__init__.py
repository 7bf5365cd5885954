"""Command line: ``dedupcore serve|sql|stats|check|demo|bench`` (also ``python -m dedupcore``).

``serve`` settings come, in rising precedence, from defaults, a TOML file
(``--config``; keys as the long options, with ``_`` for ``-``, and retention
policies), environment variables ``DEDUPCORE_<OPTION>`` and the command line
(:mod:`dedupcore.cli.config`, docs/daemon-config.md).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from dedupcore.client import DEFAULT_SOCKET, default_socket

#: Where the socket is when no path is given (:func:`dedupcore.client.default_socket`).
SOCKET_HELP = (
    f"{DEFAULT_SOCKET} for root, $XDG_RUNTIME_DIR/dedupcore/dedupcore.sock for another user"
)

#: The modules of the ``cli`` extra (tables, progress bars, Prometheus metrics), by
#: distribution name. The library itself imports and works without them.
CLI_EXTRA = {"rich": "rich", "prometheus_client": "prometheus-client"}


def missing_extra(command: str, *modules: str) -> int | None:
    """Exit code 2 after saying what to install if a module of the ``cli`` extra is
    missing; None when they all import."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            print(
                f"dedupcore {command} needs {CLI_EXTRA[module]}, which is not installed: "
                "install dedupcore[cli] (pip install 'dedupcore[cli]')",
                file=sys.stderr,
            )
            return 2
    return None


def _sql_table_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a SQL authority's table, shared by ``serve`` and ``sql init``
    (the same keys in the TOML file; docs/sql-partitions.md)."""
    parser.add_argument("--table", help="a SQL authority's table name (default dedup)")
    parser.add_argument(
        "--partition",
        help="day or hour: keep a PostgreSQL or MariaDB table in partitions by each key's "
        "event time (the time inside a time-ordered id; default none)",
    )
    parser.add_argument(
        "--partition-tolerance",
        help="seconds two event times of one message may differ across a partition "
        "boundary (default 300)",
    )
    parser.add_argument(
        "--partitions-ahead", help="partitions created ahead of the clock (default 3)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedupcore",
        description="Idempotent consumers: exactly-once effect over at-least-once delivery.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a data directory on a Unix socket")
    serve.add_argument(
        "--config", help="TOML file: the settings below, [retention] and [namespaces.NAME]"
    )
    serve.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective settings as TOML (a --config file) and exit",
    )
    serve.add_argument("--data", help="data directory (DEDUPCORE_DATA; default ./dedupcore-data)")
    serve.add_argument(
        "--authority",
        action="append",
        default=None,
        help="serve this authority instead of --data: redis://, rediss://, unix://, "
        "postgresql://, mysql://, sqlite:///path or a directory; repeat to shard over several",
    )
    serve.add_argument("--cache", help="Redis URL of a hot cache in front of the authority")
    serve.add_argument("--archive", help="directory of the cold archive of a remote authority")
    serve.add_argument("--socket", help=f"socket path (DEDUPCORE_SOCKET; default {SOCKET_HELP})")
    serve.add_argument("--group", help="let this group connect (socket 0660, directory 0750)")
    serve.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        default=None,
        help="also accept connections from this uid (repeatable)",
    )
    serve.add_argument(
        "--durability",
        choices=["durable", "power-loss-unsafe"],
        help="default durable: fdatasync before every acknowledgement",
    )
    serve.add_argument("--lease", help="default lease: seconds, or 90s, 5m, 1h (default 30)")
    serve.add_argument("--max-connections", type=int, help="default 1024")
    serve.add_argument("--request-timeout", help="seconds per request (default 30)")
    serve.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on METRICS_HOST:PORT"
    )
    serve.add_argument(
        "--metrics-host",
        help="address the metrics are served on: an IPv4 or IPv6 address or a host name "
        "(default 127.0.0.1; 0.0.0.0 or :: for every interface)",
    )
    serve.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    _sql_table_arguments(serve)

    sql = sub.add_parser("sql", help="manage a SQL authority's dedup table")
    sql_sub = sql.add_subparsers(dest="sql_command", required=True)
    init = sql_sub.add_parser("init", help="create the dedup table (idempotent)")
    init.add_argument(
        "--url",
        help="postgresql://, mysql:// or sqlite:///path (default: the SQL authorities of --config)",
    )
    init.add_argument(
        "--config",
        help="serve's TOML file: its SQL authorities, table, partitions and retention",
    )
    _sql_table_arguments(init)

    stats = sub.add_parser("stats", help="print a running daemon's figures")
    stats.add_argument(
        "--socket", help=f"the daemon's socket (DEDUPCORE_SOCKET; default {SOCKET_HELP})"
    )
    stats.add_argument("--json", action="store_true", help="print JSON instead of tables")
    stats.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between the two samples the rates come from (default 1; 0: totals only)",
    )

    check = sub.add_parser(
        "check",
        help="read a data directory whole and report damage (exit 0 clean, 1 damage, 2 error)",
    )
    check.add_argument("data_dir", metavar="DATA_DIR", help="the store's data directory")
    check.add_argument("--json", action="store_true", help="print JSON instead of tables")

    demo = sub.add_parser(
        "demo",
        help="run the demo: SIGKILLed consumers through the daemon, then with the "
        "transactional pattern on SQLite (docs/demo.md)",
    )
    demo.add_argument(
        "--keys",
        type=int,
        default=20_000,
        help="unique messages in the simulated stream (default 20000)",
    )
    demo.add_argument(
        "--duplicate-rate",
        type=float,
        default=0.2,
        help="fraction of the published messages that are producer retries (default 0.2)",
    )
    demo.add_argument("--seed", type=int, default=7, help="random seed (default 7)")

    bench = sub.add_parser(
        "bench",
        help="deprecated: the benchmarks run from a clone, with ./dev bench SUITE "
        "(docs/performance.md)",
    )
    # The options it took, so that an old command line gets the pointer, not a usage error.
    bench.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)
    bench.add_argument("--daemon", action="store_true", help=argparse.SUPPRESS)
    bench.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dedupcore`` command."""
    args = _parser().parse_args(argv)
    if args.command == "serve":
        from dedupcore.cli.serve import run_serve

        return run_serve(args)
    if args.command == "sql":
        return _sql_init(args)
    if args.command == "stats":
        from dedupcore.cli.serve import run_stats

        if not args.json and (rc := missing_extra("stats", "rich")) is not None:
            return rc
        return run_stats(args.socket or default_socket(), as_json=args.json, interval=args.interval)
    if args.command == "check":
        from dedupcore.cli.check import run_check

        return run_check(args.data_dir, as_json=args.json)
    if args.command == "demo":
        from dedupcore.cli.demo import run_demo

        if (rc := missing_extra("demo", "rich")) is not None:
            return rc
        return run_demo(keys=args.keys, duplicate_rate=args.duplicate_rate, seed=args.seed)
    if args.command == "bench":
        from dedupcore.cli.bench import run_bench

        return run_bench()
    raise AssertionError(args.command)


def _sql_init(args: argparse.Namespace) -> int:
    """Creates the table of ``--url``, or of each SQL authority of ``--config``, with
    the table, partition and retention settings of the options, environment and file."""
    from dedupcore.cli import config
    from dedupcore.errors import DedupError
    from dedupcore.sql import SqlStore

    try:
        settings = config.load(args)
    except config.SettingsError as exc:
        print(f"dedupcore sql init: {exc}", file=sys.stderr)
        return 1
    urls = [args.url] if args.url else settings.values.get("authority") or []
    others = [u for u in urls if not u.startswith(config.SQL_SCHEMES)]
    if not urls or others:
        which = f"; {others[0]!r} is not" if others else ""
        print(
            "dedupcore sql init: give a SQL URL with --url, or a --config whose authority is "
            f"SQL (postgresql://, mysql://, sqlite:///){which}",
            file=sys.stderr,
        )
        return 1
    options = settings.sql_options()
    table = options.get("table", "dedup")
    layout = f", partitioned by {options['partition']}" if options.get("partition") else ""
    for url in urls:
        try:
            with SqlStore.from_url(
                url,
                retention=settings.retention,
                namespaces=dict(settings.namespaces),
                **options,
            ) as store:
                store.init_schema()
                print(
                    f"dedup table {table!r} ready on {store.dialect} "
                    f"{store.server_version()}{layout}"
                )
        except (DedupError, ValueError, TypeError) as exc:
            print(f"dedupcore sql init: {exc}", file=sys.stderr)
            return 1
    return 0
