"""A pipeline's counters as the provider's Stats carry them (``pipelines``, ``busctl queues``, ``/metrics``):
its request queue's and each stage's with its output queue's. An image source reports its decoding in
the same shape, as one ``decode`` stage, so both are read alike."""

from __future__ import annotations

from typing import TypedDict

__all__ = ["PipelineMetrics", "QueueMetrics", "RandomState", "StageMetrics"]


class QueueMetrics(TypedDict, total=False):
    """A bounded queue between stages: what it holds now, its bound, items put, got and dropped."""

    name: str
    size: int
    capacity: int
    put: int
    get: int
    drop: int
    closed: bool


class RandomState(TypedDict):
    """A random stage's anchor: its seed, the epoch its numbers follow (``"request"``: each request's),
    and the items it has drawn for since the anchor was set."""

    seed: int
    epoch: int | str
    items_since_anchor: int


class StageMetrics(TypedDict, total=False):
    """One stage's counters; a decoding stage adds ``bad_images``, a random one its :class:`RandomState`."""

    name: str
    type: str
    items_in: int
    items_out: int
    errors: int
    busy_s: float
    bad_images: int
    seed: int
    epoch: int | str
    items_since_anchor: int
    queue: QueueMetrics


class PipelineMetrics(TypedDict):
    """A pipeline's (or an image source's) counters: its request queue and its stages in order."""

    requests: QueueMetrics
    stages: list[StageMetrics]
