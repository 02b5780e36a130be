"""``hf://datasets/ORG/NAME[@REVISION]`` against a loopback stand-in for the Hugging Face Hub
(tests/support/hubserver.py: the file API ``huggingface_hub`` calls; there is no network here), reached
through ``HF_ENDPOINT`` as a mirror would be: the source contract over a hub's Parquet export, splits from
the repository's layout (``data/SPLIT-*.parquet`` and the ``refs/convert/parquet`` layout), revisions pinned
to their commit at open, a private repository read with ``HF_TOKEN`` or the token file and refused without,
reads by range through the provider's disk cache, and a job trained from a repository."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from libbus.errors import DatasetError
from libbus.wire.messages import DatasetInfoRequest, SubmitJob
from services.provider.sources import open_source
from services.provider.sources.objstore import configure_cache
from tests.support import wait_job
from tests.support.busctl import REPO
from tests.support.contract import check_source_contract
from tests.support.hubserver import HubServer


@pytest.fixture
def hub(monkeypatch, tmp_path):
    server = HubServer()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield server
    server.close()


def write_split(path: Path, rng, n: int, width: int = 6) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(0, 1000, (n, width)).astype(np.int32)
    labels = rng.integers(0, 3, n).astype(np.int64)
    labels[0] = 2
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"input_ids": pa.array([r.tolist() for r in ids], pa.list_(pa.int32())), "label": labels})
    pq.write_table(table, path, row_group_size=7)
    return ids, labels


def write_export(d: Path, seed: int = 0) -> dict:
    """A repository as the Hub lays out an uploaded Parquet dataset: data/SPLIT-00000-of-0000N.parquet."""
    rng = np.random.default_rng(seed)
    (d / "README.md").parent.mkdir(parents=True, exist_ok=True)
    (d / "README.md").write_text("---\nlicense: mit\n---\n# a toy dataset\n")
    train = [write_split(d / "data" / f"train-0000{i}-of-00002.parquet", rng, n) for i, n in enumerate((20, 13))]
    ref = {"train": (np.concatenate([t[0] for t in train]), np.concatenate([t[1] for t in train]))}
    ref["val"] = write_split(d / "data" / "validation-00000-of-00001.parquet", rng, 9)
    write_split(d / "data" / "test-00000-of-00001.parquet", rng, 5)
    return ref


def test_a_hub_parquet_export_keeps_the_contract_read_by_range(hub, tmp_path):
    ref = write_export(tmp_path / "repo")
    commit = hub.add("org/toy", tmp_path / "repo")
    source = open_source("hf://datasets/org/toy?retries=1&backoff=0.01")
    local = open_source(f"parquet://{tmp_path / 'repo'}")
    try:
        info = source.info()
        assert (info["format"], info["store"], info["repo"], info["revision"]) == ("parquet", "hf", "org/toy", commit)
        assert {s: source.num_samples(s) for s in ("train", "val", "test")} == {"train": 33, "val": 9, "test": 5}
        idx = np.arange(33)[::-1].copy()
        assert all(a.tobytes() == b.tobytes() for a, b in zip(source.read("train", idx), local.read("train", idx)))
        check_source_contract(source, ref)
    finally:
        source.close()
        local.close()
    gets = hub.ranged_gets()
    assert gets and all(r is not None for _, r in gets), "a file was read whole, not by range"
    assert all(commit in p for p, _ in gets), "a read went to a branch, not the commit opened"


def test_the_parquet_conversion_ref_and_a_branch_are_revisions(hub, tmp_path):
    """``@refs%2Fconvert%2Fparquet`` (the Hub's own quoting, or unquoted) reads the conversion's
    ``SUBSET/SPLIT/NNNN.parquet`` layout; ``@v1`` another branch's files."""
    rng = np.random.default_rng(3)
    x, y = write_split(tmp_path / "converted" / "default" / "train" / "0000.parquet", rng, 12)
    write_split(tmp_path / "converted" / "default" / "test" / "0000.parquet", rng, 4)
    write_export(tmp_path / "main")
    hub.add("org/toy", tmp_path / "main")
    converted = hub.add("org/toy", tmp_path / "converted", revision="refs/convert/parquet")
    vx, vy = write_split(tmp_path / "v1" / "train.parquet", rng, 10, width=4)
    hub.add("org/toy", tmp_path / "v1", revision="v1")
    for uri in ("hf://datasets/org/toy@refs%2Fconvert%2Fparquet", "hf://datasets/org/toy@refs/convert/parquet"):
        source = open_source(uri + "?val_fraction=0")
        try:
            assert source.info()["revision"] == converted and source.num_samples("test") == 4
            got = source.read("train", np.arange(12))
            assert np.array_equal(got[0], x) and np.array_equal(got[1], y)
        finally:
            source.close()
    source = open_source("hf://datasets/org/toy@v1?val_fraction=0")
    try:
        got = source.read("train", np.arange(10))
        assert np.array_equal(got[0], vx) and np.array_equal(got[1], vy)
    finally:
        source.close()


def test_a_path_in_the_repository_is_its_own_dataset(hub, tmp_path):
    rng = np.random.default_rng(4)
    x, y = write_split(tmp_path / "repo" / "small" / "train.parquet", rng, 8)
    write_export(tmp_path / "repo" / "big")
    hub.add("org/two", tmp_path / "repo")
    source = open_source("hf://datasets/org/two/small?val_fraction=0")
    try:
        assert source.num_samples("train") == 8
        assert np.array_equal(source.read("train", np.arange(8))[0], x)
    finally:
        source.close()


def test_an_open_dataset_stays_on_its_commit_when_the_branch_moves(hub, tmp_path):
    old = write_export(tmp_path / "old", seed=1)
    write_export(tmp_path / "new", seed=2)
    first = hub.add("org/moving", tmp_path / "old")
    source = open_source("hf://datasets/org/moving?cache=off")
    try:
        assert hub.add("org/moving", tmp_path / "new") != first  # main now names another commit
        got = source.read("train", np.arange(33))
        assert np.array_equal(got[0], old["train"][0]) and source.info()["revision"] == first
    finally:
        source.close()


def test_a_private_repository_needs_the_token_and_never_shows_it(hub, tmp_path, monkeypatch):
    ref = write_export(tmp_path / "repo")
    token = "hf_" + "s3cr3t" * 6
    hub.add("org/private", tmp_path / "repo", token=token)
    with pytest.raises(DatasetError) as err:
        open_source("hf://datasets/org/private?retries=0")
    assert "not readable with the provider's token" in str(err.value) and "HF_TOKEN" in str(err.value)
    monkeypatch.setenv("HF_TOKEN", token)
    source = open_source("hf://datasets/org/private?retries=0")
    try:
        assert np.array_equal(source.read("train", np.arange(4))[0], ref["train"][0][:4])
        assert token not in json.dumps(source.info())
    finally:
        source.close()
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(DatasetError) as err:
        open_source("hf://datasets/org/private?retries=0")
    assert "hf_wrong" not in str(err.value) and token not in str(err.value)


def test_the_token_file_that_hf_auth_login_writes_is_read(hub, tmp_path):
    """In a process of its own (the library reads where its token file is at import): ``$HF_HOME/token``."""
    write_export(tmp_path / "repo")
    token = "hf_" + "f1le" * 8
    hub.add("org/private", tmp_path / "repo", token=token)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text(token + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub.url, PYTHONPATH=str(REPO))
    code = "from services.provider.sources import open_source as o; s = o('hf://datasets/org/private'); print(s.num_samples('train')); s.close()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["33"]


@pytest.mark.parametrize(
    "uri, message",
    [
        ("hf://datasets/org/nothing", r"not found, or private .* org/nothing is a dataset repository on http"),
        ("hf://datasets/org/toy@no-such-branch", r"INFO hf://datasets/org/toy@no-such-branch: no such revision"),
        ("hf://models/org/toy", r"expected hf://datasets/ORG/NAME\[@REVISION\]\[/PATH\] \(a dataset repository"),
        ("hf://datasets/org", r"expected hf://datasets/ORG/NAME"),
        ("hf://datasets/org/toy?token=abc", r"parameter\(s\) token would put a credential in the dataset URI"),
    ],
)
def test_a_wrong_uri_says_what_is_wrong(hub, tmp_path, uri, message):
    write_export(tmp_path / "repo")
    hub.add("org/toy", tmp_path / "repo")
    with pytest.raises(DatasetError, match=message):
        open_source(uri + ("&" if "?" in uri else "?") + "retries=0").close()


def test_reads_go_through_the_disk_cache(hub, tmp_path):
    """Reopened with the same cache, the same batch costs the Hub no request for file bytes."""
    write_export(tmp_path / "repo")
    hub.add("org/toy", tmp_path / "repo")
    uri = f"hf://datasets/org/toy?cache_dir={tmp_path / 'cache'}&cache_limit=10000000"
    idx = np.array([30, 2, 17, 5])
    first = open_source(uri)
    try:
        expected = first.read("train", idx)
    finally:
        first.close()
    before = len(hub.ranged_gets())
    again = open_source(uri)
    try:
        got = again.read("train", idx)
    finally:
        again.close()
    assert len(hub.ranged_gets()) == before, "bytes in the cache were fetched again"
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, expected))


