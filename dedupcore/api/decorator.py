"""What the ``idempotent`` decorator decides for one function, written once for the
sync and the async API (docs/conveniences.md).

:class:`Decorated` holds it: the key of a call (a function of the arguments,
a path into the payload, or a tuple of paths for a composite key), the
fingerprint of the payload's ``validate=`` paths, the result's stored form
(``serializer=``) and what a duplicate call returns (the stored result, read
back, or what ``on_duplicate=`` makes of it). The drivers in
:mod:`dedupcore.api.contract` differ only in awaiting the store and the
function.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

from dedupcore.api.answers import Claim, Outcome
from dedupcore.api.conveniences import key_path, value_at
from dedupcore.api.serializers import Serializer, serializer_for
from dedupcore.errors import InProgressError, KeyPathError

__all__ = ["Decorated", "KeySpec"]

#: ``key=``: a function of the call's arguments, a path into the payload, or a tuple
#: of paths whose values together are the key.
KeySpec = Callable[..., bytes | str] | str | tuple[str, ...]
#: ``on_duplicate(result, claim)``: what a duplicate call returns instead of the result.
OnDuplicate = Callable[[Any, Claim], Any]


class Decorated:
    """One decorated function's key, fingerprint, stored form and replay.

    ``want_async``: the decorator of an async front end takes ``async def``
    functions only, a sync one plain functions only (a coroutine object is
    not a result that can be stored). Every option is checked here, when
    the decorator is applied.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        key: KeySpec,
        payload: str | None = None,
        serializer: Serializer | type[Any] | None = None,
        on_duplicate: OnDuplicate | None = None,
        validate: str | Sequence[str] | None = None,
        want_async: bool,
    ) -> None:
        _check_function(fn, want_async)
        # payload= names the argument the paths read: the key's, or only validate's.
        only_validate = callable(key) and validate is not None
        self.key_of = _key_function(fn, key, None if only_validate else payload)
        self.fingerprint_of = (
            None if validate is None else _fingerprint_function(fn, validate, payload)
        )
        self.serializer = serializer_for(serializer)
        if on_duplicate is not None and not callable(on_duplicate):
            raise TypeError(f"on_duplicate must be callable, not {type(on_duplicate).__name__}")
        self.on_duplicate = on_duplicate

    def fingerprint(self, *args: Any, **kwargs: Any) -> bytes | None:
        """The fingerprint of a call's ``validate=`` values, or None without them."""
        return None if self.fingerprint_of is None else self.fingerprint_of(*args, **kwargs)

    def keep(self, c: Claim, value: Any) -> Exception | None:
        """Sets a NEW claim's result to ``value``'s stored form. A serializer that fails
        leaves the claim without a result and its error is returned, to be raised after
        the key is completed: the work is done, it must not run again."""
        if self.serializer is None:
            c.result = value
            return None
        try:
            c.result = self.serializer.to_stored(value)
        except Exception as exc:
            return exc
        return None

    def answer(self, c: Claim, key: bytes | str, namespace: str, value: Any) -> Any:
        """What a call returns once its claim is settled: a NEW call's own ``value``; a
        duplicate's stored result read back, or what ``on_duplicate`` makes of it (an
        awaitable for an async hook); InProgressError while another owner holds the key."""
        if c.outcome is Outcome.NEW:
            return value
        if c.outcome is Outcome.IN_PROGRESS:
            raise InProgressError(
                f"key {key!r} in namespace {namespace!r} is being processed by another "
                "owner; retry later"
            )
        result = c.result if self.serializer is None else self.serializer.from_stored(c.result)
        return result if self.on_duplicate is None else self.on_duplicate(result, c)


