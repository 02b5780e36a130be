"""Same-host delivery: the shared-memory ring against the socket path, a DataLoader, raw pyzmq and memcpy.

One invocation, one generated dataset (``.npy``, float32, CIFAR-shaped, bigger than any L3), the
same random batches of 256 for every row:

==========  =====================================================================================
shm         a real provider process writes each batch into the trainer's ring (``RemoteLoader``)
shm-stream  the same, the provider streaming the file with positional reads (``memory=stream``)
socket      the same provider, batches over loopback TCP (``RemoteLoader(shm=False)``)
dataloader  ``torch.utils.data.DataLoader(num_workers=2)``, a batched ``__getitem__`` on the .npy
pyzmq       raw DEALER/ROUTER request-reply of the same payloads, gathered by a server process
memcpy      one process gathering the same rows into one buffer: the floor on the work
memcpy-ring the same gather into the rotating slots of a real ring (as many as the shm row's)
==========  =====================================================================================

Each row reports samples/s, GB/s and p50/p99 of the time the consumer waits for each batch, and
its ratio to the DataLoader and to memcpy. Throughput counts from the first batch to the last, so
start-up (worker spawn, connection, ring set-up) is not in it. ``--wait`` adds the trainer-loop
mode: a consumer spending ``--work-ms`` of CPU per step, the fraction of its time spent waiting
for data, and what each ``next()`` cost it in µs per batch (wall, and the loop thread's CPU in it). ``--repeat N`` measures every row N times in the one invocation and judges each target
by its worst repeat (:mod:`benchmarks.delivery_report`). On a CUDA machine a ``cuda`` row adds host-to-device GB/s from the pinned ring next to
torch's own pinned-memory copy.

    python -m benchmarks.delivery --samples 16384 --epochs 3 --wait --json bench.json
    busctl bench --samples 16384 --epochs 3 --wait --json bench.json

``--stall`` measures instead what the stall split (providers timing each batch, the loader
attributing its waits, ``RemoteLoader(stall_breakdown=...)``) costs: the shm row with the split on and
off, alternately (which goes first swaps every repeat), ``--repeat`` times; the ratio of each pair, and
their median and minimum::

    busctl bench --stall --repeat 10 --json stall.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch
import zmq

from benchmarks.delivery_report import add_ratios, checks, print_result, summarize
from libbus.loader.remote import RemoteLoader
from libbus.order.epochs import batches_of, epoch_order
from libbus.security.auth import ensure_secret, issue_token
from services.launch import ServiceProcs
from shm import Ring, RingLayout

__all__ = ["main", "make_dataset"]

SAMPLE_SHAPE = (3, 32, 32)
SEED = 7


# -- the dataset ------------------------------------------------------------------------------------


def make_dataset(root: Path, samples: int) -> None:
    """``train_x.npy`` (float32, N×3×32×32) and ``train_y.npy`` (int64) under ``root``."""
    rng = np.random.default_rng(0)
    x = np.lib.format.open_memmap(root / "train_x.npy", mode="w+", dtype=np.float32, shape=(samples, *SAMPLE_SHAPE))
    for start in range(0, samples, 4096):
        stop = min(samples, start + 4096)
        x[start:stop] = rng.standard_normal((stop - start, *SAMPLE_SHAPE), dtype=np.float32)
    x.flush()
    del x
    np.save(root / "train_y.npy", rng.integers(0, 10, samples).astype(np.int64))


def batch_plan(samples: int, batch: int, epochs: int) -> list[np.ndarray]:
    """The batches every row reads: the loader's own full shuffle, epoch after epoch."""
    plan = []
    for epoch in range(epochs):
        plan += batches_of(epoch_order(samples, epoch=epoch, seed=SEED, shuffle="full"), batch, True)
    return plan


# -- measuring ----------------------------------------------------------------------------------


def measure(name: str, batches: Iterable, batch_size: int, sample_bytes: int, work_s: float = 0.0) -> dict:
    """Pull every batch, timing each wait; optionally spin ``work_s`` of CPU per batch."""
    waits: list[float] = []
    cpus: list[float] = []
    stamps: list[float] = []
    it: Iterator = iter(batches)
    while True:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            next(it)
        except StopIteration:
            break
        t1, c1 = time.perf_counter(), time.thread_time()
        waits.append(t1 - t0)
        cpus.append(c1 - c0)
        stamps.append(t1)
        if work_s:
            while time.perf_counter() - t1 < work_s:
                pass
    if len(stamps) < 3:
        raise SystemExit(f"{name}: only {len(stamps)} batches; give --samples / --epochs more room")
    span = stamps[-1] - stamps[0]
    n = (len(stamps) - 1) * batch_size
    steady = np.array(waits[1:]) * 1e3
    row = {
        "path": name,
        "batches": len(stamps),
        "samples_per_s": n / span,
        "gb_per_s": n * sample_bytes / span / 1e9,
        "p50_ms": float(np.percentile(steady, 50)),
        "p99_ms": float(np.percentile(steady, 99)),
    }
    if work_s:
        total = stamps[-1] - stamps[0] + work_s
        row["wait_fraction"] = float(sum(waits[1:]) / total)
        # what one next() costs the loop, in µs per batch: its wall time (a wait for a batch not
        # there yet, and any preemption, included) and the loop thread's own CPU in it
        row["next_us"] = float(np.mean(waits[1:]) * 1e6)
        row["next_cpu_us"] = float(np.mean(cpus[1:]) * 1e6)
    return row


