"""Datasets written by the peer loaders' own writers, as their users have them: TFRecord shards of
``tf.train.Example`` (the ``tfrecord`` package's writer: TensorFlow's framing and protobuf messages,
without TensorFlow), for tests/test_tfrecord.py and tests/test_sources_contract.py."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

__all__ = ["write_tfrecords"]


def write_tfrecords(
    d: Path, rng: np.random.Generator, shards: int = 2, per_shard: int = 15, test: int = 6, gz: bool = False
) -> dict:
    """``train-0000-of-000N.tfrecord`` … and ``test.tfrecord`` in ``d``, each record an Example of
    ``pixels`` (6 float32), ``label`` (an int64 class id), ``jpeg`` (bytes of varying length) and ``tokens``
    (0..4 int64 values); gzip files with ``gz``. Returns split → {feature: values per record}, train with
    val not carved yet."""
    from tfrecord.writer import TFRecordWriter  # the peer's writer: a test extra

    d.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict[str, list]] = {}
    files = [(f"train-{i:04d}-of-{shards:04d}.tfrecord", "train", per_shard) for i in range(shards)]
    files.append(("test.tfrecord", "test", test))
    for name, split, n in files:
        path = d / name
        writer = TFRecordWriter(str(path))
        ref = out.setdefault(split, {"pixels": [], "label": [], "jpeg": [], "tokens": []})
        for _ in range(n):
            pixels = rng.standard_normal(6).astype(np.float32)
            label = int(rng.integers(0, 3))
            jpeg = rng.integers(0, 256, int(rng.integers(1, 40)), dtype=np.uint8).tobytes()
            tokens = rng.integers(-5, 1 << 40, int(rng.integers(0, 5)))
            writer.write(
                {
                    "pixels": (pixels, "float"),
                    "label": (label, "int"),
                    "jpeg": (jpeg, "byte"),
                    "tokens": (tokens.tolist(), "int"),
                }
            )
            for key, value in (("pixels", pixels), ("label", label), ("jpeg", jpeg), ("tokens", tokens)):
                ref[key].append(value)
        writer.close()
        if gz:
            path.with_name(name + ".gz").write_bytes(gzip.compress(path.read_bytes()))
            path.unlink()
    return out
