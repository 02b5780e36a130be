"""Slurm's SIGTERM to a trainer task, for real (slurm/batchbus-trainers.sbatch submitted with sbatch to a one-node
slurmctld + slurmd of this module's own, tests/support/slurm.py; skipped only where slurm-wlm and munge cannot be
installed): `scancel --signal=TERM` of a trainer task while its job trains (and while it is paused); the trainer
checkpoints and hands its job back, the task requeues itself, and its next run resumes the job at the next sample,
ending with the weights of an uninterrupted run. While it trains, no process of the task holds or reaches what
mints a token, and no process has its token on a command line.

A module of its own, apart from tests/system/test_slurm.py (the other recipes), so that the two run side by side: each
is minutes of Slurm tasks starting, training and ending on a loaded machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.jobs import final_weights
from tests.support.slurm import (  # noqa: F401 - slurm: the fixture
    assert_no_token_on_a_command_line,
    assert_nothing_mints,
    service_processes,
    slurm,
)
from tests.support.slurm_recipes import (  # noqa: F401 - cluster: the fixture
    LONG,
    RECIPES,
    assert_exactly_once,
    assert_same_weights,
    cluster,
    joining_env,
    task_logs,
    trainer_tokens,
)


def steps(info: dict) -> int:
    return (info["progress"] or {}).get("step", 0) if info["state"] == "running" else 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("when", ["training", "paused"])
def test_sigterm_then_requeue_resumes_exactly(slurm, cluster, tmp_path, train_digests, when):  # noqa: F811
    """Slurm's SIGTERM (``scancel --signal=TERM``, as before a time limit) reaches a trainer task whose job is
    training, batches flowing; the trainer checkpoints and hands the job back, the task requeues, and its next
    run ends the job with the weights of an uninterrupted run, every sample once per epoch. (``paused``: the
    same with the job paused when the signal comes, which must stay paused through the hand-back.)"""
    reference = cluster.submit_spec(LONG)
    victim = cluster.submit_spec(LONG)
    name = f"term-{when}"
    tokens = trainer_tokens(cluster, tmp_path / "tokens", name)
    env = joining_env(cluster, BB_TOKENS=str(tokens), BB_STATE=str(tmp_path / "trainers"))
    out = tmp_path / "task-%j.out"
    sid = slurm.sbatch(
        RECIPES / "batchbus-trainers.sbatch", "--cpus-per-task=1", f"--output={out}", env=env, cwd=tmp_path
    )
    log = Path(str(out).replace("%j", sid))
    try:
        with task_logs(tmp_path):
            # the uninterrupted run first (the queue is first come, first served)
            ref = cluster.wait_end(reference, timeout=150)
            assert ref["state"] == "succeeded", ref["error"]
            first = cluster.wait(victim, lambda i: steps(i) >= 1, timeout=60)
            trainer = first["trainer"]
            assert trainer == name
            # what the trainer holds: its public key and token, nothing that mints or acts as an admin, and no
            # token on a command line
            assert_nothing_mints(
                service_processes(tmp_path / "trainers"), private=[cluster.state / "token.key"], admin=[]
            )
            assert_no_token_on_a_command_line([(tokens / "0" / "token").read_text().strip()])
            if when == "paused":
                assert cluster.control(victim, "pause")["state"] == "paused"
            else:  # steps advancing (batches flowing) since the look above: the signal goes at once
                cluster.wait(victim, lambda i: steps(i) > steps(first), timeout=30)
            slurm.run("scancel", "--signal=TERM", sid)
            back = cluster.wait(victim, lambda i: any("handed back" in e["reason"] for e in i["events"]), timeout=60)
            if when == "paused":  # (a job handed back while paused stays paused until resumed)
                cluster.control(victim, "resume")
            else:
                assert back["state"] in ("queued", "running"), back  # (not paused, not ended)
            # the task requeued itself; Slurm holds a requeued job back for two minutes (BeginTime): release it
            slurm.wait_job(
                sid,
                lambda f: f["JobState"] == "PENDING" and f["Restarts"] == "1",
                30,
                "requeued",
                logs=log.read_text() if log.exists() else "",
            )
            assert cluster.job(victim)["state"] == "queued"
            slurm.release(sid)
            info = cluster.wait_end(victim, timeout=150)
    finally:
        slurm.run("scancel", sid)
    assert info["state"] == "succeeded", info["error"]
    assert info["failures"] == 0 and info["trainer"] == trainer  # the same task's next run: same subject
    back = next(e for e in info["events"] if "handed back" in e["reason"])
    assert back["reason"].startswith(f"handed back by {trainer}")
    # the next run resumed from the checkpoint written as the trainer stopped, mid-training, not from scratch
    reasons = [e["reason"] for e in info["events"]]
    resumed = [int(r.split("resumes from step ")[1].split(",")[0]) for r in reasons if "resumes from step" in r]
    assert resumed and resumed[-1] > 0 and resumed[-1] in {c["step"] for c in info["checkpoints"]}, reasons
    assert_same_weights(final_weights(info), final_weights(ref))
    assert_exactly_once(cluster.audit, victim, train_digests)
    text = log.read_text()
    assert "trainers exited (0)" in text and f"requeueing {sid}" in text and "restart 1" in text, text
