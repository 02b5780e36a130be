"""The rows of ``busctl bench --peers`` (benchmarks/peers.py): how each loader is set up and read.

Each builder runs in the row's own process: ``build(root, work, cfg)`` writes the peer's own format
under ``work`` (from the ``.npy`` dataset in ``root``) and returns a function that starts one pass
over the data, yielding batches of ``cfg['batch']`` in a random order with ``cfg['workers']``
worker processes — as each project's documentation sets it up. Peers are imported here, inside
the builders, so that a peer that is not installed costs nothing until its row runs.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from benchmarks.delivery import SAMPLE_SHAPE, SEED, NpyBatches, Services, batch_plan, loader_batches

__all__ = [
    "BUILDERS",
    "Make",
    "arrays",
    "batches_of_loader",
    "close",
    "on_close",
    "streaming_without_torchvision",
    "workers",
    "write_litdata",
    "write_mds",
]

Make = Callable[[], Iterable]
#: What a row must close when it is done (the batchbus loader, then its services), last first.
_open: list[Callable[[], object]] = []


def on_close(fn: Callable[[], object]) -> None:
    """Have :func:`close` call ``fn`` when the row is done (after what was registered later)."""
    _open.append(fn)


def close() -> None:
    while _open:
        _open.pop()()


def workers(cfg: dict) -> dict:
    """The worker options every row's loader takes: ``--workers`` processes, kept across passes."""
    return {"num_workers": cfg["workers"], "persistent_workers": cfg["workers"] > 0}


def batches_of_loader(loader, shm: bool) -> Make:
    """A batchbus row's passes: checks the loader took the path the row is named after."""
    on_close(loader.close)
    if loader.transport != ("shm" if shm else "socket"):
        raise RuntimeError(f"expected the {'shm' if shm else 'socket'} path, the loader chose {loader.transport}")
    return lambda: loader_batches(loader, 1)


def arrays(root: Path) -> tuple[np.ndarray, np.ndarray]:
    """The samples every row reads: ``train_x.npy`` (memory-mapped) and ``train_y.npy`` under ``root``."""
    return np.load(root / "train_x.npy", mmap_mode="r"), np.load(root / "train_y.npy")


def _sample_order(cfg: dict) -> list[int]:
    return [int(i) for idx in batch_plan(cfg["samples"], cfg["batch"], 1) for i in idx]


# -- torch DataLoader ----------------------------------------------------------------------------------


class NpySamples(torch.utils.data.Dataset):
    """One sample per ``__getitem__`` (what most users write), on the page-cached .npy."""

    def __init__(self, root: Path):
        self.root = root
        self.x = self.y = None

    def __len__(self) -> int:
        return int(np.load(self.root / "train_y.npy", mmap_mode="r").shape[0])

    def __getitem__(self, i):
        if self.x is None:
            self.x, self.y = arrays(self.root)
        return torch.from_numpy(np.array(self.x[i])), int(self.y[i])


def dataloader(root: Path, work: Path, cfg: dict) -> Make:
    loader = torch.utils.data.DataLoader(
        NpySamples(root),
        batch_size=cfg["batch"],
        shuffle=True,
        drop_last=True,
        **workers(cfg),
        generator=torch.Generator().manual_seed(SEED),
    )
    return lambda: loader


def dataloader_batched(root: Path, work: Path, cfg: dict) -> Make:
    plan = batch_plan(cfg["samples"], cfg["batch"], 1)
    loader = torch.utils.data.DataLoader(
        NpyBatches(root),
        batch_size=None,
        sampler=plan,
        **workers(cfg),
    )
    return lambda: loader


# -- MosaicML Streaming ---------------------------------------------------------------------------------


def streaming_without_torchvision() -> None:
    """Let ``import streaming`` skip its ``vision``/``text``/``multimodal`` dataset classes: they
    import torchvision, which has no CPU build for this torch (the row needs only ``streaming.base``).
    Done when this module is imported: in the row's process and in the DataLoader workers Streaming
    spawns, which import this module (:class:`MosaicSamples`) before they unpickle the dataset."""
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415

    for sub in ("vision", "text", "multimodal"):
        sys.modules.setdefault(f"streaming.{sub}", types.ModuleType(f"streaming.{sub}"))


streaming_without_torchvision()


class MosaicSamples(torch.utils.data.IterableDataset):
    """A ``StreamingDataset``, pickled to the workers behind a class of this module (see above)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return iter(self.dataset)


def write_mds(root: Path, work: Path) -> Path:
    """The samples as MDS shards, written by Streaming's ``MDSWriter`` into ``work/mds``."""
    from streaming import MDSWriter  # noqa: PLC0415

    x, y = arrays(root)
    columns = {"x": f"ndarray:float32:{','.join(map(str, SAMPLE_SHAPE))}", "y": "int64"}
    with MDSWriter(out=str(work / "mds"), columns=columns, size_limit="64mb") as writer:
        for i in range(len(y)):
            writer.write({"x": x[i], "y": int(y[i])})
    return work / "mds"


