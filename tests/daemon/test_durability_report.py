"""The daemon says at start-up, and in ``stats``, what an acknowledged answer survives."""

from __future__ import annotations

import json

from tests.support.daemon import Lab
from tests.support.servers import redis_url


def _durability_lines(log: str) -> list[dict[str, object]]:
    out = []
    for line in log.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if str(entry.get("msg", "")).startswith("durability:"):
            out.append(entry)
    return out


def test_a_durable_store_is_said_at_info(lab: Lab) -> None:
    d = lab.daemon()
    (line,) = _durability_lines(d.log_text())
    assert line["level"] == "INFO" and "power loss" in str(line["msg"])
    with d.client() as c:
        assert c.stats()["durability"].startswith("durable")


def test_a_store_that_can_lose_acknowledged_keys_is_a_warning(lab: Lab) -> None:
    d = lab.daemon("--durability", "power-loss-unsafe")
    (line,) = _durability_lines(d.log_text())
    assert line["level"] == "WARNING"
    with d.client() as c:
        assert "power" in c.stats()["durability"]


def test_a_redis_authority_without_persistence_is_a_warning(lab: Lab) -> None:
    d = lab.daemon("--authority", redis_url("durability_report"))
    lines = _durability_lines(d.log_text())
    assert lines and lines[0]["level"] == "WARNING", d.log_text()
