"""One run of the remote benchmark, start to end: the generated dataset (and its MDS shards), the store, the
router and provider serving it as ``file``, ``http`` and ``s3`` datasets, then every row in turn
(:func:`loader_row`, the ``mosaic`` rows of :mod:`benchmarks.remote.streaming`), their ratios
(:func:`add_ratios`), the head-of-line part and the capped-link row; everything it started ends with it."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.remote.capped_link import htb_row
from benchmarks.remote.checks import SAMPLE_BYTES, Fingerprints, drain
from benchmarks.remote.cluster import Cluster, Store, settle
from benchmarks.remote.head_of_line import LOCAL, head_of_line
from benchmarks.remote.streaming import mosaic_row, write_mds
from libbus.errors import BusError

__all__ = ["add_ratios", "loader_row", "run"]


def loader_row(cluster: Cluster, dataset: str, shuffle: str, args: argparse.Namespace, fp: Fingerprints, **kw) -> dict:
    """One row: a fresh loader of ``dataset`` read for ``args.seconds``; a failure is the row's ``error``."""
    try:
        with cluster.loader(dataset, shuffle, args.batch, **kw) as loader:
            row = drain(loader, args.seconds, f"{dataset} ({shuffle})", fp, settle_s=args.settle_s)
            return {**row, "inflight_at_end": loader.inflight}
    except (BusError, RuntimeError) as err:  # the row says what went wrong; the benchmark goes on
        return {"error": f"{type(err).__name__}: {err}"[:300]}


def run(args: argparse.Namespace) -> dict:
    from benchmarks.delivery import make_dataset  # noqa: PLC0415 - torch loads after argument checks

    work = Path(tempfile.mkdtemp(prefix="batchbus-remote-"))
    store: Store | None = None
    cluster: Cluster | None = None
    try:
        root = work / "data"
        root.mkdir()
        make_dataset(root, args.samples)
        x, y = np.load(root / "train_x.npy"), np.load(root / "train_y.npy")
        fp = Fingerprints(x, y)
        mds = None
        if args.mosaic:
            mds = write_mds(x, y, work / "mds", args.mds_shard_mb)
        store = Store(work, mds)
        datasets = {
            "file": f"file://{root}?memory=stream&val_fraction=0",
            "http": f"{store.urls['http']}/data/?val_fraction=0",
        }
        if args.hol:  # the head-of-line part's local dataset: in RAM (benchmarks.remote.head_of_line)
            datasets[LOCAL] = f"file://{root}?memory=ram&val_fraction=0"
        # full shuffle with a RAM cache that holds the window (for a full shuffle, the files): one dataset
        # per latency, so that each row starts cold; its loader reads ahead (RemoteLoader's read_ahead)
        cache = int((root / "train_x.npy").stat().st_size * 1.2) + (8 << 20)
        for ms in [] if args.hol_only else args.latencies:
            datasets[f"hc{ms:g}"] = f"{store.urls['http']}/data/?val_fraction=0&ram_cache={cache}"
        if mds is not None:
            datasets["mds"] = "s3://bench/mds/?fields=x&label=y&val_fraction=0"
            for ms in args.latencies:
                datasets[f"mc{ms:g}"] = f"{datasets['mds']}&cache=off&ram_cache={cache}"
        cluster = Cluster(work / "state", datasets, store.urls.get("s3", {}))
        rows: list[dict] = []

        def add(measure: Callable[[], dict], **what: Any) -> None:
            gets = store.gets()
            row = {**what, **measure()}
            if "batches" in row:  # per batch read, the settling ones too (those prefetched past the window: a few)
                row["gets_per_batch"] = (store.gets() - gets) / row["read"]
            else:  # failed: what it left the provider reading ends before the next row starts
                row["settled_s"] = settle(cluster, store)
            rows.append(row)
            shown = row.get("error") or f"{row['samples_per_s']:,.0f} samples/s, {row['mb_per_s']:.1f} MB/s"
            print(f"  {row['path']:12s} {row['shuffle']:5s} {row.get('latency_ms', '-')!s:>5} ms: {shown}", flush=True)

        for shuffle in args.shuffles:  # none with --hol-only
            add(partial(loader_row, cluster, "file", shuffle, args, fp), path="file", shuffle=shuffle)
        for ms in [] if args.hol_only else args.latencies:
            store.delay(ms)
            for shuffle in args.shuffles:
                add(
                    partial(loader_row, cluster, "http", shuffle, args, fp), path="http", shuffle=shuffle, latency_ms=ms
                )
            if "full" in args.shuffles:
                cached = partial(loader_row, cluster, f"hc{ms:g}", "full", args, fp)
                add(cached, path="http+cache", shuffle="full", latency_ms=ms)
            if mds is not None:
                add(partial(mosaic_row, store, root, work, args), path="mosaic", shuffle="py1e", latency_ms=ms)
                for shuffle in args.shuffles:
                    add(
                        partial(loader_row, cluster, "mds", shuffle, args, fp),
                        path="s3-mds",
                        shuffle=shuffle,
                        latency_ms=ms,
                    )
                if "full" in args.shuffles:
                    cached = partial(loader_row, cluster, f"mc{ms:g}", "full", args, fp)
                    add(cached, path="s3-mds+cache", shuffle="full", latency_ms=ms)
        result: dict[str, Any] = {
            "samples": args.samples,
            "batch": args.batch,
            "sample_bytes": SAMPLE_BYTES,
            "seconds": args.seconds,
            "cores": os.cpu_count(),
            "load_before": os.getloadavg(),
            "rows": rows,
        }
        add_ratios(rows)
        if args.hol:
            settle(cluster, store)  # the last row's reads (prefetched, or abandoned) are over: a quiet start
            result["head_of_line"] = head_of_line(cluster, store, args, fp, datasets["http"])
        if args.htb:
            result["htb"] = htb_row(root, work, args)
        result["load_after"] = os.getloadavg()
    finally:
        if cluster is not None:
            cluster.stop()
        if store is not None:
            store.close()
        shutil.rmtree(work, ignore_errors=True)
    return result


def add_ratios(rows: list[dict]) -> None:
    """``x_file``: samples/s over the file row of the same shuffle; ``x_mosaic``: an s3-mds row's over
    the mosaic row at its latency."""
    file = {r["shuffle"]: r for r in rows if r["path"] == "file" and "error" not in r}
    mosaic = {r["latency_ms"]: r for r in rows if r["path"] == "mosaic" and "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        if r["shuffle"] in file:
            r["x_file"] = r["samples_per_s"] / file[r["shuffle"]]["samples_per_s"]
        if r["path"] in ("s3-mds", "s3-mds+cache") and r["latency_ms"] in mosaic:
            r["x_mosaic"] = r["samples_per_s"] / mosaic[r["latency_ms"]]["samples_per_s"]
