"""``dedupcore serve`` and ``dedupcore stats``: settings, logging, metrics and tables.

``serve`` takes its settings from a TOML file (``--config``), ``DEDUPCORE_<NAME>``
environment variables and the command line (:mod:`dedupcore.cli.config`,
docs/daemon-config.md); ``--print-config`` prints them and exits. Besides the
command-line ones, these limits of :class:`~dedupcore.daemon.server.DaemonServer`
can be set in the TOML file or the environment:

- ``write_timeout`` (seconds, 10): a peer that takes no reply for this long
  is disconnected;
- ``idle_timeout`` (seconds, 600): a connection that sends no request for this
  long is closed;
- ``max_unsent`` (bytes, 1 MiB): the daemon stops reading a connection while
  more of its replies than this wait to be sent;
- ``max_in_flight`` (64): requests of one connection between read and reply;
- ``max_buffered`` (bytes, 256 MiB): request bytes held across all connections;
- ``fd_reserve`` (256): descriptors kept free for the store when capping
  ``max_connections`` to the open-file limit;
- ``drain_timeout`` (seconds, 30): how long SIGTERM waits for clients to go quiet.
- ``max_waiters`` (4096): WAIT requests (``claim(wait=)`` of the clients) waiting at
  once; more are answered at once and their clients poll.
- ``poll_after_reply`` (seconds, unset: adaptive): how long the event loop polls
  for the next request without sleeping after it writes a reply; 0 never polls.

``serve`` exits with 1 when it cannot start (a bad setting included) and with
:data:`~dedupcore.daemon.server.EXIT_STORE_FAILED` (3) when the store failed
while serving (a supervisor should restart it: reopening recovers the log).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dedupcore.cli import config
from dedupcore.client import Client
from dedupcore.errors import DedupError, SocketPathError
from dedupcore.tiers.base import durability_report

log = logging.getLogger("dedupcore.daemon")


class _JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts``, ``level``, ``logger``, ``msg``; ``exc``, the
    formatted traceback, for a record logged with ``exc_info`` (``log.exception``);
    ``stack``, the formatted stack, for one logged with ``stack_info``."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry)


def run_serve(args: argparse.Namespace) -> int:
    """Runs the daemon in the foreground (or prints its settings); returns the exit code."""
    from dedupcore.daemon.server import inherited_socket, serve
    from dedupcore.factory import open_store
    from dedupcore.store import StoreLockedError

    try:
        settings = config.load(args)
    except config.SettingsError as exc:
        print(f"dedupcore serve: {exc}", file=sys.stderr)
        return 1
    if args.print_config:
        sys.stdout.write(config.to_toml(settings))
        return 0
    s = settings.values
    if s.get("metrics_port"):
        from dedupcore.cli import missing_extra

        if (rc := missing_extra("serve --metrics-port", "prometheus_client")) is not None:
            return rc
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter())
    logging.basicConfig(level=s["log_level"], handlers=[handler])
    try:
        # systemd socket activation: a listening socket passed as descriptor 3
        sock = inherited_socket()
    except DedupError as exc:
        print(f"dedupcore serve: {exc}", file=sys.stderr)
        return 1
    if sock is not None:
        log.info("serving the socket passed by the service manager (LISTEN_FDS)")
    authority = s.get("authority") or [str(Path(s["data"]))]
    remote = any("://" in a for a in authority)
    try:
        store = open_store(
            authority if len(authority) > 1 else authority[0],
            cache=s.get("cache"),
            archive=s.get("archive"),
            **settings.store_options(remote=remote),
        )
    except (StoreLockedError, DedupError, ValueError, TypeError) as exc:
        print(f"dedupcore serve: {exc}", file=sys.stderr)
        return 1
    log.info("serving %r", store)
    # What an acknowledged answer survives, said at start-up: an authority that
    # can lose acknowledged keys (a Redis without fsync'd AOF) is a warning.
    try:
        level, durability = durability_report(store)
    except DedupError as exc:  # a remote authority that is down: said when it answers
        level, durability = -1, f"unknown until the authority answers ({exc})"
    log.log(logging.WARNING if level < 3 else logging.INFO, "durability: %s", durability)
    if s.get("metrics_port"):
        host, port = s["metrics_host"], int(s["metrics_port"])
        try:
            _start_metrics(store, host, port)
        except OSError as exc:
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            print(
                f"dedupcore serve: cannot serve metrics on {where} (metrics_host, "
                f"metrics_port): {exc.strerror or exc}",
                file=sys.stderr,
            )
            store.close()
            return 1
    stop_sweeping = threading.Event()
    if hasattr(store, "sweep") and (remote or s.get("cache") or s.get("archive")):
        _start_sweeper(store, stop_sweeping)
    try:
        rc = serve(store, s["socket"], sock=sock, **settings.server_options())
    except OSError as exc:  # SocketPathError included
        if sock is not None or not _about_socket(exc, s["socket"]):
            if isinstance(exc, DedupError):
                print(f"dedupcore serve: {exc}", file=sys.stderr)
                return 1
            raise
        print(f"dedupcore serve: {_socket_failure(exc, s['socket'])}", file=sys.stderr)
        return 1
    except DedupError as exc:
        print(f"dedupcore serve: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_sweeping.set()
        try:
            store.close()
        except (DedupError, OSError) as exc:
            # A store that failed may refuse to close cleanly; reopening recovers it.
            log.error("closing the store failed: %s", exc)
    if rc:
        # The disk that failed the store may hold stderr too: the exit status is what counts.
        with contextlib.suppress(OSError):
            print(f"dedupcore serve: the store failed; exiting with {rc}", file=sys.stderr)
    return rc


def _about_socket(exc: OSError, path: str) -> bool:
    """Whether ``exc`` is about the socket: a SocketPathError, or an error naming the
    socket or one of its directories (making, binding or changing them)."""
    if isinstance(exc, SocketPathError):
        return True
    if exc.filename is None:
        return False
    socket_path = Path(path).absolute()
    return Path(os.fsdecode(exc.filename)).absolute() in (socket_path, *socket_path.parents)


def _socket_failure(exc: OSError, path: str) -> str:
    """Why the socket cannot be served, with the way out: another path."""
    if isinstance(exc, SocketPathError):
        why = str(exc)
    else:
        name = errno.errorcode.get(exc.errno or 0, "")
        where = os.fsdecode(exc.filename) if exc.filename is not None else path
        why = f"{where}: {exc.strerror or exc} (errno {exc.errno}{', ' + name if name else ''})"
    hint = (
        "; as a user other than root, set XDG_RUNTIME_DIR (the default is then "
        "$XDG_RUNTIME_DIR/dedupcore/dedupcore.sock) or name a path"
        if os.geteuid() != 0
        else "; name a path"
    )
    return (
        f"cannot serve the socket {path}: {why}{hint} this user may create: "
        "`dedupcore serve --socket PATH` or DEDUPCORE_SOCKET=PATH (docs/daemon-config.md)"
    )


def _start_sweeper(store: Any, stop: threading.Event, interval: float = 60.0) -> None:
    """Demotes a stacked store's expiring records to its cold archive every ``interval`` s,
    until ``stop`` is set."""

    def loop() -> None:
        while not stop.wait(interval):
            try:
                store.sweep()
            except DedupError as exc:
                log.warning("sweep failed: %s", exc)
            except Exception:
                log.exception("sweep failed")

    threading.Thread(target=loop, name="dedupcore-sweep", daemon=True).start()


def _start_metrics(store: Any, host: str, port: int) -> None:
    """Serves Prometheus metrics on host:port, read from stats() at each scrape
    (names in docs/metrics.md); OSError when the address cannot be bound."""
    from dedupcore.metrics import serve_daemon_metrics

    serve_daemon_metrics(store, port, host=host)
    log.info("serving metrics on %s port %d", host, port)


def run_stats(socket_path: str, *, as_json: bool, interval: float = 1.0) -> int:
    """Prints a running daemon's figures and, from two samples ``interval`` s apart, its
    claim rates (the tables need rich: the ``cli`` extra).

    Any store the daemon serves gives its own ``stats()``: the embedded store, a
    Redis or SQL authority, a stack or shards. ``--json`` prints it as it came (with
    ``rates``); the tables show what that store counts (docs/metrics.md).
    """
    from dedupcore.metrics import sample_rates

    try:
        with Client(socket_path, timeout=10.0, retries=1) as client:
            st, per_ns = sample_rates(client.stats, interval)
    except (DedupError, ValueError) as exc:
        print(f"dedupcore stats: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps({**st, "rates": per_ns}, default=repr, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"claims by namespace (rates over {interval:g} s)")
    for col in ("namespace", "new", "duplicate", "in progress", "duplicate rate"):
        table.add_column(col, justify="left" if col == "namespace" else "right")
    table.add_column("claims/s", justify="right")
    table.add_column("duplicate rate now", justify="right")
    counts = _claim_counts(st)
    for ns, c in sorted(counts.items()):
        now = per_ns.get(ns)
        total = sum(c.values())
        table.add_row(
            ns or "(all namespaces)",
            f"{c['new']:,}",
            f"{c['duplicate']:,}",
            f"{c['in_progress']:,}",
            f"{c['duplicate'] / total if total else 0.0:.1%}",
            "-" if now is None else f"{now['claims_per_second']:,.1f}",
            "-" if now is None else f"{now['duplicate_rate']:.1%}",
        )
    if not counts:
        table.caption = "this store keeps no claim counts (the daemon's requests are below)"
    console.print(table)
    figures = Table(title="store and daemon")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    for name, value in _figure_rows(st):
        figures.add_row(name, value)
    console.print(figures)
    return 0


def _claim_counts(st: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Claims per namespace and outcome, whatever store gave ``st`` (a bare SQL
    authority counts all namespaces together, under "")."""
    from dedupcore.metrics import store_figures

    counts: dict[str, dict[str, int]] = {}
    for (ns, outcome), n in store_figures(st).claims.items():
        counts.setdefault(ns, {"new": 0, "duplicate": 0, "in_progress": 0})[outcome] += n
    return counts


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _store_kind(st: dict[str, Any]) -> str:
    """What serves the keys, in words, from the shape of its ``stats()``."""
    if isinstance(st.get("shards"), list):
        kinds = [_store_kind(_mapping(s)) for s in st["shards"]]
        same = len(set(kinds)) == 1
        inner = kinds[0] if same else ", ".join(kinds)
        return f"{len(kinds)} shards: {inner}" + (" each" if same else "")
    if "write_behind" in st:
        return f"write-behind over a local {_store_kind(_mapping(st.get('local')))}"
    if isinstance(st.get("authority"), dict):
        parts = [_store_kind(st["authority"])]
        parts += [name for name in ("cache", "archive") if st.get(name)]
        if st.get("front"):
            parts.append("front filter")
        return "stack: " + " + ".join(parts)
    if "engine" in st:
        return f"{st['engine']} table {st.get('table', '?')}"
    if "maxmemory_policy" in st:
        servers = st.get("servers", 1)
        cluster = " cluster" if st.get("cluster") else ""
        return f"redis{cluster}, {servers} server{'' if servers == 1 else 's'}"
    if "lmdb" in st:
        return "embedded store"
    return "unknown"


