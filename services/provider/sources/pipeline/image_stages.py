"""Image stages of a pipeline: ``decode``, ``resize``, ``center_crop``, ``random_resized_crop``,
``color_jitter``, ``to_dtype`` (docs/datasets.md §7.1).

Their input is a source of encoded images (``file://DIR?encoded=1`` on an ImageFolder tree or WebDataset
shards). ``decode`` turns the bytes into images of any size (kind ``decoded``: Pillow images, inside the
pipeline only), ``resize`` keeps them variable, and ``center_crop`` / ``random_resized_crop`` make the
fixed ``(3, H, W)`` uint8 samples every later stage (``flip``, ``normalize``, ``color_jitter``,
``to_dtype``) and the trainer see. Each stage maps its per-sample work over a pool of ``workers``
threads: Pillow releases the GIL while it decodes and resamples.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from libbus.errors import DatasetError

from ..formats import imageops
from ..formats.imageops import BAD_POLICIES, default_workers
from ..pipeline_metrics import StageMetrics
from .stages import Chunk, RandomStage, Spec, Stage

__all__ = ["IMAGE_STAGES"]

ENCODED, DECODED = "encoded", "decoded"


def _size_pair(stage: Stage, key: str) -> tuple[int, int]:
    value = stage.config[key]
    size = [value, value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        not isinstance(size, list)
        or len(size) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 4096 for v in size)
    ):
        raise stage.error(f"{key} must be a size in pixels or [height, width], got {value!r}")
    return size[0], size[1]


class _PoolStage(Stage[Spec]):
    """A per-sample map over a thread pool of ``workers`` (a parameter of every image stage)."""

    pool: ThreadPoolExecutor

    def _pool(self) -> ThreadPoolExecutor:
        workers = self.config["workers"]
        if workers is None:
            workers = default_workers()
        if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 256:
            raise self.error(f"workers must be between 1 and 256, got {workers!r}")
        return ThreadPoolExecutor(workers, thread_name_prefix=f"stage-{self.name}")

    def map(self, fn, n: int) -> list:
        return list(self.pool.map(fn, range(n)))


def _fixed(chunk_x: list, shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty((len(chunk_x), *shape), np.uint8)
    for i, img in enumerate(chunk_x):
        out[i] = imageops.to_chw(img)
    return out


class Decode(_PoolStage):
    """``decode``: encoded JPEG/PNG/WebP bytes → RGB images of any size; ``bad`` = fail | skip."""

    type = "decode"
    params = {"bad": "fail", "workers": None}

    def check(self, spec: Spec) -> Spec:
        if spec.kind != ENCODED:
            raise self.error(f"needs encoded images (a source with encoded=1), got {spec.kind} samples")
        if self.config["bad"] not in BAD_POLICIES:
            raise self.error(f"bad must be one of {', '.join(BAD_POLICIES)}, got {self.config['bad']!r}")
        self.pool = self._pool()
        self.bad_images = 0
        return replace(spec, kind=DECODED)

    def apply(self, chunk: Chunk) -> None:
        samples, labels = chunk.xy()
        errors: dict[int, Exception] = {}

        def one(i: int):
            sample = samples[i]
            try:
                if sample.data is None:
                    raise imageops.BadImage(f"{sample.where}: no image member (.jpg, .jpeg, .png, .webp)")
                return imageops.decode(sample.data, sample.where)
            except imageops.BadImage as err:
                errors[i] = err
                return None

        images = self.map(one, len(samples))
        if errors:
            self.bad_images += len(errors)
            if self.config["bad"] == "fail":
                raise DatasetError(f"bad image: {errors[min(errors)]}")
            good = np.array([i for i in range(len(images)) if i not in errors])
            if not len(good):
                raise DatasetError(f"every sample of a chunk ({len(images)}) is a bad image")
            y = np.array(labels)
            for i in errors:
                near = int(good[np.argmin(np.abs(good - i))])
                images[i], y[i] = images[near], y[near]
            chunk.y = y
        x = np.empty(len(images), object)
        x[:] = images
        chunk.x = x

    def metrics(self) -> StageMetrics:
        return {**super().metrics(), "bad_images": self.bad_images}


class Resize(_PoolStage):
    """``resize``: shorter side to ``size`` (aspect kept), or exactly ``[height, width]``."""

    type = "resize"
    params = {"size": None, "workers": None}

    def check(self, spec: Spec) -> Spec:
        if spec.kind != DECODED:
            raise self.error(f"needs decoded images (after decode), got {spec.kind} samples")
        value = self.config["size"]
        self.exact = _size_pair(self, "size") if isinstance(value, list) else None
        if self.exact is None:
            self.shorter = _size_pair(self, "size")[0]
        self.pool = self._pool()
        return spec

    def apply(self, chunk: Chunk) -> None:
        images = chunk.xy()[0]
        if self.exact:
            h, w = self.exact
            out = self.map(lambda i: imageops.resize_exact(images[i], h, w), len(images))
        else:
            out = self.map(lambda i: imageops.resize_shorter(images[i], self.shorter), len(images))
        x = np.empty(len(out), object)
        x[:] = out
        chunk.x = x


class CenterCrop(_PoolStage):
    """``center_crop``: the centre ``size`` window (padded with black where the image is smaller) →
    fixed ``(3, H, W)`` uint8."""

    type = "center_crop"
    params = {"size": None, "workers": None}

    def check(self, spec: Spec) -> Spec:
        if spec.kind != DECODED:
            raise self.error(f"needs decoded images (after decode or resize), got {spec.kind} samples")
        self.size = _size_pair(self, "size")
        self.pool = self._pool()
        return replace(spec, sample_shape=(3, *self.size), dtype=np.dtype(np.uint8), kind="image")

    def apply(self, chunk: Chunk) -> None:
        h, w = self.size
        images = chunk.xy()[0]
        chunk.x = _fixed(self.map(lambda i: imageops.center_crop(images[i], h, w), len(images)), (3, h, w))


class RandomResizedCrop(_PoolStage, RandomStage):
    """``random_resized_crop``: torchvision's RandomResizedCrop to ``size`` on the splits it applies to;
    elsewhere shorter side to ``size`` and the centre crop (the eval recipe)."""

    type = "random_resized_crop"
    params = {"size": None, "scale": [0.08, 1.0], "ratio": [0.75, 4.0 / 3.0], "splits": ["train"], "workers": None}

    def check(self, spec: Spec) -> Spec:
        if spec.kind != DECODED:
            raise self.error(f"needs decoded images (after decode), got {spec.kind} samples")
        self.size = _size_pair(self, "size")
        for key, lo_ok in (("scale", lambda v: 0 < v <= 1), ("ratio", lambda v: v > 0)):
            v = self.config[key]
            if not (isinstance(v, list) and len(v) == 2 and all(isinstance(a, (int, float)) for a in v)):
                raise self.error(f"{key} must be [low, high], got {v!r}")
            if not (lo_ok(v[0]) and lo_ok(v[1]) and v[0] <= v[1]):
                raise self.error(f"{key} must be [low, high] with 0 < low <= high, got {v!r}")
        self.pool = self._pool()
        return replace(spec, sample_shape=(3, *self.size), dtype=np.dtype(np.uint8), kind="image")

    def apply(self, chunk: Chunk) -> None:
        h, w = self.size
        images = chunk.xy()[0]
        if chunk.split not in self.splits:
            crops = self.map(
                lambda i: imageops.center_crop(imageops.resize_shorter(images[i], min(h, w)), h, w), len(images)
            )
        else:
            u = self.uniforms(chunk, 40)
            scale, ratio = tuple(self.config["scale"]), tuple(self.config["ratio"])
            crops = self.map(lambda i: imageops.random_resized_crop(images[i], u[i], h, w, scale, ratio), len(images))
        chunk.x = _fixed(crops, (3, h, w))


def _image_input(stage: Stage, spec: Spec) -> None:
    if spec.kind in (ENCODED, DECODED) or len(spec.sample_shape) != 3 or spec.sample_shape[0] != 3:
        raise stage.error(
            f"needs fixed (3, H, W) images (after center_crop or random_resized_crop), got {spec.kind} "
            f"samples of shape {list(spec.sample_shape)}"
        )


class ColorJitter(RandomStage):
    """``color_jitter``: brightness, contrast, saturation each scaled by a factor from [1 - v, 1 + v]
    (PIL's ImageEnhance formulas, in that order), on uint8 or float (0..1) images."""

    type = "color_jitter"
    params = {"brightness": 0.0, "contrast": 0.0, "saturation": 0.0, "splits": ["train"]}

    def check(self, spec: Spec) -> Spec:
        _image_input(self, spec)
        for key in ("brightness", "contrast", "saturation"):
            v = self.config[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1:
                raise self.error(f"{key} must be between 0 and 1, got {v!r}")
        return spec

    def apply(self, chunk: Chunk) -> None:
        if chunk.split not in self.splits:
            return
        u = self.uniforms(chunk, 3)
        before = chunk.xy()[0]
        x = before.astype(np.float32)
        top = 255.0 if before.dtype == np.uint8 else 1.0
        for k, key in enumerate(("brightness", "contrast", "saturation")):
            v = float(self.config[key])
            if not v:
                continue
            f = np.maximum(0.0, 1.0 - v + 2.0 * v * u[:, k]).astype(np.float32)[:, None, None, None]
            grey = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2])[:, None]
            base = 0.0 if key == "brightness" else grey.mean(axis=(2, 3), keepdims=True) if key == "contrast" else grey
            x = np.clip(base + f * (x - base), 0.0, top)
        chunk.x = np.rint(x).astype(np.uint8) if before.dtype == np.uint8 else x.astype(before.dtype)


