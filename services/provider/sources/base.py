"""Dataset sources a provider serves, built from URIs.

Every source answers the same two questions: what it is (:meth:`Source.info`, the DatasetInfo
fields) and what samples ``indices`` of ``split`` hold (:meth:`Source.read`). Sources are
deterministic: the same request always returns the same bytes.

- ``mock://mnist`` / ``mock://cifar10``: generated, *learnable* data with real shapes and sizes:
  each class is a smooth random pattern, each sample that pattern shifted by a few pixels, scaled
  and covered in noise. ``?n=`` sets the train size (val and test are a fifth of it), ``?seed=``,
  ``?noise=`` the noise's standard deviation (default 2.0; class patterns have about 1).
- ``dummy://?shape=1,28,28&n=1000&classes=10&dtype=float32``: zeros, for benchmarks and loop tests.
- ``pipeline://FILE.toml``: a source followed by transform stages (:mod:`.pipeline_factory`).

The other schemes live in their own modules: ``file://`` (:mod:`.files`), ``http(s)://``
(:mod:`.remote`), ``parquet://`` (:mod:`.parquet`), ``weighted://`` (:mod:`.weighted`).
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from urllib.parse import parse_qs, urlsplit

import numpy as np

from libbus.errors import DatasetError

__all__ = ["SPLITS", "Source", "MockImages", "Dummy", "open_source", "parse_dataset_arg"]

SPLITS = ("train", "val", "test")
#: The split that never leaves the provider: only its local evaluator reads it.
PRIVATE_SPLIT = "test"


class Source(ABC):
    """A dataset: metadata plus indexed reads of each split."""

    uri: str
    sample_shape: tuple[int, ...]
    dtype: np.dtype
    label_dtype: np.dtype = np.dtype(np.int64)
    #: Shape of one sample's label: ``()`` for a class id; ``(0,)`` for sources without labels.
    label_shape: tuple[int, ...] = ()
    num_classes: int = 0
    class_names: list[str] = []
    kind: str = "image"

    @abstractmethod
    def num_samples(self, split: str) -> int:
        """How many samples ``split`` has."""

    # A source implements at least one of read / read_into; each has a default built on the other.
    # Generated sources implement ``read``; file-backed ones ``read_into``, so that a batch can be
    # read from disk straight into its destination (a shared-memory ring slot) with no temporary.
    def read(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples and labels at ``indices`` (already checked to be in range), C-contiguous."""
        x = np.empty((len(indices), *self.sample_shape), self.dtype)
        y = np.empty((len(indices), *self.label_shape), self.label_dtype)
        self.read_into(split, indices, x, y)
        return x, y

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        """Write the samples and labels at ``indices`` into ``x`` and ``y``.

        ``x`` has shape ``(len(indices), *sample_shape)`` and ``dtype``; ``y`` has shape
        ``(len(indices), *label_shape)`` and ``label_dtype``; both C-contiguous, possibly views of
        shared memory.
        """
        xs, ys = self.read(split, indices)
        x[...] = xs
        y[...] = ys

    def serve_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray, *,
                   epoch: int = 0) -> None:
        """What the provider calls for a BatchRequest of ``epoch``: :meth:`read_into`, for sources
        whose bytes do not depend on the epoch (a pipeline's random stages do)."""
        self.read_into(split, indices, x, y)

    def close(self) -> None:
        """Release what the source holds (threads, files); the provider calls it when it stops."""

    @property
    def x_nbytes(self) -> int:
        """Bytes of one sample."""
        return math.prod(self.sample_shape) * self.dtype.itemsize

    @property
    def y_nbytes(self) -> int:
        """Bytes of one sample's label."""
        return math.prod(self.label_shape) * self.label_dtype.itemsize

    @property
    def sample_nbytes(self) -> int:
        return self.x_nbytes + self.y_nbytes

    def info(self) -> dict:
        splits = {}
        for split in SPLITS:
            private = split == PRIVATE_SPLIT
            splits[split] = {"num_samples": self.num_samples(split), "available": not private,
                             "shuffle": not private}
        return {"uri": self.uri, "splits": splits, "sample_shape": list(self.sample_shape),
                "label_shape": list(self.label_shape), "dtype": self.dtype.name, "label_dtype": self.label_dtype.name,
                "num_classes": self.num_classes, "class_names": list(self.class_names),
                "kind": self.kind}


