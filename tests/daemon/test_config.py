"""``dedupcore serve`` settings: the TOML file with retention policies, precedence,
``--print-config`` and its round trip, and bad settings (docs/daemon-config.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from dedupcore.cli import main
from dedupcore.cli.config import Settings, SettingsError, load, parse_duration, to_toml
from dedupcore.config import Retention
from dedupcore.factory import open_store
from dedupcore.sql import SqlStore
from dedupcore.stack import TieredStore
from dedupcore.store import DedupStore
from tests.support.daemon import serve_args
from tests.support.procs import ROOT, child_env, run_cli

EXAMPLE = ROOT / "docs" / "dedupcore.toml"
DAY = 86400.0


def write(tmp_path: Path, text: str, name: str = "serve.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (90, 90.0),
        (0.5, 0.5),
        ("90", 90.0),
        ("90s", 90.0),
        ("15m", 900.0),
        ("24h", 86400.0),
        ("7d", 7 * DAY),
        (" 1.5h ", 5400.0),
        (".5d", DAY / 2),
        (0, 0.0),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-1, ValueError, ">= 0"),
        ("-5s", ValueError, "not a duration"),
        ("5w", ValueError, "not a duration"),
        ("", ValueError, "not a duration"),
        ("1e3", ValueError, "not a duration"),
        (float("inf"), ValueError, ">= 0"),
        (True, TypeError, "bool"),
        ([5], TypeError, "list"),
        (None, TypeError, "NoneType"),
    ],
)
def test_bad_durations(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse_duration(value)


def test_the_example_file_loads_with_its_policies() -> None:
    s = load(serve_args("--config", str(EXAMPLE)), environ={})
    assert s.values["data"] == "/var/lib/dedupcore"
    assert s.values["lease"] == 30.0 and s.values["idle_timeout"] == 600.0
    assert s.values["metrics_port"] == 9101 and s.values["metrics_host"] == "127.0.0.1"
    assert s.retention == Retention(exact_window=7 * DAY, cold_window=30 * DAY, hot_window=3600)
    # A namespace's windows left out are those of [retention].
    assert s.namespaces == {
        "payments": Retention(exact_window=30 * DAY, cold_window=180 * DAY, hot_window=3600),
        "audit.events": Retention(exact_window=2 * DAY, cold_window=0, hot_window=3600),
    }


def test_the_example_files_sql_authority_block_loads(tmp_path: Path) -> None:
    """The commented SQL authority of the example, uncommented, loads and gives SqlStore
    its table and partition settings."""
    lines = EXAMPLE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# authority = "))
    block = []
    for line in lines[start:]:
        if not line.startswith("# "):
            break
        block.append(line[2:])
    config = write(tmp_path, "\n".join([*block, *lines]) + "\n", "sql.toml")  # top level
    s = load(serve_args("--config", str(config)), environ={})
    assert s.values["authority"] == ["postgresql://dedupcore@db.internal/dedup"]
    options = s.store_options(remote=True)
    assert {k: options[k] for k in ("table", "partition", "partition_tolerance")} == {
        "table": "dedup_by_day",
        "partition": "day",
        "partition_tolerance": 300.0,
    }
    assert options["partitions_ahead"] == 3
    # Beside the embedded store's data directory they are refused.
    with pytest.raises(SettingsError, match="only a SQL authority"):
        load(serve_args("--config", str(EXAMPLE), "--partition", "day"), environ={}).store_options(
            remote=False
        )


def test_defaults_file_environment_command_line_in_rising_precedence(tmp_path: Path) -> None:
    config = write(tmp_path, 'lease = 10\nidle_timeout = "1m"\nsocket = "/tmp/a.sock"\n')
    env = {"DEDUPCORE_LEASE": "20", "DEDUPCORE_IDLE_TIMEOUT": "2m", "DEDUPCORE_GROUP": "wheel"}
    s = load(serve_args("--config", str(config), "--lease", "5m"), environ=env)
    assert s.values["lease"] == 300.0  # command line over environment over file
    assert s.values["idle_timeout"] == 120.0  # environment over file
    assert s.values["socket"] == "/tmp/a.sock"  # file over default
    assert s.values["group"] == "wheel"
    assert s.values["write_timeout"] == 10.0  # the default, filled in
    assert s.values["max_connections"] == 1024
    assert "cache" not in s.values  # no default: absent, not None
    assert s.values["poll_after_reply"] is None  # unset: the daemon adapts it
    s = load(serve_args(), environ={"DEDUPCORE_POLL_AFTER_REPLY": "0"})
    assert s.values["poll_after_reply"] == 0.0
    s = load(serve_args(), environ={"DEDUPCORE_ALLOW_UID": "1001,1002"})
    assert s.values["allow_uid"] == [1001, 1002]


def test_print_config_round_trip(tmp_path: Path) -> None:
    """The printed settings given back as --config are the same settings."""
    config = write(
        tmp_path,
        'authority = ["sqlite:///a.db", "sqlite:///b.db"]\nallow_uid = 1001\n'
        'cache = "redis://127.0.0.1:6379/0"\nmetrics_port = 9101\n'
        '[retention]\nexact_window = "2d"\n'
        '[namespaces."orders/eu"]\nhot_window = "5m"\n'
        '[namespaces."x:y"]\nexact_window = 1\n',
    )
    env = child_env()
    env["DEDUPCORE_MAX_IN_FLIGHT"] = "7"
    first = run_cli("serve", "--config", str(config), "--lease", "2m", "--print-config", env=env)
    assert first.returncode == 0, first.stderr
    printed = write(tmp_path, first.stdout, "printed.toml")
    second = run_cli("serve", "--config", str(printed), "--print-config")
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    s = load(serve_args("--config", str(printed)), environ={})
    assert s == load(serve_args("--config", str(config), "--lease", "120"), environ=env)
    assert s.values["max_in_flight"] == 7 and s.values["lease"] == 120.0
    assert s.values["authority"] == ["sqlite:///a.db", "sqlite:///b.db"]
    assert s.namespaces["orders/eu"] == Retention(exact_window=2 * DAY, hot_window=300)
    assert s.namespaces["x:y"].exact_window == 1.0
    assert to_toml(s) == first.stdout


def test_print_config_opens_nothing(tmp_path: Path) -> None:
    data, sock = tmp_path / "data", tmp_path / "s" / "d.sock"
    out = run_cli("serve", "--data", str(data), "--socket", str(sock), "--print-config")
    assert out.returncode == 0, out.stderr
    assert f'data = "{data}"' in out.stdout
    assert not data.exists() and not sock.parent.exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colour = 1\n", "unknown key 'colour'"),
        ("lease = true\n", "lease: a duration is a number of seconds or a string, not bool"),
        ("lease = -1\n", "lease: a duration must be >= 0 seconds, got -1"),
        ("lease = 0\n", "lease: lease must be between"),
        ("max_connections = 'many'\n", "max_connections: must be an integer, got 'many'"),
        ("max_connections = 0\n", "max_connections: must be >= 1, got 0"),
        ("max_buffered = 1.5\n", "max_buffered: must be an integer, not float"),
        ("metrics_port = 70000\n", "metrics_port: must be between 1 and 65535"),
        ("socket = ''\n", "socket: must not be empty"),
        ("socket = 5\n", "socket: must be a string, not int"),
        ("authority = [1]\n", "authority: must be a string, not int"),
        ("allow_uid = ['root']\n", "allow_uid: must be an integer, got 'root'"),
        ("durability = 'fast'\n", "durability: must be one of durable, power-loss-unsafe"),
        ("log_level = 'LOUD'\n", "log_level: must be DEBUG"),
        ("request_timeout = '0s'\n", "request_timeout: must be > 0 seconds"),
        ("poll_after_reply = 0.02\n", "poll_after_reply: must be 0 to 0.01 seconds"),
        ("poll_after_reply = '1s'\n", "poll_after_reply: must be 0 to 0.01 seconds"),
        ("poll_after_reply = -1\n", "poll_after_reply: a duration must be >= 0 seconds"),
        ("[retention]\nexact_window = -3\n", "retention.exact_window: a duration must be >= 0"),
        ("[retention]\nexact_window = 0\n", "retention: exact_window must be > 0 seconds"),
        ("[retention]\nwarm_window = 5\n", "unknown key retention.warm_window"),
        ("[retention]\nhot_window = '1y'\n", "retention.hot_window: '1y' is not a duration"),
        ("retention = 5\n", "retention must be a table"),
        ("[namespaces.p]\ncold_window = '-1d'\n", "namespaces.p.cold_window: '-1d' is not a"),
        ("[namespaces.p]\ntypo = 1\n", "unknown key namespaces.p.typo"),
        ("namespaces = 1\n", "namespaces must be tables"),
        ("[namespaces.'a b']\nexact_window = 1\n", "namespaces.a b: namespace may only hold"),
        ("lease = \n", "not valid TOML"),
    ],
)
def test_bad_settings_name_the_key_and_the_file(tmp_path: Path, text: str, message: str) -> None:
    config = write(tmp_path, text)
    with pytest.raises(SettingsError, match="^" + re.escape(str(config))) as info:
        load(serve_args("--config", str(config)), environ={})
    assert message in str(info.value)


def test_bad_environment_and_option_values_name_their_source() -> None:
    with pytest.raises(SettingsError, match=r"^DEDUPCORE_MAX_UNSENT: max_unsent: must be"):
        load(serve_args(), environ={"DEDUPCORE_MAX_UNSENT": "lots"})
    with pytest.raises(SettingsError, match=r"^--lease: lease: '5 minutes' is not a duration"):
        load(serve_args("--lease", "5 minutes"), environ={})


def test_serve_exits_1_on_a_bad_setting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "[retention]\ncold_window = -1\n")
    assert main(["serve", "--config", str(config), "--print-config"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dedupcore serve: {config}: retention.cold_window:"), err
    assert main(["serve", "--config", str(tmp_path / "missing.toml")]) == 1
    assert "missing.toml: cannot read" in capsys.readouterr().err
    out = run_cli("serve", "--config", str(config), "--data", str(tmp_path / "d"))
    assert out.returncode == 1 and "retention.cold_window" in out.stderr
    assert not (tmp_path / "d").exists()


def _options(tmp_path: Path, remote: bool) -> dict[str, Any]:
    config = write(
        tmp_path,
        'lease = "45s"\ndurability = "power-loss-unsafe"\n'
        '[retention]\nexact_window = "3d"\ncold_window = "9d"\n'
        "[namespaces.payments]\nexact_window = 7200\n",
    )
    settings: Settings = load(serve_args("--config", str(config)), environ={})
    return settings.store_options(remote=remote)


def test_policies_reach_the_embedded_store(tmp_path: Path) -> None:
    with open_store(tmp_path / "data", **_options(tmp_path, remote=False)) as store:
        assert isinstance(store, DedupStore)
        cfg = store.config
        assert cfg.lease == 45.0 and cfg.durability == "power-loss-unsafe"
        assert cfg.retention == Retention(exact_window=3 * DAY, cold_window=9 * DAY)
        assert cfg.namespaces == {
            "payments": Retention(exact_window=7200, cold_window=9 * DAY),
        }


def test_policies_reach_a_remote_authority_and_its_stack(tmp_path: Path) -> None:
    options = _options(tmp_path, remote=True)
    assert "durability" not in options  # the authority keeps its own
    url = f"sqlite:///{tmp_path}/dedup.db"
    with open_store(url, init_schema=True, archive=tmp_path / "cold", **options) as stack:
        assert isinstance(stack, TieredStore)
        assert stack.retention.exact_window == 3 * DAY
        assert stack.namespaces["payments"].exact_window == 7200
        authority = stack.authority
        assert isinstance(authority, SqlStore)
        assert authority.lease == 45.0
        assert authority.retention == stack.retention
        assert authority.namespaces == stack.namespaces
