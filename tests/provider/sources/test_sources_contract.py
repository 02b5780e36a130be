"""The source contract (tests/support/contract.py) over every scheme the registry knows: mock, dummy, file
(in RAM and streamed), http, parquet, weighted and pipeline; and over every layout the layout registry
lists at every location it declares (local files, HTTP through the loopback server, S3 through moto), the
same samples wherever the files are; resident memory that stays bounded while a streamed dataset is read
whole; a clear error, naming the file, for a file cut short. A new scheme gets a case here, a new layout a
small example (the tests fail until they have one)."""

from __future__ import annotations

import gc
import os
import textwrap
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from libbus.errors import DatasetError
from services.provider.sources import OPENERS, layouts, open_source
from services.provider.sources.formats import dataset
from services.provider.sources.formats.location import KINDS
from services.provider.sources.layouts import FORMATS
from tests.support import layout_example
from tests.support.contract import check_encoded_contract, check_fields_contract, check_source_contract, peak_rss
from tests.support.formats import build_cifar, build_idx, build_npy, build_raw, build_tokens_bin, expected_splits
from tests.support.httpd import RangeServer
from tests.support.images import write_imagefolder, write_shards
from tests.support.peers import mds_job, write_hf, write_litdata, write_mds, write_tfrecords
from tests.support.s3server import S3Server

MB = 1 << 20


def write_npy(d: Path, rng: np.random.Generator) -> dict:
    """train/val/test ``_x.npy`` + ``_y.npy`` pairs; returns what each split must serve."""
    d.mkdir(parents=True, exist_ok=True)
    ref = {}
    for split, n in (("train", 40), ("val", 9), ("test", 5)):
        x = rng.standard_normal((n, 3, 2)).astype(np.float32)
        y = rng.integers(0, 4, n).astype(np.int64)
        y[0] = 3
        np.save(d / f"{split}_x.npy", x)
        np.save(d / f"{split}_y.npy", y)
        ref[split] = (x, y)
    return ref


def write_parquet(d: Path, rng: np.random.Generator) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    ids = rng.integers(0, 1000, (30, 6)).astype(np.int32)
    labels = rng.integers(0, 3, 30).astype(np.int64)
    labels[0] = 2
    table = pa.table({"input_ids": pa.array([r.tolist() for r in ids], pa.list_(pa.int32())), "label": labels})
    pq.write_table(table, d / "train.parquet", row_group_size=7)
    return {"train": (ids, labels)}


@pytest.fixture
def server(tmp_path):
    srv = RangeServer(tmp_path)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def s3():
    """A loopback S3 server (moto), its AWS_* variables set while the module runs."""
    srv = S3Server()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in srv.env().items():
            mp.setenv(k, v)
        yield srv
    srv.close()


