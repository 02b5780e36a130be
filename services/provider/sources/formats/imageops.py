"""Per-sample image operations: decode encoded bytes, resize, crop, flip, jitter, to a CHW array.

Shared by the image sources (``file://DIR?size=S`` on ImageFolder trees and WebDataset shards) and
the pipeline's image stages. Between operations a sample is a Pillow ``Image`` in mode ``RGB`` (any
size): Pillow's decoders and its resampling release the GIL, so threads decode and resize on as many
cores as the pool has (docs/performance.md). Only the last step makes a fixed-shape numpy array.

Every random operation takes its numbers as arguments (uniforms in [0, 1) that the caller draws
from ``(seed, epoch, split, stage, index)``), so that the same request gives the same bytes.
"""

from __future__ import annotations

import io
import math
import os
import warnings

import numpy as np

from libbus.errors import DatasetError

try:  # the ``images`` extra
    from PIL import Image, ImageEnhance
except ImportError:  # pragma: no cover - reported when an image dataset is opened
    Image = ImageEnhance = None  # type: ignore[assignment]  # an image dataset refuses to open without them
try:  # the ``images`` extra: libjpeg-turbo without Pillow's overhead, 1.5x faster per core on JPEG
    import simplejpeg
except ImportError:  # pragma: no cover - Pillow decodes JPEG too
    simplejpeg = None

__all__ = [
    "BAD_POLICIES",
    "IMAGE_EXTS",
    "BadImage",
    "center_crop",
    "color_jitter",
    "decode",
    "default_workers",
    "flip",
    "random_resized_crop",
    "require_pillow",
    "resize_exact",
    "resize_shorter",
    "to_chw",
]

#: What a bad image (truncated, corrupt, not an image) does: fail the batch naming it, or be skipped.
BAD_POLICIES = ("fail", "skip")


def default_workers() -> int:
    """The cores this process may run on (the default size of a decoding pool)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


#: File name endings that hold images (lower case), as ImageFolder and WebDataset name them.
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp")


class BadImage(DatasetError):
    """An encoded sample that is not a whole image (truncated, corrupt, not an image at all)."""


def require_pillow(uri: str) -> None:
    if Image is None:
        raise DatasetError(f"{uri}: image datasets need Pillow: pip install 'batchbus[images]'")


def decode(data: bytes, where: str):
    """Decode JPEG/PNG/WebP bytes into an RGB image (grey and palette expanded, alpha dropped).

    JPEG goes through simplejpeg when it is installed (docs/performance.md: the fastest decoder per
    core of those that install here), everything else and any JPEG it refuses through Pillow.

    Raises :class:`BadImage` naming ``where`` (the file or the shard and key) for bytes that are not
    a whole image: Pillow's "truncated" and "cannot identify" errors, or a decoder warning about
    truncated data, never a half-grey picture.
    """
    if simplejpeg is not None and data[:3] == b"\xff\xd8\xff":
        try:  # same libjpeg-turbo, same accurate IDCT and upsampling as Pillow: the same pixels
            rgb = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False, strict=True)
            return Image.fromarray(rgb, "RGB")
        except ValueError:
            pass  # truncated, CMYK, progressive oddities: Pillow decides (and names what is wrong)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img: Image.Image = Image.open(io.BytesIO(data))
            img.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise BadImage(f"{where}: not a whole image ({type(err).__name__}: {err})") from None
    if img.mode != "RGB":
        img = img.convert("RGB")
    return img


def resize_shorter(img, size: int, resample: int | None = None):
    """Scale so that the shorter side is ``size`` (aspect kept; bilinear with antialiasing, as
    torchvision's ``Resize(size)`` on PIL images)."""
    w, h = img.size
    if min(w, h) == size:
        return img
    if w <= h:
        nw, nh = size, max(1, int(size * h / w))
    else:
        nw, nh = max(1, int(size * w / h)), size
    return img.resize((nw, nh), Image.Resampling.BILINEAR if resample is None else resample)


def resize_exact(img, height: int, width: int):
    """Scale to exactly ``height`` × ``width`` (bilinear), aspect not kept."""
    return img.resize((width, height), Image.Resampling.BILINEAR)


def center_crop(img, height: int, width: int):
    """The centre ``height`` × ``width`` window (torchvision's rounding); padded with black where the
    image is smaller."""
    w, h = img.size
    if w < width or h < height:
        canvas = Image.new("RGB", (max(w, width), max(h, height)))
        canvas.paste(img, ((max(w, width) - w) // 2, (max(h, height) - h) // 2))
        img, (w, h) = canvas, canvas.size
    top = int(round((h - height) / 2.0))
    left = int(round((w - width) / 2.0))
    return img.crop((left, top, left + width, top + height))


def random_resized_crop(
    img, u: np.ndarray, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]
):
    """torchvision's ``RandomResizedCrop``: a window of a random area fraction in ``scale`` and aspect
    ratio in ``ratio`` (log-uniform), at a random place, resized to ``height`` × ``width``.

    ``u`` holds 40 uniforms: 10 tries of (area, ratio, top, left), then the centre-crop fallback.
    """
    w, h = img.size
    area = w * h
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for t in range(10):
        target = area * (scale[0] + u[4 * t] * (scale[1] - scale[0]))
        aspect = math.exp(log_lo + u[4 * t + 1] * (log_hi - log_lo))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(u[4 * t + 2] * (h - ch + 1))
            left = int(u[4 * t + 3] * (w - cw + 1))
            break
    else:  # fallback: the central crop at the nearest allowed ratio
        in_ratio = w / h
        if in_ratio < ratio[0]:
            cw, ch = w, int(round(w / ratio[0]))
        elif in_ratio > ratio[1]:
            ch, cw = h, int(round(h * ratio[1]))
        else:
            cw, ch = w, h
        top, left = (h - ch) // 2, (w - cw) // 2
    return img.resize((width, height), Image.Resampling.BILINEAR, box=(left, top, left + cw, top + ch))


def flip(img):
    """Mirror left-right."""
    return img.transpose(Image.FLIP_LEFT_RIGHT)


def color_jitter(img, u: np.ndarray, brightness: float, contrast: float, saturation: float):
    """Scale brightness, contrast and saturation by factors drawn from ``[1 - v, 1 + v]`` (``u``: 3
    uniforms), in that fixed order."""
    for value, enhancer, draw in (
        (brightness, ImageEnhance.Brightness, u[0]),
        (contrast, ImageEnhance.Contrast, u[1]),
        (saturation, ImageEnhance.Color, u[2]),
    ):
        if value:
            img = enhancer(img).enhance(max(0.0, 1.0 - value + 2.0 * value * float(draw)))
    return img


def to_chw(img) -> np.ndarray:
    """The image as a C-contiguous ``(3, H, W)`` uint8 array."""
    return np.ascontiguousarray(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))
