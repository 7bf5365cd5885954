"""The Django middleware and view decorator (dedupcore.integrations.django).

Through Django's test client (WSGI and ASGI handlers, in this process, on an
embedded store in the module's temporary directory) and through uvicorn
serving the project (tests/integrations/django_app/) in two worker
processes over the daemon, with concurrent retries. Executions are counted
as rows the views write, apart from what the responses say.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import django
import httpx
import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse
from django.test import AsyncClient, Client, RequestFactory, override_settings

from dedupcore import Client as DaemonClient
from dedupcore import DedupStore, aio
from dedupcore.api import HEARTBEAT_LEASE
from dedupcore.http.protocol import credentials_identity, key_ref, scoped_key
from dedupcore.integrations.django import (
    Idempotency,
    idempotent_view,
    store_from_settings,
)
from tests.integrations.django_app import settings as app_settings
from tests.support.daemon import Daemon
from tests.support.procs import PATIENCE, ROOT, child_env, wait_until

#: The test project's settings (tests/integrations/django_app/settings.py).
APP_SETTINGS = {k: v for k, v in vars(app_settings).items() if k.isupper()}
if not settings.configured:
    settings.configure(**APP_SETTINGS)
    django.setup()

#: Headers a server or Django sets per response, not part of what the view answered, and
#: those that carry the first client's credentials (never replayed; tested apart).
PER_RESPONSE = {"date", "server", "idempotent-replayed", "content-length"}
CREDENTIALS = {"set-cookie", "authentication-info"}


@dataclass
class Home:
    """The module's temporary directory: effects file, gates, embedded store."""

    root: Path

    @property
    def effects(self) -> Path:
        return self.root / "effects.sqlite"

    @property
    def gates(self) -> Path:
        return self.root / "gates"

    def rows(self, tag: str) -> list[tuple[str, bytes]]:
        if not self.effects.exists():
            return []
        with contextlib.closing(sqlite3.connect(self.effects, timeout=30)) as db:
            try:
                return list(db.execute("SELECT nonce, body FROM effects WHERE tag = ?", (tag,)))
            except sqlite3.OperationalError:  # no table yet: nothing ran
                return []

    def wait_started(self, gate: str) -> None:
        wait_until((self.gates / f"{gate}.started").exists, f"the view held at {gate}")

    def open(self, gate: str) -> None:
        (self.gates / f"{gate}.open").touch()


@pytest.fixture(scope="module", autouse=True)
def project() -> Iterator[None]:
    """The test project's settings, also where something else configured Django first."""
    overrides = {k: v for k, v in APP_SETTINGS.items() if k != "DATABASES"}  # none are used
    with override_settings(**overrides):
        yield


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Home]:
    root = tmp_path_factory.mktemp("django")
    (root / "gates").mkdir()
    with override_settings(
        EFFECTS_DB=str(root / "effects.sqlite"),
        GATES=str(root / "gates"),
        STORE_DIR=str(root / "store"),
    ):
        yield Home(root)
        store = store_from_settings()
        store.close()


def new_key() -> str:
    return uuid.uuid4().hex


def alice(key: str, tag: str, **extra: str) -> dict[str, str]:
    """Headers of one client (a bearer token) sending ``key``."""
    return {"Authorization": "Bearer alice", "Idempotency-Key": key, "X-Tag": tag, **extra}


