"""Where a stall comes from: the time a loader waits for data, split into provider queueing,
source read, each pipeline stage by name, transfer, and the slowest replica; from a script's
RemoteLoader (``loader.stall.breakdown()``, Prometheus) and in ``busctl job show`` of a real job.

Tests assert which part dominates, never a duration: the slow parts sleep (a user stage, an HTTP
server's delay), so they stay slow whatever else the machine is doing."""

from __future__ import annotations

import math
import re
import textwrap

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from libbus.errors import BadRequest
from libbus.loader.remote import RemoteLoader
from libbus.loader.stall import MAX_SECONDS, MAX_STAGES, MORE, PARTS, StallMeter, read_timing
from libbus.wire.frames import PROTOCOL, decode
from libbus.wire.messages import BatchResponse
from tests.support import Cluster
from tests.support.busctl import REPO
from tests.support.httpd import RangeServer
from tests.support.metrics import scrape

ALLOWED = ["tests.support.user_transforms"]


def slow_stage_pipeline(tmp_path, source: str = "mock://cifar10?n=200") -> str:
    """A pipeline whose ``augment`` stage sleeps per sample (tests/support/user_transforms.py:slow)."""
    path = tmp_path / "slow.toml"
    path.write_text(
        textwrap.dedent(f"""
        [[stages]]
        name = "images"
        source = {{ uri = "{source}" }}

        [[stages]]
        name = "jitter"
        input = "images"
        user = {{ function = "tests.support.user_transforms:jitter" }}

        [[stages]]
        name = "augment"
        input = "jitter"
        user = {{ function = "tests.support.user_transforms:slow" }}
        """)
    )
    return f"pipeline://{path}"


# -- the attribution, as documented in libbus/loader/stall.py ------------------------------------------


def test_a_wait_is_charged_from_the_arrival_backwards_and_adds_up():
    meter = StallMeter("d", "train")
    timing = {"queue": 3.0, "read": 1.0, "stages": {"decode": 1.0, "augment": 2.0}}
    # round trip 8: transfer 1 (8 - 7), then augment 2, decode 1, read 1, queue 3
    assert meter.attribute(2.5, 8.0, timing) == {"transfer": 1.0, "stage:augment": 1.5}
    assert meter.attribute(5.0, 8.0, timing) == {
        "transfer": 1.0,
        "stage:augment": 2.0,
        "stage:decode": 1.0,
        "read": 1.0,
    }
    # waited longer than the round trip: the request was sent after the loop began to wait
    assert meter.attribute(10.0, 8.0, timing) == {
        "transfer": 1.0,
        "stage:augment": 2.0,
        "stage:decode": 1.0,
        "read": 1.0,
        "queue": 3.0,
        "other": 2.0,
    }
    # a provider that gave no timing (older, or the split off on its request)
    assert meter.attribute(3.0, 2.0, None) == {"unsplit": 2.0, "other": 1.0}
    split = meter.breakdown()
    assert split["largest"] == "stage:augment" and math.isclose(sum(split["parts"].values()), 20.5)


def test_provider_parts_longer_than_the_round_trip_are_scaled_into_it():
    parts = StallMeter("d", "train").attribute(4.0, 4.0, {"queue": 4.0, "read": 2.0, "stages": {"s": 2.0}})
    assert "transfer" not in parts and parts == {"stage:s": 1.0, "read": 1.0, "queue": 2.0}


# -- attack: a provider (or a forged reply) sending absurd figures ------------------------------------


def forged_reply(timing_json: str) -> BatchResponse:
    """A BatchResponse decoded from raw header bytes, as a loader receives one from a peer."""
    head = f'{{"type": "BatchResponse", "id": 1, "shapes": [], "dtypes": [], "nbytes": 0, "timing": {timing_json}}}'
    reply = decode([PROTOCOL, head.encode()])
    assert isinstance(reply, BatchResponse)
    return reply


@pytest.mark.parametrize(
    "timing_json",
    [
        '{"queue": -5, "read": -1e300, "stages": {"s": -3}}',
        '{"queue": 1e308, "read": 1e308, "stages": {"s": 1e308}}',
        '{"queue": "NaN", "read": true, "stages": [1, 2]}',
        '{"queue": null, "read": {"x": 1}, "stages": {"": 5, "s": "fast"}}',
    ],
)
def test_absurd_timings_never_corrupt_the_meter(timing_json):
    meter = StallMeter("d", "train")
    reply = forged_reply(timing_json)
    meter.add(2.0, "p")
    parts = meter.attribute(2.0, 1.0, reply.timing)
    assert all(math.isfinite(v) and v >= 0 for v in parts.values())
    assert math.isclose(sum(parts.values()), 2.0)  # the split of a wait is that wait, whatever was said
    split = meter.breakdown()
    assert split["wait_s"] == 2.0 and all(math.isfinite(v) and v >= 0 for v in split["parts"].values())
    orjson.dumps(split)  # the progress report it goes into stays JSON


