"""How the ``idempotent`` decorator stores a result that msgpack cannot encode.

A store keeps msgpack values (None, bool, int, float, str, bytes, lists,
maps). A function that returns a dataclass or a Pydantic model is decorated
with ``serializer=``: the result is stored in its msgpack form, and a
duplicate call gets it back as the same type (docs/conveniences.md, "Results
of any type"). ``serializer=`` takes a :class:`Serializer`, or a dataclass or
Pydantic model class, which :func:`serializer_for` turns into one.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "CustomSerializer",
    "DataclassSerializer",
    "PydanticSerializer",
    "Serializer",
    "serializer_for",
]


@runtime_checkable
class Serializer(Protocol):
    """A result's stored form and back: ``to_stored(value)`` is msgpack-serializable,
    and ``from_stored(to_stored(value))`` equals ``value``."""

    def to_stored(self, value: Any) -> Any: ...

    def from_stored(self, stored: Any) -> Any: ...


class CustomSerializer:
    """A serializer of two functions: ``dump(value)`` to a msgpack value, ``load`` back."""

    def __init__(self, dump: Callable[[Any], Any], load: Callable[[Any], Any]) -> None:
        if not callable(dump) or not callable(load):
            raise TypeError("CustomSerializer takes two functions: dump and load")
        self._dump = dump
        self._load = load

    def to_stored(self, value: Any) -> Any:
        return self._dump(value)

    def from_stored(self, stored: Any) -> Any:
        return self._load(stored)


class _OfClass:
    """A serializer of one class's instances; ``None`` is stored and given back as None."""

    def __init__(self, cls: type[Any]) -> None:
        if not (isinstance(cls, type) and self._takes(cls)):
            raise TypeError(f"{type(self).__name__} takes {self._takes.__doc__}, not {cls!r}")
        self.cls = cls

    @staticmethod
    def _takes(cls: type[Any]) -> bool:
        raise NotImplementedError

    def _dump(self, value: Any) -> Any:
        raise NotImplementedError

    def _load(self, stored: Any) -> Any:
        raise NotImplementedError

    def to_stored(self, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, self.cls):
            raise TypeError(f"the result is a {type(value).__name__}, not a {self.cls.__name__}")
        return self._dump(value)

    def from_stored(self, stored: Any) -> Any:
        return None if stored is None else self._load(stored)


class PydanticSerializer(_OfClass):
    """A Pydantic model (v2): stored as ``model_dump(mode="json")``, loaded with
    ``model_validate``."""

    @staticmethod
    def _takes(cls: type[Any]) -> bool:
        """a Pydantic model class"""
        return hasattr(cls, "model_validate") and hasattr(cls, "model_dump")

    def _dump(self, value: Any) -> Any:
        return value.model_dump(mode="json")

    def _load(self, stored: Any) -> Any:
        return self.cls.model_validate(stored)


class DataclassSerializer(_OfClass):
    """A dataclass: stored as a map of its fields, loaded back into the class.

    Fields that are themselves dataclasses, or lists, tuples, sets, maps or
    optionals of them, come back as their classes (read from the type
    hints); other fields must be msgpack values.
    """

    @staticmethod
    def _takes(cls: type[Any]) -> bool:
        """a dataclass"""
        return dataclasses.is_dataclass(cls)

    def _dump(self, value: Any) -> Any:
        return dataclasses.asdict(value)

    def _load(self, stored: Any) -> Any:
        return _load(self.cls, stored)


def _load(hint: Any, stored: Any) -> Any:
    """``stored`` as the type ``hint`` names, for the shapes a dataclass's fields take."""
    if stored is None:
        return None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        fields = {f.name for f in dataclasses.fields(hint) if f.init}
        return hint(**{k: _load(hints.get(k, Any), v) for k, v in stored.items() if k in fields})
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _load(inner[0], stored) if len(inner) == 1 else stored
    if origin in (list, set, frozenset) and args:
        return origin(_load(args[0], v) for v in stored)
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_load(args[0], v) for v in stored)
        return tuple(_load(a, v) for a, v in zip(args, stored, strict=False))
    if origin is dict and len(args) == 2:
        return {k: _load(args[1], v) for k, v in stored.items()}
    if origin in (list, tuple, set, frozenset):
        return origin(stored)
    return stored


def serializer_for(spec: Serializer | type[Any] | None) -> Serializer | None:
    """``serializer=`` as a :class:`Serializer`: a dataclass or a Pydantic model class
    gets its own; None stores results as they are (msgpack values)."""
    if spec is None or (isinstance(spec, Serializer) and not isinstance(spec, type)):
        return spec
    if isinstance(spec, type):
        for kind in (DataclassSerializer, PydanticSerializer):
            if kind._takes(spec):
                return kind(spec)
    raise TypeError(
        "serializer must be a Serializer (to_stored/from_stored), a dataclass or a "
        f"Pydantic model class, not {spec!r}"
    )
