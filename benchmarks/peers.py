"""``busctl bench --peers``: the same samples and batches through batchbus and the loaders users compare it with.

One generated dataset (:func:`benchmarks.delivery.make_dataset`: float32 3×32×32 + int64 labels),
and the same number of random batches of ``--batch`` for every row; each row runs in a process of
its own (some peers change torch's multiprocessing set-up or start shared-memory services on import):

===================  ===============================================================================
dataloader           ``torch.utils.data.DataLoader(num_workers=2)``, a per-sample ``__getitem__``
dataloader-batched   the same, one ``__getitem__`` per batch (the fast way; the delivery benchmark's)
mosaic               MosaicML Streaming: local MDS shards (written once), ``StreamingDataset`` + DataLoader
litdata              Lightning litData: ``optimize()`` chunks, ``StreamingDataset`` + ``StreamingDataLoader``
webdataset           WebDataset tar shards, shard + buffer shuffle, ``WebLoader``
torchdata            ``torchdata.nodes``: batch sampler → ``ParallelMapper`` (2 processes) → prefetch
shm                  batchbus: a provider process writing each batch into the trainer's ring
socket               batchbus: the same provider, batches over loopback TCP
===================  ===============================================================================

Peers that read a format of their own write it first, in their row's process (``prepare_s``, not in
the throughput). Throughput counts from a row's first batch to its last; ``startup_s`` is the time
from building the loader to its first batch. Every batch is checked for its shapes and dtypes. A peer
that is not installed (``make install-bench``) gives a row saying so.

The samples are tensors. ``WORKLOADS`` is where the image workload (JPEG decode + augmentation, the
"samples as users have them" recipe) plugs in once it has landed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from benchmarks import peer_rows
from benchmarks.delivery import SAMPLE_SHAPE, batch_plan, make_dataset, measure, parser

__all__ = ["ROWS", "WORKLOADS", "main", "run_peers", "print_peers"]

#: Row name → the module it needs (None: batchbus and torch, always there).
ROWS: dict[str, str | None] = {
    "dataloader": None,
    "dataloader-batched": None,
    "mosaic": "streaming",
    "litdata": "litdata",
    "webdataset": "webdataset",
    "torchdata": "torchdata.nodes",
    "shm": None,
    "socket": None,
}

#: The sample recipes the rows can run. ``images`` (decode and augment JPEGs) is added here when the
#: image pipeline is on main; each row then builds its samples from the recipe instead of the .npy.
WORKLOADS = ("tensor",)


def installed(module: str | None) -> bool:
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def checked(batches: Iterable, batch: int, started: dict) -> Iterator:
    """Each batch as ``(x, y)`` tensors, its shapes and dtypes checked; notes when the first came."""
    want_x = (batch, *SAMPLE_SHAPE)
    for i, b in enumerate(batches):
        if i == 0:
            started["first"] = time.perf_counter()
        x, y = (b["x"], b["y"]) if isinstance(b, dict) else (b[0], b[1])
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        if tuple(x.shape) != want_x or x.dtype != torch.float32 or tuple(y.shape) != (batch,):
            raise RuntimeError(f"wrong batch: x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}")
        yield x, y


def epochs(make: Callable[[], Iterable]) -> Iterator:
    """A loader's passes, one after another, for as long as the row reads."""
    while True:
        yield from make()


def _row_main(name: str, root: str, cfg: dict, out) -> None:
    """One row, in its own process: prepare the peer's format, read ``cfg['batches']`` batches."""
    try:
        work = Path(root) / f"row-{name}"
        work.mkdir()
        t0 = time.perf_counter()
        make = peer_rows.BUILDERS[name](Path(root), work, cfg)  # writes the peer's format, if any
        prepared = time.perf_counter()
        started: dict = {}
        batches = islice(checked(make(), cfg["batch"], started), cfg["batches"])
        row = measure(name, batches, cfg["batch"], cfg["sample_bytes"])
        row.update(status="ok", prepare_s=prepared - t0, startup_s=started["first"] - prepared)
        peer_rows.close()
    except BaseException as err:  # noqa: BLE001 - the row reports why it failed; the run goes on
        row = {"path": name, "status": f"failed: {type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
    out.put(row)


def run_row(name: str, root: Path, cfg: dict, timeout_s: float) -> dict:
    if not installed(ROWS[name]):
        return {"path": name, "status": "not installed (make install-bench)"}
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_row_main, args=(name, str(root), cfg, out))  # not daemonic: it has workers
    proc.start()
    try:
        row = out.get(timeout=timeout_s)
    except Exception:  # noqa: BLE001 - queue.Empty, or the process died before it answered
        row = {"path": name, "status": f"failed: no result within {timeout_s:.0f} s (exit code {proc.exitcode})"}
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return row