def case(scheme: str, tmp_path: Path, server: RangeServer, request=None) -> tuple[str, dict | None]:
    """(URI, reference or None) for one scheme: data written here byte for byte where it can be."""
    rng = np.random.default_rng(len(scheme))
    if scheme == "mock":
        return "mock://cifar10?n=20", None
    if scheme == "mock-fields":
        return "mock://fields?n=30", None
    if scheme == "mock-tokens":
        return "mock://tokens?n=30&seq_len=8&vocab=16", None
    if scheme == "dummy":
        return "dummy://?shape=2,3&n=30&classes=4", {"train": (np.zeros((30, 2, 3), np.float32), np.zeros(30))}
    if scheme in ("file", "file-stream"):
        ref = write_npy(tmp_path / "npy", rng)
        return f"file://{tmp_path / 'npy'}?memory={'stream' if scheme == 'file-stream' else 'ram'}", ref
    if scheme in ("http", "https"):  # one case for both: https is the same opener over TLS
        ref = write_npy(tmp_path / "web", rng)
        return f"{server.url}/web/?retries=2&backoff=0.01&timeout=5", ref
    if scheme == "s3":  # gs:// and az:// are the same opener over another obstore backend
        ref = write_npy(tmp_path / "s3", rng)
        request.getfixturevalue("s3").put_dir("contract", tmp_path.name, tmp_path / "s3")
        return f"s3://contract/{tmp_path.name}/?retries=2&backoff=0.01", ref
    if scheme == "parquet":
        ref = write_parquet(tmp_path / "pq", rng)
        return f"parquet://{tmp_path / 'pq'}?val_fraction=0", ref
    if scheme == "weighted":
        (tmp_path / "mix.toml").write_text(
            textwrap.dedent("""\
            [[sources]]
            uri = "mock://mnist?n=30"
            weight = 2
            [[sources]]
            uri = "mock://mnist?n=20&seed=3"
            weight = 1
            """)
        )
        return f"weighted://{tmp_path / 'mix.toml'}", None
    if scheme == "pipeline":
        (tmp_path / "p.toml").write_text(
            textwrap.dedent("""\
            seed = 1
            [[stages]]
            name = "images"
            source = { uri = "mock://mnist?n=40" }
            [[stages]]
            name = "flip"
            input = "images"
            flip = { p = 0.5 }
            """)
        )
        return f"pipeline://{tmp_path / 'p.toml'}", None
    if scheme == "file-imagefolder":  # images decoded on the provider
        write_imagefolder(tmp_path / "if", per_class=6, classes=2, splits=("train", "test"))
        return f"file://{tmp_path / 'if'}?size=8&augment=1&workers=2", None
    if scheme == "http-webdataset":
        write_shards(tmp_path / "wds", "train", shards=2, per_shard=6)
        return f"{server.url}/wds/train-{{0000..0001}}.tar?size=8&cache={tmp_path / 'cache'}&retries=1", None
    raise AssertionError(
        f"no contract case for scheme {scheme!r}: add one to tests/provider/sources/test_sources_contract.py"
    )


SCHEMES = ["mock", "mock-tokens", "dummy", "file", "file-stream", "http", "s3", "parquet", "weighted", "pipeline"]
SCHEMES += ["mock-fields"]  # samples with named fields
SCHEMES += ["file-imagefolder", "http-webdataset"]


def test_every_registered_scheme_has_a_contract_case():
    # https: the http opener over TLS; gs, az: the s3 opener over another backend (tests/provider/storage/test_objstore_emulators.py);
    # hf: the same over the Hub's client, against a loopback Hub (tests/provider/storage/test_hf_hub.py)
    covered = {s.split("-")[0] for s in SCHEMES} | {"https", "gs", "az", "hf"}
    assert set(OPENERS) <= covered, f"schemes without a contract case: {sorted(set(OPENERS) - covered)}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_source_keeps_the_contract(scheme, tmp_path, server, request):
    uri, reference = case(scheme, tmp_path, server, request)
    source = open_source(uri)
    try:
        if source.xy:
            check_source_contract(source, reference)
        else:
            check_fields_contract(source, reference)
    finally:
        source.close()


@pytest.mark.parametrize("scheme", ["file", "http", "parquet"])
def test_a_file_cut_short_is_named(scheme, tmp_path, server):
    uri, _ = case(scheme, tmp_path, server)
    path = {
        "file": tmp_path / "npy" / "train_x.npy",
        "http": tmp_path / "web" / "train_x.npy",
        "parquet": tmp_path / "pq" / "train.parquet",
    }[scheme]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)
    with pytest.raises(DatasetError, match=path.name):
        source = open_source(uri.replace("memory=ram", "memory=stream"))
        try:
            source.read("train", np.arange(source.num_samples("train")))
        finally:
            source.close()


def write_raw(d: Path, megabytes: int) -> None:
    d.mkdir()
    (d / "x.u8").write_bytes(np.tile(np.arange(4096, dtype=np.uint8), megabytes * 256).tobytes())
    (d / "dataset.toml").write_text('[train]\nx = "x.u8"\ndtype = "uint8"\nshape = [4096]\n')


