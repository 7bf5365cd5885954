"""Key derivation shared by every broker wrapper."""

from __future__ import annotations

import json

import pytest

from dedupcore.integrations.rabbitmq import MissingKeyError, derive_key


def body_id(body: bytes, headers: object) -> object:
    return json.loads(body).get("id")


def test_business_id_wins_over_header_and_message_id() -> None:
    k = derive_key(b'{"id": "t-1"}', {"x-id": "h"}, "m", key=body_id, key_header="x-id")
    assert k == "t-1"


def test_int_business_id_is_its_decimal_string() -> None:
    assert derive_key(b'{"id": 42}', {}, None, key=body_id) == "42"


def test_falls_back_to_header_then_message_id() -> None:
    assert derive_key(b"{}", {"x-id": b"h"}, "m", key=body_id, key_header="x-id") == b"h"
    assert derive_key(b"{}", {}, "m", key=body_id, key_header="x-id") == "m"
    assert derive_key(b"", None, "m") == "m"


def test_missing_key_names_what_was_tried() -> None:
    with pytest.raises(MissingKeyError, match=r"key\(body, headers\), header 'x-id', message id"):
        derive_key(b"{}", {}, None, key=body_id, key_header="x-id")
    with pytest.raises(MissingKeyError):
        derive_key(b"", {}, "")  # an empty id is no id


def test_key_function_errors_become_missing_key() -> None:
    with pytest.raises(MissingKeyError, match="JSONDecodeError"):
        derive_key(b"not json", {}, "m", key=body_id)
    assert issubclass(MissingKeyError, ValueError)


@pytest.mark.parametrize("bad", [1.5, True, ["a"], {"a": 1}])
def test_wrong_key_types_are_refused(bad: object) -> None:
    with pytest.raises(MissingKeyError, match=type(bad).__name__):
        derive_key(b"", {}, None, key=lambda b, h: bad)