class ToDtype(Stage[Spec]):
    """``to_dtype``: samples to ``dtype``; ``scale = true`` maps uint8 0..255 onto 0..1 (torchvision's
    ``ToDtype(scale=True)``)."""

    type = "to_dtype"
    params = {"dtype": "float32", "scale": True}

    def check(self, spec: Spec) -> Spec:
        if spec.kind in (ENCODED, DECODED, "tokens"):
            raise self.error(f"needs fixed image samples, got {spec.kind}")
        if not isinstance(self.config["scale"], bool):
            raise self.error(f"scale must be true or false, got {self.config['scale']!r}")
        dtype = self._dtype("dtype", "fiu")
        if self.config["scale"] and (spec.dtype != np.uint8 or dtype.kind != "f"):
            raise self.error(f"scale = true maps uint8 onto a float type; got {spec.dtype} → {dtype}")
        return replace(spec, dtype=dtype)

    def apply(self, chunk: Chunk) -> None:
        x = chunk.xy()[0].astype(self.spec.dtype)
        if self.config["scale"]:
            x *= self.spec.dtype.type(1.0 / 255.0)
        chunk.x = x


#: Image stage types by their TOML key.
IMAGE_STAGES: dict[str, type[Stage]] = {
    cls.type: cls for cls in (Decode, Resize, CenterCrop, RandomResizedCrop, ColorJitter, ToDtype)
}