@pytest.mark.parametrize("scheme", ["file", "http"])
def test_streamed_resident_memory_stays_bounded(scheme, tmp_path, server):
    """Reading a streamed dataset whole costs no more memory for 96 MB than for 8 MB."""
    write_raw(tmp_path / "small", 8)
    write_raw(tmp_path / "big", 96)
    base = {"file": f"file://{tmp_path}", "http": server.url}[scheme]
    query = "?memory=stream" if scheme == "file" else "/?memory=stream&files=x.u8,dataset.toml"
    small, big = peak_rss(f"{base}/small{query}"), peak_rss(f"{base}/big{query}")
    assert big - small < 24 * MB, f"peak RSS {small / MB:.0f} MB for 8 MB, {big / MB:.0f} MB for 96 MB"


def test_without_a_spare_core_a_large_gather_runs_on_the_callers_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset, "SPLIT_GATHER", False)
    write_raw(tmp_path / "ram", 8)
    source = open_source(f"file://{tmp_path / 'ram'}?memory=ram&val_fraction=0")
    x = np.empty((1024, 4096), np.uint8)
    source.read_into("train", np.arange(1024, dtype=np.int64)[::-1].copy(), x, np.empty((1024, 0), np.int64))
    assert (x == np.arange(4096, dtype=np.uint8)).all()  # every row written
    assert source._gather._pool is None  # no helper thread was started
    source.close()


def test_a_closed_file_source_leaves_no_thread_behind(tmp_path, monkeypatch):
    """A RAM source splits large gathers with a helper thread (on three cores or more: forced here,
    where there may be two); closing the source stops it."""
    monkeypatch.setattr(dataset, "SPLIT_GATHER", True)
    write_raw(tmp_path / "ram", 8)
    source = open_source(f"file://{tmp_path / 'ram'}?memory=ram&val_fraction=0")
    x = np.empty((1024, 4096), np.uint8)  # 4 MB: a gather large enough to be split
    source.read_into("train", np.arange(1024, dtype=np.int64)[::-1].copy(), x, np.empty((1024, 0), np.int64))
    assert np.array_equal(x[0], np.arange(4096, dtype=np.uint8))
    helpers = [t for t in threading.enumerate() if t.name.startswith("gather")]
    assert helpers, "the large gather ran on one thread: this test no longer tests the helper"
    source.close()
    del source
    gc.collect()
    for t in helpers:
        t.join(5)
        assert not t.is_alive()


# -- every layout at every location ----------------------------------------------------------------


def write_layout(name: str, d: Path) -> tuple[str, dict | None]:
    """A small dataset of layout ``name`` written into ``d``: (the URI query that opens it, what each split
    must serve, or None where the bytes are decoded images and the local files are the reference)."""
    d.mkdir(parents=True)
    rng = np.random.default_rng(len(name))
    tables = {"raw": build_raw, "idx": build_idx, "cifar10": build_cifar, "npy": build_npy, "tokens": build_tokens_bin}
    if name in tables:
        built = tables[name](d, rng)
        return built.query.lstrip("&"), expected_splits(built)
    if name == "parquet":
        return "val_fraction=0", write_parquet(d, rng)
    if name == "imagefolder":
        write_imagefolder(d, per_class=4, classes=2, splits=("train", "test"))
        return "size=8&workers=2", None
    if name == "webdataset":
        write_shards(d, "train", shards=2, per_shard=5)
        return "size=8&workers=2", None
    if name == "text":
        lines = [f"document {i}: {'word ' * (i % 5)}".strip() for i in range(30)]
        (d / "train.txt").write_text("\n".join(lines) + "\n")
        return "encoded=1&val_fraction=0", {"train": lines}
    if name == "tfrecord":  # an (x, y) dataset: pixels as x, label as y
        written = write_tfrecords(d, rng)
        ref = {s: (np.stack(w["pixels"]).reshape(-1, 2, 3), np.array(w["label"])) for s, w in written.items()}
        (x, y), cut = ref["train"], len(ref["train"][1]) - 3  # val: the tail of train (val_fraction 0.1)
        ref["train"], ref["val"] = (x[:cut], y[:cut]), (x[cut:], y[cut:])
        return "fields=pixels&label=label&shape=2,3", ref
    if name == "mds":  # Streaming's MDSWriter; an (x, y) dataset: x as x, y as y
        d.rmdir()
        (samples,) = write_mds(mds_job(d, 9, 30, columns=("x", "y")))
        x, y = np.stack([s["x"] for s in samples]), np.array([s["y"] for s in samples])
        return "fields=x&label=y&classes=4", {"train": (x[:27], y[:27]), "val": (x[27:], y[27:])}
    if name == "hf-disk":  # datasets' save_to_disk (a DatasetDict); an (x, y) dataset: vec as x, label as y
        d.rmdir()
        cols = write_hf(d, 6, {"train": 20, "test": 4})
        ref = {s: (np.stack(c["vec"]), np.array(c["label"])) for s, c in cols.items()}
        (x, y) = ref["train"]
        ref["train"], ref["val"] = (x[:18], y[:18]), (x[18:], y[18:])
        return "fields=vec&label=label", ref
    if name == "litdata":  # litData's optimize(); an (x, y) dataset: x (its shape declared) as x, y as y
        d.rmdir()
        (samples,) = write_litdata((d, 9, 30, True))
        x, y = np.stack([s["x"] for s in samples]), np.array([s["y"] for s in samples])
        return "fields=x&label=y&shape=2,3&classes=4", {"train": (x[:27], y[:27]), "val": (x[27:], y[27:])}
    raise AssertionError(
        f"no example of layout {name!r}: add one to write_layout in tests/provider/sources/test_sources_contract.py"
    )


