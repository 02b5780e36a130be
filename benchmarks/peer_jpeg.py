"""The image workload's samples and its per-sample recipe, shared by every row of ``--workload images``.

The samples are generated JPEGs of varied sizes (the image benchmark's content, benchmarks/images.py:
a left-to-right gradient under Gaussian noise, quality 90, ~125 KB at 500×375) in an ImageFolder tree,
``images/train/cK/NNNNN.jpg``. The recipe is the one the provider's ImageNet train pipeline runs
(examples/pipelines/imagenet-train.toml): decode → random-resized-crop to ``size`` → left-right flip
with probability 0.5 → normalize with ImageNet's means and deviations, into float32 ``(3, size, size)``.

Every row calls the same functions the provider's stages call (:mod:`services.provider.sources.formats.imageops`:
simplejpeg for JPEG when it is installed, else Pillow), so that the rows differ only in how they get the
bytes to the decoder and the decoded batches to the consumer.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from services.provider.sources.formats import imageops
from services.provider.sources.images import RRC_RATIO, RRC_SCALE

__all__ = ["CLASSES", "MEAN", "STD", "Augment", "augment_into", "image_files", "make_jpegs"]

#: Class folders of the generated tree (labels are 0 … CLASSES - 1).
CLASSES = 4
#: ImageNet's channel means and deviations on 0..255 pixels, as the example pipeline's ``normalize``.
MEAN = np.array([123.675, 116.28, 103.53], np.float32).reshape(3, 1, 1)
STD = np.array([58.395, 57.12, 57.375], np.float32).reshape(3, 1, 1)
_SCALE = (1.0 / STD).astype(np.float32)


def make_jpegs(root: Path, n: int, side: int = 500, seed: int = 0) -> list[tuple[Path, int]]:
    """``n`` JPEGs under ``root/train/cK/``: widths 0.6–1.3 × ``side``, aspect ratios 0.6–1.0 (most
    photos are landscape; 500×375 is ``side`` at 0.75). Returns (path, label) in the ImageFolder
    source's order (class folders sorted, then file names)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        w = int(rng.integers(max(8, side * 3 // 5), max(9, side * 13 // 10 + 1)))
        h = max(8, int(w * rng.uniform(0.6, 1.0)))
        base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
        pixels = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
        folder = root / "train" / f"c{i % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"{i:05d}.jpg", "JPEG", quality=90)
    return image_files(root)


def image_files(root: Path) -> list[tuple[Path, int]]:
    """The tree's (path, label) pairs, in the ImageFolder source's order."""
    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    return [(p, classes.index(p.parent.name)) for c in classes for p in sorted((root / "train" / c).glob("*.jpg"))]


class Augment:
    """The recipe for one process: its own random numbers (41 uniforms a sample, as the provider's
    ``random_resized_crop`` and ``flip`` draw), seeded from the process id so that workers differ."""

    def __init__(self, size: int):
        self.size = size
        self.rng = np.random.default_rng([7, os.getpid()])

    def __call__(self, data: bytes, where: str = "sample") -> np.ndarray:
        out = np.empty((3, self.size, self.size), np.float32)
        augment_into(data, self.rng.random(41), self.size, out, where)
        return out

    def batch(self, items: list[bytes]) -> np.ndarray:
        """A batch of encoded images → one float32 ``(B, 3, size, size)`` array, decoded one by one."""
        out = np.empty((len(items), 3, self.size, self.size), np.float32)
        for row, data in enumerate(items):
            augment_into(data, self.rng.random(41), self.size, out[row])
        return out


def augment_into(data: bytes, u: np.ndarray, size: int, out: np.ndarray, where: str = "sample") -> None:
    """Decode ``data`` and run the train recipe with uniforms ``u`` (41 of them) into ``out``."""
    img = imageops.random_resized_crop(imageops.decode(data, where), u, size, size, RRC_SCALE, RRC_RATIO)
    if u[40] < 0.5:
        img = imageops.flip(img)
    np.subtract(imageops.to_chw(img), MEAN, out=out, dtype=np.float32)
    out *= _SCALE
