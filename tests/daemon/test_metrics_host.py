"""``serve --metrics-host``: the daemon's metrics on another address than 127.0.0.1,
so that a scraper in a container can reach them (loopback addresses only here)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from dedupcore.cli.config import SettingsError, load
from tests.support.daemon import Lab, serve_args
from tests.support.procs import PATIENCE

pytest.importorskip("prometheus_client")


def free_port(host: str) -> int:
    """A TCP port nothing listens on at ``host`` nor at 127.0.0.1 (the kernel's pick)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(100):
        with socket.socket(family) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError("no free port")


def scrape(host: str, port: int) -> str:
    url = f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=PATIENCE) as r:
        return str(r.read().decode())


def refused(host: str, port: int) -> bool:
    try:
        scrape(host, port)
    except urllib.error.URLError as exc:
        return isinstance(exc.reason, ConnectionRefusedError)
    return False


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.2",
        pytest.param(
            "::1", marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")
        ),
    ],
)
def test_metrics_served_on_the_address_given(lab: Lab, host: str) -> None:
    port = free_port(host)
    daemon = lab.daemon("--metrics-port", str(port), "--metrics-host", host)
    with daemon.client() as c:
        c.claim("k", namespace="m/host")
    text = scrape(host, port)
    assert 'dedupcore_claims_total{namespace="m/host",outcome="new",region=""} 1.0' in text
    # Bound to that address alone, not to 127.0.0.1 as well.
    assert refused("127.0.0.1", port)


def test_the_settings_file_sets_the_host_and_any_address_reaches_loopback(lab: Lab) -> None:
    home = lab.tmpdir()
    port = free_port("0.0.0.0")
    config = home / "m.toml"
    config.write_text(f'metrics_port = {port}\nmetrics_host = "0.0.0.0"\n')
    daemon = lab.daemon("--config", str(config))
    assert "dedupcore_in_flight" in scrape("127.0.0.1", port)
    assert "dedupcore_in_flight" in scrape("127.0.0.3", port)
    daemon.stop()


def test_the_host_defaults_to_127_0_0_1_and_is_checked() -> None:
    def host(*argv: str, **environ: str) -> str:
        return str(load(serve_args(*argv), environ=environ).values["metrics_host"])

    assert host() == "127.0.0.1"
    assert host(DEDUPCORE_METRICS_HOST="::1") == "::1"
    assert host("--metrics-host", "localhost") == "localhost"
    for bad in ("", "not a host", "256.1.1.1", "http://x"):
        with pytest.raises(SettingsError, match=r"^--metrics-host: metrics_host: "):
            load(serve_args("--metrics-host", bad), environ={})


def test_an_address_that_cannot_be_bound_stops_serve_with_a_message(lab: Lab) -> None:
    rc, out = lab.serve_expecting_refusal(
        "--data",
        str(lab.tmpdir() / "d"),
        "--socket",
        str(lab.tmpdir() / "d.sock"),
        "--metrics-port",
        "9",
        "--metrics-host",
        "192.0.2.1",  # TEST-NET-1: no interface of this machine has it
    )
    assert rc == 1, out
    assert "Traceback" not in out, out
    assert "metrics" in out and "192.0.2.1" in out, out
