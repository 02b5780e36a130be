"""batchbus under Slurm, for real: the recipes in slurm/ submitted with sbatch to a one-node slurmctld + slurmd of
this module's own (tests/support/slurm.py; skipped only where slurm-wlm and munge cannot be installed).

- the whole cluster in one allocation (slurm/batchbus-cluster.sbatch), its two tasks' trainers one gang, is ended
  mid-epoch as its time limit would end it, requeues itself and trains the job to a downloaded model;
- an array of two trainer tasks (slurm/batchbus-trainers.sbatch) joins a router running outside Slurm and drains
  its queue;
- the cluster recipe with HS256, chosen for one machine.

(`scancel --signal=TERM` of a trainer task, and its requeue: tests/system/test_slurm_requeue.py, a module of its own so
that the two run side by side.)

Tokens are EdDSA, the default set-up, everywhere but the last: while the services run, their environment and
command line (``/proc``) show that no provider or trainer holds or reaches what mints a token or acts as an
admin, and that no process has a token on its command line.

Jobs are tests/support/jobs.py's MLP on mock://mnist?n=600 (2 epochs here), audited sample by sample.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from libbus.connect.client import Client, Identity
from libbus.jobs.spec import JobSpec
from tests.support import Cluster
from tests.support.jobs import final_weights
from tests.support.slurm import (  # noqa: F401 - slurm: the fixture
    NODE,
    SignedAdmin,
    SlurmCluster,
    assert_no_token_on_a_command_line,
    assert_nothing_mints,
    service_processes,
    slurm,
)
from tests.support.slurm_recipes import (  # noqa: F401 - cluster: the fixture
    JOB,
    LONG,
    RECIPES,
    assert_exactly_once,
    assert_private,
    assert_same_weights,
    cluster,
    joining_env,
    recipe_env,
    task_logs,
    trainer_tokens,
)


class InsideCluster(SignedAdmin, Cluster):
    """An admin of the cluster a recipe runs inside its allocation (with the token the recipe minted for itself)."""


def submit_cluster(
    slurm: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    job_file: Path,
    env: dict,
    *sbatch: str,
) -> tuple[str, Path, InsideCluster]:
    """sbatch the cluster recipe on ``job_file``: its Slurm job id, its output file, and an admin of the
    cluster it starts (with the token the recipe mints for its own busctl steps, in ``BB_KEYS``)."""
    out = tmp_path / "slurm-%j.out"
    sid = slurm.sbatch(
        RECIPES / "batchbus-cluster.sbatch", *sbatch, f"--output={out}", args=(str(job_file),), env=env, cwd=tmp_path
    )
    inside = InsideCluster(Path(env["BB_STATE"]))
    inside.admin_token_file = Path(env["BB_KEYS"]) / "admin.token"
    return sid, Path(str(out).replace("%j", sid)), inside


def attach(inside: Cluster, endpoint: str) -> None:
    """Make ``inside``'s admin client talk to the router at ``endpoint`` (started by a recipe)."""
    inside.admin = Client(endpoint, Identity(role="admin", name="test-admin", token=inside.admin_token), timeout_s=10)


def detach(inside: Cluster) -> None:
    if inside.admin is not None:
        inside.admin.close()
        inside.admin = None