def _stable_seed(*parts) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class MockImages(Source):
    """Generated, deterministic, learnable MNIST- or CIFAR-shaped data (float32, ~zero mean)."""

    SHAPES = {"mnist": ((1, 28, 28), 60000), "cifar10": ((3, 32, 32), 50000)}
    CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                   "truck"]

    def __init__(self, uri: str, name: str, n: int | None = None, seed: int = 0, noise: float = 2.0):
        if name not in self.SHAPES:
            raise DatasetError(f"{uri}: unknown mock dataset {name!r}; expected one of "
                               f"{', '.join(self.SHAPES)}")
        shape, default_total = self.SHAPES[name]
        self.uri = uri
        self.name = name
        self.sample_shape = shape
        self.dtype = np.dtype(np.float32)
        self.num_classes = 10
        self.class_names = self.CIFAR_NAMES if name == "cifar10" else [str(i) for i in range(10)]
        train = n if n is not None else default_total * 5 // 6
        if train < 1:
            raise DatasetError(f"{uri}: n must be at least 1, got {train}")
        small = max(1, train // 5)
        self.sizes = {"train": train, "val": small, "test": small}
        self.seed = seed
        self.noise = noise
        self.templates = self._templates()

    def _templates(self) -> np.ndarray:
        c, h, w = self.sample_shape
        rng = np.random.default_rng(_stable_seed("templates", self.name, self.seed))
        coarse = rng.standard_normal((self.num_classes, c, 7, 7)).astype(np.float32)
        up = np.kron(coarse, np.ones((1, 1, 4, 4), np.float32))  # smooth 28x28 blobs
        out = np.zeros((self.num_classes, c, h, w), np.float32)
        oy, ox = (h - up.shape[2]) // 2, (w - up.shape[3]) // 2
        out[:, :, oy:oy + up.shape[2], ox:ox + up.shape[3]] = up
        return out

    def num_samples(self, split: str) -> int:
        return self.sizes[split]

    def labels(self, split: str, indices: np.ndarray) -> np.ndarray:
        base = _stable_seed("labels", self.name, self.seed, split)
        # splitmix64 of (base + index): a cheap, vectorised, well-mixed hash
        z = (indices.astype(np.uint64) + np.uint64(base)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        return (z % np.uint64(self.num_classes)).astype(np.int64)

    def read(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        y = self.labels(split, indices)
        x = np.empty((len(indices), *self.sample_shape), np.float32)
        split_key = SPLITS.index(split)
        for row, (index, label) in enumerate(zip(indices.tolist(), y.tolist())):
            rng = np.random.default_rng((self.seed, split_key, index))
            dy, dx = rng.integers(-2, 3, size=2)
            scale = 0.7 + 0.6 * rng.random()
            img = np.roll(self.templates[label], (int(dy), int(dx)), axis=(1, 2)) * scale
            img += rng.standard_normal(self.sample_shape, dtype=np.float32) * self.noise
            x[row] = img
        return x, y


class Dummy(Source):
    """All-zero samples and labels of a given shape: the cheapest possible source."""

    def __init__(self, uri: str, shape: tuple[int, ...], n: int, classes: int, dtype: str):
        self.uri = uri
        self.sample_shape = shape
        try:
            self.dtype = np.dtype(dtype)
        except TypeError as err:
            raise DatasetError(f"{uri}: unknown dtype {dtype!r}") from err
        self.num_classes = classes
        self.class_names = [str(i) for i in range(classes)]
        self.n = n

    def num_samples(self, split: str) -> int:
        return self.n if split == "train" else max(1, self.n // 5)

    def read(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (np.zeros((len(indices), *self.sample_shape), self.dtype),
                np.zeros(len(indices), self.label_dtype))


def _int_param(uri: str, params: dict, key: str, default: int | None) -> int | None:
    if key not in params:
        return default
    try:
        return int(params.pop(key))
    except ValueError as err:
        raise DatasetError(f"{uri}: '{key}' must be an integer") from err


def _open_mock(uri: str, parts, params: dict) -> Source:
    name = parts.netloc or parts.path.strip("/")
    if name == "tokens":
        from .tokens import open_mock_tokens  # noqa: PLC0415 - keeps this module's imports light
        return open_mock_tokens(uri, parts, params)
    n = _int_param(uri, params, "n", None)
    seed = _int_param(uri, params, "seed", 0)
    try:
        noise = float(params.pop("noise", 2.0))
    except ValueError as err:
        raise DatasetError(f"{uri}: 'noise' must be a number") from err
    return MockImages(uri, name, n=n, seed=seed, noise=noise)


def _open_dummy(uri: str, parts, params: dict) -> Source:
    try:
        shape = tuple(int(s) for s in params.pop("shape", "1,28,28").split(",") if s)
    except ValueError as err:
        raise DatasetError(f"{uri}: shape must be comma-separated integers, e.g. 3,32,32") from err
    if not shape or any(s < 1 for s in shape):
        raise DatasetError(f"{uri}: shape must be positive integers, got {shape}")
    n = _int_param(uri, params, "n", 1000)
    classes = _int_param(uri, params, "classes", 10)
    if n < 1 or classes < 1:
        raise DatasetError(f"{uri}: n and classes must be at least 1")
    return Dummy(uri, shape, n, classes, params.pop("dtype", "float32"))


def _open_file(uri: str, parts, params: dict) -> Source:
    from .files import open_file_source  # noqa: PLC0415
    return open_file_source(uri, parts, params)


def _open_http(uri: str, parts, params: dict) -> Source:
    from .remote import open_http_source  # noqa: PLC0415
    return open_http_source(uri, parts, params)


def _open_parquet(uri: str, parts, params: dict) -> Source:
    from .files import local_path  # noqa: PLC0415
    from .parquet import open_parquet  # noqa: PLC0415
    return open_parquet(uri, local_path(parts), params)


def _open_weighted(uri: str, parts, params: dict, named: Mapping[str, Source]) -> Source:
    from .weighted import open_weighted  # noqa: PLC0415
    return open_weighted(uri, parts, params, named)


def _open_pipeline(uri: str, parts, params: dict) -> Source:
    from .pipeline_factory import open_pipeline  # noqa: PLC0415
    return open_pipeline(uri, parts, params)


#: scheme → opener(uri, urlsplit parts, query params) → Source. An opener pops the parameters it
#: understands; whatever is left is reported as unknown.
OPENERS: dict[str, Callable[..., Source]] = {
    "mock": _open_mock,
    "dummy": _open_dummy,
    "file": _open_file,
    "http": _open_http,
    "https": _open_http,
    "parquet": _open_parquet,
    "weighted": _open_weighted,
    "pipeline": _open_pipeline,
}
#: Schemes whose opener also gets the datasets the provider has already opened, by name.
NAMED_SCHEMES = {"weighted"}


def open_source(uri: str, named: Mapping[str, Source] | None = None) -> Source:
    """Build the source a URI names. Raises :class:`DatasetError` saying what is wrong with it.

    ``named``: the datasets the same provider serves so far, which a ``weighted://`` mix may name.
    """
    parts = urlsplit(uri)
    raw = parse_qs(parts.query, keep_blank_values=True)
    params = {k: v[-1] for k, v in raw.items()}
    opener = OPENERS.get(parts.scheme)
    if opener is None:
        raise DatasetError(f"unsupported dataset URI {uri!r}: known schemes are "
                           f"{', '.join(s + '://' for s in OPENERS)}")
    extra = (named or {},) if parts.scheme in NAMED_SCHEMES else ()
    source = opener(uri, parts, params, *extra)
    if params:
        raise DatasetError(f"{uri}: unknown parameter(s) {', '.join(sorted(params))}")
    return source


def parse_dataset_arg(arg: str) -> tuple[str, str]:
    """``NAME=URI`` → (name, uri), as given to ``busctl start provider --dataset``."""
    name, sep, uri = arg.partition("=")
    name = name.strip()
    if not sep or not name or not uri:
        raise DatasetError(f"--dataset {arg!r}: expected NAME=URI, e.g. mnist=mock://mnist")
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise DatasetError(f"--dataset {arg!r}: name may hold letters, digits, '-', '_', '.'")
    return name, uri.strip()