def located(kind: str, name: str, d: Path, query: str, server: RangeServer, request) -> str:
    """The URI of the files in ``d`` at a location of ``kind``."""
    if kind == "file":
        return f"file://{d}?{query}"
    if kind == "http":  # HTTP cannot list a directory: the files are named
        files = ",".join(sorted(p.name for p in d.iterdir() if p.is_file() and not p.name.startswith(".")))
        return f"{server.url}/{d.relative_to(server.root)}/?files={files}&retries=1&backoff=0.01&{query}"
    prefix = f"{d.parent.name}-{name}"
    request.getfixturevalue("s3").put_dir("layouts", prefix, d)
    return f"s3://layouts/{prefix}/?retries=2&backoff=0.01&{query}"


LAYOUTS = [pytest.param(f.name, kind, id=f"{f.name}-{kind}") for f in FORMATS for kind in f.where]


@pytest.mark.parametrize("name, kind", LAYOUTS)
def test_every_layout_keeps_the_contract_at_every_location(name, kind, tmp_path, server, request, monkeypatch):
    """A layout reads the same samples wherever its files are: the contract at each location the
    registry declares for it, and the same bytes as the local files."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # remote shard indexes
    d = tmp_path / "data"
    query, reference = write_layout(name, d)
    source = open_source(located(kind, name, d, query, server, request))
    local = open_source(f"file://{d}?{query}") if kind != "file" else None
    try:
        assert source.info()["format"] == name
        if local is not None:  # first: the contract's handler closes the source when done
            for split in ("train", "val"):
                n = local.num_samples(split)
                assert source.num_samples(split) == n, split
                if n and source.xy:
                    idx = np.arange(n)[::-1].copy()
                    (x, y), (lx, ly) = source.read(split, idx), local.read(split, idx)
                    assert x.tobytes() == lx.tobytes() and y.tobytes() == ly.tobytes(), split
        if source.kind == "encoded":
            check_encoded_contract(source, reference)
        elif source.xy:
            check_source_contract(source, reference)
        else:
            check_fields_contract(source, reference)
    finally:
        source.close()
        if local is not None:
            local.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_new_layout_is_one_module_and_one_registry_line(kind, tmp_path, server, request, monkeypatch):
    """tests/support/layout_example.py is written as a new layout is; its registry line is all it takes
    to read it at every location."""
    monkeypatch.setattr(layouts, "FORMATS", (*layouts.FORMATS, layout_example.FORMAT))
    d = tmp_path / "data"
    reference = layout_example.write_rows(d, np.random.default_rng(5))
    source = open_source(located(kind, "rows", d, "", server, request))
    try:
        assert source.info()["format"] == "rows"
        check_source_contract(source, reference)
    finally:
        source.close()