def memcpy_batches(x: np.ndarray, y: np.ndarray, plan: list[np.ndarray]) -> Iterator:
    bx = np.empty((len(plan[0]), *x.shape[1:]), x.dtype)
    by = np.empty(len(plan[0]), y.dtype)
    for idx in plan:
        np.take(x, idx, axis=0, out=bx, mode="clip")  # "clip": no hidden temporary (see the provider)
        np.take(y, idx, axis=0, out=by, mode="clip")
        yield bx, by


def memcpy_ring_batches(x: np.ndarray, y: np.ndarray, plan: list[np.ndarray], slots: int) -> Iterator:
    """The memcpy row's gather into ``slots`` rotating slots of a real ring (shared memory, made as
    the loader makes its ring): the same work as the shm row's provider minus everything else, and
    a working set of ``slots`` batches that no longer stays in cache as memcpy's one buffer does."""
    n = len(plan[0])
    layout = RingLayout.for_batch(slots, n * x[0].nbytes, n * y[0].nbytes)
    ring = Ring.create(layout)
    try:
        views = [ring.views(s, (n, *x.shape[1:]), x.dtype, (n,), y.dtype) for s in range(slots)]
        for i, idx in enumerate(plan):
            bx, by = views[i % slots]
            np.take(x, idx, axis=0, out=bx, mode="clip")
            np.take(y, idx, axis=0, out=by, mode="clip")
            yield bx, by
        del views, bx, by
    finally:
        ring.close()


class NpyBatches(torch.utils.data.Dataset):
    """A DataLoader dataset whose ``__getitem__`` takes a whole batch of indices (the fast way)."""

    def __init__(self, root: Path):
        self.root = root
        self.x = self.y = None

    def __len__(self) -> int:
        return 0

    def __getitem__(self, idx):
        if self.x is None:  # opened in each worker, after the fork
            self.x = np.load(self.root / "train_x.npy", mmap_mode="r")
            self.y = np.load(self.root / "train_y.npy", mmap_mode="r")
        return torch.from_numpy(np.take(self.x, idx, axis=0)), torch.from_numpy(np.take(self.y, idx))


def dataloader_batches(root: Path, plan: list[np.ndarray], workers: int) -> Iterator:
    loader = torch.utils.data.DataLoader(NpyBatches(root), batch_size=None, sampler=plan, num_workers=workers)
    yield from loader


def _pyzmq_server(root: str, endpoint_q, stop_ev) -> None:
    """The raw baseline's server: gather the requested rows, send them zero-copy, nothing else."""
    x = np.load(Path(root) / "train_x.npy")
    y = np.load(Path(root) / "train_y.npy")
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint_q.put(f"tcp://127.0.0.1:{port}")
    while not stop_ev.is_set():
        if not sock.poll(100):
            continue
        peer, raw = sock.recv_multipart(copy=True)
        idx = np.frombuffer(raw, np.int64)
        sock.send_multipart([peer, np.take(x, idx, axis=0).data, np.take(y, idx).data], copy=False)


def pyzmq_batches(endpoint: str, plan: list[np.ndarray], inflight: int) -> Iterator:
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(endpoint)
    try:
        sent = received = 0
        while received < len(plan):
            while sent < len(plan) and sent - received < inflight:
                sock.send(plan[sent].tobytes())
                sent += 1
            frames = sock.recv_multipart(copy=False)
            received += 1
            yield np.frombuffer(frames[0].buffer, np.float32), np.frombuffer(frames[1].buffer, np.int64)
    finally:
        sock.close(0)


def loader_batches(loader: RemoteLoader, epochs: int, hold: int = 0) -> Iterator:
    """The loader's batches; with ``hold``, the last ``hold`` are kept alive (gradient accumulation)."""
    held: deque = deque(maxlen=hold or None)
    for _ in range(epochs):
        for batch in loader:
            if hold:
                held.append(batch)
            yield batch


# -- the run ------------------------------------------------------------------------------------


