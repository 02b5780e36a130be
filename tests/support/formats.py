"""Datasets written to disk byte for byte in each format the file:// source reads (IDX headers, CIFAR records,
npy and npz, token shards, raw arrays with dataset.toml), with what a source must serve from them: for
tests/provider/sources/test_files.py and tests/provider/sources/test_files_errors.py."""

from __future__ import annotations

import gzip
import struct
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "BUILDERS",
    "Built",
    "build_cifar",
    "build_idx",
    "build_idx_gz_float",
    "build_npy",
    "build_npz",
    "build_raw",
    "build_tokens_bin",
    "build_tokens_npy",
    "expected_splits",
    "some_indices",
    "write_cifar",
    "write_idx",
]


@dataclass
class Built:
    """A dataset written to disk and what a source must serve from it."""

    files: dict[str, tuple[np.ndarray, np.ndarray]]  # the splits the files hold, as served
    info: dict  # DatasetInfo fields it must report
    truncate: Path  # a data file to cut short
    mismatch: Callable[[], None] | None = None  # rewrites labels so their count disagrees
    query: str = ""
    val_in_files: bool = False
    extra: dict = field(default_factory=dict)


def write_idx(path: Path, a: np.ndarray, code: int) -> None:
    head = struct.pack(">BBBB", 0, 0, code, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape)
    data = head + a.astype(a.dtype.newbyteorder(">")).tobytes()
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def write_mnist_idx(directory: Path, n: int = 1000) -> Path:
    """``mock://mnist?n=N&noise=1`` as MNIST's own idx files (train and t10k) in ``directory``: the
    object-store jobs upload it to their server and train on it."""
    from services.provider.sources import open_source

    source = open_source(f"mock://mnist?n={n}&noise=1")
    directory.mkdir(parents=True, exist_ok=True)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        x, y = source.read(split, np.arange(source.num_samples(split)))
        pixels = np.clip(np.rint((x[:, 0] + 4.0) * (255 / 8.0)), 0, 255).astype(np.uint8)
        write_idx(directory / f"{prefix}-images-idx3-ubyte", pixels, 0x08)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte", y.astype(np.uint8), 0x08)
    source.close()
    return directory


def build_idx(d: Path, rng) -> Built:
    x = rng.integers(0, 256, (50, 7, 5), dtype=np.uint8)
    y = rng.integers(0, 10, 50).astype(np.uint8)
    y[0] = 9
    tx, ty = rng.integers(0, 256, (8, 7, 5), dtype=np.uint8), rng.integers(0, 10, 8).astype(np.uint8)
    write_idx(d / "train-images-idx3-ubyte", x, 0x08)
    write_idx(d / "train-labels-idx1-ubyte", y, 0x08)
    write_idx(d / "t10k-images-idx3-ubyte", tx, 0x08)
    write_idx(d / "t10k-labels-idx1-ubyte", ty, 0x08)
    return Built(
        {"train": (x[:, None], y.astype(np.int64)), "test": (tx[:, None], ty.astype(np.int64))},
        {
            "sample_shape": [1, 7, 5],
            "dtype": "uint8",
            "label_shape": [],
            "num_classes": 10,
            "kind": "image",
            "format": "idx",
        },
        d / "train-images-idx3-ubyte",
        lambda: write_idx(d / "train-labels-idx1-ubyte", y[:-1], 0x08),
    )


def build_idx_gz_float(d: Path, rng) -> Built:
    """4-D big-endian float32 images and int16 labels, gzipped: byte order and any dimensions."""
    x = rng.standard_normal((30, 2, 3, 4)).astype(np.float32)
    y = rng.integers(0, 4, 30).astype(np.int16)
    y[0] = 3
    write_idx(d / "train-images-idx4-ubyte.gz", x, 0x0D)
    write_idx(d / "train-labels-idx1-ubyte.gz", y, 0x0B)
    return Built(
        {"train": (x, y.astype(np.int64))},
        {"sample_shape": [2, 3, 4], "dtype": "float32", "num_classes": 4, "format": "idx"},
        d / "train-images-idx4-ubyte.gz",
        lambda: write_idx(d / "train-labels-idx1-ubyte.gz", y[:-2], 0x0B),
    )


