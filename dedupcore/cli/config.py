"""Settings of ``dedupcore serve``: the TOML file, ``DEDUPCORE_*`` variables, options.

docs/daemon-config.md describes every key. In rising precedence: defaults, the
file given with ``--config``, ``DEDUPCORE_<KEY>`` environment variables, the
command line. The file has the keys of the command-line options (``_`` for
``-``) at its top, the default retention policy in ``[retention]`` and a
namespace's own in ``[namespaces.<namespace>]``. Durations are numbers of
seconds or strings with a unit (``"90s"``, ``"15m"``, ``"24h"``, ``"7d"``).

:func:`load` returns a :class:`Settings` with every default filled in;
:func:`to_toml` writes it back in the file's format, so its output given as
``--config`` gives the same settings.
"""

from __future__ import annotations

import argparse
import inspect
import ipaddress
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from dedupcore._spin import MAX_SPIN
from dedupcore.client import default_socket
from dedupcore.config import DURABILITY_MODES, Retention, StoreConfig, check_lease
from dedupcore.daemon.server import DaemonServer
from dedupcore.errors import SettingsError
from dedupcore.keys import check_namespace
from dedupcore.sql.partitions import PARTITION_SPANS

__all__ = ["Settings", "SettingsError", "load", "parse_duration", "to_toml"]


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([smhd]?)\s*")


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as ``"90"``, ``"90s"``, ``"15m"``, ``"24h"``,
    ``"7d"``; TypeError for another type, ValueError for a negative or malformed one."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"a duration is a number of seconds or a string, not {type(value).__name__}"
        )
    if isinstance(value, str):
        m = _DURATION.fullmatch(value)
        if m is None:
            raise ValueError(
                f"{value!r} is not a duration: a number with an optional unit s, m, h or d"
            )
        value = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"a duration must be >= 0 seconds, got {value!r}")
    return float(value)


# -- the kinds of value ------------------------------------------------------------------


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"must be a string, not {type(value).__name__}")
    if not value:
        raise ValueError("must not be empty")
    return value