def wait_line(path: Path, line: str, slurm: SlurmCluster, sid: str, timeout: float = 60) -> None:  # noqa: F811
    """Wait until the Slurm job's output ``path`` has ``line``; fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and line in path.read_text()):
        fields = slurm.job(sid)
        assert fields["JobState"] in ("PENDING", "RUNNING"), f"{fields}\n{path.read_text()}"
        assert time.monotonic() < deadline, f"no {line!r} in {path}:\n{path.read_text()}"
        time.sleep(0.1)


# two start-ups of a whole cluster (router, provider, two trainers) and a gang's training: about 35 s here alone,
# twice that on this 2-core machine under other suites' load
@pytest.mark.timeout(240)
def test_whole_cluster_in_one_allocation_survives_its_end_and_trains_to_a_model(
    slurm,  # noqa: F811
    cluster,  # noqa: F811
    tmp_path,
    tmp_path_factory,
    train_digests,
):
    job_file = tmp_path / "job.toml"
    # (json's scalars are TOML's; the one table goes last)
    gang = {**JOB, "world_size": 2}  # both tasks' trainers train it together, ranks from the allocation
    scalars = "".join(f"{k} = {json.dumps(v)}\n" for k, v in gang.items() if not isinstance(v, dict))
    job_file.write_text(scalars + "[model_kwargs]\nhidden = 64\n")
    state, audit = tmp_path / "state", tmp_path / "audit"
    # the batch script's private directory (a node-local mktemp by default; here, where the test reads its admin
    # token from, outside the directory jobs are submitted from)
    keys = tmp_path_factory.mktemp("keys")
    env = recipe_env(
        BB_HOST="127.0.0.1",
        BB_DATASETS="mnist=mock://mnist?n=600",
        BB_STATE=str(state),
        BB_KEYS=str(keys),
        BATCHBUS_AUDIT_DIR=str(audit),
    )
    sid, log, inside = submit_cluster(slurm, tmp_path, job_file, env, "--ntasks=2", "--cpus-per-task=1")
    try:
        with task_logs(tmp_path):
            wait_line(log, "(restart 0)", slurm, sid)
            job = (state / "submitted").read_text().strip()
            attach(inside, (state / "router.ep").read_text().strip())
            inside.wait(job, lambda i: i["state"] == "running" and (i["progress"] or {}).get("step", 0) >= 1)
            # mid-epoch for sure: paused at once, after a step (the checks below take seconds on a loaded
            # machine, and a job left to train through them once ended before the pause could land)
            inside.control(job, "pause")
            # while it runs: the signing key is gone (every token minted), the admin's token is the batch
            # script's alone, and no provider or trainer holds or reaches either; no token is on a command line
            assert sorted(p.name for p in keys.iterdir()) == ["admin.token"]
            assert (keys / "admin.token").stat().st_mode & 0o077 == 0
            nodes = sorted((state / "nodes").iterdir())
            assert [n.name for n in nodes] == [f"provider-{sid}-{NODE}", f"trainer-{sid}-0", f"trainer-{sid}-1"]
            for node in nodes:
                assert sorted(p.name for p in node.iterdir()) == ["token", "token.pub"], node
                assert_private(node / "token")
            services = service_processes(state / "nodes")
            assert {env.get("BATCHBUS_STATE_DIR") for _, env in services.values()} == {str(n) for n in nodes}
            admin_token = inside.admin_token
            assert_nothing_mints(services, private=[keys], admin=[admin_token])
            assert_no_token_on_a_command_line([admin_token] + [(n / "token").read_text().strip() for n in nodes])
            # the allocation ends mid-epoch: what --signal=B:TERM@180 does
            slurm.run("scancel", "--batch", "--signal=TERM", sid)
            slurm.wait_job(sid, lambda f: f["JobState"] == "PENDING" and f["Restarts"] == "1", 60, "requeued")
            detach(inside)
            slurm.release(sid)
            # the next run: the router on the same job database, the job resumed from its checkpoint
            wait_line(log, "(restart 1)", slurm, sid)
            attach(inside, (state / "router.ep").read_text().strip())
            inside.control(job, "resume")  # (handed back while paused, it stayed paused)
            detach(inside)
            fields = slurm.wait_job(
                sid, lambda f: f["JobState"] not in ("PENDING", "RUNNING", "COMPLETING"), 90, "ended"
            )
        text = log.read_text()
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{text}"
        assert f"job {job} succeeded" in text and f"requeueing {sid}" in text, text
        # every token died with its run: the node directories and the admin's are gone, and so is the key
        assert not (state / "nodes").exists() and not list(keys.iterdir())
        assert not (state / "secret").exists() and not list(state.rglob("token.key"))
        # the job database outlived both runs: a router started on it afterwards tells the story (checking
        # tokens with a key pair of the test's own)
        inside.keygen(tmp_path / "inspect.key")
        inside.start_router()
        info = inside.job(job)
    finally:
        inside.close()
    assert info["state"] == "succeeded" and info["failures"] == 0, info["error"]
    reasons = [e["reason"] for e in info["events"]]
    assert any(r.startswith(f"handed back by trainer-{sid}-") for r in reasons), reasons
    gangs = [r for r in reasons if r.startswith("assigned to a gang of 2")]
    assert len(gangs) == 2 and all(f"trainer-{sid}-0" in r and f"trainer-{sid}-1" in r for r in gangs), reasons
    assert any("resumes from step" in r and "resumes from step 0," not in r for r in reasons), reasons
    assert_exactly_once(audit, job, train_digests)
    # the model came home, byte for byte what the trainer pushed to the router
    model = state / "model.safetensors"
    assert model.read_bytes() == (state / "artifacts" / job / "model.safetensors").read_bytes()
    weights = load_file(model)
    assert weights and all(bool(torch.isfinite(t).all()) for t in weights.values())
    # a provider and two trainers (one per task) joined; all stopped cleanly, both times
    joined = (state / "router.log").read_text()
    for name in (f"provider provider-{sid}-{NODE}", f"trainer trainer-{sid}-0", f"trainer trainer-{sid}-1"):
        assert f"{name} (pid" in joined, joined
    for line in ("bb-trainer stopped (srun exit 0)", "provider stopped (exit 0)", "router stopped (exit 0)"):
        assert text.count(line) == 2, text
    assert_private(state)


@pytest.mark.timeout(180)
def test_whole_cluster_with_hs256_chosen_for_one_machine(slurm, tmp_path, tmp_path_factory):  # noqa: F811
    """BB_TOKEN_ALG=HS256, the explicit choice for a single trusted machine: the secret sits in the batch script's
    private directory, read by the router and the provider only; the trainer gets its token and trains the job
    to a model."""
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        "".join(f"{k} = {json.dumps(v)}\n" for k, v in {**LONG, "epochs": 1}.items() if k != "model_kwargs")
    )
    state, keys = tmp_path / "state", tmp_path_factory.mktemp("keys")
    env = recipe_env(
        BB_HOST="127.0.0.1",
        BB_DATASETS="mnist=mock://mnist?n=600",
        BB_STATE=str(state),
        BB_KEYS=str(keys),
        BB_TOKEN_ALG="HS256",
    )
    sid, log, inside = submit_cluster(slurm, tmp_path, job_file, env, "--ntasks=1")
    with task_logs(tmp_path):
        wait_line(log, "(restart 0)", slurm, sid)
        attach(inside, (state / "router.ep").read_text().strip())
        try:
            inside.wait((state / "submitted").read_text().strip(), lambda i: i["state"] == "running")
        finally:
            detach(inside)
        assert sorted(p.name for p in keys.iterdir()) == ["admin.token", "secret"]
        assert_private(keys / "secret")
        services = service_processes(state / "nodes")
        # (a trainer's processes: the service, its attempt and fork server; they share its state directory)
        trainers = [
            pid for pid, (_, env) in services.items() if Path(env["BATCHBUS_STATE_DIR"]).name.startswith("trainer-")
        ]
        assert trainers and len(services) > len(trainers)  # (and the provider)
        for pid, (cmdline, env) in services.items():
            # the secret is the provider's (it checks trainers' tokens with it), never a trainer's
            assert (env.get("BATCHBUS_SECRET_FILE") == str(keys / "secret")) == (pid not in trainers), cmdline
        admin_token = (keys / "admin.token").read_text().strip()
        assert_nothing_mints({pid: services[pid] for pid in trainers}, private=[keys], admin=[admin_token])
        fields = slurm.wait_job(sid, lambda f: f["JobState"] not in ("PENDING", "RUNNING", "COMPLETING"), 120, "ended")
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{text}"
    assert load_file(state / "model.safetensors")
    assert not list(keys.iterdir()) and not (state / "nodes").exists() and not (state / "secret").exists()


def test_array_of_trainer_tasks_drains_the_queue(slurm, cluster, tmp_path, train_digests):  # noqa: F811
    jobs = [cluster.submit_spec(JOB) for _ in range(3)]
    env = joining_env(
        cluster,
        BB_TOKENS=str(trainer_tokens(cluster, tmp_path / "tokens", "drain-0", "drain-1")),
        BB_STATE=str(tmp_path / "trainers"),
        BB_IDLE_EXIT_S="3",
    )
    out = tmp_path / "task-%A_%a.out"
    array = slurm.sbatch(
        RECIPES / "batchbus-trainers.sbatch",
        "--array=0-1",
        "--cpus-per-task=1",
        f"--output={out}",
        env=env,
        cwd=tmp_path,
    )
    try:
        with task_logs(tmp_path):
            # the first job's trainer holds it, paused, until another task has taken the second: both tasks work
            # (paused once it trains: a trainer applies commands between batches)
            first = cluster.wait(
                jobs[0], lambda i: i["state"] == "running" and (i["progress"] or {}).get("step", 0) >= 1, timeout=60
            )["trainer"]
            assert cluster.control(jobs[0], "pause")["state"] == "paused"
            # (the other task may have trained the second job to its end already: 76 short steps)
            second = cluster.wait(jobs[1], lambda i: i["state"] in ("running", "succeeded"), timeout=60)["trainer"]
            assert cluster.control(jobs[0], "resume")["state"] == "running"
            infos = [cluster.wait_end(j, timeout=90) for j in jobs]
            # the queue drained, each task stops its trainer and ends by itself, without requeueing
            tasks = slurm.tasks(array)
            ended = [
                slurm.wait_job(jid, lambda f: f["JobState"] not in ("PENDING", "RUNNING", "COMPLETING"), 60, "ended")
                for jid in tasks
            ]
    finally:
        slurm.run("scancel", array)  # (nothing left to cancel unless the test failed)
    assert [i["state"] for i in infos] == ["succeeded"] * 3, [i["error"] for i in infos]
    names = {"drain-0", "drain-1"}  # the subjects of the tokens the operator made (array task N: BB_TOKENS/N)
    assert len(tasks) == 2 and {first, second} == names and {i["trainer"] for i in infos} <= names
    # the same job three times: the same model, every sample once per epoch
    reference = final_weights(infos[0])
    for info in infos[1:]:
        assert_same_weights(final_weights(info), reference)
    for job in jobs:
        assert_exactly_once(cluster.audit, job, train_digests)
    for fields in ended:
        assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), fields
    for out in tmp_path.glob("task-*.out"):
        text = out.read_text()
        assert "the queue is drained" in text and "trainers exited (0)" in text and "requeueing" not in text, text


def test_the_first_run_job_file_is_a_valid_job():
    """slurm/README.md's first run submits slurm/job.toml: it must be a job the router accepts."""
    spec = JobSpec.from_dict(tomllib.loads((RECIPES / "job.toml").read_text()))
    assert spec.dataset == "mnist" and spec.checkpoint_every > 0


def test_the_recipes_pass_shellcheck():
    assert shutil.which("shellcheck"), "this test checks slurm/*.sbatch with shellcheck: apt-get install shellcheck"
    recipes = sorted(str(p) for p in RECIPES.glob("*.sbatch"))
    out = subprocess.run(["shellcheck", *recipes], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
