"""The tiered design configured in one file and served end to end (docs/tiered.toml).

Hot Redis (24 h), exact PostgreSQL (7 days), cold Bloom archive (30 days): the
daemon reads every tier and window from the file; the test only moves the
socket, the archive and the Redis database into its own places (the command
line wins over the file) and checks that a completed key sits in each tier
with the file's windows.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from dedupcore.api import Outcome
from dedupcore.record import State
from dedupcore.sql import SqlStore
from tests.support.daemon import Lab
from tests.support.procs import run_cli
from tests.support.servers import flushed_redis, redis_url, require_server

ROOT = Path(__file__).resolve().parents[2]
TIERED = ROOT / "docs" / "tiered.toml"
#: The authority docs/tiered.toml names (the daemon takes it from the file).
AUTHORITY = "postgresql://postgres@127.0.0.1:5432/test"
HOUR = 3600


@pytest.fixture
def rdb() -> Iterator[redis.Redis]:
    require_server("postgresql")
    yield from flushed_redis("tiered_config")


def test_the_file_names_every_tier_and_window() -> None:
    out = run_cli("serve", "--config", str(TIERED), "--print-config")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f'authority = ["{AUTHORITY}"]' in text
    assert 'cache = "redis://127.0.0.1:6379/0"' in text
    for line in ("hot_window = 86400", "exact_window = 604800", "cold_window = 2592000"):
        assert line in text, text


def test_a_completed_key_lives_in_every_tier_with_the_files_windows(
    tmp_path: Path, rdb: redis.Redis, lab: Lab
) -> None:
    assert run_cli("sql", "init", "--url", AUTHORITY).returncode == 0
    ns = f"tiered/{uuid.uuid4().hex[:8]}"
    # The file names the authority; the harness's --data is unused beside it.
    daemon = lab.daemon(
        "--config",
        str(TIERED),
        "--archive",
        str(tmp_path / "cold"),
        "--cache",
        redis_url("tiered_config"),
    )
    with daemon.client(timeout=30) as client:
        c = client.claim("order-1", namespace=ns)
        assert c.outcome is Outcome.NEW
        client.complete("order-1", c.token, namespace=ns, result="shipped")
        again = client.claim("order-1", namespace=ns)
        assert (again.outcome, again.result) == (Outcome.DUPLICATE, "shipped")
        stats = client.stats()
    # hot: Redis holds the completed key with the file's 24 h TTL
    hot = [k for k in rdb.keys("*") if ns.encode() in k]
    assert len(hot) == 1, hot
    ttl = rdb.ttl(hot[0])
    assert 23 * HOUR < ttl <= 24 * HOUR, ttl
    assert stats["counts"]["cache_hits"] == 1
    # exact: PostgreSQL, the authority the file names, holds the record
    with SqlStore.from_url(AUTHORITY) as authority:
        rec = authority.get("order-1", namespace=ns)
        assert rec is not None and rec.state is State.PROCESSED
    assert daemon.stop() == 0, daemon.log_text()