class Services:
    """A router and one provider serving the dataset twice (RAM and streamed), as real processes."""

    def __init__(self, root: Path, state: Path, extra: dict[str, str] | None = None):
        """``extra``: more datasets the provider serves, name → URI (a peer's files, benchmarks/peer_formats.py)."""
        extra = extra or {}
        secret = ensure_secret(state / "secret")
        # A script reading datasets directly holds a token scoped to them (providers serve other
        # trainers only the datasets of their job).
        self.token = issue_token(
            secret, sub="bench", role="trainer", audience="batchbus", ttl_s=3600, datasets=["ram", "stream", *extra]
        )
        self.procs = ServiceProcs(state)
        router = self.procs.start("router", "--bind", "tcp://127.0.0.1:0", "--log-level", "WARNING")
        self.endpoint = self.procs.start(
            "provider",
            "--router",
            router,
            "--log-level",
            "WARNING",
            "--dataset",
            f"ram=file://{root}?memory=ram&val_fraction=0",
            "--dataset",
            f"stream=file://{root}?memory=stream&val_fraction=0",
            *(arg for name, uri in extra.items() for arg in ("--dataset", f"{name}={uri}")),
        )

    def loader(self, dataset: str, batch: int, inflight: int, **kw) -> RemoteLoader:
        return RemoteLoader(
            dataset,
            provider=self.endpoint,
            token=self.token,
            batch_size=batch,
            seed=SEED,
            shuffle="full",
            drop_last=True,
            inflight=inflight,
            **kw,
        )

    def stop(self) -> None:
        self.procs.stop()


