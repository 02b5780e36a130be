"""Reading a service's Prometheus ``/metrics`` the way a scraper does."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["scrape", "value"]


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample on ``url``: (sample name, labels) → value."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples: dict, metric: str, /, **labels) -> float:
    """The one sample of ``metric`` carrying ``labels``; fails if there is none or several."""
    matches = [v for (n, ls), v in samples.items() if n == metric and set(labels.items()) <= ls]
    assert len(matches) == 1, f"{metric} {labels}: {len(matches)} samples"
    return matches[0]
