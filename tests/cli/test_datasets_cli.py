"""Inspecting data as a user does: ``busctl datasets`` and ``busctl fetch`` against a real router and real
providers, ``--indices`` parsing, and job specs' shuffle modes."""

import json

import numpy as np
import pytest

from cli.data import parse_indices
from libbus.errors import BadRequest
from libbus.jobs.spec import JobSpec
from libbus.order.epochs import DEFAULT_BLOCK_SIZE
from services.provider.sources import open_source
from tests.support import busctl as run_busctl

MNIST = "mock://mnist?n=600"
TOKENS = "mock://tokens?n=64&seq_len=8&vocab=16"


def busctl(router, state_dir, *args, timeout=60):
    """Run busctl in its own process against the test's router, as admin from the test's secret."""
    return run_busctl(
        *args,
        "--router",
        router.endpoint,
        "--state-dir",
        str(state_dir),
        timeout=timeout,
        env={"BATCHBUS_REQUEST_TIMEOUT_S": "5", "BATCHBUS_REQUEST_RETRIES": "0"},
    )


def one_line_error(out, *words):
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr + out.stdout
    assert out.stderr.strip().count("\n") == 0, out.stderr
    for word in words:
        assert word in out.stderr, out.stderr


@pytest.fixture
def served(start_provider):
    """Two providers: both serve mnist (the same data); one also serves a token dataset."""
    a = start_provider(f"mnist={MNIST}", f"tok={TOKENS}", name="prov-a")
    b = start_provider(f"mnist={MNIST}", name="prov-b")
    return a, b


# -- busctl datasets ----------------------------------------------------------------------------


def test_datasets_lists_every_dataset_with_its_providers_and_info(router, served, state_dir):
    a, b = served
    out = busctl(router, state_dir, "datasets", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["dataset"]: r for r in json.loads(out.stdout)}
    assert sorted(rows) == ["mnist", "tok"]
    assert sorted(p["name"] for p in rows["mnist"]["providers"]) == ["prov-a", "prov-b"]
    assert {p["endpoint"] for p in rows["mnist"]["providers"]} == {a.endpoint, b.endpoint}
    assert [p["name"] for p in rows["tok"]["providers"]] == ["prov-a"]
    # the raw DatasetInfo, as the provider built it
    assert rows["mnist"]["info"] == open_source(MNIST).info()
    tok = rows["tok"]["info"]
    assert (tok["kind"], tok["seq_len"], tok["vocab_size"], tok["dtype"]) == ("tokens", 8, 16, "uint16")

    table = busctl(router, state_dir, "datasets")
    assert table.returncode == 0, table.stderr
    text = table.stdout
    for words in (
        "mnist  (image)",
        f"prov-a at {a.endpoint}",
        f"prov-b at {b.endpoint}",
        MNIST,
        "train 600, val 120, test 120 (private",
        "(1, 28, 28) float32",
        "int64, 10 classes",
        "tok  (tokens)",
        "seq_len 8, vocab 16",
        "(9,) uint16",
    ):
        assert words in text, f"{words!r} missing from:\n{text}"


def test_datasets_with_no_provider_says_so(router, state_dir):
    out = busctl(router, state_dir, "datasets")
    assert out.returncode == 0 and "no provider is connected" in out.stdout
    assert json.loads(busctl(router, state_dir, "datasets", "--json").stdout) == []


# -- busctl fetch -------------------------------------------------------------------------------