def test_a_timing_that_is_not_an_object_is_a_malformed_reply_and_no_timing_to_the_meter():
    for raw in ('"not a dict"', "[1e308, -1]", "1e308"):
        with pytest.raises(BadRequest, match="BatchResponse.timing must be an object"):
            forged_reply(raw)
        assert read_timing(orjson.loads(raw)) is None


def test_non_finite_and_negative_figures_count_as_nothing():
    assert read_timing({"queue": float("nan"), "read": float("inf"), "stages": {"a": -1.0, "b": 2.0}}) == (
        0.0,
        0.0,
        {"a": 0.0, "b": 2.0},
    )
    assert read_timing({"queue": 10 * MAX_SECONDS})[0] == MAX_SECONDS
    meter = StallMeter("d", "train")
    for bad in (float("nan"), float("inf"), -1.0):
        meter.add(bad, "p")
        meter.attribute(bad, bad, {"read": 1.0})
    assert meter.breakdown() == {"wait_s": 0.0, "parts": {}, "largest": None, "slowest": "p"}


def test_thousands_of_stage_names_are_bounded_per_reply_and_per_meter():
    meter = StallMeter("d", "train")
    names = {f"s{i}-" + "x" * 100: 1.0 for i in range(5000)}
    reply = forged_reply(orjson.dumps({"read": 0.0, "stages": names}).decode())
    assert len(read_timing(reply.timing)[2]) == MAX_STAGES
    for start in range(0, 5000, MAX_STAGES):  # replies each naming other stages
        chunk = dict(list(names.items())[start : start + MAX_STAGES])
        meter.attribute(1e6, 1e6, {"stages": chunk})
    parts = meter.breakdown()["parts"]
    stage_keys = [k for k in parts if k.startswith("stage:")]
    assert len(stage_keys) == MAX_STAGES + 1 and MORE in parts
    assert all(len(k) <= len("stage:") + 64 for k in stage_keys)
    registry = CollectorRegistry()
    registry.register(meter)
    series = generate_latest(registry).decode().count("batchbus_loader_data_wait_part_seconds_total{")
    assert series == len(parts) <= MAX_STAGES + 1 + len(PARTS)


# -- a script's RemoteLoader against a real provider --------------------------------------------------


def test_a_slow_stage_is_named_as_the_largest_part_on_a_scripts_loader(start_provider, make_token, tmp_path):
    provider = start_provider(f"aug={slow_stage_pipeline(tmp_path)}", user_modules=ALLOWED)
    with RemoteLoader("aug", provider=provider.endpoint, token=make_token(), batch_size=8, shuffle=False) as loader:
        assert len(list(loader)) > 4
        split = loader.stall.breakdown()
        text = _scrape(loader.stall)
    assert split["largest"] == "stage:augment", split
    assert split["slowest"] == provider.endpoint
    assert math.isclose(sum(split["parts"].values()), split["wait_s"], rel_tol=1e-6)
    parts = split["parts"]
    assert parts["stage:augment"] > max(v for k, v in parts.items() if k != "stage:augment")
    assert 'part="stage",split="train",stage="augment"' in text.replace('dataset="aug",', "")
    # the provider's side: its queueing and fill seconds per dataset
    stats = provider.service.handler.stats()["datasets"]["aug"]
    assert stats["fill_s"] > 0 and stats["queue_s"] >= 0


def test_a_slow_source_read_shows_as_read_not_as_a_stage(start_provider, make_token, tmp_path):
    """A pipeline over an HTTP source whose every request takes its time: the read is what the loop
    waits for, and the stages after it (one of them the sleeping one, made fast here) are not."""
    shards = tmp_path / "tok"
    shards.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        (shards / f"shard-{i:02d}.bin").write_bytes(rng.integers(0, 60000, 400).astype("<u2").tobytes())
    server = RangeServer(tmp_path)
    try:
        uri = f"{server.url}/tok/shard-{{00..03}}.bin?seq_len=15&token_bytes=2&retries=2&backoff=0.01&timeout=5"
        path = tmp_path / "read.toml"
        path.write_text(
            f'[[stages]]\nname = "tokens"\nsource = {{ uri = "{uri}" }}\n\n'
            '[[stages]]\nname = "tidy"\ninput = "tokens"\n'
            'user = { function = "tests.support.user_transforms:label_plus_one" }\n'
        )
        provider = start_provider(f"tok=pipeline://{path}", user_modules=ALLOWED)
        server.delay_s = 0.05  # every range request: a slow disk, a far bucket
        with RemoteLoader("tok", provider=provider.endpoint, token=make_token(), batch_size=8) as loader:
            assert len(list(loader)) > 4
            split = loader.stall.breakdown()
    finally:
        server.close()
    assert split["largest"] == "read", split
    assert split["parts"]["read"] > split["parts"].get("stage:tidy", 0.0)


