"""Population-based training's decision, apart from I/O: given the population's scores at an epoch,
does this member exploit (copy a better member) and with what explored hyper-parameters?

Asynchronous PBT (Jaderberg et al. 2017, "truncation selection"): when a member reports an epoch
that is a multiple of ``interval``, it is ranked among the members that have reported that epoch;
one in the bottom ``quantile`` copies a member drawn from the top ``quantile`` (its latest
checkpoint: weights and optimizer state) and continues with that member's hyper-parameters, each
multiplied by a factor drawn from ``perturb`` and kept inside the ``[space]`` bounds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from libbus.jobs.spec import SETTABLE

from .study_spec import Param

__all__ = ["Exploit", "decide", "explore"]


@dataclass(frozen=True)
class Exploit:
    """Member ``member`` copies ``donor`` and continues with ``params``."""

    member: int
    donor: int
    params: dict


def decide(
    member: int,
    epoch: int,
    scores: dict[int, float],
    *,
    interval: int,
    quantile: float,
    maximize: bool,
    rng: random.Random,
) -> int | None:
    """The donor ``member`` should copy after reporting ``epoch``, or None (keep training).

    Args:
        scores: the objective at ``epoch`` of every member that has reported it (``member`` included).
        interval: exploit only at epochs that are multiples of it.
        quantile: the fraction at the bottom that copies, and at the top that is copied from.
        maximize: whether a higher score is better.
        rng: draws the donor among the top members.
    """
    if epoch % interval or member not in scores or len(scores) < 2:
        return None
    ranked = sorted(scores, key=lambda m: (scores[m], m), reverse=maximize)  # best first
    cut = max(1, math.floor(len(ranked) * quantile))
    top, bottom = ranked[:cut], ranked[-cut:]
    if member not in bottom or member in top:
        return None
    return rng.choice(top)


def explore(params: dict, space: dict[str, Param], factors: list[float], rng: random.Random) -> dict:
    """``params`` with each hyper-parameter a running job can change (:data:`SETTABLE`, or an
    entrypoint's ``params.NAME``) that the study varies multiplied by a factor drawn from
    ``factors``, clipped to its ``[space]`` range (a ``choice`` moves to a neighbouring choice instead)."""
    out = {}
    for name, param in space.items():
        if (name not in SETTABLE and not name.startswith("params.")) or name not in params:
            continue
        value = params[name]
        if param.kind == "choice":
            i = param.values.index(value) if value in param.values else 0
            step = 1 if rng.choice(factors) >= 1 else -1
            out[name] = param.values[min(max(i + step, 0), len(param.values) - 1)]
            continue
        low, high = param.values
        out[name] = float(min(max(value * rng.choice(factors), low), high))
    return out
