"""Pipeline datasets for tests/provider/pipeline/test_pipeline.py and tests/provider/pipeline/test_pipeline_factory.py: a one-stage source
file, a fixture that writes pipeline files and opens them as the provider would, and a reader."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from services.provider.sources import open_source
from services.provider.sources.pipeline import Pipeline

__all__ = ["SOURCE", "open_pipeline_fixture", "read"]

SOURCE = """
[[stages]]
name = "images"
source = { uri = "mock://cifar10?n=200" }
"""


@pytest.fixture(name="open_pipeline")
def open_pipeline_fixture(tmp_path):
    """Write a pipeline file and open it as the provider would; closes what it opened."""
    opened: list[Pipeline] = []

    def make(text: str, name: str = "p.toml") -> Pipeline:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        source = open_source(f"pipeline://{path}")
        opened.append(source)
        return source

    yield make
    for source in opened:
        source.close()


def read(p: Pipeline, split: str, indices, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
    indices = np.asarray(indices, np.int64)
    x = np.empty((len(indices), *p.sample_shape), p.dtype)
    y = np.empty((len(indices), *p.label_shape), p.label_dtype)
    p.serve_into(split, indices, x, y, epoch=epoch)
    return x, y
