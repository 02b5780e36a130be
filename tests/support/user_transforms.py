"""An operator's module of pipeline ``user`` stage functions (allowed by name in the tests' providers)."""

from __future__ import annotations

import time

import numpy as np

__all__ = ["jitter", "label_plus_one", "to_int16", "not_a_dict", "slow"]


def jitter(fields: dict, rng: np.random.Generator) -> dict:
    """Noise from the sample's own generator: the same (seed, epoch, index) gives the same bytes."""
    x = fields["x"]
    return {"x": x + rng.normal(0.0, 0.1, x.shape).astype(x.dtype)}


def label_plus_one(fields: dict, rng: np.random.Generator) -> dict:
    return {"y": fields["y"] + 1}


def to_int16(fields: dict, rng: np.random.Generator) -> dict:
    return {"x": fields["x"].astype(np.int16)}  # not what a float stage declares


def not_a_dict(fields: dict, rng: np.random.Generator):
    return fields["x"]


#: Seconds :func:`slow` sleeps per sample.
SLOW_S = 0.004


def slow(fields: dict, rng: np.random.Generator) -> dict:
    """A stage that takes its time and changes nothing: a stand-in for a heavy decode or augmentation."""
    time.sleep(SLOW_S)
    return {}