def view_of(status: int, headers: Any, content: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
    skip = PER_RESPONSE | CREDENTIALS
    kept = sorted((k.lower(), v) for k, v in headers.items() if k.lower() not in skip)
    return status, kept, content


def seen(r: Any) -> tuple[int, list[tuple[str, str]], bytes]:
    """What the view answered (status, headers less per-response ones, body)."""
    return view_of(r.status_code, r.headers, r.content)


def replayed(r: Any) -> bool:
    return r.headers.get("Idempotent-Replayed") == "true"


# -- the middleware, through the test client (WSGI handler: the sync path) ----------------


def test_the_first_response_is_replayed_without_its_cookies(home: Home) -> None:
    key, tag = new_key(), new_key()
    http = Client()
    first = http.post("/orders", b'{"sku": "A-1"}', "application/json", headers=alice(key, tag))
    again = http.post("/orders", b'{"sku": "A-1"}', "application/json", headers=alice(key, tag))
    assert first.status_code == 201 and not replayed(first)
    assert "session" in first.cookies and first["X-Order-Nonce"] == first.json()["nonce"]
    assert again.status_code == 201 and replayed(again)
    assert seen(again) == seen(first)
    assert "session" not in again.cookies and "Set-Cookie" not in again
    assert "Authentication-Info" in first and "Authentication-Info" not in again
    assert [nonce for nonce, _ in home.rows(tag)] == [first.json()["nonce"]]


def test_two_clients_with_one_key_get_their_own_executions(home: Home) -> None:
    key, tag = new_key(), new_key()
    http = Client()
    body = b'{"amount": 10}'
    a = http.post("/orders", body, "application/json", headers=alice(key, tag))
    b = http.post(
        "/orders", body, "application/json", headers=alice(key, tag, Authorization="Bearer bob")
    )
    u = http.post(
        "/orders", body, "application/json", headers=alice(key, tag, **{"X-User": "carol"})
    )
    assert [r.status_code for r in (a, b, u)] == [201, 201, 201]
    assert not any(replayed(r) for r in (a, b, u))
    assert len({r.json()["nonce"] for r in (a, b, u)}) == 3
    assert len(home.rows(tag)) == 3
    # carol is carol whatever Authorization she sends: the user comes first
    u2 = http.post(
        "/orders",
        body,
        "application/json",
        headers=alice(key, tag, Authorization="Bearer other", **{"X-User": "carol"}),
    )
    assert replayed(u2) and u2.json() == u.json()


def test_a_request_without_credentials_is_400_unless_key_scope_says_whose(
    home: Home, caplog: Any
) -> None:
    key, tag = new_key(), new_key()
    http = Client()
    headers = {"Idempotency-Key": key, "X-Tag": tag}
    with caplog.at_level("WARNING", logger="dedupcore"):
        r = http.post("/orders", b"x", "text/plain", headers=headers)
        again = http.post("/orders", b"x", "text/plain", headers=headers)
    told = [m for m in caplog.messages if "pass key_scope=" in m]
    assert len(told) == 1 and "docs/django.md" in told[0]  # once, saying where to read
    assert again.status_code == 400
    assert r.status_code == 400 and r["Content-Type"] == "application/problem+json"
    assert r.json()["title"] == "Idempotency-Key needs a client identity"
    assert home.rows(tag) == []
    shared = {"namespace": f"shared-{key}", "key_scope": lambda request: ""}
    with override_settings(DEDUPCORE_IDEMPOTENCY=shared):
        http = Client()
        first = http.post("/orders", b"x", "text/plain", headers=headers)
        other = http.post("/orders", b"x", "text/plain", headers={**headers, "X-User": "dan"})
    assert first.status_code == 201 and replayed(other) and other.json() == first.json()
    assert len(home.rows(tag)) == 1


def test_a_key_reused_for_another_request_is_422(home: Home) -> None:
    key, tag = new_key(), new_key()
    http = Client()
    assert http.post("/orders", b"a", "text/plain", headers=alice(key, tag)).status_code == 201
    for method, path, body in [
        ("post", "/orders", b"b"),
        ("post", "/orders?x=1", b"a"),
        ("patch", "/orders", b"a"),
        ("post", "/reject", b"a"),
    ]:
        r = getattr(http, method)(path, body, "text/plain", headers=alice(key, tag))
        assert r.status_code == 422, (method, path, r.content)
        assert r.json() == {
            "type": "about:blank",
            "title": "Idempotency-Key reused",
            "status": 422,
            "detail": r.json()["detail"],
        }
    assert len(home.rows(tag)) == 1


@pytest.mark.parametrize(
    "value",
    ["", " ", "x" * 256, "caf\u00e9", '"a"b"', "one, two", "a\tb"],
)
def test_a_malformed_key_is_400_and_the_view_does_not_run(home: Home, value: str) -> None:
    tag = new_key()
    r = Client().post("/orders", b"x", "text/plain", headers=alice(value, tag))
    assert r.status_code == 400, r.content
    assert r.json()["title"] == "Invalid Idempotency-Key"
    assert home.rows(tag) == []


def test_keys_in_quotes_with_commas_are_one_key(home: Home) -> None:
    tag = new_key()
    http = Client()
    quoted = f'"{new_key()}, with a comma"'
    first = http.post("/orders", b"x", "text/plain", headers=alice(quoted, tag))
    again = http.post("/orders", b"x", "text/plain", headers=alice(quoted, tag))
    assert first.status_code == 201 and replayed(again)
    assert len(home.rows(tag)) == 1


def test_required_keys_and_methods(home: Home) -> None:
    tag = new_key()
    with override_settings(DEDUPCORE_IDEMPOTENCY={"required": True}):
        http = Client()
        missing = http.post("/orders", b"x", "text/plain", headers={"X-Tag": tag})
        got = http.get("/health")  # GET is not one of the methods
    assert missing.status_code == 400
    assert missing.json()["title"] == "Idempotency-Key is missing"
    assert got.status_code == 200 and home.rows(tag) == []
    plain = Client().post("/orders", b"x", "text/plain", headers={"X-Tag": tag})
    assert plain.status_code == 201 and len(home.rows(tag)) == 1  # not required: passes


def test_a_body_over_the_limit_is_413(home: Home) -> None:
    tag = new_key()
    with override_settings(DEDUPCORE_IDEMPOTENCY={"max_body_bytes": 100}):
        r = Client().post("/orders", b"y" * 101, "text/plain", headers=alice(new_key(), tag))
    assert r.status_code == 413 and home.rows(tag) == []


@pytest.mark.parametrize("fail", ["500", "503", "429", "raise"])
def test_failures_release_the_key_so_a_retry_runs_the_view(home: Home, fail: str) -> None:
    key, tag = new_key(), new_key()
    http = Client(raise_request_exception=False)
    first = http.post("/flaky", b"x", "text/plain", headers=alice(key, tag, **{"X-Fail": fail}))
    assert first.status_code == (500 if fail == "raise" else int(fail))
    retry = http.post("/flaky", b"x", "text/plain", headers=alice(key, tag))
    assert retry.status_code == 201 and not replayed(retry)
    again = http.post("/flaky", b"x", "text/plain", headers=alice(key, tag))
    assert replayed(again) and again.content == retry.content
    assert len(home.rows(tag)) == 2


def test_a_4xx_is_recorded_and_replayed(home: Home) -> None:
    key, tag = new_key(), new_key()
    http = Client()
    first = http.post("/reject", b"x", "text/plain", headers=alice(key, tag))
    again = http.post("/reject", b"x", "text/plain", headers=alice(key, tag))
    assert first.status_code == 400 and replayed(again) and seen(again) == seen(first)
    assert len(home.rows(tag)) == 1


@pytest.mark.parametrize("path", ["/stream", "/big"])
def test_streamed_or_large_responses_are_sent_once_and_never_replayed(
    home: Home, path: str
) -> None:
    key, tag = new_key(), new_key()
    http = Client()
    first = http.post(path, b"x", "text/plain", headers=alice(key, tag))
    assert first.status_code in (200, 201)
    content = b"".join(first.streaming_content) if first.streaming else first.content
    assert content
    again = http.post(path, b"x", "text/plain", headers=alice(key, tag))
    assert again.status_code == 422
    assert again.json()["title"] == "Response not replayable"
    assert len(home.rows(tag)) == 1


def test_retries_while_the_view_runs_get_409_then_the_response(home: Home) -> None:
    key, tag, gate = new_key(), new_key(), new_key()
    headers = alice(key, tag, **{"X-Gate": gate})
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(Client().post, "/orders", b"x", "text/plain", headers=headers)
        home.wait_started(gate)
        busy = list(
            pool.map(
                lambda _: Client().post("/orders", b"x", "text/plain", headers=headers), range(3)
            )
        )
        home.open(gate)
        original = first.result(PATIENCE)
    assert [r.status_code for r in busy] == [409] * 3
    assert all(r["Retry-After"] == "1" and r.json()["status"] == 409 for r in busy)
    assert original.status_code == 201
    again = Client().post("/orders", b"x", "text/plain", headers=headers)
    assert replayed(again) and seen(again) == seen(original)
    assert len(home.rows(tag)) == 1


def test_racing_identical_requests_run_the_view_once(home: Home) -> None:
    key, tag = new_key(), new_key()
    n = 8
    barrier = threading.Barrier(n)

    def go(_: int) -> Any:
        http = Client()
        barrier.wait(PATIENCE)
        return http.post("/orders", b"same", "text/plain", headers=alice(key, tag))

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(go, range(n)))
    assert len(home.rows(tag)) == 1
    done = [r for r in answers if r.status_code != 409]
    assert done and all(r.status_code == 201 for r in done)
    assert sum(not replayed(r) for r in done) == 1
    assert len({r.json()["nonce"] for r in done}) == 1


