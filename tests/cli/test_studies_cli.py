"""busctl study / studies / submit --evaluate / job model --current as a user meets them: against a
real router, provider and trainer; wrong files refused in one line, with no traceback."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load as load_safetensors

from libbus.wire.messages import GetJob, SubmitJob
from tests.support import busctl, wait_job

STUDY = """
[base]
dataset = "mnist"
model = "mlp"
model_kwargs = { hidden = 32 }
epochs = 2
batch_size = 100
optimizer = "sgd"
evaluate = false
[space]
lr = { choice = [0.05, 0.1] }
[study]
trials = 2
concurrent = 2
sampler = "grid"
pruner = "asha"
"""


def admin_busctl(state_dir: Path, router: str, *args: str) -> subprocess.CompletedProcess:
    return busctl(*args, env={"BATCHBUS_STATE_DIR": str(state_dir), "BATCHBUS_ROUTER": router})


@pytest.mark.parametrize(
    "content, words",
    [
        ("[base\n", "not valid TOML"),
        (
            '[base]\ndataset = "mnist"\n[space]\nlr = { uniform = [0.1, 0.2] }\n[study]\nsampler = "annealing"\n',
            "sampler 'annealing' is unknown; expected one of random, grid, tpe",
        ),
    ],
)  # the other refusals: tests/router/test_studies.py, on the same check
def test_a_wrong_study_file_is_refused_in_one_line(tmp_path, content, words):
    path = tmp_path / "study.toml"
    path.write_text(content)
    out = admin_busctl(tmp_path, "tcp://127.0.0.1:9", "study", "submit", str(path))
    assert out.returncode == 2
    assert words in out.stderr and "Traceback" not in out.stderr


def test_study_commands_end_to_end(router, provider, trainer, state_dir, tmp_path):
    path = tmp_path / "study.toml"
    path.write_text(STUDY)
    out = admin_busctl(state_dir, router.endpoint, "study", "submit", str(path))
    assert out.returncode == 0, out.stderr
    study = out.stdout.strip()
    deadline = time.monotonic() + 90
    while True:
        info = json.loads(admin_busctl(state_dir, router.endpoint, "study", "show", study, "--json").stdout)
        if info["state"] != "running":
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.5)
    assert info["state"] == "complete"
    assert sorted(t["params"]["lr"] for t in info["trials"]) == [0.05, 0.1]  # the grid, each point once
    shown = admin_busctl(state_dir, router.endpoint, "study", "show", study).stdout
    assert f"best: trial {info['best']['number']} (job {info['best']['job']})" in shown
    listed = admin_busctl(state_dir, router.endpoint, "studies").stdout
    assert study in listed and "complete" in listed
    out = admin_busctl(state_dir, router.endpoint, "study", "stop", study)
    assert out.returncode == 1 and "already ended" in out.stderr
    out = admin_busctl(state_dir, router.endpoint, "study", "show", "s00000000")
    assert out.returncode == 1 and "no study" in out.stderr and "Traceback" not in out.stderr


def test_evaluate_a_model_file_and_download_a_current_model(router, provider, trainer, state_dir, tmp_path, client_for):
    admin = client_for(router.endpoint, role="admin")
    spec = {
        "dataset": "mnist",
        "model": "mlp",
        "model_kwargs": {"hidden": 32},
        "epochs": 300,
        "batch_size": 100,
        "evaluate": False,
    }
    job = admin.request(SubmitJob(spec=spec)).job
    deadline = time.monotonic() + 30
    while (admin.request(GetJob(job=job)).job.get("progress") or {}).get("step", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    now = tmp_path / "now.safetensors"
    out = admin_busctl(state_dir, router.endpoint, "job", "model", job, "--current", "-o", str(now))
    assert out.returncode == 0, out.stderr
    assert f"sha256 {hashlib.sha256(now.read_bytes()).hexdigest()}, step " in out.stdout
    admin_busctl(state_dir, router.endpoint, "job", "stop", job)
    assert wait_job(admin, job, 30)["state"] == "stopped"
    # the downloaded weights, scored by an evaluation task on the provider's test split
    out = admin_busctl(
        state_dir, router.endpoint, "submit", "--evaluate", "--model", str(now), "--dataset", "mnist", "--split", "test"
    )
    assert out.returncode == 0, out.stderr
    task = wait_job(admin, out.stdout.strip(), 60)
    assert task["state"] == "succeeded" and task["spec"]["task"] == "evaluate"
    assert task["result"]["model_sha256"] == hashlib.sha256(now.read_bytes()).hexdigest()
    assert task["result"]["test_n"] == 120 and 0 <= task["result"]["test_accuracy"] <= 1
    assert set(load_safetensors(now.read_bytes()))  # a loadable safetensors file
    out = admin_busctl(
        state_dir,
        router.endpoint,
        "submit",
        "--evaluate",
        "--model",
        str(tmp_path / "nope.safetensors"),
        "--dataset",
        "mnist",
    )
    assert out.returncode == 2 and "does not exist" in out.stderr
