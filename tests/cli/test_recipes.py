"""The recipes in examples/, run as a user runs them (real processes, a real provider), each killed
with SIGKILL mid-epoch and resumed: every epoch must train on every sample exactly once.

They need the ``recipes`` extra (``make install`` installs it); without it they are skipped, saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.support import REPO

EXAMPLES = REPO / "examples"
N = 48  # samples in the train split: 2 and 3 ranks split it evenly


@pytest.fixture
def ids_provider(start_provider, tmp_path_factory):
    """A provider of ``ids``: train sample i is ``[i, i % 5]`` (its id in the first feature)."""
    d = tmp_path_factory.mktemp("ids")
    for split, n in (("train", N), ("val", 6), ("test", 5)):
        i = np.arange(n)
        np.save(d / f"{split}_x.npy", np.stack([i, i % 5], axis=1).astype(np.float32))
        np.save(d / f"{split}_y.npy", (i % 2).astype(np.int64))
    return start_provider(f"ids=file://{d}")


def run(script: str, ckpt: Path, env: dict, die_at: int = 0, launcher: list[str] | None = None) -> str:
    """Run a recipe to its end, or (``die_at``) until it kills itself with SIGKILL; its output."""
    # PYTHONFAULTHANDLER: a rank that dies in native code (one 3-rank resume under load ended with
    # "terminate called without an active exception", SIGABRT, no traceback) prints every thread's stack
    env = {**env, "RECIPE_DIE_AT": str(die_at), "PYTHONFAULTHANDLER": "1"}
    cmd = [*(launcher or [sys.executable]), str(EXAMPLES / script), str(ckpt)]
    done = subprocess.run(cmd, env=env, cwd=EXAMPLES, capture_output=True, text=True, timeout=180)
    output = done.stdout[-3000:] + done.stderr[-3000:]
    if die_at == 0:
        # a rank's own traceback comes before torchrun's report of it: show its start too, not only the tail
        assert done.returncode == 0, done.stderr[:8000] + "\n[...]\n" + output
    else:  # killed, by itself: python's own -9, or torchrun's report of a rank's
        assert done.returncode == -9 or "Signal 9 (SIGKILL)" in output or "exitcode  : -9" in output, output
    return output


def ledgers(ckpt: Path) -> dict[int, Counter]:
    """Per epoch, how many times each sample was trained on (over every rank's ledger)."""
    out: dict[int, Counter] = {}
    for path in ckpt.glob("ledger*.txt"):
        for line in path.read_text().splitlines():
            epoch, sample = map(int, line.split())
            out.setdefault(epoch, Counter())[sample] += 1
    return out


def assert_exactly_once(ckpt: Path, epochs: int = 2) -> None:
    seen = ledgers(ckpt)
    assert sorted(seen) == list(range(epochs))
    for epoch, counts in seen.items():
        assert sorted(counts) == list(range(N)), f"epoch {epoch}: samples missing"
        assert set(counts.values()) == {1}, f"epoch {epoch}: samples trained on twice"


@pytest.fixture
def env(ids_provider, make_token):
    return {
        **os.environ,
        "BATCHBUS_PROVIDER": ids_provider.endpoint,
        "BATCHBUS_TOKEN": make_token(),
        "BATCHBUS_DATASET": "ids",
        "PYTHONPATH": str(REPO),
    }


def test_torchdata_stateful_dataloader_resumes_exactly_after_a_kill(env, tmp_path):
    pytest.importorskip("torchdata", reason="needs the recipes extra (pip install -e '.[recipes]')")
    run("stateful_dataloader.py", tmp_path, env, die_at=5)
    assert (tmp_path / "ckpt.pt").exists()
    run("stateful_dataloader.py", tmp_path, env)
    assert_exactly_once(tmp_path)


def test_ddp_under_torchrun_without_rank_arguments_resumes_at_other_world_sizes(env, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    # killed mid-epoch 0 on two ranks (checkpoint at step 3: 24 of 48 samples read), resumed on three
    run("ddp_torchrun.py", tmp_path, env, die_at=5, launcher=[*torchrun, "2"])
    run("ddp_torchrun.py", tmp_path, env, launcher=[*torchrun, "3"])
    assert_exactly_once(tmp_path)
    assert {p.name for p in tmp_path.glob("ledger*.txt")} >= {"ledger-w2-r0.txt", "ledger-w3-r2.txt"}


def test_lightning_trainer_with_a_datamodule_resumes_exactly_after_a_kill(env, tmp_path):
    pytest.importorskip("lightning", reason="needs the recipes extra (pip install -e '.[recipes]')")
    run("lightning_datamodule.py", tmp_path, env, die_at=5)
    assert (tmp_path / "last.ckpt").exists()
    run("lightning_datamodule.py", tmp_path, env)
    assert_exactly_once(tmp_path)


def test_accelerate_with_the_loader_registered_for_checkpointing_resumes_exactly(env, tmp_path):
    pytest.importorskip("accelerate", reason="needs the recipes extra (pip install -e '.[recipes]')")
    run("accelerate_prepare.py", tmp_path, env, die_at=5)
    run("accelerate_prepare.py", tmp_path, env)
    assert_exactly_once(tmp_path)
