"""Parquet columns as named fields: PNG images of varying sizes decoded to ``uint8 (?, ?, 3)``, JPEG bytes
kept as bytes, a text column as strings, through a real provider over the socket and the ring, each field
byte for byte against what the test wrote."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from libbus.errors import DatasetError
from libbus.loader.remote import RemoteLoader
from services.provider.sources import open_source

N = 12


def _png(arr: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(arr).save(out, format="PNG")
    return out.getvalue()


def _jpeg(arr: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(arr).save(out, format="JPEG", quality=90)
    return out.getvalue()


@pytest.fixture
def written(tmp_path):
    rng = np.random.default_rng(3)
    images = [
        rng.integers(0, 256, (int(rng.integers(3, 20)), int(rng.integers(3, 20)), 3), dtype=np.uint8) for _ in range(N)
    ]
    images[4] = images[4][:, :, 0].copy()  # a grey PNG: served as RGB like the rest
    jpegs = [_jpeg(rng.integers(0, 256, (8 + i, 5, 3), dtype=np.uint8)) for i in range(N)]
    texts = [f"caption {i} " + "é" * i for i in range(N)]
    table = pa.table(
        {
            "png": pa.array([_png(a) for a in images], pa.binary()),
            "jpg": pa.array(jpegs, pa.binary()),
            "caption": pa.array(texts, pa.string()),
            "label": pa.array(np.arange(N) % 3, pa.int64()),
        }
    )
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=5)
    rgb = [np.repeat(a[:, :, None], 3, axis=2) if a.ndim == 2 else a for a in images]
    return tmp_path, rgb, jpegs, texts


def _uri(root) -> str:
    return f"parquet://{root}?fields=png:image,jpg,caption,label&val_fraction=0&max_bytes=4096"


def test_parquet_fields_are_described_and_read_exactly(written):
    root, rgb, jpegs, texts = written
    source = open_source(_uri(root))
    assert [f.describe() for f in source.fields] == [
        "png uint8 (?, ?, 3)",
        "jpg bytes *",
        "caption str *",
        "label int64 ()",
    ]
    assert source.info()["kind"] == "fields" and "sample_shape" not in source.info()
    batch = source.read_fields("train", np.array([11, 0, 4, 7]))
    assert [a.tobytes() for a in batch["png"]] == [rgb[i].tobytes() for i in (11, 0, 4, 7)]
    assert batch["jpg"] == [jpegs[i] for i in (11, 0, 4, 7)] and batch["caption"] == [texts[i] for i in (11, 0, 4, 7)]
    assert batch["label"].tolist() == [11 % 3, 0, 4 % 3, 7 % 3]


@pytest.mark.parametrize("shm", [False, True])
def test_parquet_fields_through_both_deliveries(written, start_provider, make_token, shm):
    root, rgb, jpegs, texts = written
    running = start_provider(f"pq={_uri(root)}")
    with RemoteLoader(
        "pq", provider=running.endpoint, token=make_token(), batch_size=5, shuffle=False, shm=shm, collate="list"
    ) as loader:
        assert loader.transport == ("shm" if shm else "socket")
        seen = 0
        for batch in loader:
            for row in range(len(batch["caption"])):
                i = seen + row
                assert (
                    batch["png"][row].numpy().tobytes() == rgb[i].tobytes() and batch["png"][row].shape == rgb[i].shape
                )
                assert batch["jpg"][row] == jpegs[i] and batch["caption"][row] == texts[i]
                assert int(batch["label"][row]) == i % 3
            seen += len(batch["caption"])
        assert seen == N


@pytest.mark.parametrize(
    "query, words",
    [
        ("fields=caption:image", "cannot be served as 'image'"),
        ("fields=nope", "no column 'nope'"),
        ("fields=png:jpeg", "expected COLUMN or COLUMN:"),
        ("fields=png,png", "each column once"),
        ("fields=png&max_bytes=-1", "max_bytes must be a byte count"),
    ],
)
def test_bad_field_selections_are_refused_naming_the_column(written, query, words):
    with pytest.raises(DatasetError, match=words):
        open_source(f"parquet://{written[0]}?{query}")