@pytest.fixture
def forget_cache():
    yield
    configure_cache("", 0)  # the providers here set the process's default cache: unset it for later tests


def test_a_job_trains_on_a_hub_dataset(hub, tmp_path, router, start_provider, trainer, client_for, forget_cache):
    source = open_source("mock://mnist?n=1000&noise=1")
    for split, name in (("train", "train"), ("test", "test")):
        x, y = source.read(split, np.arange(source.num_samples(split)))
        path = tmp_path / "repo" / "data" / f"{name}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(len(x), -1).ravel()), x[0].size)
        pq.write_table(pa.table({"x": rows, "label": y.astype(np.int64)}), path, row_group_size=100)
    hub.add("org/digits", tmp_path / "repo")
    provider = start_provider(
        "digits=hf://datasets/org/digits", cache_dir=str(tmp_path / "cache"), cache_limit=64 << 20
    )
    info = client_for(provider.endpoint).request(DatasetInfoRequest(dataset="digits")).info
    assert (info["format"], info["store"], info["sample_shape"]) == ("parquet", "hf", [784])
    admin = client_for(router.endpoint, role="admin")
    spec = {"dataset": "digits", "model": "mlp", "epochs": 2, "batch_size": 32, "lr": 3e-3, "seed": 0}
    done = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=90)
    assert done["state"] == "succeeded", done.get("error")
    assert done["result"]["val_accuracy"] > 0.5  # chance is 0.1: it learned from what it read
