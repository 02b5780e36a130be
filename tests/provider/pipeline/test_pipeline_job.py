"""A pipeline dataset through the real services: the epoch travels with each request, a job trains the
``cnn`` on augmented data, ``busctl queues`` shows the stages' counters moving while it runs, and
``busctl control`` reaches a stage."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from libbus.config import Settings
from libbus.constants import LOADER_INFLIGHT
from libbus.errors import Forbidden
from libbus.loader.remote import RemoteLoader
from libbus.wire.messages import BatchRequest, GetJob, StageControl, SubmitJob
from tests.support import busctl_in_process, scrape, value, wait_job

PIPELINE = """
seed = 7
chunk = 16
[[stages]]
name = "digits"
source = { uri = "mock://mnist?n=1000&noise=1" }
[[stages]]
name = "norm"
input = "digits"
normalize = { mean = [0.0], std = [1.5] }
[[stages]]
name = "crop"
input = "norm"
random_crop = { padding = 2 }
[[stages]]
name = "flip"
input = "crop"
flip = { p = 0.5 }
"""


@pytest.fixture
def pipeline_file(tmp_path):
    path = tmp_path / "aug.toml"
    path.write_text(PIPELINE)
    return path


@pytest.fixture
def busctl(router, state_dir):
    """``busctl ARGS`` in-process against the test's router: (exit code, stdout, stderr)."""
    env = {"BATCHBUS_ROUTER": router.endpoint, "BATCHBUS_STATE_DIR": str(state_dir)}
    return lambda *args: busctl_in_process(*args, env=env)


def stage_counters(busctl) -> dict[str, tuple[int, int, int]]:
    code, out, err = busctl("queues", "--json")
    assert code == 0, err
    counters = {}
    for service in json.loads(out).values():
        for stage in service.get("pipelines", {}).get("aug", {}).get("stages", []):
            counters[stage["name"]] = (stage["items_in"], stage["items_out"], stage["queue"]["put"])
    return counters


def test_the_loader_sends_its_epoch_so_augmentations_change_per_epoch_and_replay_exactly(
    start_provider, pipeline_file, make_token, busctl
):
    provider = start_provider(f"aug=pipeline://{pipeline_file}")
    kw = dict(
        provider=provider.endpoint,
        token=make_token("trainer"),
        batch_size=50,
        shuffle="none",
        shm=False,
        timeout_s=10.0,
    )
    with RemoteLoader("aug", **kw) as loader:
        first = [x.numpy().copy() for x, _ in loader]
        second = [x.numpy().copy() for x, _ in loader]
    assert len(first) == len(second) == 20
    changed = np.mean([(a != b).any(axis=(1, 2, 3)).mean() for a, b in zip(first, second)])
    assert changed > 0.8, f"epoch 1 should re-draw most crops and flips; {changed:.0%} changed"
    with RemoteLoader("aug", **kw) as loader:  # another process resuming at epoch 1 gets the same bytes
        loader.set_epoch(1)
        x, _ = next(iter(loader))
        assert x.numpy().tobytes() == second[0].tobytes()
    # busctl fetch --epoch shows what the trainer saw in that epoch
    code, out, err = busctl("fetch", "aug", "--indices", "0:4", "--epoch", "1", "--json")
    assert code == 0, err
    np.testing.assert_array_equal(np.array(json.loads(out)["x"], np.float32), second[0][:4])
    code, _, err = busctl("fetch", "aug", "--epoch", "-1")
    assert code == 2 and "epoch" in err  # typer: not in the range x>=0
    with RemoteLoader("aug", split="val", **kw) as loader:  # val is not augmented: equal every epoch
        a = [x.numpy().copy() for x, _ in loader]
        b = [x.numpy().copy() for x, _ in loader]
        assert all(u.tobytes() == v.tobytes() for u, v in zip(a, b))


