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
tfrecord, hf-disk    the ``tfrecord`` package's and Hugging Face ``datasets``' loaders on their files
shm-mds, …           batchbus serving the peers' own files as written: ``shm-mds``, ``shm-litdata``,
                     ``shm-tfrecord``, ``shm-hf-disk`` (benchmarks/peer_formats.py; tensor workload only)
===================  ===============================================================================

Peers that read a format of their own write it first, in their row's process (``prepare_s``, not in
the throughput). A row reads its passes back to back until it has its batches. The first few
(``warmup``: 6, at most a quarter of the batches) are read before the clock starts: loaders decode
ahead while they start (two batches per DataLoader worker, ``--inflight`` requests), and counting
those would credit start-up work to the throughput. Throughput counts from the first timed batch to
the last; ``startup_s`` is the time from building the loader to its first batch. Every batch is
checked for its shapes, dtypes and labels. A peer that is not installed (``make install-bench``)
gives a row saying so.

Two workloads (``--workload``):

- ``tensor`` (the default): the samples above, read as they are stored (benchmarks/peer_rows.py).
- ``images``: generated JPEGs of varied sizes (~500×375, quality 90; benchmarks/peer_jpeg.py) decoded
  and augmented the way the provider's ImageNet train recipe does it (decode → random-resized-crop to
  ``--image-size`` → flip → normalize, float32), in every row with the same decoder: per sample in the
  peers' workers, on the provider's stages for batchbus (benchmarks/peer_images.py). 1,024 images and
  batches of 64 unless ``--samples``/``--batch`` say otherwise.

Each row also reports the CPU seconds its whole process tree (consumer, workers, provider) spent
per 1,000 samples over the timed window: on a shared machine that is the steadier figure. ``cores``
is that CPU over the window's wall time: the share of the machine the row got, and
``x_dataloader_batched_per_cpu`` the row's samples per CPU-second over the batched DataLoader's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from benchmarks import peer_formats, peer_rows
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
    **peer_formats.ROWS,
}

#: Batches a row reads before its clock starts (see :func:`warmup_batches`).
WARMUP = 6

#: The sample recipes the rows can run, and each one's defaults for --samples and --batch.
WORKLOADS: dict[str, dict[str, int]] = {
    "tensor": {"samples": 16384, "batch": 256},
    "images": {"samples": 1024, "batch": 64},
}


def installed(module: str | None) -> bool:
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def checked(batches: Iterable, cfg: dict, started: dict) -> Iterator:
    """Each batch as ``(x, y)`` tensors, its shapes, dtypes and label range checked; notes when the
    first came, and the row's CPU time when the first timed one (after the warm-up) came."""
    batch = cfg["batch"]
    want_x = (batch, *cfg["sample_shape"])
    for i, b in enumerate(batches):
        if i == 0:
            started["first"] = time.perf_counter()
        if i == cfg["warmup"]:
            started["cpu"] = tree_cpu_s()
        x, y = (b["x"], b["y"]) if isinstance(b, dict) else (b[0], b[1])
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        if tuple(x.shape) != want_x or x.dtype != torch.float32 or tuple(y.shape) != (batch,):
            raise RuntimeError(f"wrong batch: x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}")
        if int(y.min()) < 0 or int(y.max()) >= cfg["classes"]:
            raise RuntimeError(f"wrong batch: labels {int(y.min())}..{int(y.max())}, not 0..{cfg['classes'] - 1}")
        yield x, y


def tree_cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds used so far by process ``pid`` (this one) and every process under it (its loader's
    workers, its router and provider; those that have exited and been waited for too), from /proc;
    None where there is no /proc."""
    pid = os.getpid() if pid is None else pid
    tick = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return None
    for name in names:
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, …, utime, stime,
        kids.setdefault(int(fields[1]), []).append(int(name))  # cutime, cstime (children that have exited:
        cpu[int(name)] = sum(int(f) for f in fields[11:15]) / tick  # torchdata's workers of the pass before)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += kids.get(p, [])
    return total


def epochs(make: Callable[[], Iterable]) -> Iterator:
    """A loader's passes, one after another, for as long as the row reads."""
    while True:
        empty = True
        for batch in make():
            empty = False
            yield batch
        if empty:
            raise RuntimeError("a pass over the data gave no batch")


