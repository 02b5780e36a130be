"""One provider under many loaders at once on the socket path: total throughput and fairness.

A router and one provider serving the delivery benchmark's generated dataset from RAM (real
processes, :class:`benchmarks.delivery.Services`); ``--loaders`` processes each read it through
``RemoteLoader(shm=False)`` (batches over loopback TCP), all started together. Each loader counts the
samples it received during the same ``--seconds`` window (after ``--warmup``), so the rates compare
like with like. Reported: the total samples/s, every loader's rate, and the slowest loader's rate as
a fraction of the fastest's (the target: at least 2/3).

    python -m benchmarks.fairness --loaders 16 --seconds 20 --json fairness.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.delivery import Services, loader_batches, make_dataset

__all__ = ["main", "run"]


def _loader(endpoint: str, token: str, args: dict, ready, out) -> None:
    """One loader: its first batch, then (all loaders at once) read until the window closes; the
    samples received inside the window."""
    from libbus.loader.remote import RemoteLoader  # noqa: PLC0415 - torch loads in the loader processes only

    got = 0
    with RemoteLoader(
        "ram",
        provider=endpoint,
        token=token,
        batch_size=args["batch"],
        shuffle="full",
        drop_last=True,
        inflight=args["inflight"],
        shm=False,
    ) as loader:
        batches = loader_batches(loader, 1_000_000)
        next(batches)
        ready.wait()  # every loader connected and served once: start together
        start_at = time.monotonic()
        opens, closes = start_at + args["warmup"], start_at + args["warmup"] + args["seconds"]
        for _x, _y in batches:
            now = time.monotonic()
            if now >= closes:
                break
            if now >= opens:
                got += args["batch"]
    out.put(got)


def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="batchbus-fair-"))
    services = None
    try:
        make_dataset(root, args.samples)
        services = Services(root, root / "state")
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        largs = {k: getattr(args, k) for k in ("batch", "inflight", "warmup", "seconds")}
        ready = ctx.Barrier(args.loaders)
        procs = [
            ctx.Process(target=_loader, args=(services.endpoint, services.token, largs, ready, out), daemon=True)
            for _ in range(args.loaders)
        ]
        for p in procs:
            p.start()
        counts = sorted(out.get(timeout=args.warmup + args.seconds + 300) for _ in procs)
        for p in procs:
            p.join(30)
    finally:
        if services is not None:
            services.stop()
        shutil.rmtree(root, ignore_errors=True)
    rates = [c / args.seconds for c in counts]
    return {
        "loaders": args.loaders,
        "batch": args.batch,
        "seconds": args.seconds,
        "total_samples_per_s": sum(rates),
        "rates": rates,
        "slowest_over_fastest": rates[0] / rates[-1] if rates[-1] else 0.0,
        "fair": rates[-1] > 0 and rates[0] / rates[-1] >= 2 / 3,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--loaders", type=int, default=16)
    p.add_argument("--samples", type=int, default=4096, help="dataset size (12 KiB samples)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=20.0, help="the measured window")
    p.add_argument("--json", type=Path, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.loaders < 1 or args.seconds <= 0 or args.samples < 4 * args.batch:
        parser().error("--loaders must be at least 1, --seconds positive, --samples at least 4 batches")
    r = run(args)
    print(
        f"{r['loaders']} loaders on one provider (socket path, batches of {r['batch']}): "
        f"{r['total_samples_per_s']:,.0f} samples/s in all; slowest {r['rates'][0]:,.0f}, fastest "
        f"{r['rates'][-1]:,.0f} samples/s = {r['slowest_over_fastest']:.2f} ({'fair' if r['fair'] else 'unfair'}: "
        "target >= 0.67)"
    )
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main()
