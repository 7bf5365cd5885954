"""SIGKILL of a uvicorn server process mid-request (Starlette behind the middleware,
FastAPI per route), and the client's retry on a fresh process (tests/support/kills.py).

Each test kills 2 rounds of 3 requests at deterministic points (the handler prints
``PAUSED`` there), restarting the server after each kill. A plain effect is applied
twice by every kill between the effect and the recorded response, and only by those
(the window); the transactional table (``consume`` keyed by the request's store key,
in the effect's transaction) applies nothing twice, and the retry answers the
committed result (docs/http.md, "Where exactly once holds, and where not").
"""

from __future__ import annotations

import uuid

import pytest

from tests.support.daemon import Daemon
from tests.support.kills import KillLab
from tests.support.servers import require_server


@pytest.mark.parametrize("form", ["starlette-middleware", "fastapi-route"])
@pytest.mark.parametrize("mode", ["plain", "ledger"])
def test_a_killed_server_process_and_the_retry(
    form: str, mode: str, daemon: Daemon, pg_tables: list[str]
) -> None:
    require_server("postgresql")
    env = {"DEDUPCORE_SOCKET": str(daemon.socket), "DC_KILL_NS": f"kills/{uuid.uuid4().hex}"}
    KillLab(form, env, pg_tables).verify(mode, f"/{mode}")
