"""A provider's ``Stats`` shows a tenant's token the counters of its own datasets only: an admin
scoped to one dataset (a tenant's), asking the provider directly or the router (the provider's
heartbeat row), learns neither the names nor the reads of the other tenants' datasets the provider
serves; one scoped to jobs alone sees no dataset; the operator's unrestricted admin sees them all."""

from __future__ import annotations

import time

import orjson
import pytest

from libbus.wire.messages import BatchRequest, Stats


@pytest.fixture
def provider(start_provider):
    return start_provider("mnist=mock://mnist?n=200", "theirs-secret-project=dummy://?shape=2,3&n=100&classes=4")


def _stats(client) -> dict:
    return client.request(Stats()).services["provider"]


def test_a_tenant_sees_only_its_datasets_in_a_providers_stats(provider, client_for, make_token):
    operator = client_for(provider.endpoint, role="admin", token=make_token("admin", sub="operator"))
    for dataset in ("mnist", "theirs-secret-project"):  # both read, so both have counters
        operator.request(BatchRequest(dataset=dataset, split="train", range=[0, 2]))
    assert {"mnist", "theirs-secret-project"} <= set(_stats(operator)["datasets"])

    tenant = client_for(provider.endpoint, role="admin", token=make_token("admin", sub="t1", datasets=["mnist"]))
    shown = _stats(tenant)
    assert set(shown["datasets"]) == {"mnist"}, shown["datasets"]
    assert "theirs-secret-project" not in orjson.dumps(shown).decode()

    jobs_only = client_for(provider.endpoint, role="admin", token=make_token("admin", sub="t2", jobs=["j1"]))
    shown = _stats(jobs_only)
    assert shown["datasets"] == {} and "mnist" not in orjson.dumps(shown).decode(), shown


def test_every_per_dataset_row_is_cut_to_the_scope():
    """A remote dataset's reads and a pipeline's stages name their dataset too."""
    from libbus.security.auth import Claims
    from services.provider.metrics import stats_within_scope

    rows = {"mine": {"batches": 1}, "theirs": {"batches": 2}}
    stats = {"datasets": rows, "remote_reads": rows, "pipelines": rows, "evaluations_running": 0}
    claims = {"aud": "batchbus", "exp": 0.0, "iat": 0.0, "jti": "j"}
    tenant = Claims(sub="t1", role="admin", scopes={"datasets": ["mine"]}, **claims)
    cut = stats_within_scope(stats, tenant)
    assert all(set(cut[key]) == {"mine"} for key in ("datasets", "remote_reads", "pipelines")), cut
    assert cut["evaluations_running"] == 0 and stats["datasets"] is rows  # the service's own stats untouched
    assert stats_within_scope(stats, Claims(sub="op", role="admin", **claims)) == stats


def test_a_providers_row_at_the_router_is_cut_to_the_tenants_datasets(router, raw_dealer, client_for, make_token):
    """The router's ``Stats`` shows a tenant the heartbeat row of a provider serving its dataset: every
    per-dataset part of that row (a remote dataset's reads, a pipeline's stages) names its datasets only."""
    from libbus.wire.frames import decode
    from libbus.wire.messages import Heartbeat, Hello, encode

    rows = {"mine": {"batches": 1}, "theirs-secret-project": {"batches": 2}}
    provider = raw_dealer(router.endpoint)  # a provider serving both tenants' datasets, beating its stats
    caps = {"endpoint": "tcp://127.0.0.1:1", "datasets": {d: {} for d in rows}, "heartbeat": True}
    token = make_token("provider", sub="shared-provider")
    provider.send_multipart(encode(Hello(id=1, role="provider", name="shared", token=token, caps=caps)))
    assert provider.poll(10_000) and decode(provider.recv_multipart()).type == "Welcome"
    stats = {"datasets": rows, "remote_reads": rows, "pipelines": rows}
    provider.send_multipart(encode(Heartbeat(id=0, stats=stats)))
    operator = client_for(router.endpoint, role="admin", token=make_token("admin", sub="operator"))
    deadline = time.monotonic() + 30
    while "remote_reads" not in operator.request(Stats()).services.get("shared-provider", {}):
        assert time.monotonic() < deadline, "the provider's heartbeat never reached the router"
        time.sleep(0.1)
    tenant = client_for(router.endpoint, role="admin", token=make_token("admin", sub="t1", datasets=["mine"]))
    row = tenant.request(Stats()).services["shared-provider"]
    assert all(set(row[key]) == {"mine"} for key in ("datasets", "remote_reads", "pipelines")), row
