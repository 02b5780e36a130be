"""``file://DIR`` dataset sources: the data a user already has, in the layout it already has.

The layout is detected from the files in ``DIR`` (first match wins) or named by ``format``:

- ``idx``: MNIST IDX, ``train-images-idx3-ubyte[.gz]`` + ``train-labels-idx1-ubyte[.gz]``, ``t10k-…``;
- ``cifar10``: CIFAR-10 binary, ``data_batch_1.bin`` … ``data_batch_5.bin``, ``test_batch.bin``;
- ``npy``: ``train_x.npy`` + ``train_y.npy`` (``val_…``, ``test_…``), or an ``.npz`` holding them;
- ``tokens``: ``.bin``/``.ds``/``.npy`` shards of 2- or 4-byte tokens, sequences of ``seq_len + 1``;
- ``raw``: little-endian arrays that a ``dataset.toml`` describes;
- ``parquet``: Parquet files as dataset hubs lay them out (:mod:`.parquet`, its own parameters).

URI parameters (each but ``memory`` and ``cache`` may also be set in ``DIR/dataset.toml``; the URI
wins): ``format``; ``memory=auto|ram|stream`` (auto: RAM when the data is under a quarter of
MemAvailable and 2 GiB, else streamed with positional reads); ``cache=DIR`` for decompressed copies
(default ``DIR/.batchbus-cache``); ``val_fraction`` (default 0.1: the tail of train becomes val where
the files have no val split); ``seq_len``, ``token_bytes``, ``vocab_size`` for tokens; ``classes``
(``num_classes`` in the TOML) to skip counting class ids. ``dataset.toml`` may also set
``class_names``. A split the files lack has 0 samples (test) or is carved from train (val).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from urllib.parse import SplitResult, unquote

from libbus.errors import DatasetError

from . import parquet
from .formats import cifar, idx, npy, raw, tokens
from .formats.dataset import MEMORY_MODES, Context, FileSource
from .sources import Source

__all__ = ["FORMATS", "local_path", "open_file_source", "parse_settings"]

#: format → (is it in this directory?, opener, what its files are called), in detection order.
FORMATS = {
    "idx": (idx.detect, idx.open_idx, idx.EXPECTED),
    "cifar10": (cifar.detect, cifar.open_cifar, cifar.EXPECTED),
    "npy": (npy.detect, npy.open_npy, npy.EXPECTED),
    "tokens": (tokens.detect, tokens.open_tokens, tokens.EXPECTED),
    "raw": (None, raw.open_raw, raw.EXPECTED),
}
TOML = "dataset.toml"
#: settings: name in the URI query → (name in dataset.toml and in Context.settings, type)
SETTINGS = {"format": ("format", str), "val_fraction": ("val_fraction", float), "seq_len": ("seq_len", int),
            "token_bytes": ("token_bytes", int), "vocab_size": ("vocab_size", int),
            "classes": ("num_classes", int)}
TOML_KEYS = {key for key, _ in SETTINGS.values()} | {"class_names", "train", "val", "test"}


def open_file_source(uri: str, parts: SplitResult, params: dict) -> Source:
    """Open the dataset in the directory a ``file://`` URI names, popping the ``params`` it knows.

    Raises :class:`DatasetError` for a missing directory, an unknown layout, a bad parameter, or a
    missing, truncated or inconsistent file (naming the file, the fault and what was expected).
    """
    root = local_path(parts)
    # The operator's explicit allowance for files outside the directory (a dataset.toml cannot give it).
    extra = [Path(p.strip()) for p in params.pop("allow_paths", "").split(",") if p.strip()]
    if not root.is_dir():
        raise DatasetError(f"{uri}: {root} {'is not a directory' if root.exists() else 'does not exist'}")
    if params.get("format") == "parquet" or ("format" not in params and parquet.detect(root)):
        params.pop("format", None)
        return parquet.open_parquet(uri, root, params)
    toml = _read_toml(root)
    settings = parse_settings(uri, params, toml)
    memory = params.pop("memory", "auto")
    if memory not in MEMORY_MODES:
        raise DatasetError(f"{uri}: memory must be one of {', '.join(MEMORY_MODES)}, got {memory!r}")
    cache = Path(params.pop("cache")) if params.get("cache") else root / ".batchbus-cache"
    params.pop("cache", None)
    fmt = settings.get("format") or _detect(root, toml)
    if fmt not in FORMATS:
        raise DatasetError(f"{uri}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    ctx = Context(uri, root, cache, settings, toml, allowed=(root, cache, *extra))
    try:
        layout = FORMATS[fmt][1](ctx)
        return FileSource(uri, root, layout, ctx, memory, settings.get("val_fraction", 0.1))
    except BaseException:
        ctx.close()
        raise


def local_path(parts: SplitResult) -> Path:
    """The directory a ``scheme://DIR`` URI names: ``scheme:///abs/dir`` is absolute,
    ``scheme://rel/dir`` (a "host" that is not localhost) relative to the working directory."""
    return Path(unquote(parts.path if parts.netloc in ("", "localhost") else parts.netloc + parts.path) or ".")


def _read_toml(root: Path) -> dict:
    path = root / TOML
    return parse_dataset_toml(path.read_bytes(), str(path)) if path.is_file() else {}


def parse_dataset_toml(data: bytes, where: str) -> dict:
    """A ``dataset.toml``'s keys, checked; :class:`DatasetError` naming ``where`` (a path or URL)."""
    try:
        toml = tomllib.loads(data.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise DatasetError(f"{where}: not valid TOML: {err}") from err
    if unknown := toml.keys() - TOML_KEYS:
        raise DatasetError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; expected "
                           f"{', '.join(sorted(TOML_KEYS))}")
    return toml


def parse_settings(uri: str, params: dict, toml: dict) -> dict:
    """The typed, checked settings: the URI's query over dataset.toml's top-level keys."""
    out: dict = {}
    for query_key, (key, kind) in SETTINGS.items():
        where, value = f"{TOML} {key}", toml.get(key)
        if query_key in params:
            where, value = f"{uri}: {query_key}", params.pop(query_key)
            try:
                value = kind(value)
            except ValueError:
                raise DatasetError(f"{where} must be {'an integer' if kind is int else 'a number'}, "
                                   f"got {value!r}") from None
        if value is None:
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise DatasetError(f"{where} must be a {kind.__name__}, got {value!r}")
        if kind is not str:
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
    return out


def _detect(root: Path, toml: dict) -> str:
    if raw.detect(toml):
        return "raw"
    for fmt, (detect, _, _) in FORMATS.items():
        if detect is not None and detect(root):
            return fmt
    names = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    found = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    raise DatasetError(f"no known dataset layout in {root}: expected one of "
                       f"{'; '.join(e for _, _, e in FORMATS.values())}; found {found or 'nothing'}")