def write_cifar(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    path.write_bytes(b"".join(bytes([label]) + img.tobytes() for img, label in zip(x, y)))


def build_cifar(d: Path, rng) -> Built:
    x = rng.integers(0, 256, (25, 3, 32, 32), dtype=np.uint8)
    y = rng.integers(0, 10, 25).astype(np.uint8)
    write_cifar(d / "data_batch_1.bin", x[:10], y[:10])
    write_cifar(d / "data_batch_2.bin", x[10:], y[10:])  # a run of samples spans the two files
    tx, ty = x[:4].copy(), y[:4].copy()
    write_cifar(d / "test_batch.bin", tx, ty)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (d / "batches.meta.txt").write_text("\n".join(names) + "\n\n")
    return Built(
        {"train": (x, y.astype(np.int64)), "test": (tx, ty.astype(np.int64))},
        {"sample_shape": [3, 32, 32], "dtype": "uint8", "num_classes": 10, "class_names": names, "format": "cifar10"},
        d / "data_batch_2.bin",
    )


def build_npy(d: Path, rng) -> Built:
    files = {}
    for split, n in (("train", 40), ("val", 6), ("test", 5)):
        x = rng.standard_normal((n, 3, 2)).astype(np.float64)
        y = rng.integers(0, 3, n).astype(np.int32)
        y[0] = 2
        np.save(d / f"{split}_x.npy", x)
        np.save(d / f"{split}_y.npy", y)
        files[split] = (x, y.astype(np.int64))
    return Built(
        files,
        {"sample_shape": [3, 2], "dtype": "float64", "num_classes": 3, "format": "npy"},
        d / "train_x.npy",
        lambda: np.save(d / "train_y.npy", files["train"][1][:-1]),
        val_in_files=True,
    )


def build_npz(d: Path, rng, compressed: bool) -> Built:
    x = rng.integers(0, 256, (33, 4, 4), dtype=np.uint8)
    y = rng.integers(0, 10, 33).astype(np.uint8)
    y[0] = 9
    tx, ty = x[:7], y[:7]
    save = np.savez_compressed if compressed else np.savez
    save(d / "mnist.npz", x_train=x, y_train=y, x_test=tx, y_test=ty)
    return Built(
        {"train": (x, y.astype(np.int64)), "test": (tx, ty.astype(np.int64))},
        {"sample_shape": [4, 4], "dtype": "uint8", "num_classes": 10, "format": "npy"},
        d / "mnist.npz",
        lambda: save(d / "mnist.npz", x_train=x, y_train=y[:-1], x_test=tx, y_test=ty),
    )


def build_tokens_bin(d: Path, rng) -> Built:
    tokens = rng.integers(0, 65536, 1000, dtype=np.uint16)
    tokens[:253].tofile(d / "shard_000.bin")  # sequences of 8 straddle the shard boundaries
    tokens[253:600].tofile(d / "shard_001.ds")
    tokens[600:].tofile(d / "shard_002.bin")
    seqs = tokens[: 1000 // 8 * 8].reshape(-1, 8)
    return Built(
        {"train": (seqs, np.zeros((len(seqs), 0), np.int64))},
        {
            "sample_shape": [8],
            "dtype": "uint16",
            "label_shape": [0],
            "num_classes": 65536,
            "kind": "tokens",
            "seq_len": 7,
            "vocab_size": 65536,
            "class_names": [],
        },
        d / "shard_002.bin",
        query="&seq_len=7&token_bytes=2",
    )


def build_tokens_npy(d: Path, rng) -> Built:
    tokens = rng.integers(0, 50_000, 700, dtype=np.uint32)
    np.save(d / "a.npy", tokens[:300])
    np.save(d / "b.npy", tokens[300:])
    (d / "dataset.toml").write_text('format = "tokens"\nseq_len = 15\nvocab_size = 50000\n')
    seqs = tokens[: 700 // 16 * 16].reshape(-1, 16)
    return Built(
        {"train": (seqs, np.zeros((len(seqs), 0), np.int64))},
        {
            "sample_shape": [16],
            "dtype": "uint32",
            "num_classes": 50000,
            "kind": "tokens",
            "seq_len": 15,
            "vocab_size": 50000,
        },
        d / "b.npy",
    )


def build_raw(d: Path, rng) -> Built:
    x = rng.standard_normal((60, 2, 5)).astype("<f4")
    y = rng.integers(0, 2, 60).astype(np.uint8)
    tx = rng.standard_normal((9, 2, 5)).astype("<f4")
    x.tofile(d / "train.f32")
    y.tofile(d / "train.lab")
    tx.tofile(d / "test.f32")
    (d / "test.lab").write_bytes(bytes(9))
    (d / "dataset.toml").write_text(
        textwrap.dedent("""\
        format = "raw"
        class_names = ["no", "yes"]
        [train]
        x = "train.f32"
        dtype = "float32"
        shape = [2, 5]
        y = "train.lab"
        label_dtype = "uint8"
        [test]
        x = "test.f32"
        dtype = "float32"
        shape = [2, 5]
        y = "test.lab"
        label_dtype = "uint8"
        """)
    )
    return Built(
        {"train": (x, y.astype(np.int64)), "test": (tx, np.zeros(9, np.int64))},
        {"sample_shape": [2, 5], "dtype": "float32", "num_classes": 2, "class_names": ["no", "yes"], "format": "raw"},
        d / "train.f32",
        lambda: (d / "train.lab").write_bytes(y[:-1].tobytes()),
    )


BUILDERS = {
    "idx": build_idx,
    "idx-gz-float": build_idx_gz_float,
    "cifar10": build_cifar,
    "npy": build_npy,
    "npz": lambda d, rng: build_npz(d, rng, False),
    "npz-compressed": lambda d, rng: build_npz(d, rng, True),
    "tokens-bin": build_tokens_bin,
    "tokens-npy": build_tokens_npy,
    "raw": build_raw,
}


def expected_splits(built: Built, val_fraction: float = 0.1) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """What each split serves: the files' splits, val carved from the tail of train if absent."""
    out = dict(built.files)
    if not built.val_in_files:
        x, y = out["train"]
        keep = len(x) - round(len(x) * val_fraction)
        out["train"], out["val"] = (x[:keep], y[:keep]), (x[keep:], y[keep:])
    out.setdefault("test", (built.files["train"][0][:0], built.files["train"][1][:0]))
    return out


def some_indices(n: int, rng) -> np.ndarray:
    """Unsorted, duplicated and contiguous indices, first and last included."""
    return (
        np.r_[
            rng.permutation(n)[:7], 0, 0, np.arange(min(n, 5)), n - 1, np.arange(n - 3, n)[::-1], n // 2, n // 2 + 1
        ].astype(np.int64)
        % n
    )
