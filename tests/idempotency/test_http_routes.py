"""Idempotency per route through a real uvicorn: ``Depends(Idempotent(...))`` on FastAPI
routes of an ``IdempotentRoute`` router, ``Idempotency.endpoint`` on Starlette endpoints.

Each behaviour is checked with two clients (different credentials); executions are
counted as the handlers' SQLite rows (tests/idempotency/http_apps.py).
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from dedupcore import Client, DedupStore
from dedupcore.http import Idempotency

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
    serve_routes,
)

#: (framework, store): FastAPI over the embedded store, Starlette through the daemon.
KINDS = ("fastapi-embedded", "starlette-daemon")


@pytest.fixture(scope="module", params=KINDS)
def routed(request: pytest.FixtureRequest) -> Iterator[Site]:
    """A server whose routes are idempotent one by one (``required=True``), and ``/free``."""
    kind, store_kind = request.param.split("-")
    home = Path(tempfile.mkdtemp(prefix="dcroute"))
    effects = Effects(home / "effects.sqlite")
    ns = f"routes/{uuid.uuid4().hex}"
    store: Any = (
        DedupStore.open(home / "store")
        if store_kind == "embedded"
        else request.getfixturevalue("daemon").client()
    )
    try:
        with serve_routes(kind, store, effects, namespace=ns, required=True) as server:
            yield Site(server.url, effects, store, ns)
    finally:
        store.close()


def test_replay_and_another_clients_own_execution(routed: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag}
    with routed.client(ALICE) as alice, routed.client(BOB) as bob:
        first = alice.post("/orders", content=b"buy", headers=headers)
        replay = alice.post("/orders", content=b"buy", headers=headers)
        other = bob.post("/orders", content=b"buy", headers=headers)
        other_replay = bob.post("/orders", content=b"buy", headers=headers)
    assert first.status_code == 201 and not is_replay(first)
    assert is_replay(replay) and app_view(replay) == app_view(first)
    assert other.status_code == 201 and not is_replay(other)
    assert other.json()["nonce"] != first.json()["nonce"]
    assert is_replay(other_replay) and app_view(other_replay) == app_view(other)
    assert len(routed.effects.rows(tag)) == 2


def test_a_route_without_the_handling_runs_every_time(routed: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    with routed.client(ALICE) as alice, routed.client(BOB) as bob:
        answers = [
            http.post("/free", content=b"p", headers={"Idempotency-Key": key, "X-Tag": tag})
            for http in (alice, alice, bob)
        ]
        keyless = alice.post("/free", content=b"p", headers={"X-Tag": tag})
    assert [r.status_code for r in answers] == [201, 201, 201]
    assert not any(is_replay(r) for r in answers)
    assert keyless.status_code == 201
    assert len(routed.effects.rows(tag)) == 4


def test_replays_carry_no_credentials(routed: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag}
    with routed.client(ALICE) as alice, routed.client(BOB) as bob:
        first = alice.post("/session", content=b"login", headers=headers)
        replay = alice.post("/session", content=b"login", headers=headers)
        other = bob.post("/session", content=b"login", headers=headers)
    assert set(first.headers) >= CREDENTIAL_HEADERS
    assert is_replay(replay) and replay.content == first.content
    assert not CREDENTIAL_HEADERS & set(replay.headers)
    assert other.status_code == 201 and first.json()["nonce"] not in str(other.headers)
    assert len(routed.effects.rows(tag)) == 2


def test_bad_or_missing_keys_and_credentials_are_400(routed: Site) -> None:
    tag = f"t-{new_key()}"
    with (
        routed.client(ALICE) as alice,
        routed.client(BOB) as bob,
        routed.client({}) as anonymous,
    ):
        missing = alice.post("/orders", content=b"p", headers={"X-Tag": tag})
        bad = bob.post("/orders", content=b"p", headers={"Idempotency-Key": "", "X-Tag": tag})
        two = bob.post(
            "/orders",
            content=b"p",
            headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b"), ("X-Tag", tag)],
        )
        nobody = anonymous.post(
            "/orders", content=b"p", headers={"Idempotency-Key": "k", "X-Tag": tag}
        )
    for r, title in [
        (missing, "Idempotency-Key is missing"),
        (bad, "Invalid Idempotency-Key"),
        (two, "Invalid Idempotency-Key"),
        (nobody, "Idempotency-Key needs a client identity"),
    ]:
        assert r.status_code == 400, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["title"] == title
    assert routed.effects.rows(tag) == []


def test_a_key_in_progress_is_409_for_its_client_only(routed: Site) -> None:
    key, gate = new_key(), new_key()
    tag = f"t-{key}"
    held = {"Idempotency-Key": key, "X-Tag": tag, "X-Gate": gate}
    with routed.client(ALICE) as alice, routed.client(BOB) as bob, ThreadPoolExecutor(2) as pool:
        first = pool.submit(alice.post, "/orders", content=b"p", headers=held)
        assert routed.effects.started_event(gate).wait(PATIENCE)
        retry = alice.post("/orders", content=b"p", headers=held)
        others = bob.post("/orders", content=b"p", headers={"Idempotency-Key": key, "X-Tag": tag})
        routed.effects.gate(gate).set()
        original = first.result(PATIENCE)
        after = alice.post("/orders", content=b"p", headers=held)
    assert retry.status_code == 409 and retry.headers["retry-after"] == "1"
    assert retry.json()["title"] == "Request in progress"
    assert others.status_code == 201 and not is_replay(others)
    assert original.status_code == 201
    assert is_replay(after) and app_view(after) == app_view(original)
    assert len(routed.effects.rows(tag)) == 2


def test_the_same_key_with_another_body_is_422(routed: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag}
    with routed.client(ALICE) as alice, routed.client(BOB) as bob:
        assert alice.post("/orders", content=b"a", headers=headers).status_code == 201
        reused = alice.post("/orders", content=b"b", headers=headers)
        elsewhere = alice.post("/reject", content=b"a", headers=headers)
        # Bob's key is his own: the other body is a first request for him.
        bobs = bob.post("/orders", content=b"b", headers=headers)
    for r in (reused, elsewhere):
        assert r.status_code == 422, r.text
        assert r.json()["title"] == "Idempotency-Key reused"
    assert bobs.status_code == 201 and not is_replay(bobs)
    assert sorted(body for _, body in routed.effects.rows(tag)) == [b"a", b"b"]


def test_failures_release_the_key(routed: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag, "X-Fail": "raise"}
    with routed.client(ALICE) as alice, routed.client(BOB) as bob:
        failed = alice.post("/flaky", content=b"p", headers={**headers, "Connection": "close"})
        again = alice.post("/flaky", content=b"p", headers=headers)
        replay = alice.post("/flaky", content=b"p", headers=headers)
        bobs = bob.post("/flaky", content=b"p", headers=headers)
    assert failed.status_code == 500
    assert again.status_code == 201 and not is_replay(again)
    assert is_replay(replay) and app_view(replay) == app_view(again)
    assert bobs.status_code == 201 and not is_replay(bobs)
    assert len(routed.effects.rows(tag)) == 3


def test_fastapi_parses_the_body_the_handling_read(tmp_path: Path) -> None:
    """FastAPI validates the body the handling read; its 422 (an exception) releases the key."""
    effects = Effects(tmp_path / "effects.sqlite")
    key = new_key()
    headers = {"Idempotency-Key": key, "X-Tag": "typed"}
    order = {"sku": "A-1", "quantity": 2}
    with (
        DedupStore.open(tmp_path / "store") as store,
        serve_routes("fastapi", store, effects) as server,
        httpx.Client(base_url=server.url, timeout=PATIENCE, headers=ALICE) as alice,
        httpx.Client(base_url=server.url, timeout=PATIENCE, headers=BOB) as bob,
    ):
        first = alice.post("/typed", json=order, headers=headers)
        replay = alice.post("/typed", json=order, headers=headers)
        invalid = bob.post("/typed", json={"sku": "A-1"}, headers=headers)
        fixed = bob.post("/typed", json=order, headers=headers)
    assert first.status_code == 201 and first.json()["quantity"] == 2
    assert is_replay(replay) and app_view(replay) == app_view(first)
    assert invalid.status_code == 422 and invalid.json()["detail"][0]["loc"][-1] == "quantity"
    assert fixed.status_code == 201 and not is_replay(fixed)
    assert fixed.json()["nonce"] != first.json()["nonce"]
    assert len(effects.rows("typed")) == 2


@pytest.mark.parametrize("kind", ["fastapi", "starlette"])
def test_store_unavailable_is_503_and_nothing_runs(kind: str, tmp_path: Path) -> None:
    effects = Effects(tmp_path / "effects.sqlite")
    with (
        Client(tmp_path / "no-daemon.sock", retries=0) as gone,
        serve_routes(kind, gone, effects) as server,
    ):
        answers = []
        for who in (ALICE, BOB):
            with httpx.Client(base_url=server.url, timeout=PATIENCE, headers=who) as http:
                answers.append(
                    http.post("/orders", content=b"p", headers={"Idempotency-Key": new_key()})
                )
    for r in answers:
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["title"] == "Idempotency store unavailable"
    assert effects.rows("orders") == []


def test_the_dependency_refuses_to_run_outside_an_idempotent_route(tmp_path: Path) -> None:
    from fastapi import Depends, FastAPI

    from dedupcore.http.fastapi import Idempotent

    effects = Effects(tmp_path / "effects.sqlite")
    with DedupStore.open(tmp_path / "store") as store:
        idempotent = Idempotent(Idempotency(store))
        api = FastAPI()  # its routes are plain APIRoutes

        @api.post("/orders", dependencies=[Depends(idempotent)])
        async def orders() -> dict[str, str]:
            effects.record("plain", b"")
            return {"ran": "yes"}

        with (
            Server(api) as server,
            httpx.Client(base_url=server.url, timeout=PATIENCE, headers=ALICE) as http,
        ):
            r = http.post("/orders", headers={"Idempotency-Key": "k", "Connection": "close"})
    assert r.status_code == 500
    assert effects.rows("plain") == []
    with pytest.raises(TypeError, match="options go to Idempotency"):
        Idempotent(Idempotency(store), required=True)
