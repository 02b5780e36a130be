"""Images decoded on the provider: per-core decoding, the trainer's CPU offloaded and scale-out
(docs/performance.md's section), in one run.

Generated JPEGs of realistic size (500×375, quality 90, ~125 KB) in an ImageFolder tree; the ImageNet
train recipe (decode → random_resized_crop 224 → flip → normalize):

- ``per-core``: samples per CPU-second and per wall-second, the process pinned to one core:
  batchbus's pipeline (examples/pipelines/imagenet-train.toml, every stage ``workers = 1``) against
  ``DataLoader(num_workers=1)`` doing the same work per sample with Pillow and torch (torchvision's
  recipe written out: torchvision's PyPI wheel does not load against the CPU torch here).
- ``offload``: the consumer's CPU seconds per 1,000 samples when a provider process decodes
  (``file://DIR?size=224&augment=1`` through a ``RemoteLoader``) against a ``DataLoader`` whose
  workers decode (the consumer plus its workers), and the ratio.
- ``scale``: one against two provider processes, each pinned to its own core (``taskset``) with
  ``workers=1``, serving one ``RemoteLoader`` that only counts; and one provider's decoding pool,
  ``workers=2`` threads against ``workers=2&pool=process`` against 1 thread, back to back (does the
  GIL cost anything?).

CPU-seconds are the honest unit on a shared machine: wall rates move with the neighbours' load.

    python -m benchmarks.images --images 256 --json images.json
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from libbus.loader.remote import RemoteLoader
from libbus.security.auth import ensure_secret, issue_token
from services.launch import ServiceProcs
from services.provider.sources import open_source

__all__ = ["main"]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pipelines" / "imagenet-train.toml"
MEAN = torch.tensor([123.675, 116.28, 103.53]).view(3, 1, 1)
STD = torch.tensor([58.395, 57.12, 57.375]).view(3, 1, 1)


def make_images(root: Path, n: int, classes: int = 4) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    base = np.linspace(0, 255, 500, dtype=np.float32)[None, :, None]
    for i in range(n):
        folder = root / "train" / f"c{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.clip(base + rng.normal(0, 40, (375, 500, 3)), 0, 255).astype(np.uint8)
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(pixels).save(path, "JPEG", quality=90)
        paths.append(path)
    return paths


class TorchRecipe(torch.utils.data.Dataset):
    """What torchvision's RandomResizedCrop(224) → RandomHorizontalFlip → ToTensor-less Normalize does."""

    def __init__(self, paths: list[Path]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        img = Image.open(io.BytesIO(self.paths[i].read_bytes())).convert("RGB")
        w, h = img.size
        for _ in range(10):
            area = w * h * float(torch.empty(1).uniform_(0.08, 1.0))
            ratio = math.exp(float(torch.empty(1).uniform_(math.log(3 / 4), math.log(4 / 3))))
            cw, ch = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
            if 0 < cw <= w and 0 < ch <= h:
                top, left = int(torch.randint(0, h - ch + 1, (1,))), int(torch.randint(0, w - cw + 1, (1,)))
                break
        else:
            cw, ch, top, left = w, h, 0, 0
        img = img.resize((224, 224), Image.Resampling.BILINEAR, box=(left, top, left + cw, top + ch))
        if torch.rand(1) < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float()
        return (x - MEAN) / STD, 0


def pinned(cores: set[int]):
    class Pin:
        def __enter__(self):
            self.old = os.sched_getaffinity(0)
            os.sched_setaffinity(0, cores)

        def __exit__(self, *exc):
            os.sched_setaffinity(0, self.old)

    return Pin()


def run_source(uri: str, n: int, batch: int = 32) -> tuple[float, float]:
    """(samples per wall-second, samples per CPU-second of this process) serving ``n`` samples."""
    source = open_source(uri)
    x = np.empty((batch, *source.sample_shape), source.dtype)
    y = np.empty(batch, np.int64)
    source.serve_into("train", np.arange(batch), x, y, epoch=0)  # warm-up
    started, cpu0, done = time.perf_counter(), time.process_time(), 0
    for start in range(0, n - batch + 1, batch):
        source.serve_into("train", np.arange(start, start + batch), x, y, epoch=1)
        done += batch
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
    source.close()
    return done / elapsed, done / cpu


def run_dataloader(paths: list[Path], workers: int, batch: int = 32) -> tuple[float, float, float]:
    """(samples/s, samples per CPU-second, CPU seconds per 1000 samples) of this process and its workers."""
    loader = torch.utils.data.DataLoader(TorchRecipe(paths), batch_size=batch, num_workers=workers, drop_last=True)
    cpu0 = _cpu()
    started, done = time.perf_counter(), 0
    for x, _ in loader:
        done += len(x)
    elapsed = time.perf_counter() - started
    del loader  # its workers exit: their CPU time lands in RUSAGE_CHILDREN
    cpu = _cpu() - cpu0
    return done / elapsed, done / cpu, cpu / done * 1000


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _token(state: Path) -> str:
    secret = ensure_secret(state / "secret")
    return issue_token(secret, sub="bench", role="trainer", audience="batchbus", ttl_s=3600, datasets=["img"])


def run_remote(root: Path, state: Path, n: int, batch: int = 32) -> tuple[float, float]:
    """A provider process decodes; (samples/s, this consumer's CPU seconds per 1000 samples)."""
    token = _token(state)
    procs = ServiceProcs(state)
    try:
        router = procs.start("router", "--bind", "tcp://127.0.0.1:0", "--log-level", "WARNING")
        endpoint = procs.start(
            "provider", "--router", router, "--log-level", "WARNING",
            "--dataset", f"img=file://{root}?size=224&augment=1&val_fraction=0",
        )  # fmt: skip
        with RemoteLoader("img", provider=endpoint, token=token, batch_size=batch, seed=0, drop_last=True) as loader:
            # from the first request, set-up included: the loader asks batches ahead of the consumer
            cpu0 = time.process_time()
            started, done = time.perf_counter(), 0
            for _ in range(2):
                for x, _ in loader:
                    done += len(x)
            elapsed = time.perf_counter() - started
            return done / elapsed, (time.process_time() - cpu0) / max(done, 1) * 1000
    finally:
        procs.stop()


def run_pinned_providers(root: Path, state: Path, cores: list[int], epochs: int = 3, batch: int = 32) -> float:
    """Samples/s that one counting RemoteLoader gets from ``len(cores)`` provider processes, each pinned
    to its core (``taskset``) with one decoding thread."""
    token = _token(state)
    procs = ServiceProcs(state)
    providers: list[subprocess.Popen] = []
    try:
        router = procs.start("router", "--bind", "tcp://127.0.0.1:0", "--log-level", "WARNING")
        endpoints = []
        for i, core in enumerate(cores):
            ready = state / f"p{i}.endpoint"
            cmd = [
                "taskset", "-c", str(core), sys.executable, "-m", "cli", "start", "provider",
                "--state-dir", str(state), "--router", router, "--name", f"p{i}", "--log-level", "WARNING",
                "--ready-file", str(ready),
                "--dataset", f"img=file://{root}?size=224&augment=1&val_fraction=0&workers=1",
            ]  # fmt: skip
            providers.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + 60
            while not ready.exists():
                if time.monotonic() > deadline or providers[-1].poll() is not None:
                    raise SystemExit(f"provider p{i} did not start")
                time.sleep(0.05)
            endpoints.append(ready.read_text().strip())
        with RemoteLoader(
            "img", provider=endpoints, token=token, batch_size=batch, seed=0, drop_last=True, inflight=4
        ) as loader:
            # timed from the first request: the loader asks ``inflight`` batches ahead, so a clock
            # started at the first batch would leave out the work already under way
            started, done = time.perf_counter(), 0
            for _ in range(epochs):
                for x, _ in loader:
                    done += len(x)
            return done / (time.perf_counter() - started)
    finally:
        for p in providers:
            p.terminate()
        for p in providers:
            p.wait(15)
        procs.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="batchbus-images-") as tmp:
        root = Path(tmp) / "data"
        paths = make_images(root, args.images)
        pipeline = Path(tmp) / "train.toml"
        text = EXAMPLE.read_text().replace("file:///data/imagenet", f"file://{root}")
        for stage in ("decode = { ", "random_resized_crop = { "):
            text = text.replace(stage, stage + "workers = 1, ")
        pipeline.write_text(text.replace("?encoded=1", "?encoded=1&val_fraction=0"))
        rows: dict[str, dict] = {}
        with pinned({cores[0]}):
            bb_wall, bb_cpu = run_source(f"pipeline://{pipeline}", args.images)
            dl_wall, dl_cpu, _ = run_dataloader(paths, 1)
        rows["per-core"] = {
            "batchbus_per_cpu_s": round(bb_cpu, 1),
            "dataloader_per_cpu_s": round(dl_cpu, 1),
            "ratio_cpu": round(bb_cpu / dl_cpu, 2),
            "batchbus_per_s": round(bb_wall, 1),
            "dataloader_per_s": round(dl_wall, 1),
            "ratio_wall": round(bb_wall / dl_wall, 2),
        }
        _, _, dl_cpu_1k = run_dataloader(paths, min(2, len(cores)))
        remote_rate, remote_cpu = run_remote(root, Path(tmp) / "state", args.images)
        rows["offload"] = {
            "provider_decodes_cpu_s_per_1k": round(remote_cpu, 3),
            "dataloader_cpu_s_per_1k": round(dl_cpu_1k, 3),
            "ratio": round(remote_cpu / dl_cpu_1k, 3),
            "remote_samples_per_s": round(remote_rate, 1),
        }
        uri = f"file://{root}?size=224&augment=1&val_fraction=0"
        scale: dict[str, float] = {}
        if shutil.which("taskset") and len(cores) >= 2:
            one = run_pinned_providers(root, Path(tmp) / "s1", cores[:1])
            two = run_pinned_providers(root, Path(tmp) / "s2", cores[:2])
            scale.update(providers1=round(one, 1), providers2=round(two, 1), providers_ratio=round(two / one, 2))
        with pinned({cores[0]}):
            t1, _ = run_source(uri + "&workers=1", args.images)
        t2, _ = run_source(uri + "&workers=2", args.images)
        p2, _ = run_source(uri + "&workers=2&pool=process", args.images)
        scale.update(
            threads1=round(t1, 1), threads2=round(t2, 1), processes2=round(p2, 1),
            threads2_vs_1=round(t2 / t1, 2), threads2_vs_processes2=round(t2 / p2, 2),
        )  # fmt: skip
        rows["scale"] = scale
    out = {"images": args.images, "cores": len(cores), "rows": rows}
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
