"""Following a study as a user does: ``busctl study watch`` draws its trials (state, params, last value,
best so far) until it ends, stops on Ctrl-C without a traceback and refuses an unknown study in one
line; a pruned trial shows the value it last reported (it had one: the pruner judged it) in ``busctl
study show``; each trial's metrics land in its own TensorBoard run folder under its study. Against real
router, provider and trainer processes."""

from __future__ import annotations

import re
import selectors
import signal
import subprocess

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from libbus.wire.messages import GetStudy
from tests.support.busctl import BUSCTL, REPO, interruptible, sigint_state
from tests.support.jobs import EntryCluster

#: tests/trainer/test_entrypoint_studies.py's study: eight trials of ``parabola`` one at a time, the median pruner
#: (seed 4 prunes some), each trial four epochs unless pruned.
STUDY = """
[base]
dataset = "mnist"
entrypoint = "tests.support.entrypoints:parabola"
evaluate = false
[base.params]
epochs = 4
[space.params]
x = { uniform = [0.0, 1.0] }
[study]
trials = 8
concurrent = 1
sampler = "random"
pruner = "median"
seed = 4
objective = "val_loss"
"""


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line ``proc`` prints (its stdout is a pipe), within ``timeout``."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout), f"nothing printed in {timeout:.0f} s"
    return proc.stdout.readline()


@pytest.mark.timeout(600)
def test_study_watch_follows_trials_and_a_pruned_trial_shows_its_last_value(tmp_path):
    cluster = EntryCluster(tmp_path / "state")
    board = tmp_path / "tb"
    cluster.env["BATCHBUS_TENSORBOARD_DIR"] = str(board)
    try:
        cluster.start_router()
        cluster.start_provider()
        cluster.endpoint_of("provider")
        cluster.start_trainer("trainer-s")

        unknown = cluster.busctl("study", "watch", "s00000000", check=False)
        assert unknown.returncode != 0 and "s00000000" in unknown.stderr, unknown.stderr
        assert "Traceback" not in unknown.stderr + unknown.stdout and len(unknown.stderr.splitlines()) == 1

        path = tmp_path / "study.toml"
        path.write_text(STUDY)
        study = cluster.busctl("study", "submit", str(path)).stdout.strip()

        # Ctrl-C while it runs: one line saying the study goes on, no traceback
        watch = subprocess.Popen(
            [*BUSCTL, "study", "watch", study],
            env=cluster.env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=interruptible,
        )
        try:
            first = read_line(watch, 120)
            assert re.search(r"trial 0 \((j[0-9a-f]{10}|no job)\) running: .*params\.x=", first), first
            taken = sigint_state(watch.pid)
            watch.send_signal(signal.SIGINT)
            out, err = watch.communicate(timeout=60)
        finally:
            watch.kill()
        assert watch.returncode == 130, (watch.returncode, err, f"SIGINT there: {taken}")
        assert f"stopped watching: study {study} goes on" in err and "Traceback" not in err + out, err

        # followed to its end: every trial's end, the study as show prints it, exit 0 (complete)
        done = cluster.busctl("study", "watch", study, timeout=420)
        info = cluster.admin.request(GetStudy(study=study)).study
        assert info["state"] == "complete", info
        pruned = [t for t in info["trials"] if t["state"] == "pruned"]
        assert pruned and all(t["value"] is None and t["reports"] for t in pruned), info["trials"]
        for t in info["trials"]:
            assert re.search(rf"trial {t['number']} \({t['job']}\) {t['state']}: ", done.stdout), (t, done.stdout)
        best = info["best"]
        assert f"best: trial {best['number']} (job {best['job']}) val_loss {best['value']:.4f}" in done.stdout

        # a pruned trial shows the value it last reported, marked as such, in watch and in show
        show = cluster.busctl("study", "show", study).stdout
        for t in pruned:
            epoch = max(int(e) for e in t["reports"])
            last = t["reports"][str(epoch)]
            assert f"trial {t['number']} ({t['job']}) pruned: val_loss {last:.4f} at epoch {epoch}" in done.stdout
            row = next(line for line in show.splitlines() if line.split()[:2] == [str(t["number"]), t["job"]])
            assert f"{last:.4f}*" in row, row
        assert "* its last reported value" in show
        for t in info["trials"]:
            if t["state"] == "complete":
                row = next(line for line in show.splitlines() if line.split()[:2] == [str(t["number"]), t["job"]])
                assert f"{t['value']:.4f} " in row and "*" not in row, row

        # each trial's TensorBoard run is its own, under its study: the epochs it reported
        for t in info["trials"]:
            run = board / study / f"trial-{t['number']}"
            events = EventAccumulator(str(run), size_guidance={"scalars": 0})
            events.Reload()
            got = {e.step: e.value for e in events.Scalars("epoch/val_loss")}
            assert got == pytest.approx({int(e): v for e, v in t["reports"].items()}), (t, got)
        assert not list(board.glob("j*")), "a trial's run outside its study's folder"
    finally:
        cluster.close()
