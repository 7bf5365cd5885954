"""IdempotencyMiddleware through a real uvicorn, for Starlette and FastAPI apps.

Executions are counted as SQLite rows written by the handlers, so "ran once"
is checked independently of what the middleware answers.
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from dedupcore import DedupStore
from dedupcore.http import IdempotencyMiddleware, parse_key

from .http_apps import ALICE, MAX_BODY, PATIENCE, Effects, Site, app_view, is_replay, new_key, serve


def test_retries_while_running_get_409_then_the_first_response(site: Site) -> None:
    key, gate = new_key(), new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Gate": gate, "X-Tag": tag}
    body = b'{"amount": 10}'
    with site.client() as http, ThreadPoolExecutor(8) as pool:
        first = pool.submit(http.post, "/orders", content=body, headers=headers)
        assert site.effects.started_event(gate).wait(PATIENCE)
        retries = list(
            pool.map(lambda _: http.post("/orders", content=body, headers=headers), range(6))
        )
        assert [r.status_code for r in retries] == [409] * 6
        assert all(r.headers["retry-after"] == "1" for r in retries)
        assert retries[0].headers["content-type"] == "application/problem+json"
        assert retries[0].json()["status"] == 409
        site.effects.gate(gate).set()
        original = first.result()
        assert original.status_code == 201 and not is_replay(original)
        replays = list(
            pool.map(lambda _: http.post("/orders", content=body, headers=headers), range(4))
        )
    rows = site.effects.rows(tag)
    assert len(rows) == 1
    assert original.json()["nonce"] == rows[0][0]
    for r in replays:
        assert is_replay(r)
        assert app_view(r) == app_view(original)


def test_racing_identical_requests_run_once(site: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag}
    n = 8
    barrier = threading.Barrier(n)

    def go(_: int) -> httpx.Response:
        with site.client() as http:
            barrier.wait(PATIENCE)
            return http.post("/orders", content=b"same", headers=headers)

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(go, range(n)))
    assert len(site.effects.rows(tag)) == 1
    done = [r for r in answers if r.status_code != 409]
    assert done, [r.status_code for r in answers]
    assert all(app_view(r) == app_view(done[0]) for r in done)
    assert sum(not is_replay(r) for r in answers if r.status_code == 201) <= 1
    with site.client() as http:
        again = http.post("/orders", content=b"same", headers=headers)
    assert is_replay(again) and app_view(again) == app_view(done[0])


def test_key_reused_for_another_payload_is_422(site: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag}
    with site.client() as http:
        assert http.post("/orders", content=b"a", headers=headers).status_code == 201
        for method, path, body in [
            ("POST", "/orders", b"b"),
            ("POST", "/orders?x=1", b"a"),
            ("PATCH", "/orders", b"a"),
            ("POST", "/reject", b"a"),
        ]:
            r = http.request(method, path, content=body, headers=headers)
            assert r.status_code == 422, (method, path, r.text)
            assert r.json()["title"] == "Idempotency-Key reused"
        assert is_replay(http.post("/orders", content=b"a", headers=headers))
    assert len(site.effects.rows(tag)) == 1


def test_binary_bodies_and_streamed_uploads(site: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    body = bytes(range(256)) * 40
    headers = {"Idempotency-Key": key, "X-Tag": tag, "Content-Type": "application/octet-stream"}

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    with site.client() as http:
        first = http.post("/orders", content=body, headers=headers)
        # The same bytes, chunked without a Content-Length: the same request.
        again = http.post("/orders", content=chunks(), headers=headers)
    assert first.status_code == 201
    assert is_replay(again) and app_view(again) == app_view(first)
    rows = site.effects.rows(tag)
    assert len(rows) == 1 and rows[0][1] == body


def test_oversized_bodies_are_413_and_never_run(site: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag}
    body = b"x" * (MAX_BODY + 1)
    with site.client() as http:
        r = http.post("/orders", content=body, headers=headers)
        assert r.status_code == 413 and "65536" in r.json()["detail"]
        streamed = http.post("/orders", content=iter([body[:40000], body[40000:]]), headers=headers)
        assert streamed.status_code == 413
        # Without a key the middleware does not limit the body.
        plain = http.post("/orders", content=body, headers={"X-Tag": tag})
        assert plain.status_code == 201
        # The key was never claimed: a request within the limit runs.
        ok = http.post("/orders", content=b"x" * MAX_BODY, headers=headers)
        assert ok.status_code == 201 and not is_replay(ok)
    assert len(site.effects.rows(tag)) == 2


def test_lost_response_is_replayed_to_the_retry(site: Site) -> None:
    key, gate = new_key(), new_key()
    tag = f"t-{key}"
    body = b"transfer 5"
    port = int(site.url.rsplit(":", 1)[1])
    # A client that sends its request and goes away before the answer.
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as sock:
        sock.sendall(
            b"POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: " + key.encode() + b"\r\n"
            b"Authorization: " + ALICE["Authorization"].encode() + b"\r\n"
            b"X-Gate: " + gate.encode() + b"\r\nX-Tag: " + tag.encode() + b"\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        assert site.effects.started_event(gate).wait(PATIENCE)
    headers = {"Idempotency-Key": key, "X-Tag": tag}
    with site.client() as http:
        assert http.post("/orders", content=body, headers=headers).status_code == 409
        site.effects.gate(gate).set()
        deadline = time.monotonic() + PATIENCE
        while (r := http.post("/orders", content=body, headers=headers)).status_code == 409:
            assert time.monotonic() < deadline, "the first request never finished"
            time.sleep(0.02)
    rows = site.effects.rows(tag)
    assert len(rows) == 1
    assert r.status_code == 201 and is_replay(r)
    assert r.json()["nonce"] == rows[0][0] == r.headers["x-order-nonce"]


@pytest.mark.parametrize("mode", ["500", "503", "raise", "429"])
def test_failures_release_the_key(site: Site, mode: str) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag, "X-Fail": mode}
    with site.client() as http:
        # Starlette answers 500 and re-raises; uvicorn then drops the connection.
        first = http.post("/flaky", content=b"p", headers={**headers, "Connection": "close"})
        assert first.status_code == (500 if mode == "raise" else int(mode))
        second = http.post("/flaky", content=b"p", headers=headers)
        assert second.status_code == 201 and not is_replay(second)
        third = http.post("/flaky", content=b"p", headers=headers)
    assert is_replay(third) and app_view(third) == app_view(second)
    assert len(site.effects.rows(tag)) == 2


def test_client_errors_are_recorded_and_replayed(site: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag}
    with site.client() as http:
        first = http.post("/reject", content=b"p", headers=headers)
        again = http.post("/reject", content=b"p", headers=headers)
    assert first.status_code == 400 and not is_replay(first)
    assert is_replay(again) and app_view(again) == app_view(first)
    assert len(site.effects.rows(tag)) == 1


def test_responses_too_large_to_record_are_never_replayed(site: Site) -> None:
    key = new_key()
    tag = f"t-{key}"
    headers = {"Idempotency-Key": key, "X-Tag": tag, "X-Size": "100000"}
    with site.client() as http:
        first = http.post("/big", content=b"p", headers=headers)
        assert first.status_code == 200 and len(first.content) >= 100_000
        again = http.post("/big", content=b"p", headers=headers)
        assert again.status_code == 422
        assert again.json()["title"] == "Response not replayable"
        assert "larger than" in again.json()["detail"]
        # A response that fits is replayed.
        small = {"Idempotency-Key": new_key(), "X-Tag": tag, "X-Size": "1000"}
        a = http.post("/big", content=b"p", headers=small)
        b = http.post("/big", content=b"p", headers=small)
        assert is_replay(b) and app_view(a) == app_view(b)
    assert len(site.effects.rows(tag)) == 2


def test_malformed_keys_are_400(site: Site) -> None:
    tag = f"t-{new_key()}"
    with site.client() as http:
        for bad in ["k" * 256, "", '"unterminated\\"']:
            r = http.post("/orders", content=b"p", headers={"Idempotency-Key": bad, "X-Tag": tag})
            assert r.status_code == 400, bad
            assert r.json()["title"] == "Invalid Idempotency-Key"
        two = [("Idempotency-Key", "a"), ("Idempotency-Key", "b"), ("X-Tag", tag)]
        r = http.post("/orders", content=b"p", headers=two)
        assert r.status_code == 400 and "2 idempotency-key headers" in r.json()["detail"]
        # A quoted structured-field string is the same key as the bare one.
        key = new_key()
        bare = http.post("/orders", content=b"p", headers={"Idempotency-Key": key, "X-Tag": tag})
        quoted = http.post(
            "/orders", content=b"p", headers={"Idempotency-Key": f'"{key}"', "X-Tag": tag}
        )
        assert bare.status_code == 201 and is_replay(quoted)
        assert app_view(quoted) == app_view(bare)
        # 255 characters are fine.
        r = http.post("/orders", content=b"p", headers={"Idempotency-Key": "k" * 255, "X-Tag": tag})
        assert r.status_code == 201
    assert len(site.effects.rows(tag)) == 2


def test_other_methods_and_keyless_requests_pass_through(site: Site) -> None:
    tag = f"t-{new_key()}"
    with site.client() as http:
        for _ in range(2):
            r = http.get("/orders", headers={"Idempotency-Key": "same", "X-Tag": tag})
            assert r.status_code == 201 and not is_replay(r)
            r = http.post("/orders", content=b"p", headers={"X-Tag": tag})
            assert r.status_code == 201 and not is_replay(r)
    assert len(site.effects.rows(tag)) == 4


def test_required_key(tmp_path: Path) -> None:
    effects = Effects(tmp_path / "effects.sqlite")
    with (
        DedupStore.open(tmp_path / "store") as store,
        serve("fastapi", store, effects, required=True) as server,
        httpx.Client(base_url=server.url, timeout=PATIENCE, headers=ALICE) as http,
    ):
        r = http.post("/orders", content=b"p", headers={"X-Tag": "req"})
        assert r.status_code == 400
        assert r.json()["title"] == "Idempotency-Key is missing"
        assert r.headers["content-type"] == "application/problem+json"
        assert http.get("/orders", headers={"X-Tag": "req"}).status_code == 201  # not covered
        ok = http.post("/orders", content=b"p", headers={"X-Tag": "req", "Idempotency-Key": "a"})
        assert ok.status_code == 201
    assert len(effects.rows("req")) == 2


def test_keys_scoped_per_client(tmp_path: Path) -> None:
    effects = Effects(tmp_path / "effects.sqlite")

    def who(scope: Any) -> str | None:
        return dict(scope["headers"]).get(b"x-user", b"").decode() or None

    with (
        DedupStore.open(tmp_path / "store") as store,
        serve("starlette", store, effects, key_scope=who) as server,
        httpx.Client(base_url=server.url, timeout=PATIENCE) as http,
    ):
        answers = []
        for user in ("alice", "bob", "alice"):
            h = {"Idempotency-Key": "k1", "X-Tag": "scoped", "X-User": user}
            answers.append(http.post("/orders", content=b"p", headers=h))
        # No identity (key_scope says None): refused, not shared with anyone.
        anonymous = http.post("/orders", content=b"p", headers={"Idempotency-Key": "k1"})
    assert [r.status_code for r in answers] == [201, 201, 201]
    assert [is_replay(r) for r in answers] == [False, False, True]
    assert app_view(answers[2]) == app_view(answers[0])
    assert anonymous.status_code == 400
    assert anonymous.json()["title"] == "Idempotency-Key needs a client identity"
    assert len(effects.rows("scoped")) == 2
    assert len(effects.rows("orders")) == 0


def test_parse_key_and_arguments() -> None:
    assert parse_key(b"abc") == "abc"
    assert parse_key(b' "a\\"b\\\\c" ') == 'a"b\\c'
    assert parse_key(b"with space") == "with space"
    for bad in [b"", b'""', b"k" * 256, b"caf\xc3\xa9", b"a\x01b", b'"a"b"', b'"a\\x"']:
        with pytest.raises(ValueError):
            parse_key(bad)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError

    with pytest.raises(TypeError, match="claim/complete/release"):
        IdempotencyMiddleware(app, object())
    with tempfile.TemporaryDirectory() as d, DedupStore.open(d) as store:
        with pytest.raises(TypeError, match="max_body_bytes must be an int, not float"):
            IdempotencyMiddleware(app, store, max_body_bytes=1.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_response_bytes must be > 64"):
            IdempotencyMiddleware(app, store, max_response_bytes=10)
        with pytest.raises(ValueError, match="namespace"):
            IdempotencyMiddleware(app, store, namespace="bad ns")
        assert IdempotencyMiddleware(app, store).idempotency.max_response_bytes == 65536
