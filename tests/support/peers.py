"""Datasets written by the peer loaders' own writers, as their users have them: TFRecord shards of
``tf.train.Example`` (the ``tfrecord`` package's writer: TensorFlow's framing and protobuf messages,
without TensorFlow), MosaicML Streaming's MDS shards (its ``MDSWriter``), litData's ``optimize()`` output
and Hugging Face datasets saved with ``save_to_disk``, for tests/provider/formats/test_tfrecord.py, tests/provider/formats/test_mds.py,
tests/provider/formats/test_litdata.py, tests/provider/formats/test_hfdisk.py and tests/provider/sources/test_sources_contract.py."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from .busctl import REPO

__all__ = [
    "MDS_COLUMNS",
    "lit_sample",
    "mds_job",
    "mds_samples",
    "png_pixels",
    "write_hf",
    "write_litdata",
    "write_mds",
    "write_tfrecords",
    "write_xy_everywhere",
]


def write_tfrecords(
    d: Path, rng: np.random.Generator, shards: int = 2, per_shard: int = 15, test: int = 6, gz: bool = False
) -> dict:
    """``train-0000-of-000N.tfrecord`` … and ``test.tfrecord`` in ``d``, each record an Example of
    ``pixels`` (6 float32), ``label`` (an int64 class id), ``jpeg`` (bytes of varying length) and ``tokens``
    (0..4 int64 values); gzip files with ``gz``. Returns split → {feature: values per record}, train with
    val not carved yet."""
    from tfrecord.writer import TFRecordWriter  # the peer's writer: a test extra

    d.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict[str, list]] = {}
    files = [(f"train-{i:04d}-of-{shards:04d}.tfrecord", "train", per_shard) for i in range(shards)]
    files.append(("test.tfrecord", "test", test))
    for name, split, n in files:
        path = d / name
        writer = TFRecordWriter(str(path))
        ref = out.setdefault(split, {"pixels": [], "label": [], "jpeg": [], "tokens": []})
        for _ in range(n):
            pixels = rng.standard_normal(6).astype(np.float32)
            label = int(rng.integers(0, 3))
            jpeg = rng.integers(0, 256, int(rng.integers(1, 40)), dtype=np.uint8).tobytes()
            tokens = rng.integers(-5, 1 << 40, int(rng.integers(0, 5)))
            writer.write(
                {
                    "pixels": (pixels, "float"),
                    "label": (label, "int"),
                    "jpeg": (jpeg, "byte"),
                    "tokens": (tokens.tolist(), "int"),
                }
            )
            for key, value in (("pixels", pixels), ("label", label), ("jpeg", jpeg), ("tokens", tokens)):
                ref[key].append(value)
        writer.close()
        if gz:
            path.with_name(name + ".gz").write_bytes(gzip.compress(path.read_bytes()))
            path.unlink()
    return out


def mds_samples(seed: int, n: int) -> list[dict]:
    """``n`` samples of every column kind :func:`write_mds` writes, the same for the same ``seed``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        h, w = (int(v) for v in rng.integers(2, 9, 2))
        out.append(
            {
                "x": rng.standard_normal((2, 3)).astype(np.float32),
                "y": int(rng.integers(0, 4)),
                "caption": "é" * int(rng.integers(0, 6)) + "caption",
                "tokens": rng.integers(0, 1000, int(rng.integers(1, 9))).astype(np.int32),
                "any": rng.standard_normal((int(rng.integers(1, 4)), 2)).astype(np.float64),
                "image": rng.integers(0, 256, (h, w, 3), dtype=np.uint8),
                "blob": rng.integers(0, 256, int(rng.integers(0, 30)), dtype=np.uint8).tobytes(),
            }
        )
    return out


#: The columns :func:`write_mds` writes, by Streaming encoding (MDSWriter orders them by name).
MDS_COLUMNS = {
    "x": "ndarray:float32:2,3",
    "y": "int64",
    "caption": "str",
    "tokens": "ndarray:int32",
    "any": "ndarray",
    "image": "png",
    "blob": "bytes",
}

