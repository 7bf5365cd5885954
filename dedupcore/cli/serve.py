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

``serve`` exits with 1 when it cannot start (a bad setting included) and with
:data:`~dedupcore.daemon.server.EXIT_STORE_FAILED` (3) when the store failed
while serving (a supervisor should restart it: reopening recovers the log).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any

from dedupcore.cli import config
from dedupcore.client import Client
from dedupcore.errors import DedupError
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
    stop_sweeping = threading.Event()
    if hasattr(store, "sweep") and (remote or s.get("cache") or s.get("archive")):
        _start_sweeper(store, stop_sweeping)
    if s.get("metrics_port"):
        _start_metrics(store, int(s["metrics_port"]))
    try:
        rc = serve(store, s["socket"], sock=sock, **settings.server_options())
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


def _start_metrics(store: Any, port: int) -> None:
    """Serves Prometheus metrics on 127.0.0.1:port, read from stats() at each scrape
    (names in docs/metrics.md)."""
    from dedupcore.metrics import serve_daemon_metrics

    serve_daemon_metrics(store, port)


def run_stats(socket_path: str, *, as_json: bool, interval: float = 1.0) -> int:
    """Prints a running daemon's figures and, from two samples ``interval`` s apart, its
    claim rates (the tables need rich: the ``cli`` extra)."""
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
    for ns, c in sorted(st["namespaces"].items()):
        now = per_ns.get(ns)
        table.add_row(
            ns,
            f"{c['new']:,}",
            f"{c['duplicate']:,}",
            f"{c['in_progress']:,}",
            f"{c['duplicate_rate']:.1%}",
            "-" if now is None else f"{now['claims_per_second']:,.1f}",
            "-" if now is None else f"{now['duplicate_rate']:.1%}",
        )
    console.print(table)
    d = st.get("daemon", {})
    figures = Table(title="store and daemon")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    rows = [
        ("lease takeovers", f"{st['lease_takeovers']:,}"),
        ("front filter: lookups answered alone", f"{st['front']['skip_ratio']:.1%}"),
        ("front filter: memory", f"{st['front']['nbytes'] / 2**20:.1f} MiB"),
        ("front filter: estimated FPR", f"{st['front']['estimated_fpr']:.2e}"),
        ("front slices", str(len(st["front"]["slices"]))),
        ("LMDB records", f"{st['lmdb']['records']:,}"),
        ("LMDB size", f"{st['lmdb']['disk_bytes'] / 2**20:.1f} MiB"),
        ("recent records (log, memory)", f"{st['recent_records']:,}"),
        ("in flight", f"{st['in_flight']:,}"),
        ("checkpoints", f"{st['checkpoints']:,}"),
        ("requests", f"{d.get('requests', 0):,}"),
        (
            "mean request time (incl. commit)",
            f"{d.get('request_seconds', 0.0) / max(1, d.get('requests', 0)) * 1e3:.2f} ms",
        ),
        ("connections open", str(d.get("connections_open", 0))),
        ("refused connections", str(d.get("refused_connections", 0))),
    ]
    for name, value in rows:
        figures.add_row(name, value)
    for window, cold in st.get("cold", {}).items():
        figures.add_row(
            f"cold archive ({window} s): slices / est. FPR",
            f"{len(cold['slices'])} / {cold['estimated_fpr']:.2e}",
        )
    console.print(figures)
    return 0