def _check_function(fn: Callable[..., Any], want_async: bool) -> None:
    if not callable(fn):
        raise TypeError(f"idempotent decorates a function, not {type(fn).__name__}")
    name = getattr(fn, "__qualname__", repr(fn))
    if want_async and not inspect.iscoroutinefunction(fn):
        raise TypeError(f"an async front end's idempotent decorates async def; {name} is not")
    if not want_async and inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"{name} is async def: decorate it with the idempotent of dedupcore.aio.Client "
            "(or another AsyncClaimAPI)"
        )


def _decorated_key(
    fn: Callable[..., Any], key: KeySpec, payload: str | None, *, want_async: bool
) -> Callable[..., bytes | str]:
    """The key function of ``fn`` decorated by ``idempotent``, its arguments checked."""
    _check_function(fn, want_async)
    return _key_function(fn, key, payload)


def _key_function(
    fn: Callable[..., Any], key: KeySpec, payload: str | None
) -> Callable[..., bytes | str]:
    if callable(key):
        if payload is not None:
            raise TypeError("payload= is for a key path; here key is a function")
        return key
    if isinstance(key, tuple):
        if not key or not all(isinstance(p, str) for p in key):
            raise TypeError("a composite key is a non-empty tuple of key paths")
        parts = [key_path(p) for p in key]
        return _payload_arg(fn, lambda value: _composite([part(value) for part in parts]), payload)
    if not isinstance(key, str):
        raise TypeError(
            f"key must be a function, a key path or a tuple of paths, not {type(key).__name__}"
        )
    return _payload_arg(fn, key_path(key), payload)


def _composite(parts: list[bytes | str]) -> str:
    """The key of several values: their JSON array (bytes as ``hex:`` text), which no
    other list of values gives."""
    texts = [p if isinstance(p, str) else "hex:" + bytes(p).hex() for p in parts]
    return json.dumps(texts, ensure_ascii=False, separators=(",", ":"))


def _fingerprint_function(
    fn: Callable[..., Any], validate: str | Sequence[str], payload: str | None
) -> Callable[..., bytes]:
    """The fingerprint of the payload's values at ``validate``: SHA-256 of their
    canonical JSON. A later call whose values differ is a ConflictError."""
    paths = [validate] if isinstance(validate, str) else validate
    if not isinstance(paths, Sequence) or not paths or not all(isinstance(p, str) for p in paths):
        raise TypeError("validate is a key path or a non-empty sequence of them")
    paths = list(paths)
    finders = [(p, value_at(p)) for p in paths]

    def fingerprint(value: Any) -> bytes:
        found = [f(value) for _, f in finders]
        try:
            canonical = json.dumps(found, sort_keys=True, separators=(",", ":"), default=_bytes)
        except (TypeError, ValueError) as exc:
            raise KeyPathError(
                f"validate={paths!r} found a value that is not JSON: {exc}"
            ) from None
        return hashlib.sha256(canonical.encode()).digest()

    return _payload_arg(fn, fingerprint, payload)


def _bytes(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return "hex:" + bytes(value).hex()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _payload_arg(
    fn: Callable[..., Any], extract: Callable[[Any], Any], payload: str | None
) -> Callable[..., Any]:
    """``extract`` applied to the payload argument of a call of ``fn``: the argument
    named ``payload``, else the first."""
    try:
        sig: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature (some builtins)
        sig = None
    params = list(sig.parameters.values()) if sig is not None else []
    if payload is not None and sig is not None and payload not in sig.parameters:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"{name} has no argument named {payload!r} (payload=)")
    name = payload if payload is not None else (params[0].name if params else None)

    def of_call(*args: Any, **kwargs: Any) -> Any:
        if sig is None or name is None:
            if not args:
                raise TypeError("the payload is the first positional argument; none was given")
            return extract(args[0])
        bound = sig.bind(*args, **kwargs)
        if name not in bound.arguments:
            raise TypeError(f"the payload argument {name!r} was not given")
        value = bound.arguments[name]
        if sig.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            if not value:
                raise TypeError("the payload is the first positional argument; none was given")
            value = value[0]
        return extract(value)

    return of_call
