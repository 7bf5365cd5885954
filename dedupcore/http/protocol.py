"""What the ``Idempotency-Key`` header means and what is stored for a response.

The pieces every HTTP integration shares, whatever the framework: the key's
syntax, the request's fingerprint, the record of a response and its replay,
and the problem documents (RFC 9457). The ASGI middleware is in
:mod:`dedupcore.http.asgi`; docs/http.md describes the behaviour.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dedupcore.api import pack_result

#: 4xx statuses that ask the client to try again: released like a 5xx, not recorded.
DEFAULT_RETRY_STATUSES = frozenset({408, 425, 429})
MAX_KEY_CHARS = 255
DEFAULT_RESULT_LIMIT = 65536

# Recorded results: [1, status, [[name, value], ...], body] or [0, why, status].
RESPONSE = 1
NOT_REPLAYABLE = 0
ENVELOPE_SLACK = 64  # msgpack framing around the body, checked exactly before storing


def parse_key(raw: bytes) -> str:
    """The idempotency key of a header value (bare, or a quoted sf-string); ValueError if bad."""
    text = raw.decode("latin-1").strip(" \t")
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        inner, out, i = text[1:-1], [], 0
        while i < len(inner):
            c = inner[i]
            if c == "\\":
                if i + 1 == len(inner) or inner[i + 1] not in '"\\':
                    raise ValueError("bad escape in the quoted key")
                out.append(inner[i + 1])
                i += 2
                continue
            if c == '"':
                raise ValueError("unescaped quote inside the quoted key")
            out.append(c)
            i += 1
        text = "".join(out)
    if not 1 <= len(text) <= MAX_KEY_CHARS:
        raise ValueError(f"the key must be 1..{MAX_KEY_CHARS} characters, got {len(text)}")
    bad = next((c for c in text if not " " <= c <= "~"), None)
    if bad is not None:
        raise ValueError(f"the key must be printable ASCII, it holds {bad!r}")
    return text


def result_limit(store: object) -> int:
    """The largest result ``store`` keeps (its ``max_result_bytes``), else 64 KiB."""
    config = getattr(store, "config", None)
    for owner in (config, store):
        limit = getattr(owner, "max_result_bytes", None)
        if isinstance(limit, int) and not isinstance(limit, bool):
            return limit
    return DEFAULT_RESULT_LIMIT


def fingerprint(method: str, path: bytes, query: bytes, body: bytes) -> bytes:
    """The request's fingerprint: SHA-256 over method, path, query string and body."""
    h = hashlib.sha256()
    for part in (method.upper().encode(), path, query):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    h.update(body)
    return h.digest()


def response_record(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes, limit: int
) -> list[Any]:
    """What the store keeps of a response: all of it, or a note if it is over ``limit``."""
    result = [RESPONSE, status, [list(h) for h in headers], body]
    try:
        pack_result(result, limit)
    except ValueError:
        return not_replayable(
            f"the response was larger than the {limit} bytes the store keeps per response",
            status,
        )
    return result


def not_replayable(why: str, status: int) -> list[Any]:
    """The record of a response that happened but cannot be sent again, and why."""
    return [NOT_REPLAYABLE, why, status]


def stored_response(stored: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes] | str:
    """The recorded response (status, headers, body), or why there is none to replay."""
    if (
        isinstance(stored, list)
        and len(stored) == 4
        and stored[0] == RESPONSE
        and isinstance(stored[1], int)
        and isinstance(stored[3], bytes)
    ):
        return stored[1], [(bytes(n), bytes(v)) for n, v in stored[2]], stored[3]
    if isinstance(stored, list) and len(stored) >= 2 and stored[0] == NOT_REPLAYABLE:
        return str(stored[1])
    return "the store holds no response for it (past the exact window, or not recorded)"


def problem(
    status: int, title: str, detail: str, *, retry_after: int | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """An RFC 9457 problem document: status, headers, body."""
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail})
    payload = body.encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    return status, headers, payload