def test_fetch_prints_what_a_trainer_receives(router, served, state_dir):
    out = busctl(router, state_dir, "fetch", "mnist", "--split", "val", "--indices", "3,7,9", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    want_x, want_y = open_source(MNIST).read("val", np.array([3, 7, 9]))
    assert got["indices"] == [3, 7, 9] and got["x_shape"] == [3, 1, 28, 28] and got["dtype"] == "float32"
    assert np.allclose(np.array(got["x"], np.float32), want_x) and got["y"] == want_y.tolist()

    table = busctl(router, state_dir, "fetch", "mnist", "--indices", "0:4")
    assert table.returncode == 0, table.stderr
    x, y = open_source(MNIST).read("train", np.arange(4))
    assert "mnist/train" in table.stdout and "4 samples, x (4, 1, 28, 28) float32, y (4,) int64" in table.stdout
    for i in range(4):  # one row per sample: index, label, min / mean / max
        row = next(line for line in table.stdout.splitlines() if line.strip("│ ").startswith(f"{i} "))
        assert f"{x[i].min():.4g}" in row and f"{x[i].max():.4g}" in row and f" {y[i]} " in row


def test_fetch_prints_tokens_as_integers_and_steps_through_ranges(router, served, state_dir):
    out = busctl(router, state_dir, "fetch", "tok", "--indices", "0:6:2,63")
    assert out.returncode == 0, out.stderr
    x, _ = open_source(TOKENS).read("train", np.array([0, 2, 4, 63]))
    assert "4 samples, x (4, 9) uint16" in out.stdout
    for i, row in zip([0, 2, 4, 63], x):
        assert f"{i}: " + " ".join(str(int(t)) for t in row) in out.stdout


def test_fetch_saves_npz_and_npy(router, served, state_dir, tmp_path):
    npz = tmp_path / "batch.npz"
    out = busctl(router, state_dir, "fetch", "mnist", "--indices", "10:14", "--out", str(npz))
    assert out.returncode == 0, out.stderr
    assert "written to" in out.stdout and "x, y and indices" in out.stdout
    x, y = open_source(MNIST).read("train", np.arange(10, 14))
    with np.load(npz) as saved:
        assert np.array_equal(saved["x"], x) and np.array_equal(saved["y"], y)
        assert saved["indices"].tolist() == [10, 11, 12, 13]
    npy = tmp_path / "tokens.npy"
    assert busctl(router, state_dir, "fetch", "tok", "--indices", "5", "--out", str(npy)).returncode == 0
    assert np.array_equal(np.load(npy), open_source(TOKENS).read("train", np.array([5]))[0])
    one_line_error(busctl(router, state_dir, "fetch", "tok", "--out", str(tmp_path / "x.csv")), ".npz", ".npy")


@pytest.mark.parametrize(
    "args, words",
    [
        (["mnist", "--indices", "0:x"], ["--indices", "'0:x' is not an index"]),
        (["mnist", "--indices", "1:2:3:4"], ["is not an index, A:B or A:B:STEP"]),
        (["mnist", "--indices", "0:8:0"], ["step cannot be 0"]),
        (["mnist", "--indices", "-3"], ["cannot be negative"]),
        (["mnist", "--indices", ""], ["no indices given"]),
        (["mnist", "--indices", "590:610"], ["590:610 reaches past the split's end (600 samples)"]),
        (["mnist", "--indices", "4,600"], ["index 600 is outside the split (0..599)", "mnist/train"]),
        (["mnist", "--indices", "5:5"], ["selects no samples"]),
        (["mnist", "--split", "holdout"], ["no split 'holdout'", "train, val, test"]),
        (["mnist", "--split", "test"], ["never leaves its provider", "SPLIT_PRIVATE"]),
        (["nope"], ["'nope' is not served by any provider", "mnist (prov-a)", "NOT_FOUND"]),
    ],
)
def test_fetch_errors_are_one_line(router, served, state_dir, args, words):
    one_line_error(busctl(router, state_dir, "fetch", *args), *words)


def test_fetch_of_the_test_split_is_refused_by_the_provider(router, served, state_dir):
    """The provider, not busctl, decides: the refusal is its SPLIT_PRIVATE, whatever the indices."""
    out = busctl(router, state_dir, "fetch", "mnist", "--split", "test", "--indices", "0:100000")
    one_line_error(out, "SPLIT_PRIVATE")
    refused = sum(p.service.handler.refused["split_private"] for p in served)
    assert refused == 1  # refused by a provider, once; no sample was read
    assert not any(p.service.handler.served.get("mnist", {}).get("batches") for p in served)


def test_parse_indices_concatenates_pieces_in_order():
    assert parse_indices("0:4", 10).tolist() == [0, 1, 2, 3]
    assert parse_indices("8:", 10).tolist() == [8, 9]
    assert parse_indices(":3,9,0:10:4", 10).tolist() == [0, 1, 2, 9, 0, 4, 8]
    assert parse_indices(" 3 , 7 ", 10).tolist() == [3, 7]
    assert parse_indices("0:100:50", 100).dtype == np.int64


# -- job spec: shuffle modes --------------------------------------------------------------------


def test_job_spec_accepts_shuffle_modes_and_bools():
    assert JobSpec.from_dict({"dataset": "d"}).shuffle == "full"
    assert JobSpec.from_dict({"dataset": "d"}).block_size == DEFAULT_BLOCK_SIZE
    assert JobSpec.from_dict({"dataset": "d", "shuffle": False}).shuffle == "none"
    assert JobSpec.from_dict({"dataset": "d", "shuffle": True}).shuffle == "full"
    spec = JobSpec.from_dict({"dataset": "d", "shuffle": "Block", "block_size": 256})
    assert (spec.shuffle, spec.block_size) == ("block", 256)
    assert JobSpec.from_dict(spec.to_dict()) == spec  # what the router stores reads back the same


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"shuffle": "random"}, "job field 'shuffle' must be none, full or block (or true/false), got 'random'"),
        ({"shuffle": 1}, "job field 'shuffle' must be none, full or block"),
        ({"block_size": 0}, "block_size must be at least 1"),
        ({"block_size": "big"}, "job field 'block_size' must be int"),
    ],
)
def test_job_spec_refuses_bad_shuffle_settings_naming_the_field(raw, words):
    with pytest.raises(BadRequest) as err:
        JobSpec.from_dict({"dataset": "d", **raw})
    assert words in str(err.value)


def test_submit_refuses_a_bad_shuffle_mode_in_one_line(router, state_dir):
    out = busctl(router, state_dir, "submit", "--dataset", "mnist", "--shuffle", "sideways")
    one_line_error(out, "job field 'shuffle'", "'sideways'", "BAD_REQUEST")