def run_peers(args) -> dict:
    """Every row of ``--rows`` (all by default) on one dataset; ratios to ``dataloader-batched``."""
    if args.workload not in WORKLOADS:
        raise SystemExit(
            f"workload {args.workload!r} is not available yet (only {', '.join(WORKLOADS)}): the image "
            "recipe plugs in at benchmarks.peers.WORKLOADS once it has landed"
        )
    names = args.rows.split(",") if args.rows else list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown row(s) {', '.join(unknown)}; rows are {', '.join(ROWS)}")
    root = Path(tempfile.mkdtemp(prefix="batchbus-peers-"))
    try:
        make_dataset(root, args.samples)
        x = np.load(root / "train_x.npy", mmap_mode="r")
        sample_bytes = x[0].nbytes + 8
        plan = batch_plan(args.samples, args.batch, args.epochs)
        cfg = {
            "samples": args.samples,
            "batch": args.batch,
            "epochs": args.epochs,
            "batches": len(plan),
            "sample_bytes": sample_bytes,
            "workers": args.workers,
            "inflight": args.inflight,
        }
        rows = [run_row(name, root, cfg, args.row_timeout) for name in names]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = next((r for r in rows if r["path"] == "dataloader-batched" and r["status"] == "ok"), None)
    for r in rows:
        if base is not None and r["status"] == "ok":
            r["x_dataloader_batched"] = r["samples_per_s"] / base["samples_per_s"]
    return {**cfg, "workload": args.workload, "dataset_mb": args.samples * sample_bytes / 2**20, "rows": rows}


def print_peers(result: dict) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table(
        "row",
        "samples/s",
        "GB/s",
        "p50 ms",
        "p99 ms",
        "× DL batched",
        "start-up s",
        "prepare s",
        title=f"{result['samples']} samples ({result['dataset_mb']:.0f} MiB), {result['batches']} random batches "
        f"of {result['batch']}, workload {result['workload']}",
    )
    for r in result["rows"]:
        if r["status"] != "ok":
            table.add_row(r["path"], r["status"].splitlines()[0][:80], *[""] * 6)
            continue
        table.add_row(
            r["path"],
            f"{r['samples_per_s']:,.0f}",
            f"{r['gb_per_s']:.2f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['x_dataloader_batched']:.2f}" if "x_dataloader_batched" in r else "—",
            f"{r['startup_s']:.2f}",
            f"{r['prepare_s']:.1f}",
        )
    Console().print(table)


def peers_parser() -> argparse.ArgumentParser:
    """The delivery benchmark's options (same dataset, batches, workers, ``--json``) and the rows'."""
    p = parser()
    p.prog = "busctl bench --peers"
    g = p.add_argument_group("peers (the loaders install with `make install-bench`)")
    g.add_argument("--rows", default="", help=f"these rows only, comma-separated (of {', '.join(ROWS)})")
    g.add_argument("--workload", default="tensor", help=f"the samples' recipe (of {', '.join(WORKLOADS)})")
    g.add_argument("--row-timeout", type=float, default=300.0, help="give a row up after this many seconds")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = peers_parser().parse_args(argv)
    if args.samples < 4 * args.batch or args.batch < 1:
        peers_parser().error(f"--samples must be at least 4 batches ({4 * args.batch})")
    result = run_peers(args)
    print_peers(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(["--peers", *sys.argv[1:]])
