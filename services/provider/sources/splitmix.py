"""SplitMix64 (Steele, Lea and Flood, 2014) over numpy ``uint64`` arrays: counter-based randomness, so
a sample's random numbers are a pure function of (seed, epoch, split, index, draw) and a whole batch is
drawn at once, the same whichever batch, retry or resume asks for it.

SplitMix64's state after ``n`` steps from ``seed`` is ``seed + n * GAMMA``; its output is :func:`mix` of
that state. Every source and stage that needs such numbers uses these (``mock://`` labels, image
augmentation, pipeline stages); two older hashes built from the same constants (``mock://tokens``'
chain and the text-line order of ``formats/textlines.py``) differ from it and stay as they are, so that
the data they generate does not change.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GAMMA", "MUL1", "MUL2", "mix", "uniforms"]

#: SplitMix64's state increment (the golden ratio in 64 bits).
GAMMA = np.uint64(0x9E3779B97F4A7C15)
#: The multipliers of its output function.
MUL1 = np.uint64(0xBF58476D1CE4E5B9)
MUL2 = np.uint64(0x94D049BB133111EB)


def mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of the states ``z`` (uint64; the arithmetic wraps on purpose)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * MUL1
        z = (z ^ (z >> np.uint64(27))) * MUL2
    return z ^ (z >> np.uint64(31))


def uniforms(key: np.uint64, counters: np.ndarray) -> np.ndarray:
    """Numbers in [0, 1), one per counter: the top 53 bits of SplitMix64's output at state
    ``key + counter * GAMMA`` (float64 has 53 bits of mantissa)."""
    with np.errstate(over="ignore"):
        z = mix(key + counters * GAMMA)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
