"""SIGKILL of a Django server process (uvicorn over the test project, the middleware or
a decorated view) mid-request, and the client's retry on a fresh process
(tests/support/kills.py).

Each test kills 2 rounds of 3 requests at deterministic points (the view prints
``PAUSED`` there), restarting the server after each kill. A plain effect is applied
twice by every kill between the effect and the recorded response, and only by those
(the window); the transactional table (``consume`` keyed by
``request.idempotency_key``, in the effect's transaction) applies nothing twice, and
the retry answers the committed result (docs/django.md, "Where exactly once holds").
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.support.daemon import Daemon
from tests.support.kills import LEASE, KillLab
from tests.support.servers import require_server


@pytest.mark.parametrize("form", ["middleware", "views"])
@pytest.mark.parametrize("mode", ["plain", "ledger"])
def test_a_killed_django_process_and_the_retry(
    form: str, mode: str, daemon: Daemon, pg_tables: list[str]
) -> None:
    require_server("postgresql")
    env = {
        "DEDUPCORE_SOCKET": str(daemon.socket),
        "DJANGO_SETTINGS_MODULE": "tests.integrations.django_app.settings",
        "DJANGO_APP_MODE": form,
        "DJANGO_APP_NAMESPACE": f"django-kills/{uuid.uuid4().hex}",
        "DJANGO_APP_OPTIONS": json.dumps({"heartbeat": True, "lease": LEASE}),
    }
    KillLab("django", env, pg_tables).verify(
        mode, f"/view/{mode}" if form == "views" else f"/{mode}"
    )
