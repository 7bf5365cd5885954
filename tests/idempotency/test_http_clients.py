"""Keys belong to clients: two clients (different credentials) through a real uvicorn.

A key is scoped by the credentials of the client that sent it, a replay
carries none of the first caller's credentials, logs never hold a key as
sent, and problem documents link to documentation when asked to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from dedupcore import DedupStore
from dedupcore.http import (
    DEFAULT_REPLAY_DROP_HEADERS,
    PROBLEMS,
    IdempotencyMiddleware,
    credentials_identity,
    key_ref,
    scoped_key,
)
from dedupcore.http.protocol import problem_types

from .http_apps import (
    ALICE,
    BOB,
    CREDENTIAL_HEADERS,
    PATIENCE,
    Effects,
    Server,
    Site,
    app_view,
    is_replay,
    new_key,
    serve,
)

DOCS = "https://api.example.com/docs/idempotency#"


def test_another_client_with_the_same_key_and_body_gets_its_own_execution(site: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag}
    with site.client(ALICE) as alice, site.client(BOB) as bob:
        a1 = alice.post("/orders", content=b"same", headers=headers)
        b1 = bob.post("/orders", content=b"same", headers=headers)
        a2 = alice.post("/orders", content=b"same", headers=headers)
        b2 = bob.post("/orders", content=b"same", headers=headers)
    rows = site.effects.rows(tag)
    assert len(rows) == 2
    assert a1.status_code == b1.status_code == 201
    assert not is_replay(a1) and not is_replay(b1)
    assert a1.json()["nonce"] != b1.json()["nonce"]
    assert {a1.json()["nonce"], b1.json()["nonce"]} == {nonce for nonce, _ in rows}
    # Each client's retry gets its own response back.
    assert is_replay(a2) and app_view(a2) == app_view(a1)
    assert is_replay(b2) and app_view(b2) == app_view(b1)


def test_a_replay_carries_no_credentials_of_the_first_caller(site: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag}
    with site.client(ALICE) as alice, site.client(BOB) as bob:
        first = alice.post("/session", content=b"login", headers=headers)
        replay = alice.post("/session", content=b"login", headers=headers)
        other = bob.post("/session", content=b"login", headers=headers)
        other_replay = bob.post("/session", content=b"login", headers=headers)
    nonce = first.json()["nonce"]
    # The first response carries the session; the replay has everything else of it.
    assert set(first.headers) >= CREDENTIAL_HEADERS
    assert is_replay(replay) and replay.content == first.content
    assert replay.headers["x-order-nonce"] == nonce
    assert not CREDENTIAL_HEADERS & set(replay.headers), replay.headers
    assert "set-cookie" not in {k.lower() for k, _ in replay.headers.multi_items()}
    # The other client ran on its own and never saw the first one's session.
    assert other.status_code == 201 and not is_replay(other)
    assert nonce not in other.text and nonce not in str(other.headers)
    assert is_replay(other_replay) and nonce not in str(other_replay.headers)
    assert not CREDENTIAL_HEADERS & set(other_replay.headers)
    assert len(site.effects.rows(tag)) == 2


def test_a_request_without_credentials_is_refused_unless_keys_are_shared(tmp_path: Path) -> None:
    effects = Effects(tmp_path / "effects.sqlite")
    key = new_key()
    headers = {"Idempotency-Key": key, "X-Tag": "anon"}
    with (
        DedupStore.open(tmp_path / "store") as store,
        serve("fastapi", store, effects, namespace="scoped") as scoped,
        serve("starlette", store, effects, namespace="shared", key_scope=lambda s: "") as shared,
    ):
        with httpx.Client(base_url=scoped.url, timeout=PATIENCE) as anonymous:
            refused = anonymous.post("/orders", content=b"p", headers=headers)
            keyless = anonymous.post("/orders", content=b"p", headers={"X-Tag": "anon"})
        assert refused.status_code == 400
        assert refused.json()["title"] == "Idempotency-Key needs a client identity"
        assert keyless.status_code == 201  # without a key nothing is deduplicated
        assert len(effects.rows("anon")) == 1
        # key_scope=lambda scope: "" shares keys (unsafe): the other client gets the
        # first one's response, still without its credentials.
        with (
            httpx.Client(base_url=shared.url, timeout=PATIENCE, headers=ALICE) as alice,
            httpx.Client(base_url=shared.url, timeout=PATIENCE, headers=BOB) as bob,
        ):
            a = alice.post("/session", content=b"p", headers={**headers, "X-Tag": "shared"})
            b = bob.post("/session", content=b"p", headers={**headers, "X-Tag": "shared"})
    assert a.status_code == 201 and is_replay(b)
    assert b.json()["nonce"] == a.json()["nonce"]
    assert not CREDENTIAL_HEADERS & set(b.headers)
    assert len(effects.rows("shared")) == 1


def test_the_scope_and_store_key_are_documented_functions() -> None:
    alice = credentials_identity([ALICE["Authorization"].encode()])
    assert alice is not None and alice.startswith("authorization:")
    assert credentials_identity([]) is None
    assert credentials_identity([BOB["Authorization"].encode()]) != alice
    # A key from two clients is two store keys; logs name each by 12 hex digits of it.
    a, b = scoped_key(alice, "k"), scoped_key("someone else", "k")
    assert a != b and a.startswith("scoped:") and a.startswith("scoped:" + key_ref(a))
    assert len(key_ref(a)) == 12 and key_ref(a) != key_ref(b)
    assert {"set-cookie", "authorization"} <= DEFAULT_REPLAY_DROP_HEADERS
    assert problem_types(None)["in-progress"] == "about:blank"
    assert problem_types(DOCS)["key-reused"] == DOCS + "key-reused"
    assert problem_types({"in-progress": "https://x/409"})["in-progress"] == "https://x/409"
    with pytest.raises(ValueError, match="unknown problems"):
        problem_types({"nope": "https://x"})


class Takeover:
    """Client A's request runs past its lease; A's retry takes the key over and runs.

    The first attempt is held at a gate until the retry's own attempt has started
    (the lease ran out and the store handed the key over); then the first attempt
    finishes with a stale claim, which the middleware logs.
    """

    def __init__(self, url: str, path: str, key: str, credentials: dict[str, str]) -> None:
        self.url, self.path, self.key = url, path, key
        self.tag = f"t-{key}"
        self.credentials = credentials
        self.pool = ThreadPoolExecutor(4)

    def post(self, gate: str, **extra: str) -> Future[httpx.Response]:
        headers = {"Idempotency-Key": self.key, "X-Tag": self.tag, "X-Gate": gate, **extra}

        def go() -> httpx.Response:
            with httpx.Client(base_url=self.url, timeout=PATIENCE, headers=self.credentials) as c:
                return c.post(self.path, content=b"slow", headers=headers)

        return self.pool.submit(go)


@pytest.fixture
def slow_server(tmp_path: Path) -> Iterator[tuple[Server, Effects, str]]:
    """A server whose claims hold for 0.3 s, so a held request loses its lease."""
    effects = Effects(tmp_path / "effects.sqlite")
    with (
        DedupStore.open(tmp_path / "store") as store,
        serve("starlette", store, effects, namespace="slow", lease=0.3) as server,
    ):
        yield server, effects, "slow"


@pytest.mark.parametrize("path", ["/orders", "/flaky"])
def test_logs_name_keys_by_a_hash_never_as_sent(
    slow_server: tuple[Server, Effects, str], path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease runs out under a held request: completing (``/orders``) or releasing
    (``/flaky``, whose first execution fails) its stale claim is logged."""
    server, effects, _ = slow_server
    key = f"raw-key-{new_key()}"
    caplog.set_level(logging.WARNING, logger="dedupcore")
    run = Takeover(server.url, path, key, ALICE)
    first_gate, second_gate = new_key(), new_key()
    first = run.post(first_gate, **{"X-Fail": "500"})
    assert effects.started_event(first_gate).wait(PATIENCE)
    # Retry until the lease has run out and the retry's own attempt starts.
    deadline = time.monotonic() + PATIENCE
    while True:
        second = run.post(second_gate, **{"X-Fail": "500"})
        while not (second.done() or effects.started_event(second_gate).is_set()):
            time.sleep(0.01)
        if effects.started_event(second_gate).is_set():
            break
        assert second.result().status_code == 409, second.result().text
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.05)
    # Meanwhile client B, with the same key, runs on its own (its key is not A's).
    with httpx.Client(base_url=server.url, timeout=PATIENCE, headers=BOB) as bob:
        b = bob.post(path, content=b"slow", headers={"Idempotency-Key": key, "X-Tag": "b"})
    assert b.status_code in (201, 500) and not is_replay(b)
    effects.gate(first_gate).set()
    first.result(PATIENCE)
    effects.gate(second_gate).set()
    assert second.result(PATIENCE).status_code == 201
    run.pool.shutdown()
    alice_identity = credentials_identity([ALICE["Authorization"].encode()])
    assert alice_identity is not None
    ref = key_ref(scoped_key(alice_identity, key))
    ours = [r for r in caplog.records if r.name == "dedupcore"]
    stale = [r for r in ours if ref in r.getMessage()]
    assert stale, [r.getMessage() for r in ours]
    assert "lease" in stale[0].getMessage()
    for record in ours:
        assert key not in record.getMessage()
        assert key not in (record.exc_text or "")
    assert key not in caplog.text


