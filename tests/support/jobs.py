"""A cluster for job tests: a router, a provider of ``mock://mnist?n=600`` and trainers as processes, tuned to
notice failures fast, with trainers that audit every sample they train on (services/trainer/attempt/audit.py)."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from libbus.loader.remote import RemoteLoader
from libbus.wire.messages import Resolve, Stats
from services.trainer.attempt.audit import digest

from .busctl import REPO
from .cluster import Cluster

__all__ = [
    "PLAIN",
    "SPEC",
    "EntryCluster",
    "JobCluster",
    "alone_fixture",
    "final_weights",
    "plain_fixture",
    "plain_trainer",
    "rank_batches",
    "wait_trained",
]

#: The job the job tests train: an MLP on mock://mnist?n=600, shuffle full, checkpoints every 10 steps.
SPEC = {
    "dataset": "mnist",
    "model": "mlp",
    "model_kwargs": {"hidden": 64},
    "epochs": 3,
    "batch_size": 16,
    "shuffle": "full",
    "seed": 5,
    "optimizer": "adam",
    "lr": 0.003,
    "evaluate": False,
    "checkpoint_every": 10,
}


class JobCluster(Cluster):
    """:class:`Cluster` with short heartbeats and leases, and an audit directory for its trainers."""

    def __init__(self, state: Path):
        self.audit = state / "audit"
        super().__init__(
            state,
            {
                "BATCHBUS_HEARTBEAT_MS": "250",
                "BATCHBUS_HEARTBEAT_LIVENESS": "10",
                "BATCHBUS_LEASE_S": "4",
                "BATCHBUS_PROGRESS_INTERVAL_S": "0.1",
                "BATCHBUS_AUDIT_DIR": str(self.audit),
                "BATCHBUS_REQUEST_TIMEOUT_S": "3",
                "BATCHBUS_REQUEST_RETRIES": "1",
                # a loader waits this long for a lost provider to come back before the attempt
                # fails (retryable); tests/system/test_replicas.py covers the wait itself
                "BATCHBUS_PROVIDER_WAIT_S": "2",
            },
        )
        self.provider_endpoint = ""

    def start_provider(self, bind: str = "tcp://127.0.0.1:0") -> None:
        """The provider of ``mnist`` (again, after a stop: same name); :meth:`endpoint_of` waits for it."""
        self.start("provider", "provider", "--bind", bind, "--dataset", "mnist=mock://mnist?n=600", ready=True)

    def start_killed_at(self, name: str, point: str, nth: int = 1) -> subprocess.Popen:
        """A trainer that SIGKILLs itself the ``nth`` time it reaches ``point`` (tests/killpoint.py)."""
        with open(self.state / f"{name}.log", "a") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.killpoint", point, str(nth), "--", "start", "trainer", "--name", name],
                env=self.env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self.adopt(name, proc)

    def submit(self, **changes) -> str:
        """Submit :data:`SPEC` with ``changes``; returns the job's id."""
        return self.submit_spec({**SPEC, **changes})

    def trained_batches(self, job: str, trainer: str) -> int:
        """Batches ``trainer`` has trained on for ``job`` so far (from its audit file)."""
        return sum(len(p.read_bytes().splitlines()) - 1 for p in self.audit.glob(f"{job}.{trainer}.*.jsonl"))

    def train_split(self, dataset: str = "mnist") -> tuple[np.ndarray, np.ndarray]:
        """Every train sample and label of ``dataset``, in index order, read straight from its provider."""
        deadline = time.monotonic() + 30
        while True:
            try:
                provider = self.admin.request(Resolve(dataset=dataset)).providers[0]["endpoint"]
                break
            except Exception:  # noqa: BLE001 - the provider is still registering
                assert time.monotonic() < deadline, "provider never registered"
                time.sleep(0.1)
        with RemoteLoader(
            dataset, provider=provider, token=self.admin_token, batch_size=1000, shuffle="none", copy=True
        ) as loader:
            x, y = next(iter(loader))
        return x.numpy(), y.numpy()

    def train_digests(self) -> Counter:
        """The multiset of every train sample's digest (services/trainer/attempt/audit.py)."""
        xs, ys = self.train_split()
        return Counter(digest(xs[i].tobytes(), ys[i].tobytes()) for i in range(len(xs)))

    def index_of_digest(self, dataset: str = "mnist") -> dict[str, int]:
        """The train split's sample index of each digest (every sample's bytes differ in mock://mnist)."""
        xs, ys = self.train_split(dataset)
        out = {digest(xs[i].tobytes(), ys[i].tobytes()): i for i in range(len(xs))}
        assert len(out) == len(xs), "the train samples are not all distinct"
        return out

    def wait_connected(self, names: tuple[str, ...], timeout: float = 60) -> None:
        """Until the router has heard from every trainer in ``names`` (so a gang gathers them all)."""
        deadline = time.monotonic() + timeout
        while not all(n in self.admin.request(Stats()).services for n in names):
            assert time.monotonic() < deadline, f"trainers {names} never connected\n{self.logs()}"
            time.sleep(0.2)