def test_the_split_can_be_turned_off(start_provider, make_token, tmp_path):
    provider = start_provider(f"aug={slow_stage_pipeline(tmp_path)}", user_modules=ALLOWED)
    with RemoteLoader(
        "aug", provider=provider.endpoint, token=make_token(), batch_size=8, shuffle=False, stall_breakdown=False
    ) as loader:
        list(loader)
        split = loader.stall.breakdown()
    assert split["wait_s"] > 0 and split["parts"] == {} and split["largest"] is None


def _scrape(meter: StallMeter) -> str:
    registry = CollectorRegistry()
    registry.register(meter)
    return generate_latest(registry).decode()


# -- a real job: busctl job show -----------------------------------------------------------------------


def test_busctl_job_show_names_the_slow_stage_of_a_real_job(tmp_path):
    cluster = Cluster(
        tmp_path / "cluster",
        {
            "BATCHBUS_USER_MODULES": ",".join(ALLOWED),
            "BATCHBUS_ASSIGNED_ONLY": "false",
            # the provider imports the user stage's module as an operator's would: from its PYTHONPATH
            "PYTHONPATH": str(REPO),
        },
    )
    try:
        cluster.start_router()
        cluster.start("prov", "provider", "--dataset", f"aug={slow_stage_pipeline(tmp_path)}", ready=True)
        cluster.endpoint_of("prov")
        cluster.start_trainer("trainer-1", "--metrics-bind", "127.0.0.1:0")
        job = cluster.submit_spec({"dataset": "aug", "model": "mlp", "epochs": 1, "batch_size": 8})
        info = cluster.wait_end(job, timeout=180)
        assert info["state"] == "succeeded", f"{info.get('error')}\n{cluster.logs()}"
        split = info["progress"]["data_wait_split"]
        assert split["largest"] == "stage:augment", split
        shown = cluster.busctl("job", "show", job).stdout
        assert "data wait split: stage:augment" in shown, shown
        # and on the trainer's own Prometheus endpoint, the ended job's split by part
        url = re.search(r"metrics on (http://\S+)", (cluster.state / "trainer-1.log").read_text()).group(1)
        parts = {
            dict(labels)["part"]: v
            for (name, labels), v in scrape(url).items()
            if name == "batchbus_trainer_data_wait_part_seconds_total"
        }
        assert max(parts, key=parts.__getitem__) == "stage:augment", parts
        assert parts["stage:augment"] == pytest.approx(split["parts"]["stage:augment"], rel=1e-6)
    finally:
        cluster.close()


def test_top_and_job_show_lead_with_the_largest_part():
    from cli.tables import wait_split
    from cli.top import data_wait_cell

    split = {"wait_s": 10.0, "parts": {"read": 1.0, "stage:augment": 8.0, "transfer": 1.0}, "slowest": "p1"}
    assert wait_split(split) == "stage:augment 80%, read 10%, transfer 10%"
    assert wait_split({"parts": {}}) == "" and wait_split(None) == ""
    row = {"data_wait_pct": 42.0, "data_wait_slowest": "p1", "data_wait_split": split}
    assert data_wait_cell(row) == "42.0% (p1): stage:augment 80%, read 10%"


def test_the_trainer_exports_a_bounded_split_whatever_an_attempt_reports():
    """An attempt's progress comes from the process that runs the job's code: its split reaches the
    trainer's Prometheus labels only as finite, non-negative seconds under few, plain part names."""
    from services.trainer.service.app import add_parts
    from services.trainer.service.attempt_run import MAX_WAIT_PARTS, wait_parts

    hostile = {f"stage:s{i}": 1.0 for i in range(5000)}
    hostile.update({"read": math.nan, "queue": -3.0, "transfer": math.inf, 'x"}\n': 1.0, "ok": True, "q" * 500: 1.0})
    parts = wait_parts({"parts": hostile})
    assert len(parts) == MAX_WAIT_PARTS and all(name.startswith("stage:s") for name in parts)
    assert wait_parts({"parts": {"read": 2, "queue": 0.5}}) == {"read": 2.0, "queue": 0.5}
    for junk in (None, [], "parts", {"parts": [1, 2]}):
        assert wait_parts(junk) == {}
    total: dict[str, float] = {}
    for attempt in range(3):  # attempt after attempt of new names: the labels stay bounded, the seconds kept
        add_parts(total, {f"stage:a{attempt}-{i}": 1.0 for i in range(MAX_WAIT_PARTS)})
    assert len(total) == MAX_WAIT_PARTS + 1 and total["other"] == 2 * MAX_WAIT_PARTS
    assert sum(total.values()) == 3 * MAX_WAIT_PARTS
