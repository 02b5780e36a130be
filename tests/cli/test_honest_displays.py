"""What busctl shows of a job, a model and a score is true and says how to read it: a weights digest
beside the file's sha256 (equal for equal tensors, whatever job the file's metadata names), the
privacy noise's margin beside every private-test score, an evaluation task that shows only what it
did, the entrypoint a job runs, a module typo answered with "did you mean". Against a real router,
provider and trainer; busctl as a user runs it."""

from __future__ import annotations

import hashlib
import math
import os
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from cli.evaluate import describe
from libbus.errors import BadRequest
from libbus.jobs.weights import weights_digest
from libbus.wire.messages import SubmitJob
from services.provider.score_release import Release, margin
from services.usercode import closest_allowed, import_allowed, not_allowed
from tests.support import wait_job
from tests.support.busctl import REPO, busctl

ENTRY = "tests.support.entrypoints:linear_classifier"
EVALUATOR = "tests.support.evaluators:linear"


def test_equal_tensors_have_one_weights_digest_whatever_the_metadata():
    tensors = {"b": torch.arange(3, dtype=torch.float32), "a": torch.ones(2, 2, dtype=torch.float64)}
    one = save_safetensors(tensors, metadata={"job": "j0000000001", "step": "40"})
    two = save_safetensors(dict(reversed(tensors.items())), metadata={"job": "j0000000002", "step": "40"})
    assert hashlib.sha256(one).hexdigest() != hashlib.sha256(two).hexdigest()
    assert weights_digest(one) == weights_digest(two)
    for changed in (
        {**tensors, "b": torch.tensor([0.0, 1.0, 2.5])},  # a value
        {**tensors, "b": torch.arange(3, dtype=torch.float64)},  # a dtype
        {**tensors, "a": torch.ones(4, dtype=torch.float64)},  # a shape, the same bytes
        {"c": tensors["b"], "a": tensors["a"]},  # a name
    ):
        assert weights_digest(save_safetensors(changed)) != weights_digest(one)
    for bad in (b"", b"\x05\x00\x00\x00\x00\x00\x00\x00{}", one[:-4]):
        try:
            weights_digest(bad)
        except ValueError as err:
            assert "not a safetensors file" in str(err)
        else:
            raise AssertionError(f"{bad[:12]!r} was taken for safetensors")


def test_the_noise_margin_holds_95_percent_of_released_scores():
    """margin() is the released value's distance from the exact one at 95%: checked against the
    release's own noise, over many questions (each seeded by its question)."""
    release = Release(epsilon=0.1)
    exact, n = 0.5, 1000
    off = [abs(release(str(i).encode(), 1.0, exact, n, {}, b"k" * 32)[1] - exact) for i in range(4000)]
    within = float(np.mean(np.array(off) <= margin("accuracy", n, 0.1)))
    assert 0.93 <= within <= 0.97, within
    assert math.isclose(margin("accuracy", n, 0.1), math.log(20) / (n * 0.1) + 0.0005)
    assert margin("loss", n, 0.1) > margin("accuracy", n, 0.1)  # the loss's range is 10, not 1
    assert margin("accuracy", n, 0.0) == 0.0


def test_job_eval_prints_the_margin_and_how_to_get_exact_scores():
    d = {"step": 7, "epoch": 1, "provider": "p", "test_accuracy": 0.946, "test_loss": 0.2, "test_n": 1000}
    d |= {"copy_ms": 1.0, "eval_s": 0.5}
    noised = describe("j0000000001", {**d, "test_epsilon": 0.1})
    assert "test accuracy 0.9460 ± 0.0305 at 95%" in noised and "eval_epsilon = 0" in noised, noised
    exact = describe("j0000000001", {**d, "test_epsilon": 0.0})
    assert "test accuracy 0.9460 (exact)" in exact and "eval_epsilon" not in exact, exact


def test_a_module_typo_is_answered_with_did_you_mean():
    assert closest_allowed("tests.suport.entrypoints", ["tests.support.entrypoints"]) == "tests.support.entrypoints"
    assert closest_allowed("mylba.train", ["mylab."]) == "mylab.train"
    assert closest_allowed("os", ["mylab."]) is None
    said = not_allowed("entrypoint 'mylba.train:main'", "mylba.train", ["mylab."], "job_modules", "trainer")
    assert "Did you mean 'mylab.train'?" in said and "To allow it as it is" in said


def test_a_typo_inside_an_allowed_package_is_answered_with_did_you_mean():
    # the module's name, and the function's, misspelt under a package the trainer allows ("mylab.")
    with pytest.raises(BadRequest, match=r"did you mean 'tests.support.entrypoints'\?"):
        import_allowed("tests.support.entrypionts:counter", ["tests."], "entrypoint", "job_modules")
    with pytest.raises(BadRequest, match=r"has no 'countr'; did you mean tests.support.entrypoints:counter\?"):
        import_allowed("tests.support.entrypoints:countr", ["tests."], "entrypoint", "job_modules")
    with pytest.raises(BadRequest) as far:  # nothing close: no guess
        import_allowed("tests.support.zzzzzzzz:counter", ["tests."], "entrypoint", "job_modules")
    assert "did you mean" not in str(far.value)