def _texts(value: object) -> list[str]:
    """A list of strings, or one string of comma-separated items."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise TypeError(f"must be a string or a list of strings, not {type(value).__name__}")
    return [_text(v) for v in items]


def _count(value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, str):  # the environment and the command line give text
        try:
            value = int(value, 10)
        except ValueError:
            raise ValueError(f"must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"must be an integer, not {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"must be {bound}, got {value}")
    return value


def _uids(value: object) -> list[int]:
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, int) and not isinstance(items, bool):
        items = [items]
    if not isinstance(items, list) or not items:
        raise TypeError(f"must be a uid or a list of uids, not {type(value).__name__}")
    return [_count(v, 0, 2**32 - 2) for v in items]


def _positive_seconds(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"must be > 0 seconds, got {value!r}")
    return seconds


def _poll_seconds(value: object) -> float:
    seconds = parse_duration(value)
    if not 0 <= seconds <= MAX_SPIN:
        raise ValueError(f"must be 0 to {MAX_SPIN} seconds, got {value!r}")
    return seconds


def _lease(value: object) -> float:
    return check_lease(parse_duration(value))


def _durability(value: object) -> str:
    text = _text(value)
    if text not in DURABILITY_MODES:
        raise ValueError(f"must be one of {', '.join(DURABILITY_MODES)}, got {text!r}")
    return text


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _host(value: object) -> str:
    """An IPv4 or IPv6 address, or a host name (letters, digits, hyphens, dots)."""
    text = _text(value)
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    if (
        len(text) > 253
        or not all(_HOST_LABEL.fullmatch(label) for label in labels)
        or labels[-1].isdigit()
    ):
        raise ValueError(f"must be an IP address or a host name, got {text!r}")
    return text


def _partition(value: object) -> str:
    text = _text(value)
    if text not in PARTITION_SPANS:
        raise ValueError(f"must be one of {', '.join(PARTITION_SPANS)}, got {text!r}")
    return text


def _log_level(value: object) -> str:
    text = _text(value).upper()
    if text not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {value!r}")
    return text


#: The top-level keys, in the order they are printed, and how each is checked.
KEYS: dict[str, Callable[[object], Any]] = {
    "data": _text,
    "authority": _texts,
    "cache": _text,
    "archive": _text,
    "socket": _text,
    "group": _text,
    "allow_uid": _uids,
    "durability": _durability,
    "lease": _lease,
    "max_connections": lambda v: _count(v, 1),
    "request_timeout": _positive_seconds,
    "metrics_port": lambda v: _count(v, 1, 65535),
    "metrics_host": _host,
    "log_level": _log_level,
    "table": _text,  # SqlStore checks it is an SQL identifier
    "partition": _partition,
    "partition_tolerance": parse_duration,
    "partitions_ahead": lambda v: _count(v, 1, 1000),
    "write_timeout": _positive_seconds,
    "idle_timeout": _positive_seconds,
    "max_unsent": lambda v: _count(v, 1),
    "max_in_flight": lambda v: _count(v, 1),
    "max_buffered": lambda v: _count(v, 1),
    "fd_reserve": lambda v: _count(v, 0),
    "drain_timeout": _positive_seconds,
    "max_waiters": lambda v: _count(v, 0),
    "poll_after_reply": _poll_seconds,
}
#: Keys without a default: left out of the printed settings when unset.
OPTIONAL = (
    "authority",
    "cache",
    "archive",
    "group",
    "allow_uid",
    "metrics_port",
    "table",
    "partition",
    "partition_tolerance",
    "partitions_ahead",
    "poll_after_reply",
)
#: Keys of a SQL authority's table, passed to SqlStore by name (docs/sql-partitions.md).
SQL_KEYS = ("table", "partition", "partition_tolerance", "partitions_ahead")
#: The URL schemes of a SQL authority.
SQL_SCHEMES = ("postgresql://", "postgres://", "mysql://", "mariadb://", "sqlite:///")
#: Keys that are limits of DaemonServer, passed to it by name.
SERVER_LIMITS = (
    "max_connections",
    "request_timeout",
    "write_timeout",
    "idle_timeout",
    "max_unsent",
    "max_in_flight",
    "max_buffered",
    "fd_reserve",
    "drain_timeout",
    "max_waiters",
    "poll_after_reply",
)
RETENTION_KEYS = tuple(f.name for f in fields(Retention))


def defaults(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The value of every key that has a default (from the classes that own them);
    the socket's is :func:`~dedupcore.client.default_socket`'s in ``environ``."""
    server = inspect.signature(DaemonServer.__init__).parameters
    store = StoreConfig()
    return {
        "data": "dedupcore-data",
        "socket": default_socket(environ),
        "durability": store.durability,
        "lease": store.lease,
        "metrics_host": "127.0.0.1",
        "log_level": "INFO",
        **{key: server[key].default for key in SERVER_LIMITS},
    }


@dataclass
class Settings:
    """The effective settings: top-level keys, the default and per-namespace retention."""

    values: dict[str, Any]
    retention: Retention = field(default_factory=Retention)
    namespaces: dict[str, Retention] = field(default_factory=dict)

    def store_options(self, *, remote: bool) -> dict[str, Any]:
        """Keyword arguments of ``open_store`` (``durability`` is the embedded store's alone)."""
        options: dict[str, Any] = {
            "lease": self.values["lease"],
            "retention": self.retention,
            "namespaces": dict(self.namespaces),
        }
        if not remote:
            options["durability"] = self.values["durability"]
        sql = self.sql_options()
        if sql:
            targets = self.values.get("authority") or [self.values["data"]]
            other = [t for t in targets if not t.startswith(SQL_SCHEMES)]
            if other:
                raise SettingsError(
                    f"{', '.join(sql)}: only a SQL authority (postgresql://, mysql://, "
                    f"sqlite:///) has a table, and {other[0]!r} is not one"
                )
            options.update(sql)
        return options

    def sql_options(self) -> dict[str, Any]:
        """The SQL table settings that are set, as SqlStore keywords (the others keep
        SqlStore's defaults: table ``dedup``, no partitions, tolerance 300 s, 3 ahead)."""
        return {key: self.values[key] for key in SQL_KEYS if self.values.get(key) is not None}

    def server_options(self) -> dict[str, Any]:
        """Keyword arguments of DaemonServer."""
        options: dict[str, Any] = {key: self.values[key] for key in SERVER_LIMITS}
        if self.values.get("group"):
            options["group"] = self.values["group"]
        if self.values.get("allow_uid"):
            options["allowed_uids"] = {os.geteuid(), *self.values["allow_uid"]}
        return options


