"""Generated datasets: ``mock://`` and ``dummy://``.

- ``mock://mnist`` / ``mock://cifar10``: generated, *learnable* data with real shapes and sizes:
  each class is a smooth random pattern, each sample that pattern shifted by a few pixels, scaled
  and covered in noise. ``?n=`` sets the train size (val and test are a fifth of it), ``?seed=``,
  ``?noise=`` the noise's standard deviation (default 2.0; class patterns have about 1).
- ``mock://tokens``: a learnable token stream (:mod:`.mock_tokens`).
- ``mock://fields?n=&seed=&max=``: samples with named fields of every kind, for tests and demos:
  ``image`` ``uint8 (?, ?, 3)`` (2..16 pixels a side), ``tokens`` ``int32 (?,)`` (0..12 of them),
  ``text`` ``str``, ``label`` ``int64 ()``. ``max=`` overrides the image's declared ``max_bytes``
  (768) — set it below 768 to see an oversized batch refused.
- ``dummy://?shape=1,28,28&n=1000&classes=10&dtype=float32``: zeros, for benchmarks and loop tests.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from libbus.errors import DatasetError

from .base import SPLITS, Field, FieldBatch, OpenRequest, ReadPolicy, Source, stable_seed
from .mock_tokens import open_mock_tokens
from .splitmix import GAMMA, mix

__all__ = ["Dummy", "MockFields", "MockImages", "open_dummy", "open_mock"]

#: Bytes of a batch generated at once: its temporaries stay in the CPU's cache.
CHUNK_BYTES = 384 * 1024


class MockImages(Source):
    """Generated, deterministic, learnable MNIST- or CIFAR-shaped data (float32, ~zero mean).

    Sample ``i`` of a split is ``scale * shifted(template[label]) + noise``, generated for a whole
    batch at once with no per-sample Python: its label, shift (-2..2 pixels each way), scale (0.7..1.3)
    and noise all come from SplitMix64 of (seed, split, ``i``) (:mod:`.splitmix`). The class templates
    are rolled into all 25 shifts once, and the noise of a sample is a window of one fixed bank of
    Gaussian noise (:data:`NOISE_BANK` values, scaled by ``noise``) at an offset drawn from its hash, so
    a batch is two gathers, a multiply and an add (docs/performance.md, "Generated datasets").
    """

    SHAPES = {"mnist": ((1, 28, 28), 60000), "cifar10": ((3, 32, 32), 50000)}
    CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    #: Pixels a class pattern is shifted by at most, each way (a sample draws one of 5 x 5 shifts).
    SHIFT = 2
    #: Windows of the noise bank a sample's noise is drawn from (the bank holds these plus one sample).
    NOISE_BANK = 1 << 20
    #: A read is a pure function of read-only arrays: two may run at once (a ring slot filled off the loop).
    read_policy = ReadPolicy.CONCURRENT

    def __init__(self, uri: str, name: str, n: int | None = None, seed: int = 0, noise: float = 2.0):
        if name not in self.SHAPES:
            raise DatasetError(f"{uri}: unknown mock dataset {name!r}; expected one of {', '.join(self.SHAPES)}")
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
        self._shifted = self._shifted_templates()
        size = math.prod(shape)
        rng = np.random.default_rng(stable_seed("noise", self.name, self.seed))
        bank = rng.standard_normal(self.NOISE_BANK + size - 1, dtype=np.float32)
        bank *= np.float32(noise)
        #: ``NOISE_BANK`` overlapping windows of one sample's size (a view: no copy).
        self._noise = sliding_window_view(bank, size)

    def _shifted_templates(self) -> np.ndarray:
        """Each class's smooth random pattern rolled by every shift: ``(classes * 25, sample size)``,
        row ``label * 25 + shift``."""
        c, h, w = self.sample_shape
        rng = np.random.default_rng(stable_seed("templates", self.name, self.seed))
        coarse = rng.standard_normal((self.num_classes, c, 7, 7)).astype(np.float32)
        up = np.kron(coarse, np.ones((1, 1, 4, 4), np.float32))  # smooth 28x28 blobs
        templates = np.zeros((self.num_classes, c, h, w), np.float32)
        oy, ox = (h - up.shape[2]) // 2, (w - up.shape[3]) // 2
        templates[:, :, oy : oy + up.shape[2], ox : ox + up.shape[3]] = up
        moves = range(-self.SHIFT, self.SHIFT + 1)
        rolled = [np.roll(templates, (dy, dx), axis=(2, 3)) for dy in moves for dx in moves]
        return np.stack(rolled, axis=1).reshape(self.num_classes * len(rolled), c * h * w)

    def num_samples(self, split: str) -> int:
        return self.sizes[split]

    def labels(self, split: str, indices: np.ndarray) -> np.ndarray:
        return (self._hash("labels", split, indices) % np.uint64(self.num_classes)).astype(np.int64)

    def _hash(self, what: str, split: str, indices: np.ndarray) -> np.ndarray:
        """SplitMix64's output at ``(base + index) * gamma``, ``base`` from (``what``, dataset, seed,
        split): a cheap, vectorised, well-mixed hash of each index."""
        base = np.uint64(stable_seed(what, self.name, self.seed, split))
        with np.errstate(over="ignore"):
            return mix((indices.astype(np.uint64) + base) * GAMMA)

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        y[...] = self.labels(split, indices)
        if not len(indices):  # an empty batch is an empty batch (reshape(0, -1) has no shape to infer)
            return
        z = self._hash("samples", split, indices)
        shifts = (2 * self.SHIFT + 1) ** 2
        rows = y.astype(np.int64) * shifts + (z & np.uint64(0xFFFF)).astype(np.int64) % shifts
        scale = np.float32(0.7) + np.float32(0.6 / 65536) * ((z >> np.uint64(16)) & np.uint64(0xFFFF)).astype(
            np.float32
        )
        offsets = (z >> np.uint64(32)).astype(np.int64) % len(self._noise)
        out = x.reshape(len(indices), -1)
        # in chunks that stay in cache: a whole batch's temporaries are fresh pages every call (a
        # page fault per 4 KiB: that, not the arithmetic, took most of the time)
        step = max(1, CHUNK_BYTES // out.shape[1] // out.itemsize)
        for start in range(0, len(indices), step):
            chunk = slice(start, start + step)
            np.take(self._shifted, rows[chunk], axis=0, out=out[chunk])
            out[chunk] *= scale[chunk, None]
            out[chunk] += self._noise[offsets[chunk]]


class MockFields(Source):
    """Generated samples with variable-size, bytes-like and fixed named fields (deterministic)."""

    WORDS = ("red", "green", "blue", "cat", "dog", "sun", "ünï", "code")

    def __init__(self, uri: str, n: int = 40, seed: int = 0, image_max: int = 16 * 16 * 3):
        if n < 1:
            raise DatasetError(f"{uri}: n must be at least 1, got {n}")
        self.uri = uri
        self.seed = seed
        self.sizes = {"train": n, "val": max(1, n // 5), "test": max(1, n // 5)}
        self.num_classes = 4
        self.class_names = [str(i) for i in range(4)]
        self.kind = "fields"
        # no x/y: what reads the old way (a mix, a pipeline stage) gets a DatasetError from read()
        self.sample_shape, self.dtype = (0,), np.dtype(np.uint8)
        self._fields = [
            Field("image", "uint8", (None, None, 3), image_max),
            Field("tokens", "int32", (None,), 12 * 4),
            Field("text", "str", (), 64),
            Field("label", "int64", ()),
        ]

    @property
    def fields(self) -> list[Field]:
        return list(self._fields)

    def num_samples(self, split: str) -> int:
        return self.sizes[split]

    def sample(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray, str, int]:
        """Sample ``index`` of ``split``: (image, tokens, text, label)."""
        rng = np.random.default_rng((self.seed, SPLITS.index(split), index))
        h, w = (int(v) for v in rng.integers(2, 17, size=2))
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        tokens = rng.integers(0, 1000, int(rng.integers(0, 13)), dtype=np.int32)
        text = " ".join(self.WORDS[int(i)] for i in rng.integers(0, len(self.WORDS), int(rng.integers(0, 6))))
        return image, tokens, text, int(rng.integers(0, self.num_classes))

    def read_fields(self, split: str, indices: np.ndarray, epoch: int = 0) -> FieldBatch:
        samples = [self.sample(split, i) for i in indices.tolist()]
        return {
            "image": [s[0] for s in samples],
            "tokens": [s[1] for s in samples],
            "text": [s[2] for s in samples],
            "label": np.array([s[3] for s in samples], np.int64),
        }

    def read(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise DatasetError(f"{self.uri}: a multi-field dataset is read with read_fields, not as x/y")


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
        return (np.zeros((len(indices), *self.sample_shape), self.dtype), np.zeros(len(indices), self.label_dtype))


def open_mock(req: OpenRequest) -> Source:
    """``mock://NAME?n=&seed=&noise=`` (NAME: mnist, cifar10, tokens), popping what it reads."""
    uri, params = req.uri, req.params
    name = req.parts.netloc or req.parts.path.strip("/")
    if name == "tokens":
        return open_mock_tokens(req)
    if name == "fields":
        return MockFields(
            uri,
            n=req.int_param("n", 40) or 1,
            seed=req.int_param("seed", 0) or 0,
            image_max=req.int_param("max", 768) or 1,
        )
    n = req.int_param("n", None)
    seed = req.int_param("seed", 0)
    try:
        noise = float(params.pop("noise", 2.0))
    except ValueError as err:
        raise DatasetError(f"{uri}: 'noise' must be a number") from err
    return MockImages(uri, name, n=n, seed=seed, noise=noise)


def open_dummy(req: OpenRequest) -> Source:
    """``dummy://?shape=&n=&classes=&dtype=``, popping what it reads."""
    uri, params = req.uri, req.params
    try:
        shape = tuple(int(s) for s in params.pop("shape", "1,28,28").split(",") if s)
    except ValueError as err:
        raise DatasetError(f"{uri}: shape must be comma-separated integers, e.g. 3,32,32") from err
    if not shape or any(s < 1 for s in shape):
        raise DatasetError(f"{uri}: shape must be positive integers, got {shape}")
    n = req.int_param("n", 1000)
    classes = req.int_param("classes", 10)
    if n < 1 or classes < 1:
        raise DatasetError(f"{uri}: n and classes must be at least 1")
    return Dummy(uri, shape, n, classes, params.pop("dtype", "float32"))