# -- the async path: Django's ASGI handler (AsyncClient) ---------------------------------------


@pytest.mark.parametrize("path", ["/orders", "/aorders"])
def test_the_async_path_replays_and_scopes_like_the_sync_one(home: Home, path: str) -> None:
    key, tag = new_key(), new_key()

    async def run() -> list[Any]:
        http = AsyncClient()
        user = alice(key, tag, **{"X-User": "erin"})  # the user is read off the event loop
        first = await http.post(path, b"x", "text/plain", headers=user)
        again = await http.post(path, b"x", "text/plain", headers=user)
        other = await http.post(path, b"x", "text/plain", headers=alice(key, tag))
        other_body = await http.post(path, b"y", "text/plain", headers=alice(key, tag))
        return [first, again, other, other_body]

    first, again, other, other_body = asyncio.run(run())
    assert first.status_code == 201 and not replayed(first)
    assert replayed(again) and seen(again) == seen(first)
    assert not CREDENTIALS & {k.lower() for k in again.headers}
    assert other.status_code == 201 and not replayed(other)
    assert other_body.status_code == 422
    assert len(home.rows(tag)) == 2


def test_an_aio_client_is_awaited_by_async_views(daemon: Daemon) -> None:
    key = new_key()
    ran: list[int] = []

    async def view(request: Any) -> HttpResponse:
        ran.append(1)
        return HttpResponse(b"made", status=201)

    async def run() -> list[Any]:
        store = aio.Client(daemon.socket)
        try:
            decorated = idempotent_view(view, store=store, namespace=f"aio-{key}")
            factory = RequestFactory()
            answers = []
            for _ in range(2):
                request = factory.post("/x", b"x", "text/plain", headers=alice(key, "aio"))
                answers.append(await decorated(request))
            return answers
        finally:
            await store.close()

    first, again = asyncio.run(run())
    assert (first.status_code, again.status_code) == (201, 201)
    assert replayed(again) and again.content == b"made" and ran == [1]


