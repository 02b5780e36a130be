"""What an evaluation's reply may say about a private test split: each score rounded to a step, with
calibrated noise, inside a fixed range.

A score at full precision answers per-sample questions: weights crafted to react to one chosen input
move the test loss by that one sample's loss, and so reveal whether the input is in the split and its
label. Here each released metric is a mean over the split's ``n`` samples whose per-sample value lies
in a fixed range — ``[0, EVAL_LOSS_CLIP]`` for the loss (the provider clips each prediction's loss),
``[0, 1]`` for accuracy and an evaluator's extra metrics — so one sample moves it by at most
``range / n`` (its sensitivity). Laplace noise of scale ``sensitivity / (n * epsilon)`` makes each
released metric ``epsilon``-differentially private in each test sample (Dwork & Roth, "The
Algorithmic Foundations of Differential Privacy", §3.3; the reusable holdout of Dwork et al.,
Science 2015, builds on the same mechanism); rounding to ``quantum`` and clamping to the range are
post-processing, which keeps that guarantee and also bounds how many distinct answers a reply can
take (:func:`bits_per_evaluation`): the bits an attacker can learn a day follow from the per-dataset
budget (kept at the router: services/router/eval_budget.py), whatever the weights sent.

The noise of a reply is drawn from a generator seeded by a keyed hash (HMAC-SHA256) of what was
asked: the weights' digest (their tensors' names, dtypes, shapes and bytes: libbus/jobs/weights.py, so
the same weights under other file metadata are the same question), the model spec, the dataset, the
split and the release's epsilon. The key is the dataset's, kept by the router and handed to the
provider with each charge of the dataset's budget (services/router/eval_budget.py): every replica
and every restart of the dataset's providers draws the same noise for the same question, so
repeating it and averaging the answers learns nothing more; a new question costs an evaluation of
the budget. A noised release without a key is refused: noise anyone could recompute hides nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import math

import numpy as np

from libbus.constants import EVAL_EPSILON, EVAL_LOSS_CLIP, EVAL_QUANTUM
from libbus.errors import Internal

__all__ = ["EXACT", "Release", "bits_per_evaluation", "margin"]


def _range(name: str) -> float:
    return EVAL_LOSS_CLIP if name == "loss" else 1.0


def bits_per_evaluation(extra_metrics: int = 0, quantum: float = EVAL_QUANTUM) -> float:
    """Most bits one released evaluation can carry: the log2 of how many distinct replies exist
    (``loss`` in ``[0, EVAL_LOSS_CLIP]``, ``accuracy`` and each extra metric in ``[0, 1]``, each on a
    grid of ``quantum``; ``n`` is the split's size, public in its DatasetInfo)."""
    values = [EVAL_LOSS_CLIP, 1.0] + [1.0] * extra_metrics
    return sum(math.log2(round(r / quantum) + 1) for r in values)


def _scale(name: str, n: int, epsilon: float) -> float:
    """The Laplace scale of ``name``'s noise on a mean over ``n`` samples: its sensitivity / epsilon."""
    return _range(name) / (max(1, n) * epsilon)


def margin(name: str, n: int, epsilon: float, quantum: float = EVAL_QUANTUM, level: float = 0.95) -> float:
    """How far a released ``name`` (a mean over ``n`` samples, released at ``epsilon``) lies from the
    exact value with probability ``level``: the Laplace noise's quantile, ``scale * ln(1 / (1 - level))``
    (about 3 scales at 95%), plus half a rounding step. 0 for an exact release (``epsilon`` 0)."""
    if epsilon <= 0:
        return 0.0
    return _scale(name, n, epsilon) * math.log(1.0 / (1.0 - level)) + quantum / 2


class Release:
    """Turns exact scores into what leaves the provider.

    Args:
        epsilon: privacy parameter per released metric (smaller: more noise); 0 releases exact values,
            for splits that need no hiding (nor rounding).
        quantum: the rounding step of every released metric.
    """

    def __init__(self, epsilon: float = EVAL_EPSILON, quantum: float = EVAL_QUANTUM):
        self.epsilon = max(0.0, epsilon)
        self.quantum = quantum if self.epsilon > 0 else 0.0

    def metric(self, name: str, value: float, n: int, rng: np.random.Generator | None = None) -> float:
        """``value`` (a mean over ``n`` samples) as released: noised, rounded, clamped to its range.
        A value that is not a number (a diverged model) is released as the range's worst end."""
        high = _range(name)
        if not math.isfinite(value):
            value = high if name == "loss" else 0.0
        if self.epsilon > 0 and rng is not None:
            value += float(rng.laplace(0.0, _scale(name, n, self.epsilon)))
        if self.quantum > 0:
            value = round(round(value / self.quantum) * self.quantum, 12)
        return min(high, max(0.0, value))

    def __call__(
        self, question: bytes, loss: float, accuracy: float, n: int, metrics: dict[str, float], key: bytes = b""
    ) -> tuple[float, float, dict]:
        """``(loss, accuracy, metrics)`` as released for ``question`` (bytes naming what was asked:
        the same question under the same ``key``, the dataset's, gets the same noise).

        Raises :class:`Internal` for a noised release whose ``key`` is shorter than 16 bytes."""
        if self.epsilon <= 0:
            rng = None
        elif len(key) < 16:
            raise Internal("a noised score needs its dataset's noise key (from the router); none was given")
        else:
            # epsilon is part of the question: two releases at two scales of one draw would cancel it
            seed = hmac.new(key, b"%r\0%s" % (self.epsilon, question), hashlib.sha256).digest()
            rng = np.random.default_rng(int.from_bytes(seed, "big"))
        return (
            self.metric("loss", loss, n, rng),
            self.metric("accuracy", accuracy, n, rng),
            {k: self.metric(k, v, n, rng) for k, v in sorted(metrics.items())},
        )


#: The release of a split that needs no hiding (val, or a test split served with private_test=false):
#: exact, save a non-finite value, which is released as its range's worst end (JSON has no NaN).
EXACT = Release(epsilon=0.0, quantum=0.0)
