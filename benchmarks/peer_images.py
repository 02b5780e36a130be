"""The rows of ``busctl bench --peers --workload images``: JPEGs decoded and augmented by each loader.

The same rows as the tensor workload (benchmarks/peer_rows.py), on the generated JPEG tree under
``root/images`` (benchmarks/peer_jpeg.py), every sample through the same recipe (decode →
random-resized-crop → flip → normalize, float32 ``(3, S, S)``) with the same decoder:

- ``dataloader``: a per-sample ``__getitem__`` reading the file and decoding it, ``num_workers=2``;
- ``dataloader-batched``: one ``__getitem__`` per batch of indices, decoding its files one by one;
- ``mosaic``: MDS shards with a ``bytes`` column, decoded in the dataset's ``__getitem__``;
- ``litdata``: ``optimize()`` chunks of bytes, decoded by the dataset's ``transform``;
- ``webdataset``: tar shards of ``.jpg``/``.cls``, decoded by a ``map`` after the shuffle buffer;
- ``torchdata``: the batch plan → ``ParallelMapper`` (2 processes, a batch of files each) → prefetch;
- ``shm`` / ``socket``: a provider process running examples/pipelines/imagenet-train.toml on the
  tree (an encoded-image source, then its ``decode``, ``random_resized_crop``, ``flip`` and
  ``normalize`` stages on ``workers`` threads), batches into the trainer's ring or over TCP.

Each builder has the signature of peer_rows's: ``build(root, work, cfg) -> make`` where ``make()``
starts one pass. ``cfg['image_size']`` is ``S``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from benchmarks.delivery import SEED, batch_plan
from benchmarks.peer_jpeg import Augment, image_files
from benchmarks.peer_rows import Make, batches_of_loader, on_close, workers
from libbus.loader.remote import RemoteLoader
from libbus.security.auth import ensure_secret, issue_token
from services.launch import ServiceProcs

__all__ = ["BUILDERS", "EXAMPLE"]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pipelines" / "imagenet-train.toml"


def _tree(root: Path) -> Path:
    return root / "images"


# -- torch DataLoader ----------------------------------------------------------------------------------


class JpegSamples(torch.utils.data.Dataset):
    """One file read and decoded per ``__getitem__`` (torchvision's ImageFolder, written out)."""

    def __init__(self, files: list[tuple[Path, int]], size: int):
        self.files, self.size = files, size
        self.augment: Augment | None = None

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        if self.augment is None:  # in the worker: its own random numbers
            self.augment = Augment(self.size)
        path, label = self.files[i]
        return torch.from_numpy(self.augment(path.read_bytes(), str(path))), label


class JpegBatches(JpegSamples):
    """One ``__getitem__`` per batch of indices: its files decoded into one array."""

    def __getitem__(self, idx):
        if self.augment is None:
            self.augment = Augment(self.size)
        x = self.augment.batch([self.files[int(i)][0].read_bytes() for i in idx])
        return torch.from_numpy(x), torch.tensor([self.files[int(i)][1] for i in idx], dtype=torch.int64)


def dataloader(root: Path, work: Path, cfg: dict) -> Make:
    loader = torch.utils.data.DataLoader(
        JpegSamples(image_files(_tree(root)), cfg["image_size"]),
        batch_size=cfg["batch"],
        shuffle=True,
        drop_last=True,
        **workers(cfg),
        generator=torch.Generator().manual_seed(SEED),
    )
    return lambda: loader


def dataloader_batched(root: Path, work: Path, cfg: dict) -> Make:
    loader = torch.utils.data.DataLoader(
        JpegBatches(image_files(_tree(root)), cfg["image_size"]),
        batch_size=None,
        sampler=batch_plan(cfg["samples"], cfg["batch"], 1),
        **workers(cfg),
    )
    return lambda: loader


# -- MosaicML Streaming ---------------------------------------------------------------------------------


def mosaic(root: Path, work: Path, cfg: dict) -> Make:
    from streaming import MDSWriter  # noqa: PLC0415
    from streaming.base.util import clean_stale_shared_memory  # noqa: PLC0415

    from benchmarks.peer_mosaic import MosaicJpegs  # noqa: PLC0415

    with MDSWriter(out=str(work / "mds"), columns={"jpg": "bytes", "y": "int64"}, size_limit="64mb") as writer:
        for path, label in image_files(_tree(root)):
            writer.write({"jpg": path.read_bytes(), "y": label})
    clean_stale_shared_memory()
    dataset = MosaicJpegs(
        image_size=cfg["image_size"],
        local=str(work / "mds"),
        shuffle=True,
        shuffle_seed=SEED,
        batch_size=cfg["batch"],
        predownload=None,
    )
    loader: torch.utils.data.DataLoader = torch.utils.data.DataLoader(
        dataset,
        batch_size=cfg["batch"],
        drop_last=True,
        **workers(cfg),
    )
    return lambda: loader


# -- Lightning litData ---------------------------------------------------------------------------------


def _lit_sample(item: tuple[str, int]) -> dict:
    return {"jpg": Path(item[0]).read_bytes(), "y": item[1]}


_lit_augment: dict[int, Augment] = {}


def _lit_decode(item: dict, size: int):
    """litData's ``transform`` (applied in its ``__getitem__``), in each worker."""
    augment = _lit_augment.get(size) or _lit_augment.setdefault(size, Augment(size))
    return torch.from_numpy(augment(item["jpg"])), int(item["y"])


def litdata(root: Path, work: Path, cfg: dict) -> Make:
    import litdata as ld  # noqa: PLC0415

    ld.optimize(
        fn=_lit_sample,
        inputs=[(str(p), label) for p, label in image_files(_tree(root))],
        output_dir=str(work / "lit"),
        chunk_bytes="64MB",
        num_workers=1,
        mode="overwrite",
    )
    dataset = ld.StreamingDataset(
        str(work / "lit"),
        shuffle=True,
        seed=SEED,
        drop_last=True,
        transform=partial(_lit_decode, size=cfg["image_size"]),
    )
    loader = ld.StreamingDataLoader(
        dataset,
        batch_size=cfg["batch"],
        drop_last=True,
        **workers(cfg),
    )
    return lambda: loader


# -- WebDataset -----------------------------------------------------------------------------------------

_wds_augment: dict[int, Augment] = {}


def _wds_decode(sample: tuple[bytes, bytes], size: int):
    augment = _wds_augment.get(size) or _wds_augment.setdefault(size, Augment(size))
    return torch.from_numpy(augment(sample[0])), int(sample[1])


def webdataset(root: Path, work: Path, cfg: dict) -> Make:
    import webdataset as wds  # noqa: PLC0415

    shards = work / "wds"
    shards.mkdir()
    per_shard = max(cfg["batch"], cfg["samples"] // 16)
    with wds.ShardWriter(str(shards / "s-%05d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, (path, label) in enumerate(image_files(_tree(root))):
            sink.write({"__key__": f"{i:08d}", "jpg": path.read_bytes(), "cls": str(label).encode()})
    urls = sorted(str(p) for p in shards.glob("s-*.tar"))
    dataset = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=SEED, empty_check=False, nodesplitter=wds.split_by_node)
        .shuffle(1000)
        .to_tuple("jpg", "cls")  # the raw bytes: the row's decoder, not WebDataset's .decode("pil")
        .map(partial(_wds_decode, size=cfg["image_size"]))
        .batched(cfg["batch"], partial=False)
    )
    loader = wds.WebLoader(dataset, batch_size=None, **workers(cfg))
    return lambda: loader


# -- torchdata.nodes ------------------------------------------------------------------------------------

_batch_state: dict = {}


def _decode_batch(job: tuple[str, int, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of files decoded, in a ParallelMapper worker (the file list read once per worker)."""
    root, size, idx = job
    if "files" not in _batch_state:
        _batch_state.update(files=image_files(Path(root)), augment=Augment(size))
    files = _batch_state["files"]
    x = _batch_state["augment"].batch([files[int(i)][0].read_bytes() for i in idx])
    return torch.from_numpy(x), torch.tensor([files[int(i)][1] for i in idx], dtype=torch.int64)


def torchdata(root: Path, work: Path, cfg: dict) -> Make:
    from torchdata.nodes import IterableWrapper, Loader, ParallelMapper, Prefetcher  # noqa: PLC0415

    def one_pass():
        plan = [(str(_tree(root)), cfg["image_size"], idx) for idx in batch_plan(cfg["samples"], cfg["batch"], 1)]
        node = ParallelMapper(
            IterableWrapper(plan), map_fn=_decode_batch, num_workers=cfg["workers"], in_order=True, method="process"
        )
        return Loader(Prefetcher(node, prefetch_factor=cfg["inflight"]))

    return one_pass


# -- batchbus ----------------------------------------------------------------------------------------------


def pipeline_file(tree: Path, size: int, out: Path) -> Path:
    """examples/pipelines/imagenet-train.toml on ``tree``, cropping to ``size``, no val carved off."""
    text = EXAMPLE.read_text()
    for old, new in (
        ("file:///data/imagenet?encoded=1", f"file://{tree}?encoded=1&val_fraction=0"),
        ("random_resized_crop = { size = 224,", f"random_resized_crop = {{ size = {size},"),
    ):
        if old not in text:
            raise RuntimeError(f"{EXAMPLE} no longer has {old!r}: update benchmarks/peer_images.py")
        text = text.replace(old, new)
    out.write_text(text)
    return out


def _batchbus(shm: bool) -> Callable[[Path, Path, dict], Make]:
    def build(root: Path, work: Path, cfg: dict) -> Make:
        state = work / "state"
        token = issue_token(
            ensure_secret(state / "secret"),
            sub="bench",
            role="trainer",
            audience="batchbus",
            ttl_s=3600,
            datasets=["img"],
        )
        pipeline = pipeline_file(_tree(root), cfg["image_size"], work / "train.toml")
        procs = ServiceProcs(state)
        on_close(procs.stop)
        router = procs.start("router", "--bind", "tcp://127.0.0.1:0", "--log-level", "WARNING")
        endpoint = procs.start(
            "provider", "--router", router, "--log-level", "WARNING", "--dataset", f"img=pipeline://{pipeline}"
        )
        loader = RemoteLoader(
            "img",
            provider=endpoint,
            token=token,
            batch_size=cfg["batch"],
            seed=SEED,
            shuffle="full",
            drop_last=True,
            inflight=cfg["inflight"],
            shm=shm,
        )
        return batches_of_loader(loader, shm)

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
