"""Pipeline datasets: samples per second through ``normalize → random_crop → flip`` against the bare
source and against the same stages applied inline on one thread (docs/performance.md).

    python -m benchmarks.pipeline [--samples 8192] [--batch 256] [--chunks 16,64,256]

The source is a generated ``.npy`` dataset of uint8 3×32×32 images held in RAM, so the stages are
what is measured. Each row reads the train split twice in batches and reports its better pass.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import cast

import numpy as np

from services.provider.sources import Source, open_source
from services.provider.sources.pipeline import Pipeline
from services.provider.sources.pipeline.stages import Chunk

STAGES = """
[[stages]]
name = "images"
source = {{ uri = "file://{data}?memory=ram&val_fraction=0" }}
[[stages]]
name = "norm"
input = "images"
normalize = {{ mean = [125.3, 123.0, 113.9], std = [63.0, 62.1, 66.7] }}
[[stages]]
name = "crop"
input = "norm"
random_crop = {{ size = 32, padding = 4 }}
[[stages]]
name = "flip"
input = "crop"
flip = {{}}
"""


def rate(read, n: int, batch: int) -> float:
    """Best of two passes over ``n`` samples in batches, in samples per second."""
    best = 0.0
    for epoch in range(2):
        started = time.perf_counter()
        for start in range(0, n - batch + 1, batch):
            read(np.arange(start, start + batch), epoch)
        best = max(best, (n // batch * batch) / (time.perf_counter() - started))
    return best


def served(source: Source, batch: int):
    x = np.empty((batch, *source.sample_shape), source.dtype)
    y = np.empty((batch, *source.label_shape), source.label_dtype)
    return lambda indices, epoch: source.serve_into("train", indices, x, y, epoch=epoch)


def inline(pipeline: Pipeline):
    """The same stages called one after the other on this thread: what the threads are measured against."""

    def read(indices, epoch):
        chunk = Chunk(None, 0, indices, "train", epoch)
        for stage in pipeline.stages:
            stage.run(chunk)

    return read


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", default="16,64,256", help="chunk sizes to try, comma-separated")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp, "data")
        data.mkdir()
        rng = np.random.default_rng(0)
        np.save(data / "train_x.npy", rng.integers(0, 256, (args.samples, 3, 32, 32), dtype=np.uint8))
        np.save(data / "train_y.npy", rng.integers(0, 10, args.samples))
        source = open_source(f"file://{data}?memory=ram&val_fraction=0")
        print(f"{'row':<44} samples/s")
        alone = rate(served(source, args.batch), args.samples, args.batch)
        print(f"{'source alone (uint8 npy in RAM)':<44} {alone:>9.0f}")
        path = Path(tmp, "inline.toml")
        path.write_text(STAGES.format(data=data))
        pipeline = cast(Pipeline, open_source(f"pipeline://{path}"))  # its threads never start: only inline() reads
        print(f"{'stages inline, one thread':<44} {rate(inline(pipeline), args.samples, args.batch):>9.0f}")
        for chunk in (int(c) for c in args.chunks.split(",")):
            path = Path(tmp, f"p{chunk}.toml")
            path.write_text(f"chunk = {chunk}\n" + STAGES.format(data=data))
            pipeline = cast(Pipeline, open_source(f"pipeline://{path}"))
            try:
                r = rate(served(pipeline, args.batch), args.samples, args.batch)
                busy = ", ".join(f"{s['name']} {s['busy_s']:.2f}" for s in pipeline.metrics()["stages"])
                print(f"{f'pipeline threads, chunk {chunk}':<44} {r:>9.0f}   busy s: {busy}")
            finally:
                pipeline.close()


if __name__ == "__main__":
    main()
