"""Checking parsed JSON headers against a message dataclass's annotations.

Each message class's fields are compiled once into ``accepts(value) -> bool`` checks, because
decoding sits on the batch path. Nothing here knows the wire format or any message type.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

import orjson

from libbus.errors import BadRequest, TooLarge

__all__ = ["schema_of", "type_name", "too_deep"]

#: Per message class: field name → (accepts(value) -> bool, required, annotation). Built once per
#: class: decoding sits on the batch path, so the type checks are compiled, not re-derived per message.
_SCHEMAS: dict[type, dict[str, tuple[Callable[[Any], bool], bool, Any]]] = {}


def schema_of(cls: type) -> dict[str, tuple[Callable[[Any], bool], bool, Any]]:
    """``cls``'s header fields (all dataclass fields but ``frames``): checker, required, annotation."""
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = typing.get_type_hints(cls)
        schema = {}
        for f in dataclasses.fields(cls):
            if f.name == "frames":
                continue
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            schema[f.name] = (_checker(hints[f.name]), required, hints[f.name])
        _SCHEMAS[cls] = schema
    return schema


def _checker(annotation: Any) -> Callable[[Any], bool]:
    """``value -> bool`` for a field annotation: JSON's bool is not an int, an int is a float."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        parts = [_checker(arg) for arg in typing.get_args(annotation)]
        return lambda value: any(part(value) for part in parts)
    if annotation is type(None):
        return lambda value: value is None
    if annotation is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    origin = typing.get_origin(annotation) or annotation
    return lambda value: isinstance(value, origin)


def type_name(annotation: Any) -> str:
    """How an error message names what a field must be ("an integer or null")."""
    if isinstance(annotation, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(annotation))
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }.get(annotation, str(annotation))


def too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests containers more than ``limit`` levels deep."""
    level = [value]
    for _ in range(limit):
        level = [
            child
            for item in level
            if isinstance(item, (dict, list))
            for child in (item.values() if isinstance(item, dict) else item)
        ]
        if not level:
            return False
    return any(isinstance(item, (dict, list)) for item in level)


def check_stored(value: Any, what: str, max_depth: int, max_bytes: int) -> None:
    """Refuse (:class:`BadRequest`/:class:`TooLarge`) peer JSON a service would store or echo
    (heartbeat stats, progress, results) when it nests deeper than ``max_depth`` or encodes to more
    than ``max_bytes``: stored, it would break every admin reply that carries it."""
    if too_deep(value, max_depth):
        raise BadRequest(f"{what} nests deeper than {max_depth} levels; flatten it")
    size = len(orjson.dumps(value))
    if size > max_bytes:
        raise TooLarge(f"{what} is {size} bytes of JSON; at most {max_bytes} are stored")