def _total(parts: list[Mapping[str, Any]], name: str) -> int:
    return sum(int(p.get(name) or 0) for p in parts)


def _windows(archive: Any) -> list[tuple[str, str]]:
    rows = []
    for window, cold in sorted(_mapping(archive).items()):
        cold = _mapping(cold)
        rows.append(
            (
                f"cold archive ({float(window):g} s): slices / est. FPR",
                f"{len(cold.get('slices', ()))} / {cold.get('estimated_fpr', 0.0):.2e}",
            )
        )
    return rows


def _figure_rows(st: dict[str, Any]) -> list[tuple[str, str]]:
    """The figures table: what every store counts, then what this kind of store has."""
    from dedupcore.metrics import store_figures, store_parts

    fig = store_figures(st)
    rows = [("store", _store_kind(st)), ("durability", str(st.get("durability", "unknown")))]
    parts = list(store_parts(st))
    if any("lease_takeovers" in p or "takeovers" in p for p in parts):
        rows.append(("lease takeovers", f"{fig.takeovers:,}"))
    embedded = [p for p in parts if isinstance(p.get("lmdb"), dict)]
    if embedded:
        rows += [
            ("in flight", f"{fig.in_flight:,}"),
            ("LMDB records", f"{fig.lmdb_records:,}"),
            ("LMDB size", f"{fig.lmdb_bytes / 2**20:.1f} MiB"),
            ("LMDB reads", f"{fig.tier_hits['lmdb']:,}"),
            ("recent records (log, memory)", f"{_total(embedded, 'recent_records'):,}"),
            ("checkpoints", f"{_total(embedded, 'checkpoints'):,}"),
        ]
        if len(embedded) == 1:
            front = _mapping(embedded[0].get("front"))
            rows += [
                ("front filter: lookups answered alone", f"{front.get('skip_ratio', 0.0):.1%}"),
                ("front filter: memory", f"{front.get('nbytes', 0) / 2**20:.1f} MiB"),
                ("front filter: estimated FPR", f"{front.get('estimated_fpr', 0.0):.2e}"),
                ("front slices", str(len(front.get("slices", ())))),
            ]
            rows += _windows(embedded[0].get("cold"))
    stacks = [p for p in parts if isinstance(p.get("counts"), dict)]
    if stacks:
        rows += [
            ("front filter: keys answered alone", f"{fig.front_skips:,}"),
            ("cache hits", f"{fig.tier_hits['cache']:,}"),
            ("cold archive hits", f"{fig.tier_hits['cold']:,}"),
        ]
        if len(stacks) == 1:
            rows += _windows(stacks[0].get("archive"))
    sql = [p for p in parts if "engine" in p]
    if sql:
        rows.append(("SQL connections made", f"{_total(sql, 'connects'):,}"))
    redis = [p for p in parts if "maxmemory_policy" in p]
    if redis:
        rows.append(("Redis restarts seen", f"{_total(redis, 'restarts'):,}"))
        rows.append(("Redis maxmemory-policy", str(redis[0].get("maxmemory_policy"))))
    d = _mapping(st.get("daemon"))
    rows += [
        ("requests", f"{d.get('requests', 0):,}"),
        (
            "mean request time (incl. commit)",
            f"{d.get('request_seconds', 0.0) / max(1, d.get('requests', 0)) * 1e3:.2f} ms",
        ),
        ("errors", f"{d.get('errors', 0):,}"),
        ("connections open", str(d.get("connections_open", 0))),
        ("refused connections", str(d.get("refused_connections", 0))),
    ]
    return rows