_WRITE_MDS = """
import json, sys, types
# streaming's vision/text/multimodal dataset classes import torchvision, which has no CPU build for this
# torch; the writer needs none of them (benchmarks/peer_rows.py does the same, in its own process)
for sub in ("vision", "text", "multimodal"):
    sys.modules.setdefault(f"streaming.{sub}", types.ModuleType(f"streaming.{sub}"))
from PIL import Image
from streaming import MDSWriter
from tests.support.peers import MDS_COLUMNS, mds_samples
for job in json.loads(sys.argv[1]):
    columns = {k: v for k, v in MDS_COLUMNS.items() if k in job["columns"]}
    with MDSWriter(
        out=job["out"], columns=columns, compression=job["compression"] or None, size_limit=job["size_limit"]
    ) as writer:
        for sample in mds_samples(job["seed"], job["n"]):
            sample["image"] = Image.fromarray(sample["image"])
            writer.write({k: v for k, v in sample.items() if k in columns})
"""


def mds_job(
    out: Path, seed: int, n: int, compression: str = "", size_limit: int = 1 << 11, columns=MDS_COLUMNS
) -> dict:
    """One directory for :func:`write_mds`: :func:`mds_samples` ``(seed, n)``, the ``columns`` named."""
    return {
        "out": str(out),
        "seed": seed,
        "n": n,
        "compression": compression,
        "size_limit": size_limit,
        "columns": list(columns),
    }


