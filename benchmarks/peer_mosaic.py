"""MosaicML Streaming's dataset for the image workload (benchmarks/peer_images.py): JPEG bytes from MDS
shards, decoded and augmented in the dataset's ``__getitem__`` — Streaming's documented way to add a
transform (subclass ``StreamingDataset``, override ``__getitem__``).

A module of its own because it imports Streaming when it is imported: only the mosaic row's process
does, and the DataLoader workers Streaming spawns, which import it to unpickle the dataset.
"""

from __future__ import annotations

import torch

from benchmarks.peer_jpeg import Augment
from benchmarks.peer_rows import streaming_without_torchvision

streaming_without_torchvision()  # (already done by importing peer_rows: said here because it must come first)

from streaming import StreamingDataset  # noqa: E402

__all__ = ["MosaicJpegs"]


class MosaicJpegs(StreamingDataset):
    """Samples ``{"jpg": bytes, "y": int}`` served as ``(float32 (3, S, S) tensor, label)``."""

    def __init__(self, *, image_size: int, **kw):
        super().__init__(**kw)
        self.image_size = image_size
        self._augment: Augment | None = None  # made in the worker that uses it (its own random numbers)

    def __getitem__(self, i):
        sample = super().__getitem__(i)
        if self._augment is None:
            self._augment = Augment(self.image_size)
        return torch.from_numpy(self._augment(sample["jpg"], f"mds sample {i}")), int(sample["y"])
