"""``dataset.toml`` and the URI settings it shares, parsed and checked in one place (``file://`` and
``http(s)://`` read it alike)."""

from __future__ import annotations

import tomllib
from typing import TypedDict, cast

from libbus.errors import DatasetError

__all__ = ["SETTINGS", "TOML", "TOML_KEYS", "DatasetSettings", "parse_dataset_toml", "parse_settings"]

TOML = "dataset.toml"
#: settings: name in the URI query → (name in dataset.toml and in Context.settings, type)
SETTINGS = {
    "format": ("format", str),
    "val_fraction": ("val_fraction", float),
    "seq_len": ("seq_len", int),
    "token_bytes": ("token_bytes", int),
    "vocab_size": ("vocab_size", int),
    "classes": ("num_classes", int),
}
TOML_KEYS = {key for key, _ in SETTINGS.values()} | {"class_names", "train", "val", "test"}


class DatasetSettings(TypedDict, total=False):
    """A dataset's settings, typed and checked: the URI's query over ``dataset.toml``'s top-level keys
    (:data:`SETTINGS`), with its class names."""

    format: str
    val_fraction: float
    seq_len: int
    token_bytes: int
    vocab_size: int
    num_classes: int
    class_names: list[str]


def parse_dataset_toml(data: bytes, where: str) -> dict:
    """A ``dataset.toml``'s keys, checked; :class:`DatasetError` naming ``where`` (a path or URL)."""
    try:
        toml = tomllib.loads(data.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise DatasetError(f"{where}: not valid TOML: {err}") from err
    if unknown := toml.keys() - TOML_KEYS:
        raise DatasetError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))}; expected {', '.join(sorted(TOML_KEYS))}"
        )
    return toml


def parse_settings(uri: str, params: dict, toml: dict) -> DatasetSettings:
    """The typed, checked settings: the URI's query over dataset.toml's top-level keys."""
    out: dict = {}
    for query_key, (key, kind) in SETTINGS.items():
        where, value = f"{TOML} {key}", toml.get(key)
        if query_key in params:
            where, value = f"{uri}: {query_key}", params.pop(query_key)
            try:
                value = kind(value)
            except ValueError:
                raise DatasetError(
                    f"{where} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
                ) from None
        if value is None:
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise DatasetError(f"{where} must be a {kind.__name__}, got {value!r}")
        if isinstance(value, (int, float)):  # kind is int or float: value is one
            bad = {"val_fraction": not 0 <= value < 1, "token_bytes": value not in (2, 4)}.get(key, value < 1)
            if bad:
                want = {"val_fraction": "in [0, 1)", "token_bytes": "2 or 4"}.get(key, "at least 1")
                raise DatasetError(f"{where} must be {want}, got {value!r}")
        out[key] = value
    names = toml.get("class_names")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise DatasetError(f"{TOML} class_names must be a list of strings")
        out["class_names"] = names
        out.setdefault("num_classes", len(names))
    return cast(DatasetSettings, out)  # each key of SETTINGS checked to be of its type above
