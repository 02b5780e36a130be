"""``busctl datasets`` and ``busctl fetch`` show named fields (``?`` a varying dimension, ``*`` bytes/str),
in their own process against a real router and provider."""

import json

import numpy as np

from services.provider.sources import open_source
from tests.support import busctl as run_busctl

FIELDS = "mock://fields?n=30"


def busctl(router, state_dir, *args):
    return run_busctl(
        *args,
        "--router",
        router.endpoint,
        "--state-dir",
        str(state_dir),
        timeout=60,
        env={"BATCHBUS_REQUEST_TIMEOUT_S": "5", "BATCHBUS_REQUEST_RETRIES": "0"},
    )


def test_datasets_and_fetch_show_every_field(router, start_provider, state_dir, tmp_path):
    start_provider(f"multi={FIELDS}", "mnist=mock://mnist?n=100")
    out = busctl(router, state_dir, "datasets")
    assert out.returncode == 0, out.stderr
    assert "fields     image uint8 (?, ?, 3), tokens int32 (?,), text str *, label int64 ()" in out.stdout
    assert "fields     x float32 (1, 28, 28), y int64 ()" in out.stdout and "samples    (1, 28, 28)" in out.stdout

    out = busctl(router, state_dir, "fetch", "multi", "--indices", "0:3", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["fields"]
    want = open_source(FIELDS).read_fields("train", np.arange(3))
    assert got["text"] == want["text"] and got["label"] == want["label"].tolist()
    assert got["image"] == [a.tolist() for a in want["image"]] and got["tokens"] == [a.tolist() for a in want["tokens"]]

    out = busctl(router, state_dir, "fetch", "multi", "--indices", "1")
    assert out.returncode == 0, out.stderr
    h, w, _ = want["image"][1].shape
    assert f"({h}, {w}, 3)" in out.stdout and repr(want["text"][1])[:20] in out.stdout

    out = busctl(router, state_dir, "fetch", "multi", "--indices", "1", "--out", str(tmp_path / "a.npz"))
    assert out.returncode == 2 and "use --json" in out.stderr and "Traceback" not in out.stderr