def warmup_batches(batches: int) -> int:
    """Batches read before the clock starts: what the loaders may have ready by their first batch
    (two per DataLoader worker, or ``--inflight`` requests), at most a quarter of the row's."""
    return min(WARMUP, batches // 4)


def _row_main(name: str, root: str, work_dir: str, cfg: dict, out) -> None:
    """One row, in its own process: prepare the peer's format under ``work_dir``, read
    ``cfg['batches']`` batches."""
    try:
        os.setpgrp()  # a group of its own: what it starts can be ended with it (run_row)
        # as in the user's own script: a process started by spawn defaults to spawn for its children,
        # which would start torchdata's per-pass workers (and DataLoader's) afresh, imports and all
        multiprocessing.set_start_method(cfg["start_method"], force=True)
        work = Path(work_dir)
        t0 = time.perf_counter()
        builders = {**peer_rows.BUILDERS, **peer_formats.BUILDERS} if cfg["workload"] == "tensor" else _image_builders()
        make = builders[name](Path(root), work, cfg)  # writes the peer's format, if any
        prepared = time.perf_counter()
        started: dict = {}
        batches = checked(epochs(make), cfg, started)
        for _ in islice(batches, cfg["warmup"]):  # the batches made ahead while the loader started
            pass
        row = measure(name, islice(batches, cfg["batches"] - cfg["warmup"]), cfg["batch"], cfg["sample_bytes"])
        cpu = tree_cpu_s()
        row.update(
            status="ok",
            prepare_s=prepared - t0,
            startup_s=started["first"] - prepared,
            timed_batches=row["batches"],
            batches=row["batches"] + cfg["warmup"],
        )
        if cpu is not None and started["cpu"] is not None:  # measure()'s window: first timed batch to last
            row["cpu_s_per_1k"] = (cpu - started["cpu"]) / ((row["timed_batches"] - 1) * cfg["batch"]) * 1000
            row["cores"] = row["cpu_s_per_1k"] * row["samples_per_s"] / 1000  # busy on average: the share it got
    except BaseException as err:  # noqa: BLE001 - the row reports why it failed; the run goes on
        row = {"path": name, "status": f"failed: {type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
    finally:
        try:
            peer_rows.close()  # a failed batchbus row too: its router and provider are processes of their own
        except Exception as err:  # noqa: BLE001 - the row's result is what the run needs
            print(f"{name}: closing: {type(err).__name__}: {err}", file=sys.stderr)
    out.put(row)


def _image_builders() -> dict:
    from benchmarks import peer_images  # noqa: PLC0415 - the image rows' process only

    return peer_images.BUILDERS


def run_row(name: str, root: Path, cfg: dict, timeout_s: float) -> dict:
    if not installed(ROWS[name]):
        return {"path": name, "status": "not installed (make install-bench)"}
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    work = tempfile.mkdtemp(prefix=f"row-{name}-", dir=root)  # the peer's format: gone when the row is
    proc = ctx.Process(target=_row_main, args=(name, str(root), work, cfg, out))  # not daemonic: it has workers
    proc.start()
    answered = False
    try:
        row = out.get(timeout=timeout_s)
        answered = True
    except Exception:  # noqa: BLE001 - queue.Empty, or the process died before it answered
        row = {"path": name, "status": f"failed: no result within {timeout_s:.0f} s (exit code {proc.exitcode})"}
    finally:  # given up, or this run interrupted (Ctrl-C): the row and all it started go at once
        proc.join(30 if answered else 0)
        if proc.is_alive() or not answered:
            _kill_group(proc.pid)
            if proc.is_alive():  # killed before it made its group
                proc.kill()
        proc.join()
        shutil.rmtree(work, ignore_errors=True)
    return row


def _kill_group(pgid: int | None) -> None:
    """SIGKILL the row's process group: the row, its loader's workers, its router and provider."""
    if pgid is None:  # never started
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # all gone already


def best_of(runs: list[dict]) -> dict:
    """A row's fastest round (on a shared machine, neighbours only ever slow a round down), with
    every round's samples/s and CPU seconds per 1,000 samples beside it; the first failure if none ran."""
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return runs[0]
    row = dict(max(ok, key=lambda r: r["samples_per_s"]))
    if len(runs) > 1:
        row["rounds_samples_per_s"] = [r.get("samples_per_s") for r in runs]
        row["rounds_cpu_s_per_1k"] = [r.get("cpu_s_per_1k") for r in runs]
    return row


def run_peers(args) -> dict:
    """Every row of ``--rows`` (all by default) on one dataset; ratios to ``dataloader-batched``."""
    names = (
        args.rows.split(",")
        if args.rows
        else [n for n in ROWS if args.workload == "tensor" or n not in peer_formats.ROWS]
    )
    root = Path(tempfile.mkdtemp(prefix="batchbus-peers-"))
    try:
        if args.workload == "images":
            from benchmarks.peer_jpeg import CLASSES, make_jpegs  # noqa: PLC0415 - Pillow: the images workload's

            make_jpegs(root / "images", args.samples, args.image_side)
            shape, classes = (3, args.image_size, args.image_size), CLASSES
        else:
            make_dataset(root, args.samples)
            shape, classes = SAMPLE_SHAPE, 10
        sample_bytes = 4 * int(np.prod(shape)) + 8  # float32 samples, int64 labels
        plan = batch_plan(args.samples, args.batch, args.epochs)
        cfg = {
            "workload": args.workload,
            "sample_shape": shape,
            "classes": classes,
            "image_size": args.image_size,
            "samples": args.samples,
            "batch": args.batch,
            "epochs": args.epochs,
            "batches": len(plan),
            "warmup": warmup_batches(len(plan)),
            "start_method": multiprocessing.get_start_method(),  # this platform's default, for the rows
            "sample_bytes": sample_bytes,
            "workers": args.workers,
            "inflight": args.inflight,
            "rounds": args.rounds,
        }
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for round_ in range(args.rounds):  # every other round in reverse: a drifting load hits all rows alike
            for name in names if round_ % 2 == 0 else names[::-1]:
                runs[name].append(run_row(name, root, cfg, args.row_timeout))
        rows = [best_of(runs[name]) for name in names]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    add_ratios(rows)
    return {**cfg, "dataset_mb": args.samples * sample_bytes / 2**20, "rows": rows}


def add_ratios(rows: list[dict]) -> None:
    """Each row that ran against ``dataloader-batched``: in samples/s and, where both rows' CPU was
    measurable (a tick is 10 ms), in samples per CPU-second."""
    base = next((r for r in rows if r["path"] == "dataloader-batched" and r["status"] == "ok"), None)
    for r in rows:
        if base is not None and r["status"] == "ok":
            r["x_dataloader_batched"] = r["samples_per_s"] / base["samples_per_s"]
            if r.get("cpu_s_per_1k") and base.get("cpu_s_per_1k"):
                r["x_dataloader_batched_per_cpu"] = base["cpu_s_per_1k"] / r["cpu_s_per_1k"]


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
        "CPU s / 1k",
        "per CPU × DL b.",
        "cores",
        "start-up s",
        "prepare s",
        title=f"{result['samples']} samples ({result['dataset_mb']:.0f} MiB as served), {result['batches']} "
        f"random batches of {result['batch']}, workload {result['workload']}"
        + (f", best of {result['rounds']} rounds" if result["rounds"] > 1 else ""),
    )
    for r in result["rows"]:
        if r["status"] != "ok":
            table.add_row(r["path"], r["status"].splitlines()[0][:80], *[""] * 9)
            continue
        table.add_row(
            r["path"],
            f"{r['samples_per_s']:,.0f}",
            f"{r['gb_per_s']:.2f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['x_dataloader_batched']:.2f}" if "x_dataloader_batched" in r else "—",
            f"{r['cpu_s_per_1k']:.3g}" if "cpu_s_per_1k" in r else "—",
            f"{r['x_dataloader_batched_per_cpu']:.2f}" if "x_dataloader_batched_per_cpu" in r else "—",
            f"{r['cores']:.2f}" if "cores" in r else "—",
            f"{r['startup_s']:.2f}",
            f"{r['prepare_s']:.1f}",
        )
    Console(width=None if sys.stdout.isatty() else 140).print(table)  # a log file gets every column


def peers_parser() -> argparse.ArgumentParser:
    """The delivery benchmark's options (same dataset, batches, workers, ``--json``) and the rows'."""
    p = parser()
    p.prog = "busctl bench --peers"
    g = p.add_argument_group("peers (the loaders install with `make install-bench`)")
    g.add_argument("--rows", default="", help=f"these rows only, comma-separated (of {', '.join(ROWS)})")
    g.add_argument(
        "--workload",
        default="tensor",
        choices=list(WORKLOADS),
        help="tensor: the .npy samples as stored; images: JPEGs decoded and augmented (1,024 and batches of 64 "
        "unless --samples/--batch say otherwise)",
    )
    g.add_argument("--image-size", type=int, default=224, help="images: the random-resized-crop's side")
    g.add_argument("--image-side", type=int, default=500, help="images: the generated JPEGs' typical width")
    g.add_argument("--rounds", type=int, default=1, help="run every row this many times; report each one's fastest")
    g.add_argument("--row-timeout", type=float, default=300.0, help="give a row up after this many seconds")
    p.set_defaults(samples=None, batch=None)  # the workload's (WORKLOADS)
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The options, the workload's defaults filled in; a usage error (exit 2) for values no row can run."""
    p = peers_parser()
    args = p.parse_args(argv)
    for key, value in WORKLOADS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.batch < 1 or args.samples < 4 * args.batch:
        p.error(f"--samples must be at least 4 batches ({4 * max(args.batch, 1)}) and --batch at least 1")
    if args.epochs < 1 or args.workers < 0 or args.inflight < 1 or not 1 <= args.rounds <= 20:
        p.error("--epochs and --inflight must be at least 1, --workers at least 0, --rounds 1 to 20")
    unknown = [n for n in args.rows.split(",") if n not in ROWS] if args.rows else []
    if unknown:
        p.error(f"unknown row(s) {', '.join(unknown)}; rows are {', '.join(ROWS)}")
    if args.workload != "tensor" and (tensor_only := [n for n in args.rows.split(",") if n in peer_formats.ROWS]):
        p.error(f"row(s) {', '.join(tensor_only)} read the tensor workload only")
    if args.workload == "images" and not (8 <= args.image_size <= 1024 and 16 <= args.image_side <= 4096):
        p.error("--image-size must be 8 to 1024 pixels and --image-side 16 to 4096")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    result = run_peers(args)
    print_peers(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(["--peers", *sys.argv[1:]])