def test_a_sync_view_refuses_an_aio_client(tmp_path: Path) -> None:
    store = aio.Client(tmp_path / "unused.sock")
    decorated = idempotent_view(lambda request: HttpResponse(b"made"), store=store)
    request = RequestFactory().post("/x", b"x", "text/plain", headers=alice(new_key(), "a"))
    with pytest.raises(TypeError, match="sync store"):
        decorated(request)


# -- heartbeats ---------------------------------------------------------------------------


class Renewals:
    """A sync store whose renewals (``extend`` calls that succeeded) are counted."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def extend(self, *args: Any, **kwargs: Any) -> None:
        self.store.extend(*args, **kwargs)
        self.count += 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_view_slower_than_its_lease_keeps_its_key_under_a_heartbeat(
    tmp_path: Path, kind: str
) -> None:
    """The claim (2 s) is renewed every third of its lease while the view runs: after four
    renewals (more than a lease) a retry still gets 409, and the view ran once."""
    key = new_key()
    started, go = threading.Event(), threading.Event()
    ran: list[int] = []

    def answer() -> HttpResponse:
        ran.append(1)
        return HttpResponse(f"made {len(ran)}".encode(), status=201)

    def sync_view(request: Any) -> HttpResponse:
        started.set()
        go.wait(PATIENCE)
        return answer()

    async def async_view(request: Any) -> HttpResponse:
        started.set()
        await asyncio.to_thread(go.wait, PATIENCE)
        return answer()

    with DedupStore.open(tmp_path / "store") as inner:
        store = Renewals(inner)
        view = idempotent_view(
            sync_view if kind == "sync" else async_view,
            store=store,
            namespace=f"beat-{key}",
            heartbeat=True,
            lease=2.0,
        )

        def post() -> Any:
            request = RequestFactory().post("/x", b"x", "text/plain", headers=alice(key, "b"))
            response = view(request)
            return asyncio.run(response) if kind == "async" else response

        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post)
            assert started.wait(PATIENCE)
            wait_until(lambda: store.count >= 4, "four renewals of the held claim")
            busy = post()
            go.set()
            original = first.result(PATIENCE)
        again = post()
    assert busy.status_code == 409 and original.status_code == 201
    assert replayed(again) and again.content == original.content == b"made 1"
    assert ran == [1]


def test_heartbeat_needs_a_store_that_renews(tmp_path: Path) -> None:
    no_extend = Renewals(DaemonClient(tmp_path / "unused.sock"))
    no_extend.extend = None  # type: ignore[assignment,method-assign]
    with pytest.raises(TypeError, match="renews claims"):
        Idempotency(no_extend, heartbeat=True)
    assert Idempotency(no_extend).lease is None  # without a heartbeat, extend is not needed
    with DedupStore.open(tmp_path / "store") as store:
        assert Idempotency(store, heartbeat=True).lease == HEARTBEAT_LEASE
        assert Idempotency(store, heartbeat=True, lease=5.0).lease == 5.0


# -- the decorator --------------------------------------------------------------------------


@pytest.fixture
def views_only() -> Iterator[None]:
    """The project without the middleware: only decorated views take keys."""
    with override_settings(MIDDLEWARE=app_settings.WITHOUT_MIDDLEWARE):
        yield


@pytest.mark.parametrize("path", ["/view/orders", "/view/aorders"])
def test_a_decorated_view_replays_409s_and_422s(home: Home, views_only: None, path: str) -> None:
    key, tag, gate = new_key(), new_key(), new_key()
    held = alice(key, tag, **{"X-Gate": gate})
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(Client().post, path, b"x", "text/plain", headers=held)
        home.wait_started(gate)
        busy = Client().post(path, b"x", "text/plain", headers=alice(key, tag))
        home.open(gate)
        original = first.result(PATIENCE)
    again = Client().post(path, b"x", "text/plain", headers=alice(key, tag))
    other = Client().post(path, b"z", "text/plain", headers=alice(key, tag))
    bad = Client().post(path, b"x", "text/plain", headers=alice("", tag))
    plain = Client().post("/orders", b"x", "text/plain", headers=alice(key, tag))
    assert busy.status_code == 409 and original.status_code == 201
    assert replayed(again) and seen(again) == seen(original)
    assert other.status_code == 422 and bad.status_code == 400
    assert plain.status_code == 201 and not replayed(plain)  # no middleware: not keyed
    assert len(home.rows(tag)) == 2


def test_a_decorated_view_under_the_middleware_is_keyed_once(home: Home) -> None:
    key, tag = new_key(), new_key()
    http = Client()
    first = http.post("/view/orders", b"x", "text/plain", headers=alice(key, tag))
    again = http.post("/view/orders", b"x", "text/plain", headers=alice(key, tag))
    assert first.status_code == 201 and replayed(again)
    assert len(home.rows(tag)) == 1


def test_a_decorated_view_can_require_the_key(home: Home, views_only: None) -> None:
    tag = new_key()
    r = Client().post("/view/required", b"x", "text/plain", headers={"X-Tag": tag})
    assert r.status_code == 400 and r.json()["title"] == "Idempotency-Key is missing"
    assert home.rows(tag) == []


def test_an_unavailable_store_is_503_and_the_view_does_not_run(tmp_path: Path) -> None:
    ran: list[int] = []

    def view(request: Any) -> HttpResponse:
        ran.append(1)
        return HttpResponse(b"made", status=201)

    nowhere = DaemonClient(tmp_path / "no-daemon.sock", retries=0, timeout=5.0)
    decorated = idempotent_view(view, store=nowhere)
    request = RequestFactory().post("/x", b"x", "text/plain", headers=alice(new_key(), "u"))
    r = decorated(request)
    assert r.status_code == 503 and r["Retry-After"] == "5" and ran == []
    assert json.loads(r.content)["title"] == "Idempotency store unavailable"


def test_logs_name_a_key_by_its_hash(home: Home, tmp_path: Path, caplog: Any) -> None:
    key = new_key()
    nowhere = DaemonClient(tmp_path / "no-daemon.sock", retries=0, timeout=5.0)
    decorated = idempotent_view(lambda request: HttpResponse(b""), store=nowhere)
    with caplog.at_level("INFO", logger="dedupcore"):
        decorated(RequestFactory().post("/x", b"x", "text/plain", headers=alice(key, "l")))
    ref = key_ref(scoped_key(credentials_identity([b"Bearer alice"]), key))
    assert f"(key {ref})" in caplog.text and key not in caplog.text


def test_problems_link_to_the_documentation_when_asked(home: Home) -> None:
    base = "https://api.example.com/docs/idempotency#"
    key, tag = new_key(), new_key()
    with override_settings(DEDUPCORE_IDEMPOTENCY={"problem_base_url": base}):
        http = Client()
        bad = http.post("/orders", b"x", "text/plain", headers=alice("", tag))
        http.post("/orders", b"x", "text/plain", headers=alice(key, tag))
        reused = http.post("/orders", b"y", "text/plain", headers=alice(key, tag))
    assert bad.json()["type"] == base + "invalid-key"
    assert reused.json()["type"] == base + "key-reused"
    plain = Client().post("/orders", b"x", "text/plain", headers=alice("", tag))
    assert plain.json()["type"] == "about:blank"


def test_replay_drop_headers_is_configurable(home: Home) -> None:
    key, tag = new_key(), new_key()
    options = {"replay_drop_headers": ["set-cookie", "x-order-nonce"]}
    with override_settings(DEDUPCORE_IDEMPOTENCY=options):
        http = Client()
        first = http.post("/orders", b"x", "text/plain", headers=alice(key, tag))
        again = http.post("/orders", b"x", "text/plain", headers=alice(key, tag))
    assert "X-Order-Nonce" in first and "X-Order-Nonce" not in again
    assert replayed(again) and "Authentication-Info" in again  # not in this list


# -- settings ---------------------------------------------------------------------------


def test_settings_errors_are_precise(home: Home) -> None:
    with (
        override_settings(DEDUPCORE_STORE=None),
        pytest.raises(ImproperlyConfigured, match="DEDUPCORE_STORE"),
    ):
        store_from_settings()
    with (
        override_settings(DEDUPCORE_IDEMPOTENCY={"max_body_bytes": "big"}),
        pytest.raises(ImproperlyConfigured, match="max_body_bytes must be an int"),
    ):
        Client().post("/orders", b"x", "text/plain", headers=alice(new_key(), "s"))
    with (
        override_settings(DEDUPCORE_IDEMPOTENCY={"store": object()}),
        pytest.raises(ImproperlyConfigured, match="DEDUPCORE_STORE"),
    ):
        Client().post("/orders", b"x", "text/plain", headers=alice(new_key(), "s"))
    with pytest.raises(TypeError, match="claim/complete/release"):
        Idempotency(store=object())
    with pytest.raises(ValueError, match="namespace"):
        Idempotency(namespace="bad namespace!")


# -- a real server: uvicorn, two worker processes, the daemon -----------------------------


@dataclass
class Server:
    url: str
    home: Home
    mode: str  # "middleware" or "views"
    log: Path

    def path(self, name: str) -> str:
        return f"/view/{name}" if self.mode == "views" else f"/{name}"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=PATIENCE)


@pytest.fixture(scope="module", params=["middleware", "views"])
def server(
    request: pytest.FixtureRequest, daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp(f"django-{request.param}")
    (root / "gates").mkdir()
    log = root / "uvicorn.log"
    env = child_env()
    env.update(
        DEDUPCORE_SOCKET=str(daemon.socket),
        DJANGO_SETTINGS_MODULE="tests.integrations.django_app.settings",
        DJANGO_APP_MODE=request.param,
        DJANGO_APP_NAMESPACE=f"django/{uuid.uuid4().hex}",
        DJANGO_APP_EFFECTS=str(root / "effects.sqlite"),
        DJANGO_APP_GATES=str(root / "gates"),
    )
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "tests.integrations.django_app.asgi:application",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--workers",
        "2",
        "--lifespan",
        "off",
        "--http",
        "h11",
        "--loop",
        "asyncio",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        found: list[str] = []

        def listening() -> bool:
            assert proc.poll() is None, log.read_text()
            text = log.read_text()
            found[:] = re.findall(r"running on (http://127\.0\.0\.1:\d+)", text)
            return bool(found) and text.count("Started server process") >= 2

        wait_until(listening, "uvicorn's two workers")
        url = found[0]
        wait_until(lambda: _answers(url), "the server's first answer")
        yield Server(url, Home(root), request.param, log)
    finally:
        proc.terminate()
        try:
            proc.wait(PATIENCE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("view", ["orders", "aorders"])
def test_concurrent_retries_on_a_real_server_run_the_view_once(server: Server, view: str) -> None:
    key, tag = new_key(), new_key()
    n = 8
    barrier = threading.Barrier(n)
    body = b'{"amount": 5}'

    def go(_: int) -> httpx.Response:
        with server.client() as http:  # a connection each: the workers share them out
            barrier.wait(PATIENCE)
            return http.post(server.path(view), content=body, headers=alice(key, tag))

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(go, range(n)))
    assert len(server.home.rows(tag)) == 1, server.log.read_text()[-4000:]
    assert {r.status_code for r in answers} <= {201, 409}
    done = [r for r in answers if r.status_code == 201]
    assert sum(not replayed(r) for r in done) == 1  # the one that ran the view
    assert len({r.json()["nonce"] for r in done}) == 1
    with server.client() as http:
        again = http.post(server.path(view), content=body, headers=alice(key, tag))
    assert replayed(again) and not CREDENTIALS & set(again.headers)
    assert again.json()["nonce"] == server.home.rows(tag)[0][0]


def test_two_clients_with_one_key_on_a_real_server_run_separately(server: Server) -> None:
    key, tag = new_key(), new_key()
    n = 6
    barrier = threading.Barrier(n)
    tokens = ["Bearer alice", "Bearer bob"] * (n // 2)

    def go(i: int) -> httpx.Response:
        with server.client() as http:
            barrier.wait(PATIENCE)
            headers = alice(key, tag, Authorization=tokens[i])
            return http.post(server.path("orders"), content=b"same", headers=headers)

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(go, range(n)))
    rows = server.home.rows(tag)
    assert len(rows) == 2, rows
    with server.client() as http:
        a = http.post(server.path("orders"), content=b"same", headers=alice(key, tag))
        b = http.post(
            server.path("orders"),
            content=b"same",
            headers=alice(key, tag, Authorization="Bearer bob"),
        )
    assert replayed(a) and replayed(b)
    assert {a.json()["nonce"], b.json()["nonce"]} == {nonce for nonce, _ in rows}


@pytest.mark.parametrize("view", ["orders", "aorders"])
def test_a_client_that_goes_away_gets_the_response_on_its_retry(server: Server, view: str) -> None:
    key, tag, gate = new_key(), new_key(), new_key()
    headers = alice(key, tag, **{"X-Gate": gate})
    host, port = server.url.removeprefix("http://").split(":")
    body = b"gone"
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    request = (
        f"POST {server.path(view)} HTTP/1.1\r\nHost: {host}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\n{head}\r\n"
    ).encode() + body
    with socket.create_connection((host, int(port)), timeout=PATIENCE) as raw:
        raw.sendall(request)
        server.home.wait_started(gate)
    # The server has seen the client go (Django cancelled the request) before the view ends.
    wait_until((server.home.gates / f"{gate}.cancelled").exists, "the server to see the client go")
    with server.client() as http:  # the first request still holds its key
        early = http.post(server.path(view), content=body, headers=alice(key, tag))
    assert early.status_code == 409, early.text
    server.home.open(gate)
    wait_until(lambda: len(server.home.rows(tag)) == 1, "the first request's view to end")

    def settled() -> bool:
        with server.client() as http:
            r = http.post(server.path(view), content=body, headers=alice(key, tag))
        return r.status_code != 409

    wait_until(settled, "the first request's response to be recorded")
    with server.client() as http:
        retry = http.post(server.path(view), content=body, headers=alice(key, tag))
    rows = server.home.rows(tag)
    assert len(rows) == 1
    assert retry.status_code == 201 and replayed(retry)
    assert retry.json()["nonce"] == rows[0][0]


def test_without_django_the_module_names_the_extra(tmp_path: Path) -> None:
    """In a process where Django cannot be imported: MissingExtraError with the pip line,
    and the rest of the package (the ASGI middleware among it) still imports."""
    script = tmp_path / "check.py"
    script.write_text(
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('django', 'asgiref'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import dedupcore, dedupcore.integrations, dedupcore.http\n"
        "from dedupcore.errors import MissingExtraError\n"
        "try:\n"
        "    import dedupcore.integrations.django\n"
        "except MissingExtraError as exc:\n"
        "    print(exc)\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == (
        "dedupcore.integrations.django needs django, which is not installed: "
        "pip install 'dedupcore[django]'"
    )