def write_mds(*jobs: dict) -> list[list[dict]]:
    """MDS shards written by Streaming's ``MDSWriter`` for each :func:`mds_job`, all in one process of their
    own (importing Streaming takes seconds; see the script for why apart); returns each job's samples."""
    done = subprocess.run(
        [sys.executable, "-c", _WRITE_MDS, json.dumps(list(jobs))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [mds_samples(job["seed"], job["n"]) for job in jobs]


def png_pixels(data: bytes) -> np.ndarray:
    """The pixels of a PNG file's bytes."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img)


def write_hf(d: Path, seed: int, splits: dict[str, int], shard_bytes: str = "1KB", extra: bool = False) -> dict:
    """A ``datasets`` ``DatasetDict`` of ``splits`` (name → rows; one split named ``""``: a plain ``Dataset``)
    saved with ``save_to_disk`` into ``d``: columns ``image`` (an Image feature: PNG), ``label`` (a
    ClassLabel of a, b, c), ``text``, ``vec`` (3 float32) and ``tokens`` (int32, any length); with ``extra``
    a ``meta`` column of structs. Returns split → column → values."""
    import datasets  # the peer's writer: a test extra
    from PIL import Image

    rng = np.random.default_rng(seed)
    features = {
        "image": datasets.Image(),
        "label": datasets.ClassLabel(names=["a", "b", "c"]),
        "text": datasets.Value("string"),
        "vec": datasets.Sequence(datasets.Value("float32"), length=3),
        "tokens": datasets.Sequence(datasets.Value("int32")),
    }
    if extra:
        features["meta"] = {"a": datasets.Value("int32"), "b": datasets.Value("string")}
    out, made = {}, {}
    for split, n in splits.items():
        cols = {
            "image": [rng.integers(0, 256, (int(rng.integers(2, 7)), 5, 3), dtype=np.uint8) for _ in range(n)],
            "label": [int(v) for v in rng.integers(0, 3, n)],
            "text": [f"row {i} " + "ü" * int(rng.integers(0, 4)) for i in range(n)],
            "vec": [rng.standard_normal(3).astype(np.float32) for _ in range(n)],
            "tokens": [rng.integers(0, 99, int(rng.integers(0, 6))).astype(np.int32) for _ in range(n)],
        }
        if extra:
            cols["meta"] = [{"a": i, "b": str(i)} for i in range(n)]
        rows = dict(cols, image=[Image.fromarray(a) for a in cols["image"]])
        made[split] = datasets.Dataset.from_dict(rows, features=datasets.Features(features))
        out[split] = cols
    saved = made[""] if "" in made else datasets.DatasetDict(made)
    saved.save_to_disk(str(d), max_shard_size=shard_bytes)
    return out


def lit_sample(key: tuple[int, int], columns: tuple[str, ...] = ()) -> dict:
    """Sample ``i`` of seed ``seed`` (``key``) as an ``optimize()`` function returns it: ``x`` (float32 2x3),
    ``y`` (a class id), ``caption``, ``blob`` (bytes), ``tokens`` (int32, 1..8 of them), ``image`` (a PIL
    image, kept as raw pixels); only ``columns`` where given."""
    from PIL import Image

    seed, i = key
    rng = np.random.default_rng([seed, i])
    h, w = (int(v) for v in rng.integers(2, 7, 2))
    sample = {
        "x": rng.standard_normal((2, 3)).astype(np.float32),
        "y": int(rng.integers(0, 4)),
        "caption": f"sample {i} " + "ß" * int(rng.integers(0, 4)),
        "blob": rng.integers(0, 256, int(rng.integers(1, 30)), dtype=np.uint8).tobytes(),
        "tokens": rng.integers(0, 500, int(rng.integers(1, 9))).astype(np.int32),
        "image": Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)),
    }
    return {k: v for k, v in sample.items() if k in columns} if columns else sample


def _lit_xy(key: tuple[int, int]) -> dict:
    return lit_sample(key, ("x", "y"))


_WRITE_LITDATA = """
import json, sys
from litdata import optimize
from tests.support import peers
for job in json.loads(sys.argv[1]):
    fn = peers._lit_xy if job["xy"] else peers.lit_sample
    inputs = [(job["seed"], i) for i in range(job["n"])]
    optimize(fn=fn, inputs=inputs, output_dir=job["out"], chunk_bytes=job["chunk_bytes"], num_workers=1)
"""


def write_litdata(*jobs: tuple[Path, int, int, bool]) -> list[list[dict]]:
    """litData ``optimize()`` output of :func:`lit_sample` for each ``(out, seed, n, xy)`` (``xy``: only ``x``
    and ``y``), all in one process of its own (``optimize`` starts workers and prints progress); returns
    each job's samples."""
    spec = [{"out": str(o), "seed": s, "n": n, "xy": xy, "chunk_bytes": "2kb"} for o, s, n, xy in jobs]
    done = subprocess.run(
        [sys.executable, "-c", _WRITE_LITDATA, json.dumps(spec)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [[lit_sample((s, i), ("x", "y") if xy else ()) for i in range(n)] for _, s, n, xy in jobs]


# -- one (x, y) dataset in every peer format, for a job to train on ------------------------------------------

_WRITE_XY = """
import functools, sys, types
import numpy as np
for sub in ("vision", "text", "multimodal"):  # see _WRITE_MDS
    sys.modules.setdefault(f"streaming.{sub}", types.ModuleType(f"streaming.{sub}"))
from litdata import optimize
from streaming import MDSWriter
from tests.support import peers
arrays, mds, lit = sys.argv[1:]
z = np.load(arrays)
shape = ",".join(map(str, z["x"].shape[1:]))
with MDSWriter(out=mds, columns={"x": f"ndarray:float32:{shape}", "y": "int64"}, size_limit=1 << 20) as writer:
    for x, y in zip(z["x"], z["y"]):
        writer.write({"x": x, "y": int(y)})
fn = functools.partial(peers._lit_row, arrays)
optimize(fn=fn, inputs=list(range(len(z["y"]))), output_dir=lit, chunk_bytes="1MB", num_workers=1)
"""


def _lit_row(arrays: str, i: int) -> dict:
    z = np.load(arrays)
    return {"x": z["x"][i], "y": int(z["y"][i])}


def write_xy_everywhere(d: Path, x: np.ndarray, y: np.ndarray) -> dict[str, str]:
    """The train samples ``x`` (float32) and class ids ``y`` written by each peer's own writer under ``d``
    (``tfrecord``, ``mds``, ``litdata``, ``hf``) and as ``.npy`` (``npy``); returns each one's URI query that
    serves it as ``(x, y)`` of ``x``'s shape."""
    import datasets
    from tfrecord.writer import TFRecordWriter

    shape = ",".join(map(str, x.shape[1:]))
    (d / "npy").mkdir(parents=True)
    np.save(d / "npy" / "train_x.npy", x)
    np.save(d / "npy" / "train_y.npy", y)
    (d / "tfrecord").mkdir()
    writer = TFRecordWriter(str(d / "tfrecord" / "train-0000-of-0001.tfrecord"))
    for xi, yi in zip(x, y):
        writer.write({"pixels": (xi.reshape(-1), "float"), "label": (int(yi), "int")})
    writer.close()
    flat = datasets.Sequence(datasets.Value("float32"), length=int(np.prod(x.shape[1:])))
    features = datasets.Features({"pixels": flat, "label": datasets.Value("int64")})
    rows = {"pixels": list(x.reshape(len(x), -1)), "label": [int(v) for v in y]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(d / "hf"))
    np.savez(d / "arrays.npz", x=x, y=y)
    done = subprocess.run(
        [sys.executable, "-c", _WRITE_XY, str(d / "arrays.npz"), str(d / "mds"), str(d / "litdata")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {
        "npy": "",
        "tfrecord": f"fields=pixels&label=label&shape={shape}",
        "mds": "fields=x&label=y",
        "litdata": f"fields=x&label=y&shape={shape}",
        "hf": f"fields=pixels&label=label&shape={shape}",
    }