def rank_batches(cluster: JobCluster, job: str) -> dict[int, int]:
    """Batches each rank has trained on for ``job`` so far, over all its attempts, from the audit files
    (a line still being written, at the end of a running attempt's file, is not one yet)."""
    out: dict[int, int] = {}
    for path in cluster.audit.glob(f"{job}.*.jsonl"):
        lines = path.read_bytes().splitlines(keepends=True)
        records = [json.loads(line) for line in lines if line.endswith(b"\n")]
        if records:
            out[records[0]["rank"]] = out.get(records[0]["rank"], 0) + len(records) - 1
    return out


def wait_trained(cluster: JobCluster, job: str, batches: int, ranks: int = 1, timeout_s: float = 90.0) -> dict:
    """``job`` as it was once running, after each of its ``ranks`` ranks has trained ``batches`` batches,
    read from the audit files (flushed as each batch is trained). A progress report lags: it is up to its
    interval old when made, and delivered after the reports before it, so a job seen at step 3 in one may
    have run to its end before a command or a signal sent then lands."""
    info = cluster.wait(job, lambda i: i["state"] == "running", timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        counts = rank_batches(cluster, job)
        if len(counts) == ranks and min(counts.values()) >= batches:
            return info
        assert time.monotonic() < deadline, f"batches trained {counts}, never {batches} on each rank; {cluster.state}"
        time.sleep(0.05)


def final_weights(info: dict) -> dict[str, torch.Tensor]:
    """The weights a succeeded job pushed, checked against the digest its result names."""
    model = info["result"]["model"]
    assert hashlib.sha256(Path(model["path"]).read_bytes()).hexdigest() == model["sha256"]
    return load_file(model["path"])


class EntryCluster(JobCluster):
    """:class:`JobCluster` whose trainers allow the tests' entrypoints (tests/support/entrypoints.py),
    find hung attempts after 60 s of silence (a test of hangs starts its trainer with less: a loaded
    machine may keep a gang's rank in a collective for seconds, which is no hang) and give a stop 30 s.

    Leases are long (20 s) and the heartbeats :class:`JobCluster`'s: a trainer killed and restarted under
    its name is admitted once the killed one's session has expired (10 silent heartbeats, 2.5 s), and
    its job is given back at once then."""

    def __init__(self, state):
        super().__init__(state)
        self.env.update(
            BATCHBUS_LEASE_S="20",
            PYTHONPATH=str(REPO),
            BATCHBUS_JOB_MODULES="tests.support.entrypoints",
            BATCHBUS_ATTEMPT_SILENCE_S="60",
            BATCHBUS_STOP_GRACE_S="30",
        )


# -- a trainer the tests of a module take turns on ------------------------------------------------------

#: The plain trainer a module's tests share (a trainer's start-up, its fork server's torch import, is much of
#: a short test). Its module imports the ``plain`` and ``alone`` fixtures (:func:`plain_fixture`, :func:`alone_fixture`) and has a ``cluster`` fixture with
#: ``procs`` and ``start_trainer``.
PLAIN = "plain"


def plain_trainer(cluster) -> str:
    """:data:`PLAIN`, started unless it runs already: the tests that need any trainer take turns on it."""
    proc = cluster.procs.get(PLAIN)
    if proc is None or proc.poll() is not None:
        cluster.start_trainer(PLAIN)
    return PLAIN


@pytest.fixture(name="plain")
def plain_fixture(cluster) -> str:
    return plain_trainer(cluster)


@pytest.fixture(name="alone")
def alone_fixture(cluster) -> None:
    """This test's jobs go to the trainers it starts: the shared plain trainer is stopped first (the next
    test that asks for it starts it again)."""
    proc = cluster.procs.get(PLAIN)
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