def test_module_flags_are_in_start_help():
    assert "--job-modules" in busctl("start", "trainer", "-h", env={"COLUMNS": "200"}).stdout
    shown = busctl("start", "provider", "-h", env={"COLUMNS": "200"}).stdout
    assert "--evaluator-modules" in shown and "--eval-epsilon" in shown


def test_what_busctl_shows_of_an_entrypoint_job_its_model_and_an_evaluation_task(
    router, start_provider, entry_trainer, client_for, state_dir, tmp_path
):
    start_provider("mnist=mock://mnist?n=600", evaluator_modules=["tests.support.evaluators"], eval_epsilon=0.1)
    admin = client_for(router.endpoint, role="admin", timeout_s=10)
    env = {
        **os.environ,
        "BATCHBUS_STATE_DIR": str(state_dir),
        "BATCHBUS_ROUTER": router.endpoint,
        "PYTHONPATH": str(REPO),
        "COLUMNS": "250",
    }

    def run(*args: str, code: int = 0) -> str:
        out = busctl(*args, env=env, timeout=120)
        assert out.returncode == code and "Traceback" not in out.stderr, (args, out.stdout, out.stderr)
        return out.stdout + out.stderr

    spec = {"dataset": "mnist", "entrypoint": ENTRY, "evaluator": EVALUATOR, "batch_size": 32}
    job = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=120)
    assert job["state"] == "succeeded", job["error"]

    # the job: its weights digest, its test score with the noise's margin, the way to exact scores
    shown = run("job", "show", job["id"])
    digest = job["result"]["model"]["weights_digest"]
    assert f"weights digest {digest}" in shown, shown
    assert re.search(r"test accuracy \d\.\d{4} ± \d\.\d{4} at 95%", shown), shown
    assert "eval_epsilon = 0" in shown and "docs/security.md §9" in shown, shown
    # no made-up training loss (a released test loss may well read 0.0000: its noise, clipped at 0)
    assert not re.search(r"progress:.*loss 0\.0000", shown) and "epoch 0/" not in shown, shown
    watched = run("job", "watch", job["id"])
    assert "± " in watched and "at 95%" in watched and "val accuracy" not in watched, watched
    assert ENTRY in run("jobs")  # not the built-in model its spec holds by default

    # its model, downloaded to a name without the suffix: the same digest; other metadata, same digest
    path = tmp_path / "linear.weights"
    downloaded = run("job", "model", job["id"], "-o", str(path))
    assert f"weights digest {digest}" in downloaded, downloaded
    data = path.read_bytes()
    relabelled = save_safetensors(load_safetensors(data), metadata={"job": "j0123456789", "entrypoint": ENTRY})
    assert hashlib.sha256(relabelled).hexdigest() != hashlib.sha256(data).hexdigest()
    assert weights_digest(relabelled) == digest

    # an evaluation task with an evaluator: no --arch, no --split, the file job model wrote
    task_id = run("submit", "--evaluate", "--model", str(path), "--dataset", "mnist", "--evaluator", EVALUATOR)
    task = wait_job(admin, task_id.strip(), timeout=120)
    assert task["state"] == "succeeded", task["error"]
    shown = run("job", "show", task["id"])
    spec_line = next(line for line in shown.splitlines() if line.startswith("spec:"))
    assert "task=evaluate" in spec_line and f"evaluator={EVALUATOR}" in spec_line, spec_line
    assert not re.search(r"\b(model|optimizer|lr|epochs)=", spec_line), spec_line
    assert "val accuracy" not in shown and "± " in shown, shown
    watched = run("job", "watch", task["id"])
    assert "val accuracy" not in watched and "test accuracy" in watched, watched
    assert "evaluate uploaded file" in run("jobs")

    # what is neither a job id nor a readable safetensors file is refused, saying what --model takes
    refused = run("submit", "--evaluate", "--model", str(tmp_path / "nope"), "--dataset", "mnist", code=2)
    assert "not a job id" in refused and ".safetensors" in refused, refused
    notes = tmp_path / "notes.txt"
    notes.write_text("not weights")
    refused = run("submit", "--evaluate", "--model", str(notes), "--dataset", "mnist", "--split", "test", code=2)
    assert "notes.txt: not a safetensors file" in refused, refused
    # an architecture beside an evaluator would go unused: refused, not silently ignored
    refused = run("submit", "--evaluate", "--model", str(path), "--dataset", "mnist", "--evaluator", EVALUATOR,
                  "--arch", "cnn", code=2)  # fmt: skip
    assert "--arch" in refused and "--evaluator" in refused and "give one" in refused, refused

    # a typo in the entrypoint's module: refused at submit (the connected trainer told the router what
    # it can import), saying what was meant
    typo = {"dataset": "mnist", "entrypoint": "tests.suport.entrypoints:linear_classifier"}
    with pytest.raises(BadRequest, match=r"did you mean 'tests.support.entrypoints'\?"):
        admin.request(SubmitJob(spec=typo))
