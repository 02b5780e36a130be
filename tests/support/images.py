"""Image datasets written by tests: real JPEG/PNG/WebP bytes of different sizes and colour modes, laid out
as ImageFolder trees and WebDataset tar shards, with classes trivially separable by colour."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

#: Class colours (RGB): far apart in hue and in grey level (luminance about 55, 100, 160, 232), so that
#: any classifier separates them after any resize or crop, grey images included.
COLOURS = [(160, 10, 10), (60, 90, 255), (60, 230, 60), (250, 245, 120)]
FORMATS = [("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP")]
MODES = ["RGB", "L", "RGBA", "P"]


def image_bytes(label: int, number: int, fmt: str = "JPEG", mode: str = "RGB", size=None) -> bytes:
    """An image of class ``label``: its colour plus mild noise, of a size that varies with ``number``."""
    rng = np.random.default_rng((label, number))
    w, h = size or (int(24 + (number * 7) % 40), int(20 + (number * 11) % 36))
    pixels = np.clip(np.array(COLOURS[label % len(COLOURS)]) + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    if fmt == "JPEG" and mode in ("RGBA", "P"):
        img = img.convert("RGB")
    out = io.BytesIO()
    img.save(out, fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return out.getvalue()


def sample_format(number: int) -> tuple[str, str, str]:
    """(extension, Pillow format, mode) cycling through formats and colour modes."""
    ext, fmt = FORMATS[number % len(FORMATS)]
    return ext, fmt, MODES[(number // len(FORMATS)) % len(MODES)]


def write_imagefolder(root: Path, per_class: int, classes: int = 2, splits=("train",)) -> Path:
    for split in splits:
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for n in range(per_class):
                ext, fmt, mode = sample_format(n)
                number = n if split == "train" else 10_000 + n
                (folder / f"{n:05d}.{ext}").write_bytes(image_bytes(c, number, fmt, mode))
    return root


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def shard_members(split: str, first: int, count: int, classes: int = 2, text=None) -> list[tuple[str, bytes]]:
    """WebDataset members of ``count`` samples: ``KEY.EXT`` image, ``KEY.cls``, and ``KEY.txt`` from
    ``text(number)`` when given."""
    members = []
    for n in range(first, first + count):
        label = n % classes
        ext, fmt, mode = sample_format(n)
        key = f"{split}/s{n:06d}"
        members.append((f"{key}.{ext}", image_bytes(label, n, fmt, mode)))
        members.append((f"{key}.cls", str(label).encode()))
        if text is not None:
            members.append((f"{key}.txt", text(n).encode()))
    return members


def write_shards(root: Path, split: str, shards: int, per_shard: int, classes: int = 2) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        path = root / f"{split}-{s:04d}.tar"
        path.write_bytes(tar_bytes(shard_members(split, s * per_shard, per_shard, classes)))
        paths.append(path)
    return paths
