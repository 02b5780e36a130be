"""The rows of ``busctl bench --peers`` for data written for other loaders, tensor workload only:
each format read by its own loader and by batchbus from the very same files, side by side.

=================  ==================================================================================
tfrecord           the ``tfrecord`` package's ``TFRecordDataset`` (its index, so that DataLoader workers
                   each read their share; a shuffle queue of 1,024) + DataLoader
hf-disk            Hugging Face ``datasets``: ``load_from_disk`` of a ``save_to_disk`` directory,
                   ``with_format("torch")`` + DataLoader (``shuffle=True``), as its docs show
shm-mds            batchbus serving the MDS shards the ``mosaic`` row reads (Streaming's ``MDSWriter``)
shm-litdata        batchbus serving the ``optimize()`` chunks the ``litdata`` row reads
shm-tfrecord       batchbus serving the ``tfrecord`` row's file
shm-hf-disk        batchbus serving the ``hf-disk`` row's directory
=================  ==================================================================================

Each writes the peer's files with the peer's own writer (``prepare_s``), from the same ``.npy`` samples as
every row; the batchbus rows read them through a provider process into the trainer's shared-memory ring
(``?fields=x&label=y``, the shape declared where the format keeps none), as a user pointing a provider at
the files they already have would. ``hf://`` has no row: there is no Hub to read from here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.delivery import SAMPLE_SHAPE, SEED, Services
from benchmarks.peer_rows import Make, arrays, batches_of_loader, on_close, workers, write_litdata, write_mds

__all__ = ["BUILDERS", "ROWS"]

#: Row name → the module it needs (its writer, and for a peer row its loader).
ROWS: dict[str, str] = {
    "tfrecord": "tfrecord",
    "hf-disk": "datasets",
    "shm-mds": "streaming",
    "shm-litdata": "litdata",
    "shm-tfrecord": "tfrecord",
    "shm-hf-disk": "datasets",
}
SHAPE = ",".join(map(str, SAMPLE_SHAPE))


# -- TFRecord ---------------------------------------------------------------------------------------------


def write_tfrecord(root: Path, work: Path) -> Path:
    """``work/tfr/train.tfrecord``: one ``tf.train.Example`` per sample (``x`` floats, ``y`` an int64), by
    the ``tfrecord`` package's writer; its index (for the loader's worker shards) beside the folder."""
    from tfrecord.tools.tfrecord2idx import create_index  # noqa: PLC0415
    from tfrecord.writer import TFRecordWriter  # noqa: PLC0415

    x, y = arrays(root)
    (work / "tfr").mkdir()
    path = work / "tfr" / "train.tfrecord"
    writer = TFRecordWriter(str(path))
    for i in range(len(y)):
        writer.write({"x": (np.asarray(x[i]).ravel(), "float"), "y": (int(y[i]), "int")})
    writer.close()
    create_index(str(path), str(work / "train.tfindex"))
    return path


def _tfrecord_sample(features: dict) -> tuple[torch.Tensor, int]:
    return torch.from_numpy(features["x"].reshape(SAMPLE_SHAPE)), int(features["y"][0])


def tfrecord(root: Path, work: Path, cfg: dict) -> Make:
    from tfrecord.torch.dataset import TFRecordDataset  # noqa: PLC0415

    path = write_tfrecord(root, work)
    dataset = TFRecordDataset(
        str(path),
        str(work / "train.tfindex"),
        {"x": "float", "y": "int"},
        shuffle_queue_size=1024,
        transform=_tfrecord_sample,
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg["batch"], drop_last=True, **workers(cfg))
    return lambda: loader


# -- Hugging Face save_to_disk ---------------------------------------------------------------------------------


def write_hf_disk(root: Path, work: Path) -> Path:
    """``work/hf``: a ``datasets.Dataset`` of ``x`` (float32, flat) and ``y`` saved with ``save_to_disk``."""
    import datasets  # noqa: PLC0415

    x, y = arrays(root)
    features = datasets.Features(
        {
            "x": datasets.Sequence(datasets.Value("float32"), length=int(np.prod(SAMPLE_SHAPE))),
            "y": datasets.Value("int64"),
        }
    )
    ds = datasets.Dataset.from_dict({"x": np.asarray(x).reshape(len(y), -1), "y": np.asarray(y)}, features=features)
    ds.save_to_disk(str(work / "hf"))
    return work / "hf"


def _hf_batch(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.stack([r["x"] for r in rows]).reshape(len(rows), *SAMPLE_SHAPE)
    return x, torch.stack([r["y"] for r in rows])


def hf_disk(root: Path, work: Path, cfg: dict) -> Make:
    import datasets  # noqa: PLC0415

    dataset = datasets.load_from_disk(str(write_hf_disk(root, work))).with_format("torch")
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=cfg["batch"],
        shuffle=True,
        drop_last=True,
        collate_fn=_hf_batch,
        generator=torch.Generator().manual_seed(SEED),
        **workers(cfg),
    )
    return lambda: loader


# -- batchbus on the peers' files ------------------------------------------------------------------------------


def _batchbus_on(write: Callable[[Path, Path, dict], str]) -> Callable[[Path, Path, dict], Make]:
    def build(root: Path, work: Path, cfg: dict) -> Make:
        uri = write(root, work, cfg)
        services = Services(root, work / "state", extra={"peer": uri})
        on_close(services.stop)
        return batches_of_loader(services.loader("peer", cfg["batch"], cfg["inflight"], shm=True), True)

    return build


def _query(shape: bool) -> str:
    return "?fields=x&label=y&classes=10&val_fraction=0" + (f"&shape={SHAPE}" if shape else "")


BUILDERS: dict[str, Callable[[Path, Path, dict], Make]] = {
    "tfrecord": tfrecord,
    "hf-disk": hf_disk,
    "shm-mds": _batchbus_on(lambda root, work, cfg: f"file://{write_mds(root, work)}{_query(False)}"),
    "shm-litdata": _batchbus_on(lambda root, work, cfg: f"file://{write_litdata(root, work, cfg)}{_query(True)}"),
    "shm-tfrecord": _batchbus_on(lambda root, work, cfg: f"file://{write_tfrecord(root, work).parent}{_query(True)}"),
    "shm-hf-disk": _batchbus_on(lambda root, work, cfg: f"file://{write_hf_disk(root, work)}{_query(True)}"),
}
