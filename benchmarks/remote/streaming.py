"""MosaicML Streaming beside batchbus: the samples written as MDS shards by Streaming's ``MDSWriter``
(:func:`write_mds`, served by the store's S3 server), and the ``mosaic`` row, ``StreamingDataset`` + a
DataLoader reading them cold from the store in a process of its own (:func:`mosaic_row`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.remote.checks import Fingerprints, drain
from benchmarks.remote.cluster import REPO, ROW_GRACE_S, SEED, Store

__all__ = ["mosaic_child", "mosaic_row", "write_mds"]


def write_mds(x: np.ndarray, y: np.ndarray, out: Path, shard_mb: int) -> Path:
    """The samples as MDS shards of ``shard_mb`` MB at most, written by Streaming's ``MDSWriter``."""
    from benchmarks.peer_rows import streaming_without_torchvision  # noqa: PLC0415

    streaming_without_torchvision()  # before Streaming's import (importing peer_rows did it: said here)
    from streaming import MDSWriter  # noqa: PLC0415

    columns = {"x": f"ndarray:float32:{','.join(map(str, x.shape[1:]))}", "y": "int64"}
    with MDSWriter(out=str(out), columns=columns, size_limit=f"{shard_mb}mb") as writer:
        for i in range(len(y)):
            writer.write({"x": x[i], "y": int(y[i])})
    return out


def mosaic_child(cfg_json: str) -> None:
    """In a process of its own (Streaming starts shared memory and worker processes): read the MDS at
    ``s3://bench/mds`` with ``StreamingDataset`` + DataLoader for ``seconds``; print one JSON line."""
    import torch  # noqa: PLC0415

    from benchmarks.peer_rows import MosaicSamples, streaming_without_torchvision  # noqa: PLC0415

    streaming_without_torchvision()  # before Streaming's import (importing peer_rows did it: said here)
    from streaming import StreamingDataset  # noqa: PLC0415

    cfg = json.loads(cfg_json)
    dataset = StreamingDataset(
        remote="s3://bench/mds", local=cfg["local"], shuffle=True, shuffle_seed=SEED, batch_size=cfg["batch"]
    )
    loader = torch.utils.data.DataLoader(
        MosaicSamples(dataset), batch_size=cfg["batch"], drop_last=True, num_workers=cfg["workers"]
    )
    x, y = np.load(Path(cfg["root"]) / "train_x.npy", mmap_mode="r"), np.load(Path(cfg["root"]) / "train_y.npy")
    row = drain(loader, cfg["seconds"], "mosaic", Fingerprints(np.asarray(x), y), settle_s=cfg["settle_s"])
    print(json.dumps(row), flush=True)


def mosaic_row(store: Store, root: Path, work: Path, args: argparse.Namespace) -> dict:
    """The mosaic row in a child process (its own session: its DataLoader workers end with it)."""
    local = Path(tempfile.mkdtemp(prefix="mosaic-", dir=work))  # cold: nothing downloaded yet
    cfg = {
        "local": str(local),
        "batch": args.batch,
        "workers": args.workers,
        "seconds": args.seconds,
        "settle_s": args.settle_s,
        "root": str(root),
    }
    s3 = store.urls["s3"]
    env = {**os.environ, **s3, "S3_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"], "PYTHONPATH": str(REPO)}
    code = "import sys; from benchmarks.remote.streaming import mosaic_child; mosaic_child(sys.argv[1])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=args.settle_s + args.seconds + ROW_GRACE_S + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's session: it and its workers
        proc.communicate()
        return {"error": f"no result within {args.settle_s + args.seconds + ROW_GRACE_S + 60:.0f} s"}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # workers left behind by a child that exited
        shutil.rmtree(local, ignore_errors=True)
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {err.strip().splitlines()[-1:] or ['(no output)']}"[:300]}
    return json.loads(lines[-1])
