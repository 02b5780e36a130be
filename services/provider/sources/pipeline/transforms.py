"""The transform stages of a pipeline: ``normalize``, ``one_hot``, ``cast``, ``random_crop``, ``flip``.

Each checks its parameters against what its input produces and declares its own output
(:meth:`~.stages.Stage.check`); docs/datasets.md §4.1 lists them with their parameters.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from libbus.errors import DatasetError

from .stages import Chunk, RandomStage, SourceStage, Spec, Stage

__all__ = ["STAGE_TYPES", "TRANSFORMS", "Cast", "Flip", "Normalize", "OneHot", "RandomCrop"]


class Normalize(Stage[Spec]):
    """``normalize``: ``(x - mean) / std`` per channel (the first sample axis), as float."""

    type = "normalize"
    params = {"mean": 0.0, "std": 1.0, "dtype": "float32"}

    def check(self, spec: Spec) -> Spec:
        if spec.kind == "tokens" or spec.dtype.kind not in "biuf":
            raise self.error(f"needs numeric image samples, got {spec.kind} samples of {spec.dtype}")
        channels = spec.sample_shape[0] if spec.sample_shape else 1
        mean, std = self._number_list("mean", channels), self._number_list("std", channels)
        if np.any(std <= 0):
            raise self.error(f"std must be positive, got {self.config['std']!r}")
        dtype = self._dtype("dtype", "f")
        trailing = (1,) * max(0, len(spec.sample_shape) - 1)
        self.mean = mean.astype(dtype).reshape(-1, *trailing)
        self.scale = (1.0 / std).astype(dtype).reshape(-1, *trailing)
        return replace(spec, dtype=dtype)

    def apply(self, chunk: Chunk) -> None:
        x = chunk.xy()[0].astype(self.spec.dtype)
        x -= self.mean
        x *= self.scale
        chunk.x = x


class OneHot(Stage[Spec]):
    """``one_hot``: a class id label becomes a ``(num_classes,)`` row with a single 1."""

    type = "one_hot"
    params = {"num_classes": None, "dtype": "float32"}

    def check(self, spec: Spec) -> Spec:
        if spec.label_shape != () or spec.label_dtype.kind not in "iu":
            raise self.error(
                f"needs one integer class id per sample, got labels of shape "
                f"{list(spec.label_shape)} and dtype {spec.label_dtype}"
            )
        classes = self.config["num_classes"] if self.config["num_classes"] is not None else spec.num_classes
        if not isinstance(classes, int) or isinstance(classes, bool) or classes < 1:
            raise self.error(
                f"num_classes must be a positive integer (the input has {spec.num_classes}), got {classes!r}"
            )
        self.classes = classes
        return replace(spec, label_shape=(classes,), label_dtype=self._dtype("dtype", "fiub"), num_classes=classes)

    def apply(self, chunk: Chunk) -> None:
        y = chunk.xy()[1]
        if len(y) and (y.min() < 0 or y.max() >= self.classes):
            bad = int(y.min()) if y.min() < 0 else int(y.max())
            raise DatasetError(
                f"stage {self.name!r} (one_hot): label {bad} is outside the "
                f"{self.classes} classes 0..{self.classes - 1}"
            )
        out = np.zeros((len(y), self.classes), self.spec.label_dtype)
        out[np.arange(len(y)), y] = 1
        chunk.y = out


class Cast(Stage[Spec]):
    """``cast``: samples and/or labels to another numeric dtype (values converted as numpy does)."""

    type = "cast"
    params = {"dtype": None, "label_dtype": None}

    def check(self, spec: Spec) -> Spec:
        if self.config["dtype"] is None and self.config["label_dtype"] is None:
            raise self.error("give dtype, label_dtype or both")
        out = spec
        if self.config["dtype"] is not None:
            out = replace(out, dtype=self._dtype("dtype", "fiub"))
        if self.config["label_dtype"] is not None:
            out = replace(out, label_dtype=self._dtype("label_dtype", "fiub"))
        if spec.kind == "tokens" and out.dtype.kind not in "iu":
            raise self.error(f"token samples must stay integers, not {out.dtype}")
        return out

    def apply(self, chunk: Chunk) -> None:
        x, y = chunk.xy()
        chunk.x = x.astype(self.spec.dtype, copy=False)
        chunk.y = y.astype(self.spec.label_dtype, copy=False)


def _spatial(stage: Stage, spec: Spec) -> None:
    if spec.kind == "tokens" or len(spec.sample_shape) < 2:
        raise stage.error(
            f"needs image samples with height and width (C, H, W) or (H, W), got "
            f"{spec.kind} samples of shape {list(spec.sample_shape)}"
        )


class RandomCrop(RandomStage):
    """``random_crop``: pad the last two axes by ``padding``, then cut a ``size`` window at a random
    place (the centre on splits it does not apply to)."""

    type = "random_crop"
    params = {"size": None, "padding": 0, "fill": 0, "mode": "constant", "splits": ["train"]}
    MODES = ("constant", "edge", "reflect")

    def check(self, spec: Spec) -> Spec:
        _spatial(self, spec)
        h, w = spec.sample_shape[-2:]
        pad = self.config["padding"]
        if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
            raise self.error(f"padding must be a non-negative integer, got {pad!r}")
        size = self.config["size"]
        size = [h, w] if size is None else [size, size] if isinstance(size, int) else size
        if (
            not isinstance(size, list)
            or len(size) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in size)
        ):
            raise self.error(f"size must be a positive integer or [height, width], got {self.config['size']!r}")
        if size[0] > h + 2 * pad or size[1] > w + 2 * pad:
            raise self.error(f"size {size} does not fit samples of {h}x{w} padded by {pad}")
        if self.config["mode"] not in self.MODES:
            raise self.error(f"mode must be one of {', '.join(self.MODES)}, got {self.config['mode']!r}")
        if self.config["mode"] == "reflect" and pad >= min(h, w):
            raise self.error(f"reflect padding {pad} needs samples larger than it, got {h}x{w}")
        if not isinstance(self.config["fill"], (int, float)) or isinstance(self.config["fill"], bool):
            raise self.error(f"fill must be a number, got {self.config['fill']!r}")
        self.pad, self.size = pad, tuple(size)
        return replace(spec, sample_shape=(*spec.sample_shape[:-2], *size))

    def apply(self, chunk: Chunk) -> None:
        x, p = chunk.xy()[0], self.pad
        if p:
            widths = [(0, 0)] * (x.ndim - 2) + [(p, p), (p, p)]
            extra = {"constant_values": self.config["fill"]} if self.config["mode"] == "constant" else {}
            x = np.pad(x, widths, mode=self.config["mode"], **extra)
        ch, cw = self.size
        room_h, room_w = x.shape[-2] - ch, x.shape[-1] - cw
        if chunk.split not in self.splits:
            top, left = room_h // 2, room_w // 2
            chunk.x = np.ascontiguousarray(x[..., top : top + ch, left : left + cw])
            return
        u = self.uniforms(chunk, 2)
        top = (u[:, 0] * (room_h + 1)).astype(np.intp)
        left = (u[:, 1] * (room_w + 1)).astype(np.intp)
        windows = np.lib.stride_tricks.sliding_window_view(x, (ch, cw), axis=(-2, -1))
        # (N, …, H', W', ch, cw) → each row's window at (top, left): (N, …, ch, cw), one gather
        chunk.x = windows[np.arange(len(x)), ..., top, left, :, :]


class Flip(RandomStage):
    """``flip``: mirror a sample left-right (its last axis) with probability ``p``."""

    type = "flip"
    params = {"p": 0.5, "splits": ["train"]}

    def check(self, spec: Spec) -> Spec:
        _spatial(self, spec)
        p = self.config["p"]
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
            raise self.error(f"p must be a probability between 0 and 1, got {p!r}")
        self.p = float(p)
        return spec

    def apply(self, chunk: Chunk) -> None:
        if chunk.split not in self.splits:
            return
        flips = self.uniforms(chunk, 1)[:, 0] < self.p
        if flips.any():
            x = np.array(chunk.xy()[0])
            x[flips] = x[flips][..., ::-1]
            chunk.x = x


#: Transform stage types by their TOML key.
TRANSFORMS: dict[str, type[Stage]] = {cls.type: cls for cls in (Normalize, OneHot, Cast, RandomCrop, Flip)}
#: Every stage type: the source and the transforms.
STAGE_TYPES: dict[str, type[Stage]] = {"source": SourceStage, **TRANSFORMS}