def test_a_job_trains_the_cnn_on_a_pipeline_while_busctl_queues_shows_the_stages_move(
    router, start_provider, trainer, client_for, pipeline_file, busctl
):
    provider = start_provider(f"aug=pipeline://{pipeline_file}")
    name = provider.service.name
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(
        SubmitJob(
            spec={
                "dataset": "aug",
                "model": "cnn",
                "model_kwargs": {"width": 8},
                "epochs": 2,
                "batch_size": 32,
                "lr": 2e-3,
                "seed": 0,
            }
        )
    ).job
    # two reads of the stage counters while the job runs: every stage's must have moved in between
    deadline = time.monotonic() + 120
    while True:
        first = stage_counters(busctl)
        if first and min(c[0] for c in first.values()) > 0:
            break
        assert time.monotonic() < deadline, f"stage counters never moved: {first}"
        time.sleep(0.2)
    assert admin.request(GetJob(job=job)).job["state"] == "running"
    time.sleep(1.0)
    second = stage_counters(busctl)
    assert list(second) == ["digits", "norm", "crop", "flip"]
    for stage, (items_in, items_out, puts) in second.items():
        before = first[stage]
        assert items_in > before[0] and items_out > before[1] and puts > before[2], (stage, before, second[stage])
    code, table, _ = busctl("queues")
    assert code == 0 and f"{name}: pipeline aug" in table, table
    assert all(word in table for word in ("(requests)", "digits", "source", "random_crop", "flip")), table
    code, out, _ = busctl("datasets")
    assert code == 0 and (
        f"source     pipeline://{pipeline_file}" in out
        and "stages     mock://mnist?n=1000&noise=1 -> norm (normalize) -> crop (random_crop) -> flip (flip)" in out
    ), out

    done = wait_job(admin, job, timeout=180)
    assert done["state"] == "succeeded", done.get("error")
    result = done["result"]
    print(
        f"cnn on {pipeline_file.name}: val acc {result['val_accuracy']:.4f}, test acc "
        f"{result['test_accuracy']:.4f}, {result['samples_per_s']:.0f} samples/s, "
        f"data wait {result['data_wait_pct']:.0f}%"
    )
    # chance is 0.1; the data allows about 0.99 (test_idx_job); augmentation costs a little of it
    assert result["val_accuracy"] >= 0.85 and result["test_accuracy"] >= 0.85
    assert result["transport"] == "shm"  # the sink thread wrote every train batch into the trainer's ring

    # every train and val sample of both epochs went through every stage; the evaluation's test split too
    final = stage_counters(busctl)
    served = provider.service.handler.served["aug"]["samples"]
    # and at most inflight - 1 batches of 32 asked ahead by each loader after its last whole pass
    ahead = ((Settings().inflight or LOADER_INFLIGHT) - 1) * 32  # 0: the loader's own, kept for a local dataset
    assert 2 * (1000 + 200) <= served <= 2 * (1000 + 200) + 2 * ahead
    assert final["flip"][1] == served + 200, (final, served)  # + the 200-sample test split, evaluated here

    code, out, err = busctl("control", name, "crop", "get", "--json")
    assert code == 0, err
    got = json.loads(out)
    # both train epochs, and at most the batches the trainer's loader asked ahead of epoch 2
    assert 2 * 1000 <= got["result"].pop("items_since_anchor") <= 2 * 1000 + ahead
    assert got == {"dataset": "aug", "stage": "crop", "type": "random_crop", "result": {"seed": 7, "epoch": "request"}}
    code, out, err = busctl("control", name, "crop", "set", "seed=11", "epoch=3")
    assert code == 0, err
    assert "seed" in out and "11" in out and provider.service.handler.datasets["aug"].stage("crop").epoch == 3
    code, _, err = busctl("control", name, "crop", "reset")
    assert code == 0 and provider.service.handler.datasets["aug"].stage("crop").seed == 7
    code, out, err = busctl("control", name, "*", "set", "seed=5", "--json")
    assert code == 0 and set(json.loads(out)["result"]) == {"crop", "flip"}, err
    code, out, err = busctl("control", name, "*", "reset")
    assert code == 0 and f"{name} aug/crop reset:" in out and f"{name} aug/flip reset:" in out, err
    assert [s.seed for s in provider.service.handler.datasets["aug"].stages[2:]] == [7, 7]
    code, _, err = busctl("control", name, "cropp", "get")
    assert code == 1 and "no pipeline here has a stage 'cropp'; stages: aug/digits, aug/norm, aug/crop, aug/flip" in err
    code, _, err = busctl("control", name, "norm", "reset")
    assert code == 1 and "stage 'norm' (normalize) has no command 'reset'; it answers stats" in err
    code, _, err = busctl("control", "nobody", "crop", "get")
    assert code == 1 and f"no provider named 'nobody' is connected; providers: {name}" in err
    code, _, err = busctl("control", name, "crop", "set", "seed")
    assert code == 2 and "'seed' is not key=value" in err


def test_batch_requests_carry_the_epoch_and_prometheus_shows_each_stage(start_provider, pipeline_file, client_for):
    provider = start_provider(f"aug=pipeline://{pipeline_file}", metrics_bind="127.0.0.1:0", name="prov-p")
    trainer = client_for(provider.endpoint)

    def batch(epoch: int) -> bytes:
        reply = trainer.request(BatchRequest(dataset="aug", split="train", range=[0, 48], epoch=epoch))
        return bytes(reply.frames[0].buffer)

    assert batch(2) == batch(2) != batch(3)
    with pytest.raises(Forbidden, match="StageControl needs role admin"):
        trainer.request(StageControl(stage="flip", command="get"))
    admin = client_for(provider.endpoint, role="admin")
    detail = admin.request(StageControl(stage="flip", command="set", args={"seed": 1})).detail
    assert detail == {
        "dataset": "aug",
        "stage": "flip",
        "type": "flip",
        "result": {"seed": 1, "epoch": "request", "items_since_anchor": 0},
    }

    s = scrape(provider.service.metrics.url)
    me = dict(service="provider", name="prov-p", dataset="aug")
    for stage in ("digits", "norm", "crop", "flip"):
        assert value(s, "batchbus_stage_items_in_total", stage=stage, **me) == 3 * 48
        assert value(s, "batchbus_stage_items_out_total", stage=stage, **me) == 3 * 48
        assert value(s, "batchbus_stage_errors_total", stage=stage, **me) == 0
        assert value(s, "batchbus_stage_busy_seconds_total", stage=stage, **me) > 0
        assert value(s, "batchbus_stage_queue_put_total", stage=stage, **me) == 3 * 3  # chunks of 16
        assert value(s, "batchbus_stage_queue_capacity", stage=stage, **me) == 4
    assert value(s, "batchbus_stage_queue_get_total", stage="(requests)", **me) == 9
    assert value(s, "batchbus_stage_queue_size", stage="(requests)", **me) == 0
