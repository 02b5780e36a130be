"""``file://DIR`` dataset sources: the data a user already has, in the layout it already has.

The layout is detected from the files in ``DIR`` (first match wins) or named by ``format``:

- ``idx``: MNIST IDX, ``train-images-idx3-ubyte[.gz]`` + ``train-labels-idx1-ubyte[.gz]``, ``t10k-…``;
- ``cifar10``: CIFAR-10 binary, ``data_batch_1.bin`` … ``data_batch_5.bin``, ``test_batch.bin``;
- ``npy``: ``train_x.npy`` + ``train_y.npy`` (``val_…``, ``test_…``), or an ``.npz`` holding them;
- ``tokens``: ``.bin``/``.ds``/``.npy`` shards of 2- or 4-byte tokens, sequences of ``seq_len + 1``;
- ``raw``: little-endian arrays that a ``dataset.toml`` describes;
- ``parquet``: Parquet files as dataset hubs lay them out (:mod:`.parquet`, its own parameters);
- ``imagefolder``: ``train/CLASS/*.jpg|png|webp`` trees, and ``webdataset``: ``*.tar`` shards, both
  decoded on the provider (:mod:`.images`: ``size``, ``augment``, ``bad``, ``workers``, ``encoded``);
- ``text``: ``train.txt`` (``val.txt``, ``test.txt``), a document per line, for a pipeline's
  ``tokenize`` and ``pack`` stages (``encoded=1``).

URI parameters (each but ``memory`` and ``cache`` may also be set in ``DIR/dataset.toml``; the URI
wins): ``format``; ``memory=auto|ram|stream`` (auto: RAM when the data is under a quarter of
MemAvailable and 2 GiB, else streamed with positional reads); ``cache=DIR`` for decompressed copies
(default ``DIR/.batchbus-cache``); ``val_fraction`` (default 0.1: the tail of train becomes val where
the files have no val split); ``seq_len``, ``token_bytes``, ``vocab_size`` for tokens; ``classes``
(``num_classes`` in the TOML) to skip counting class ids. ``dataset.toml`` may also set
``class_names``. A split the files lack has 0 samples (test) or is carved from train (val).
"""

from __future__ import annotations

from pathlib import Path

from libbus.errors import DatasetError

from . import images, parquet
from .base import OpenRequest, Source, local_path
from .formats import cifar, idx, imagefolder, npy, raw, textlines, tokens, webdataset
from .formats.confine import Confinement
from .formats.dataset import MEMORY_MODES, Context, FileSource
from .formats.dataset_toml import TOML, parse_dataset_toml, parse_settings

__all__ = ["FORMATS", "open_file_source"]

#: format → (is it in this directory?, opener, what its files are called), in detection order.
FORMATS = {
    "idx": (idx.detect, idx.open_idx, idx.EXPECTED),
    "cifar10": (cifar.detect, cifar.open_cifar, cifar.EXPECTED),
    "npy": (npy.detect, npy.open_npy, npy.EXPECTED),
    "tokens": (tokens.detect, tokens.open_tokens, tokens.EXPECTED),
    "raw": (None, raw.open_raw, raw.EXPECTED),
}


def open_file_source(req: OpenRequest) -> Source:
    """Open the dataset in the directory a ``file://`` URI names, popping the ``params`` it knows.

    Raises :class:`DatasetError` for a missing directory, an unknown layout, a bad parameter, or a
    missing, truncated or inconsistent file (naming the file, the fault and what was expected).
    """
    uri, params = req.uri, req.params
    root = local_path(req.parts)
    # The operator's explicit allowance for files outside the directory (a dataset.toml cannot give it).
    extra = [Path(p.strip()) for p in params.pop("allow_paths", "").split(",") if p.strip()]
    if not root.is_dir():
        raise DatasetError(f"{uri}: {root} {'is not a directory' if root.exists() else 'does not exist'}")
    if params.get("format") == "parquet" or ("format" not in params and parquet.detect(root)):
        params.pop("format", None)
        return parquet.open_parquet_dir(uri, root, params)
    image_format = _image_format(root, params)
    if image_format is not None:
        return _open_image_layout(req, root, image_format, Confinement(root, (root, *extra)))
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


#: Layouts of encoded samples, decoded on the provider (:mod:`.images`), in detection order.
IMAGE_FORMATS = ("imagefolder", "webdataset", "text")


def _image_format(root: Path, params: dict) -> str | None:
    fmt = params.get("format")
    if fmt is not None:
        if fmt in IMAGE_FORMATS:
            params.pop("format")
            return fmt
        return None
    if imagefolder.detect(root):
        return "imagefolder"
    if webdataset.detect(root):
        return "webdataset"
    if textlines.detect(root):
        return "text"
    return None


def _open_image_layout(req: OpenRequest, root: Path, fmt: str, confinement: Confinement) -> Source:
    params = req.params
    try:
        val_fraction = float(params.pop("val_fraction", "0.1"))
    except ValueError:
        raise DatasetError(f"{req.uri}: val_fraction must be a number") from None
    if not 0 <= val_fraction < 1:
        raise DatasetError(f"{req.uri}: val_fraction must be in [0, 1), got {val_fraction}")
    if fmt == "imagefolder":
        if not imagefolder.detect(root):
            raise DatasetError(f"{req.uri}: no ImageFolder tree in {root}; expected {imagefolder.EXPECTED}")
        store = imagefolder.ImageFolder(req.uri, root, val_fraction, confinement)
    elif fmt == "text":
        if not textlines.detect(root):
            raise DatasetError(f"{req.uri}: no text files in {root}; expected {textlines.EXPECTED}")
        store = textlines.TextLines(req.uri, root, val_fraction, confinement)
    else:
        cache = Path(params.pop("cache")) if params.get("cache") else root / ".batchbus-cache"
        params.pop("cache", None)
        strict = params.get("bad") != "skip"
        store = webdataset.open_local_shards(req.uri, root, cache, val_fraction, strict=strict, confinement=confinement)
    return images.open_images(req, store, fmt)


def _read_toml(root: Path) -> dict:
    path = root / TOML
    return parse_dataset_toml(path.read_bytes(), str(path)) if path.is_file() else {}


def _detect(root: Path, toml: dict) -> str:
    if raw.detect(toml):
        return "raw"
    for fmt, (detect, _, _) in FORMATS.items():
        if detect is not None and detect(root):
            return fmt
    names = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    found = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    raise DatasetError(
        f"no known dataset layout in {root}: expected one of "
        f"{'; '.join(e for _, _, e in FORMATS.values())}; found {found or 'nothing'}"
    )
