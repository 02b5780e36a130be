"""Samples per second that ``mock://`` image datasets generate on one core.

Reads random sorted batches of ``--batch`` samples from the train split through ``Source.read_into``
(as the provider does, straight into a reused destination) for ``--seconds`` per dataset, on the
calling thread, and prints samples/s by wall clock and per CPU second of that thread::

    taskset -c 0 python -m benchmarks.mock_sources [--batch 256] [--seconds 3] [mock://cifar10 ...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

__all__ = ["main", "measure"]


def measure(uri: str, batch: int, seconds: float) -> tuple[float, float]:
    """``(samples/s by wall clock, samples per CPU second)`` of ``uri`` read in random batches."""
    from services.provider.sources import open_source  # after argument checks

    source = open_source(uri)
    n = source.num_samples("train")
    rng = np.random.default_rng(0)
    batches = [np.sort(rng.choice(n, min(batch, n), replace=False)) for _ in range(64)]
    x = np.empty((len(batches[0]), *source.sample_shape), source.dtype)
    y = np.empty((len(batches[0]), *source.label_shape), source.label_dtype)
    source.read_into("train", batches[0], x, y)  # warm: the first read builds nothing lazily, but pages fault
    done, start, cpu = 0, time.perf_counter(), time.thread_time()
    while time.perf_counter() - start < seconds:
        source.read_into("train", batches[done % len(batches)], x, y)
        done += 1
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    return done * len(x) / wall, done * len(x) / max(cpu, 1e-9)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("uris", nargs="*", default=["mock://cifar10", "mock://mnist"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    if args.batch < 1 or args.seconds <= 0:
        ap.error("--batch must be at least 1 and --seconds positive")
    for uri in args.uris:
        wall, cpu = measure(uri, args.batch, args.seconds)
        print(f"{uri}: {wall:,.0f} samples/s, {cpu:,.0f} per CPU second ({args.batch}-sample batches)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
