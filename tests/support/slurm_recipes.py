"""What the tests of slurm/'s recipes share (tests/system/test_slurm.py, tests/system/test_slurm_requeue.py): the head node's
batchbus services that trainer tasks join (the ``cluster`` fixture), the environment recipes are submitted with,
the tokens an operator gives trainer tasks, and the checks on what the jobs trained.

Jobs are tests/support/jobs.py's MLP on mock://mnist?n=600 (2 epochs here), audited sample by sample.
"""

from __future__ import annotations

import contextlib
import stat
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.trainer.attempt.audit import effective_epochs

from .busctl import BUSCTL, REPO
from .cluster import Cluster
from .jobs import SPEC, JobCluster
from .slurm import SignedAdmin

__all__ = [
    "JOB",
    "LONG",
    "RECIPES",
    "HeadCluster",
    "assert_exactly_once",
    "assert_private",
    "assert_same_weights",
    "cluster",
    "joining_env",
    "recipe_env",
    "task_logs",
    "trainer_tokens",
]

RECIPES = REPO / "slurm"
JOB = {**SPEC, "epochs": 2}
#: The SIGTERM test's job: more, shorter steps than JOB's (300), so that a signal sent while it trains lands long
#: before its end.
LONG = {**JOB, "batch_size": 4}
#: What every service started by a recipe runs with here: one torch thread, fast heartbeats (2 cores, shared).
QUICK = {"BATCHBUS_TORCH_THREADS": "1", "BATCHBUS_HEARTBEAT_MS": "250", "BATCHBUS_PROGRESS_INTERVAL_S": "0.1"}


class HeadCluster(SignedAdmin, JobCluster):
    """The job tests' cluster on the default set-up (EdDSA): its state directory is the administrator's machine,
    the only one holding the signing key."""


@pytest.fixture(scope="module")
def cluster(slurm, tmp_path_factory):
    """A router and a provider running outside Slurm (a head node's services), which trainer tasks join."""
    bus = HeadCluster(tmp_path_factory.mktemp("bus"))
    bus.keygen(bus.state / "token.key")
    try:
        bus.start_router()
        bus.start_provider()
        bus.endpoint_of("provider")
        yield bus
    finally:
        bus.close()


def recipe_env(**extra: str) -> dict[str, str]:
    assert len(BUSCTL) == 1, "the recipes run the venv's busctl"
    return {**QUICK, "BB_BUSCTL": BUSCTL[0], **extra}


@contextlib.contextmanager
def task_logs(directory: Path) -> Iterator[None]:
    """A failure inside says what the Slurm tasks wrote (their ``*.out`` files under ``directory``)."""
    try:
        yield
    except AssertionError as err:
        outs = "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}" for p in directory.glob("*.out"))
        raise AssertionError(f"{err}\n{outs}") from err


def assert_private(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode & 0o077 == 0, f"{path} is mode {mode:o}"


def assert_exactly_once(audit: Path, job: str, train_digests: Counter) -> None:
    epochs = effective_epochs(audit, job)
    assert sorted(epochs) == list(range(JOB["epochs"]))
    for epoch, seen in epochs.items():
        assert seen == train_digests, f"epoch {epoch}: samples missing or repeated"


def assert_same_weights(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), f"{name} differs"


def trainer_tokens(head: Cluster, root: Path, *names: str) -> Path:
    """What the operator gives trainer tasks (slurm/README.md): ROOT/N, one ``busctl token node`` directory per
    trainer (the public key and its own token), made on the administrator's machine (``head``)."""
    for i, name in enumerate(names):
        head.busctl("token", "node", str(root / str(i)), "--role", "trainer", "--name", name, "--ttl", "3600")
    return root


def joining_env(head: Cluster, **extra: str) -> dict[str, str]:
    """The environment trainer tasks joining ``head``'s router are submitted with: its short heartbeats and
    audit directory, not its state directory (the administrator's, with the signing key)."""
    settings = {k: v for k, v in head.env.items() if k.startswith("BATCHBUS_") and k != "BATCHBUS_STATE_DIR"}
    return recipe_env(**settings, BB_ROUTER=head.endpoint, **extra)
