"""One trainer token on every rank: the README's DDP pattern — ``router=`` and one token
under ``torchrun`` — connects every time, launch after launch, and every launch reads one exact epoch
(disjoint shards that together hold every sample once). What must have one holder still has one: a
second trainer *service* under the same subject is refused, and a loader's session can neither take
work nor receive a trainer's commands."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from libbus.connect.client import Client, Identity
from libbus.errors import Forbidden, Unavailable
from libbus.wire.messages import CommandAck, ControlJob, GetJob, GetTask, ListPeers, Progress, Resolve, SubmitJob
from tests.support import REPO

N = 40  # samples in the train split: two ranks read 20 each
LAUNCHES = 5
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

SCRIPT = """
import os, sys
import torch.distributed as dist
from libbus import RemoteLoader

dist.init_process_group("gloo")
out, seed = sys.argv[1], int(sys.argv[2])
with RemoteLoader("ids", router=os.environ["BATCHBUS_ROUTER"], token=os.environ["BATCHBUS_TOKEN"],
                  batch_size=3, seed=seed) as loader:
    ids = [int(i) for x, _ in loader for i in x[:, 0].tolist()]
    with open(f"{out}/rank-{dist.get_rank()}.txt", "w") as f:
        f.write(" ".join(map(str, ids)))
dist.destroy_process_group()
"""


@pytest.fixture
def ids(start_provider, tmp_path_factory):
    """A provider of ``ids`` (sample i holds i in its first feature), serving scoped tokens only."""
    d = tmp_path_factory.mktemp("ids")
    for split, n in (("train", N), ("val", 6), ("test", 5)):
        i = np.arange(n)
        np.save(d / f"{split}_x.npy", np.stack([i, i % 3], axis=1).astype(np.float32))
        np.save(d / f"{split}_y.npy", (i % 2).astype(np.int64))
    return start_provider(f"ids=file://{d}", assigned_only=True)


def test_one_token_on_every_rank_under_torchrun_connects_every_launch_and_reads_one_exact_epoch(
    router, ids, make_token, tmp_path
):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    token = make_token("trainer", sub="team-a", datasets=["ids"])  # busctl token issue --role trainer --dataset ids
    env = {**os.environ, "BATCHBUS_ROUTER": router.endpoint, "BATCHBUS_TOKEN": token, "PYTHONPATH": str(REPO)}
    for launch in range(LAUNCHES):
        out = tmp_path / f"launch-{launch}"
        out.mkdir()
        cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(script), str(out), str(launch)]
        done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, f"launch {launch}: " + done.stdout[-3000:] + done.stderr[-3000:]
        shards = [[int(i) for i in (out / f"rank-{r}.txt").read_text().split()] for r in (0, 1)]
        assert [len(s) for s in shards] == [N // 2, N // 2], f"launch {launch}: {shards}"
        assert not set(shards[0]) & set(shards[1]), f"launch {launch}: the ranks' shards overlap"
        assert sorted(shards[0] + shards[1]) == list(range(N)), f"launch {launch}: not one exact epoch"


def _client(endpoint: str, token: str, *, host_id: str, loader: bool) -> Client:
    caps = {"loader": True} if loader else {}
    return Client(
        endpoint,
        Identity(role="trainer", name="copy", token=token, host_id=host_id, caps=caps),
        timeout_s=5,
        retries=0,
    )


def test_a_second_trainer_service_under_the_subject_is_still_refused_and_loaders_take_no_work(
    router, ids, client_for, make_token
):
    token = make_token("trainer", sub="team-a")
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "ids", "epochs": 1})).job
    service = client_for(router.endpoint, role="trainer", token=token, host_id="gpu-node")
    assert service.request(GetTask()).job == job
    # a loader of the same subject, in another process on another host: welcome, and it resolves
    loader = _client(router.endpoint, token, host_id="laptop", loader=True)
    attacker = _client(router.endpoint, token, host_id="elsewhere", loader=False)
    try:
        assert [p["endpoint"] for p in loader.request(Resolve(dataset="ids")).providers] == [ids.endpoint]
        kinds = sorted(p["kind"] for p in admin.request(ListPeers()).peers if p["subject"] == "team-a")
        assert kinds == ["loader", "trainer"], kinds  # operators tell them apart
        # ... but it is no trainer service: no work, no progress on the service's job
        for msg in (GetTask(), Progress(job=job, progress={"step": 1})):
            with pytest.raises(Forbidden, match="said Hello as a loader"):
                loader.request(msg)
        # a second trainer *service* under the subject: refused, as before (one holder of the lease)
        with pytest.raises(Unavailable, match="already connected"):
            attacker.hello()
        # a command goes to the service, never to the loader heard from last
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(admin.request, ControlJob(job=job, command="pause"))
            deadline = time.monotonic() + 10
            while not any(m.type == "Command" for m in service.pushes):
                assert time.monotonic() < deadline, "pause never pushed to the trainer service"
                loader.request(Resolve(dataset="ids"))  # the loader is the session heard from last
                service.recv(0.05)
            seq = next(m.seq for m in service.pushes if m.type == "Command")
            assert not [m for m in loader.pushes if m.type == "Command"]
            service.request(CommandAck(job=job, command="pause", seq=seq, state="paused"))
            assert asked.result(10).detail["acked"] is True
        assert admin.request(GetJob(job=job)).job["trainer"] == "team-a"
    finally:
        loader.close()
        attacker.close()
