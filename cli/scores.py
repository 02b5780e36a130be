"""How busctl shows a score of the private test split: with the size of the privacy noise it was
released with (services/provider/score_release.py, docs/security.md §9), so two scores of the same weights
that differ by the noise are not read as two models.

A result or an ``eval`` acknowledgement holds ``test_n`` and ``test_epsilon`` (the provider's
``eval_epsilon`` when it released them: 0 is exact; absent from an older provider's)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["EXACT_HOW", "noise_note", "score"]

#: How to get exact scores, said wherever noised ones are shown.
EXACT_HOW = (
    "for exact scores the provider's operator sets eval_epsilon = 0, only where every asker may see "
    "the test split (docs/security.md §9)"
)


def _margin(metric: str, n: int, epsilon: float) -> float:
    from services.provider.score_release import margin  # noqa: PLC0415 - numpy: only where a score is shown

    return margin(metric, n, epsilon)


def score(d: Mapping, metric: str, short: bool = False) -> str:
    """``test_<metric>`` of ``d`` as ``0.9460 ± 0.0305 at 95%`` (``short``: ``0.9460±0.031``), or
    ``0.9460 (exact)``; ``-`` when ``d`` has none. ``metric`` is ``accuracy``, ``loss`` or an
    evaluator's metric (read from ``test_metrics``)."""
    value = d.get(f"test_{metric}", (d.get("test_metrics") or {}).get(metric))
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    epsilon, n = d.get("test_epsilon"), d.get("test_n")
    if not isinstance(epsilon, (int, float)) or not isinstance(n, int):
        return f"{value:.4f}" if short else f"{value:.4f} (noise not reported)"
    if epsilon <= 0:
        return f"{value:.4f}" if short else f"{value:.4f} (exact)"
    m = _margin(metric, n, float(epsilon))
    return f"{value:.4f}±{m:.3f}" if short else f"{value:.4f} ± {m:.4f} at 95%"


def noise_note(d: Mapping) -> str:
    """One line on the noise of ``d``'s test scores and how to get exact ones; "" when they are exact
    or there are none."""
    if not isinstance(d.get("test_accuracy", d.get("test_loss")), (int, float)):
        return ""
    epsilon = d.get("test_epsilon")
    if isinstance(epsilon, (int, float)) and epsilon <= 0:
        return ""
    if not isinstance(epsilon, (int, float)):
        said = "with privacy noise of a size its provider did not report"
    else:
        said = (
            f"with privacy noise (the provider's eval_epsilon {epsilon:g}), within ± of the exact score 95% of the time"
        )
    return f"test scores are released {said}; {EXACT_HOW}"
