"""Named fields on the trainer: what decoding, checking and collating a multi-field batch costs.

A router and one provider as real processes serve ``mock://fields`` (a variable-size image, a token
list, a text, a label) and, for comparison, ``mock://mnist`` (x/y). For each dataset, delivery
(socket, shm) and collate (pad, list) the script reads ``--epochs`` passes and reports samples/s and
the trainer's CPU seconds per 1,000 samples (``time.process_time`` of the consuming process: what
the field path costs the trainer, apart from the provider's work). With ``--device cuda`` every
batch is also moved to the GPU by the loader and checked equal to the CPU batch.

    python -m benchmarks.fields --samples 4096 --batch 64 --epochs 2
    python -m benchmarks.fields --samples 2048 --device cuda
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from libbus.loader.remote import RemoteLoader
from libbus.security.auth import ensure_secret, issue_token
from services.launch import ServiceProcs

__all__ = ["main"]


def _rows(endpoint: str, token: str, args) -> list[dict]:
    rows = []
    for dataset in ("multi", "mnist"):
        for shm in (False, True):
            for collate in ("pad", "list") if dataset == "multi" else ("pad",):
                with RemoteLoader(
                    dataset, provider=endpoint, token=token, batch_size=args.batch, shm=shm, collate=collate, seed=1
                ) as loader:
                    next(iter(loader))  # connection, ring: not counted
                    loader.set_epoch(1)
                    n, wall, cpu = 0, time.perf_counter(), time.process_time()
                    for _ in range(args.epochs):
                        for batch in loader:
                            n += len(batch["label"] if isinstance(batch, dict) else batch[1])
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                rows.append(
                    {
                        "dataset": dataset,
                        "transport": loader.transport,
                        "collate": collate if dataset == "multi" else "-",
                        "samples_per_s": round(n / wall),
                        "trainer_cpu_s_per_1000": round(1000 * cpu / n, 4),
                    }
                )
    return rows


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.cpu(), b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _cuda_check(endpoint: str, token: str, args) -> dict:
    """Every field of every batch on ``args.device`` equals the CPU batch (ring and socket)."""
    checked = 0
    for shm in (False, True):
        for collate in ("pad", "list"):
            kw = dict(provider=endpoint, token=token, batch_size=args.batch, shm=shm, collate=collate, seed=1)
            with RemoteLoader("multi", **kw) as cpu, RemoteLoader("multi", device=args.device, **kw) as dev:
                for a, b in zip(dev, cpu):
                    assert set(a) == set(b)
                    for name in a:
                        on = a[name][0] if isinstance(a[name], list) and a[name] else a[name]
                        assert not isinstance(on, torch.Tensor) or on.device.type == "cuda", name
                        assert _same(a[name], b[name]), f"{name} differs on {args.device} (shm={shm}, {collate})"
                    checked += 1
    return {"device": args.device, "batches_checked": checked, "equal": True}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        token = issue_token(
            ensure_secret(state / "secret"), sub="bench", role="trainer", audience="batchbus", ttl_s=3600,
            datasets=["multi", "mnist"],
        )  # fmt: skip
        procs = ServiceProcs(state)
        try:
            router = procs.start("router", "--bind", "tcp://127.0.0.1:0", "--log-level", "WARNING")
            endpoint = procs.start(
                "provider", "--router", router, "--log-level", "WARNING",
                "--dataset", f"multi=mock://fields?n={args.samples}",
                "--dataset", f"mnist=mock://mnist?n={args.samples}",
            )  # fmt: skip
            result: dict[str, Any] = {"rows": _rows(endpoint, token, args)}
            if args.device != "cpu":
                result["cuda"] = _cuda_check(endpoint, token, args)
        finally:
            procs.stop()
    for row in result["rows"]:
        print(
            f"{row['dataset']:6} {row['transport']:6} {row['collate']:4} {row['samples_per_s']:>9} samples/s "
            f"{row['trainer_cpu_s_per_1000']:.4f} trainer CPU s / 1000 samples"
        )
    if "cuda" in result:
        print(f"cuda: {result['cuda']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