def test_store_unavailable_is_logged_without_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dedupcore import Client

    effects = Effects(tmp_path / "effects.sqlite")
    key = f"raw-key-{new_key()}"
    caplog.set_level(logging.ERROR, logger="dedupcore")
    with (
        Client(tmp_path / "no-daemon.sock", retries=0) as gone,
        serve("starlette", gone, effects) as server,
    ):
        for who in (ALICE, BOB):
            with httpx.Client(base_url=server.url, timeout=PATIENCE, headers=who) as http:
                r = http.post("/orders", content=b"p", headers={"Idempotency-Key": key})
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert effects.rows("orders") == []
    lines = [r.getMessage() for r in caplog.records if r.name == "dedupcore"]
    assert len(lines) == 2 and all("unavailable" in line for line in lines)
    assert all(key not in line for line in lines)
    assert key not in caplog.text


def test_problem_documents_link_to_the_documentation_when_configured(tmp_path: Path) -> None:
    effects = Effects(tmp_path / "effects.sqlite")
    key, gate = new_key(), new_key()
    with (
        DedupStore.open(tmp_path / "store") as store,
        serve("fastapi", store, effects, required=True, problem_base_url=DOCS) as linked,
        serve("starlette", store, effects, namespace="plain") as plain,
        ThreadPoolExecutor(2) as pool,
    ):
        with (
            httpx.Client(base_url=linked.url, timeout=PATIENCE, headers=ALICE) as alice,
            httpx.Client(base_url=linked.url, timeout=PATIENCE, headers=BOB) as bob,
            httpx.Client(base_url=linked.url, timeout=PATIENCE) as anonymous,
        ):
            answers: dict[str, httpx.Response] = {}
            answers["missing-key"] = alice.post("/orders", content=b"p", headers={"X-Tag": "p"})
            answers["invalid-key"] = bob.post("/orders", headers={"Idempotency-Key": "k" * 256})
            answers["no-client-identity"] = anonymous.post(
                "/orders", headers={"Idempotency-Key": key}
            )
            held = {"Idempotency-Key": key, "X-Tag": "p", "X-Gate": gate}
            first = pool.submit(alice.post, "/orders", content=b"p", headers=held)
            assert effects.started_event(gate).wait(PATIENCE)
            answers["in-progress"] = alice.post("/orders", content=b"p", headers=held)
            # Bob's key is his own: not in progress, it runs.
            bob_run = bob.post("/orders", content=b"p", headers={"Idempotency-Key": key})
            effects.gate(gate).set()
            assert first.result(PATIENCE).status_code == 201
            answers["key-reused"] = alice.post("/orders", content=b"q", headers=held)
        with httpx.Client(base_url=plain.url, timeout=PATIENCE, headers=ALICE) as http:
            unlinked = http.post("/orders", headers={"Idempotency-Key": "k" * 256})
    assert bob_run.status_code == 201 and not is_replay(bob_run)
    for slug, r in answers.items():
        status, title = PROBLEMS[slug]
        assert r.status_code == status, (slug, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json() == {
            "type": DOCS + slug,
            "title": title,
            "status": status,
            "detail": r.json()["detail"],
        }
    assert unlinked.json()["type"] == "about:blank"


def test_bad_options_are_refused(tmp_path: Path) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError

    with DedupStore.open(tmp_path / "store") as store:
        with pytest.raises(TypeError, match="key_scope must be a callable"):
            IdempotencyMiddleware(app, store, key_scope="user")
        with pytest.raises(ValueError, match="header name"):
            IdempotencyMiddleware(app, store, replay_drop_headers=["set-cookie", ""])
        with pytest.raises(TypeError, match="collection of header names"):
            IdempotencyMiddleware(app, store, replay_drop_headers="set-cookie")
        with pytest.raises(ValueError, match="unknown problems"):
            IdempotencyMiddleware(app, store, problem_base_url={"teapot": "https://x"})
        with pytest.raises(ValueError, match="problem_base_url"):
            IdempotencyMiddleware(app, store, problem_base_url="has space")