def _checked(key: str, value: object, where: str) -> Any:
    try:
        return KEYS[key](value)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{where}: {key}: {exc}") from None


def _policy(table: object, base: Retention, where: str, prefix: str) -> Retention:
    if not isinstance(table, dict):
        raise SettingsError(f"{where}: {prefix} must be a table of {', '.join(RETENTION_KEYS)}")
    unknown = sorted(set(table) - set(RETENTION_KEYS))
    if unknown:
        raise SettingsError(
            f"{where}: unknown key {prefix}.{unknown[0]} (known: {', '.join(RETENTION_KEYS)})"
        )
    windows: dict[str, float] = {}
    for key, value in table.items():
        try:
            windows[key] = parse_duration(value)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"{where}: {prefix}.{key}: {exc}") from None
    merged = {key: windows.get(key, getattr(base, key)) for key in RETENTION_KEYS}
    try:
        return Retention(**merged)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{where}: {prefix}: {exc}") from None


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            table: dict[str, Any] = tomllib.load(fh)
            return table
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None


def load(
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Defaults < the ``--config`` file < ``DEDUPCORE_<KEY>`` variables < command-line options.

    Raises :class:`SettingsError` naming the key and its source (file, variable or option).
    """
    env = os.environ if environ is None else environ
    values = defaults(env)
    retention = Retention()
    namespaces: dict[str, Retention] = {}
    path = getattr(args, "config", None)
    if path:
        table = _read_file(path)
        policies = {k: table.pop(k) for k in ("retention", "namespaces") if k in table}
        for key, value in table.items():
            if key not in KEYS:
                raise SettingsError(
                    f"{path}: unknown key {key!r} (docs/daemon-config.md lists the keys)"
                )
            values[key] = _checked(key, value, path)
        if "retention" in policies:
            retention = _policy(policies["retention"], Retention(), path, "retention")
        spaces = policies.get("namespaces", {})
        if not isinstance(spaces, dict):
            raise SettingsError(f"{path}: namespaces must be tables [namespaces.<namespace>]")
        for ns, policy in spaces.items():
            try:
                check_namespace(ns)
            except (TypeError, ValueError) as exc:
                raise SettingsError(f"{path}: namespaces.{ns}: {exc}") from None
            namespaces[ns] = _policy(policy, retention, path, f"namespaces.{ns}")
    for key in KEYS:
        name = f"DEDUPCORE_{key.upper()}"
        if name in env:
            values[key] = _checked(key, env[name], name)
    for key in KEYS:
        value = getattr(args, key, None)
        if value is not None:
            values[key] = _checked(key, value, "--" + key.replace("_", "-"))
    unbound = [k for k in ("partition_tolerance", "partitions_ahead") if values.get(k) is not None]
    if unbound and values.get("partition") is None:
        raise SettingsError(
            f"{unbound[0]}: set with no partition; it applies to a partitioned table "
            '(partition = "day" or "hour", docs/sql-partitions.md)'
        )
    return Settings(values, retention, namespaces)


# -- writing the settings back as TOML ------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # A JSON string without ASCII escaping is a TOML basic string.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _toml_policy(policy: Retention) -> list[str]:
    return [f"{key} = {_toml_value(getattr(policy, key))}" for key in RETENTION_KEYS]


def to_toml(settings: Settings) -> str:
    """The settings in the ``--config`` format (durations in seconds)."""
    lines = ["# dedupcore serve: effective settings (docs/daemon-config.md)"]
    for key in KEYS:
        value = settings.values.get(key)
        if value is None and key in OPTIONAL:
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    lines += ["", "[retention]", *_toml_policy(settings.retention)]
    for ns in sorted(settings.namespaces):
        lines += ["", f"[namespaces.{_toml_value(ns)}]", *_toml_policy(settings.namespaces[ns])]
    return "\n".join(lines) + "\n"