def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="batchbus-bench-"))
    ctx = multiprocessing.get_context("spawn")
    stop_ev = ctx.Event()
    server = None
    services = None
    try:
        make_dataset(root, args.samples)
        x = np.load(root / "train_x.npy")  # also leaves the file in the page cache for every row
        y = np.load(root / "train_y.npy")
        sample_bytes = x[0].nbytes + y[0].nbytes
        plan = batch_plan(args.samples, args.batch, args.epochs)
        q = ctx.Queue()
        server = ctx.Process(target=_pyzmq_server, args=(str(root), q, stop_ev), daemon=True)
        server.start()
        pyzmq_endpoint = q.get(timeout=60)
        services = Services(root, root / "state")

        def loader_row(
            name: str, dataset: str, work_s: float = 0.0, steps: int | None = None, hold: int = 0, **kw
        ) -> dict:
            with services.loader(dataset, args.batch, args.inflight, **kw) as loader:
                want = "socket" if kw.get("shm") is False else "shm"
                if loader.transport != want:
                    raise SystemExit(f"{name}: expected the {want} path, the loader chose {loader.transport}")
                batches = islice(loader_batches(loader, args.epochs + (steps or 0), hold), steps)
                return measure(name, batches, args.batch, sample_bytes, work_s)

        if args.stall:
            return stall_overhead(args, loader_row)

        def one_repeat() -> list[dict]:
            rows = [
                measure("memcpy", memcpy_batches(x, y, plan), args.batch, sample_bytes),
                measure("memcpy-ring", memcpy_ring_batches(x, y, plan, args.inflight + 2), args.batch, sample_bytes),
                measure("dataloader", dataloader_batches(root, plan, args.workers), args.batch, sample_bytes),
                measure("pyzmq", pyzmq_batches(pyzmq_endpoint, plan, args.inflight), args.batch, sample_bytes),
                # shm: batches valid while held (a slot returns with its last tensor); shm-copy:
                # copy=True; shm-hold8: a loop that keeps its last 8 batches (more than the ring's
                # slots: copies)
                loader_row("shm", "ram"),
                loader_row("shm-copy", "ram", copy=True),
                loader_row("shm-hold8", "ram", hold=8),
                loader_row("shm-stream", "stream"),
                loader_row("socket", "ram", shm=False),
            ]
            if torch.cuda.is_available():
                rows += cuda_rows(services, args, sample_bytes, loader_row)
            add_ratios(rows)
            return rows

        repeats = [one_repeat() for _ in range(args.repeat)]
        result = {
            "samples": args.samples,
            "batch": args.batch,
            "epochs": args.epochs,
            "sample_bytes": sample_bytes,
            "dataset_mb": x.nbytes / 2**20,
            "rows": repeats[0],
            "checks": checks(repeats),
        }
        if args.repeat > 1:
            result["repeats"] = repeats
            result["summary"] = summarize(repeats)
        if args.wait:
            work = args.work_ms / 1e3
            steps = max(3, args.wait_steps)
            wait_plan = batch_plan(args.samples, args.batch, -(-steps * args.batch // args.samples))[:steps]
            wait_rows = [
                loader_row("shm", "ram", work, steps),
                loader_row("socket", "ram", work, steps, shm=False),
                measure(
                    "dataloader", dataloader_batches(root, wait_plan, args.workers), args.batch, sample_bytes, work
                ),
            ]
            result["wait"] = {"work_ms": args.work_ms, "rows": wait_rows}
            shm_wait = wait_rows[0]
            result["checks"].append(
                {
                    "check": f"shm wait fraction at {args.work_ms:g} ms of work per step",
                    "target": "< 1%",
                    "value": f"{shm_wait['wait_fraction']:.2%} (next() {shm_wait['next_us']:.0f} µs per batch, "
                    f"{shm_wait['next_cpu_us']:.0f} µs of it CPU)",
                    "ok": shm_wait["wait_fraction"] < 0.01,
                }
            )
        return result
    finally:
        stop_ev.set()
        if server is not None:
            server.join(5)
        if services is not None:
            services.stop()
        shutil.rmtree(root, ignore_errors=True)


def stall_overhead(args: argparse.Namespace, loader_row: Callable) -> dict:
    """The shm row with the stall split on and off, ``args.repeat`` pairs (see the module docstring)."""
    pairs = []
    for i in range(args.repeat):
        order = (True, False) if i % 2 == 0 else (False, True)
        rows = {on: loader_row("shm" if on else "shm-nosplit", "ram", stall_breakdown=on) for on in order}
        pairs.append(
            {
                "split_on": rows[True]["samples_per_s"],
                "split_off": rows[False]["samples_per_s"],
                "ratio": rows[True]["samples_per_s"] / rows[False]["samples_per_s"],
            }
        )
    ratios = [p["ratio"] for p in pairs]
    median = float(np.median(ratios))
    return {
        "samples": args.samples,
        "batch": args.batch,
        "epochs": args.epochs,
        "stall": {"pairs": pairs, "median_ratio": median, "min_ratio": min(ratios)},
        "checks": [
            {
                "check": "shm samples/s with the stall split vs without (median of pairs)",
                "target": ">= 0.99",
                "value": f"{median:.4f} (min {min(ratios):.4f}, {len(ratios)} pairs)",
                "ok": median >= 0.99,
            }
        ],
    }


def cuda_rows(services: Services, args, sample_bytes: int, loader_row: Callable) -> list[dict]:
    """Host-to-device: batches from the pinned ring to CUDA tensors, and torch's own pinned copy."""
    rows = [loader_row("shm→cuda", "ram", device="cuda:0")]
    nbytes = args.batch * sample_bytes
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    reps = 50
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    span = time.perf_counter() - start
    rows.append(
        {
            "path": "torch pinned→cuda",
            "batches": reps,
            "samples_per_s": reps * args.batch / span,
            "gb_per_s": reps * nbytes / span / 1e9,
            "p50_ms": span / reps * 1e3,
            "p99_ms": span / reps * 1e3,
        }
    )
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="busctl bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=16384, help="dataset size (16384 × 12 KiB = 192 MiB)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2, help="passes over the dataset per row")
    p.add_argument("--inflight", type=int, default=4, help="requests in flight (ring slots = this + 2)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader num_workers")
    p.add_argument("--wait", action="store_true", help="also run the trainer-loop mode")
    p.add_argument("--work-ms", type=float, default=20.0, help="CPU work per step in the trainer-loop mode")
    p.add_argument("--wait-steps", type=int, default=100, help="steps per row in the trainer-loop mode")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--peers",
        action="store_true",
        help="compare with DataLoader, Mosaic, litData, WebDataset, torchdata instead (benchmarks/peers.py)",
    )
    return p


def delivery_parser() -> argparse.ArgumentParser:
    """:func:`parser` (shared with ``--peers``) and the options of this benchmark alone."""
    p = parser()
    p.add_argument("--repeat", type=int, default=1, help="measure every row this many times; targets must hold in each")
    p.add_argument(
        "--stall", action="store_true", help="only the shm row with the stall split on and off (--repeat pairs)"
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    args = delivery_parser().parse_args(argv)
    if args.samples < 4 * args.batch or args.batch < 1:
        delivery_parser().error(f"--samples must be at least 4 batches ({4 * args.batch})")
    if args.repeat < 1:
        delivery_parser().error(f"--repeat must be at least 1, got {args.repeat}")
    if args.peers:  # busctl bench hands --peers to benchmarks.peers, which imports this module
        delivery_parser().error("--peers: run `busctl bench --peers` or `python -m benchmarks.peers`")
    result = run(args)
    if args.stall:
        for pair in result["stall"]["pairs"]:
            print(
                f"shm samples/s split on {pair['split_on']:,.0f}  off {pair['split_off']:,.0f}  ratio {pair['ratio']:.4f}"
            )
        print(result["checks"][0]["check"], result["checks"][0]["value"])
    else:
        print_result(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