def mosaic(root: Path, work: Path, cfg: dict) -> Make:
    from streaming import StreamingDataset  # noqa: PLC0415
    from streaming.base.util import clean_stale_shared_memory  # noqa: PLC0415

    write_mds(root, work)
    clean_stale_shared_memory()
    dataset = StreamingDataset(
        local=str(work / "mds"), shuffle=True, shuffle_seed=SEED, batch_size=cfg["batch"], predownload=None
    )
    loader = torch.utils.data.DataLoader(
        MosaicSamples(dataset),
        batch_size=cfg["batch"],
        drop_last=True,
        **workers(cfg),
    )
    return lambda: loader


# -- Lightning litData ---------------------------------------------------------------------------------


def _lit_sample(i: int, root: str) -> dict:
    x, y = arrays(Path(root))
    return {"x": np.array(x[i]), "y": int(y[i])}


def write_litdata(root: Path, work: Path, cfg: dict) -> Path:
    """The samples as litData chunks, written by its ``optimize()`` into ``work/lit``."""
    from functools import partial  # noqa: PLC0415

    import litdata as ld  # noqa: PLC0415

    ld.optimize(
        fn=partial(_lit_sample, root=str(root)),
        inputs=list(range(cfg["samples"])),
        output_dir=str(work / "lit"),
        chunk_bytes="64MB",
        num_workers=1,
        mode="overwrite",
    )
    return work / "lit"


def litdata(root: Path, work: Path, cfg: dict) -> Make:
    import litdata as ld  # noqa: PLC0415

    write_litdata(root, work, cfg)
    dataset = ld.StreamingDataset(str(work / "lit"), shuffle=True, seed=SEED, drop_last=True)
    loader = ld.StreamingDataLoader(
        dataset,
        batch_size=cfg["batch"],
        drop_last=True,
        **workers(cfg),
    )
    return lambda: loader


# -- WebDataset -----------------------------------------------------------------------------------------


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def webdataset(root: Path, work: Path, cfg: dict) -> Make:
    import webdataset as wds  # noqa: PLC0415

    x, y = arrays(root)
    shards = work / "wds"
    shards.mkdir()
    per_shard = max(cfg["batch"], cfg["samples"] // 16)
    with wds.ShardWriter(str(shards / "s-%05d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(len(y)):
            sink.write({"__key__": f"{i:08d}", "x.npy": _npy_bytes(np.asarray(x[i])), "cls": str(int(y[i])).encode()})
    urls = sorted(str(p) for p in shards.glob("s-*.tar"))
    dataset = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=SEED, empty_check=False, nodesplitter=wds.split_by_node)
        .shuffle(1000)
        .decode()
        .to_tuple("x.npy", "cls")
        .batched(cfg["batch"], partial=False)
    )
    # each worker reads whole shards: the pass is the workers' shards together
    loader = wds.WebLoader(dataset, batch_size=None, **workers(cfg))
    return lambda: loader


# -- torchdata.nodes ------------------------------------------------------------------------------------

_gather_arrays: tuple | None = None


def _gather(job: tuple[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch from the .npy, in a ParallelMapper worker (the arrays opened once per worker)."""
    global _gather_arrays
    root, idx = job
    if _gather_arrays is None:
        _gather_arrays = arrays(Path(root))
    x, y = _gather_arrays
    return torch.from_numpy(np.take(x, idx, axis=0)), torch.from_numpy(np.take(y, idx))


def torchdata(root: Path, work: Path, cfg: dict) -> Make:
    from torchdata.nodes import IterableWrapper, Loader, ParallelMapper, Prefetcher  # noqa: PLC0415

    def one_pass():
        plan = [(str(root), idx) for idx in batch_plan(cfg["samples"], cfg["batch"], 1)]
        node = ParallelMapper(
            IterableWrapper(plan), map_fn=_gather, num_workers=cfg["workers"], in_order=True, method="process"
        )
        return Loader(Prefetcher(node, prefetch_factor=cfg["inflight"]))

    return one_pass


# -- batchbus ----------------------------------------------------------------------------------------------


def _batchbus(shm: bool) -> Callable[[Path, Path, dict], Make]:
    def build(root: Path, work: Path, cfg: dict) -> Make:
        services = Services(root, work / "state")
        on_close(services.stop)
        return batches_of_loader(services.loader("ram", cfg["batch"], cfg["inflight"], shm=shm), shm)

    return build


BUILDERS: dict[str, Callable[[Path, Path, dict], Make]] = {
    "dataloader": dataloader,
    "dataloader-batched": dataloader_batched,
    "mosaic": mosaic,
    "litdata": litdata,
    "webdataset": webdataset,
    "torchdata": torchdata,
    "shm": _batchbus(True),
    "socket": _batchbus(False),
}
