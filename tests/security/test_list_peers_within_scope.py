"""An administrator limited to one tenant's datasets lists only that tenant's part of the cluster:
``ListPeers`` gives a dataset-scoped admin the providers serving its datasets (naming only those)
and the sessions whose scopes lie inside its own, not another tenant's datasets, endpoints or
trainers; an unrestricted admin still sees everyone."""

from __future__ import annotations

import time

from libbus.wire.messages import ListPeers, Resolve, Stats


def test_a_scoped_admin_sees_only_its_tenants_peers(router, start_provider, client_for, make_token):
    ours = start_provider("a=mock://mnist?n=60")
    theirs = start_provider("b=mock://mnist?n=60")
    for tenant, dataset in (("tenant-a", "a"), ("tenant-b", "b")):
        trainer = client_for(router.endpoint, token=make_token("trainer", sub=tenant, datasets=[dataset]))
        assert trainer.request(Resolve(dataset=dataset)).providers  # a live session at the router
    # the attacker: tenant A's administrator asks for every peer
    scoped = client_for(router.endpoint, role="admin", token=make_token("admin", sub="admin-a", datasets=["a"]))
    peers = scoped.request(ListPeers()).peers
    text = repr(peers)
    assert theirs.endpoint not in text and "'b'" not in text and "tenant-b" not in text, peers
    providers = [p for p in peers if p["role"] == "provider"]
    assert [(p["endpoint"], p["datasets"]) for p in providers] == [(ours.endpoint, ["a"])]
    assert {p["subject"] for p in peers if p["role"] == "trainer"} == {"tenant-a"}
    # an unrestricted admin sees both tenants
    everyone = client_for(router.endpoint, role="admin", token=make_token("admin", sub="root")).request(ListPeers())
    subjects = {p["subject"] for p in everyone.peers}
    assert {"tenant-a", "tenant-b"} <= subjects
    assert {ours.endpoint, theirs.endpoint} <= {p.get("endpoint") for p in everyone.peers}


def test_an_admin_scoped_to_jobs_alone_sees_no_provider_in_peers_or_stats(
    router, start_provider, client_for, make_token
):
    """A jobs scope names no dataset: such an admin is shown no provider, its endpoint, datasets or
    counters."""
    provider = start_provider("a=mock://mnist?n=60")
    jobs_only = client_for(router.endpoint, role="admin", token=make_token("admin", sub="admin-j", jobs=["j1"]))
    peers = jobs_only.request(ListPeers()).peers
    assert not [p for p in peers if p["role"] == "provider"] and provider.endpoint not in repr(peers), peers
    assert {p["subject"] for p in peers} == {"admin-j"}  # itself: its own session is inside its scopes
    # nor in Stats, once the provider's heartbeat row is there for an unrestricted admin to see
    root = client_for(router.endpoint, role="admin", token=make_token("admin", sub="root"))
    deadline = time.monotonic() + 30
    while not any(row.get("role") == "provider" for row in root.request(Stats()).services.values()):
        assert time.monotonic() < deadline, "the provider's heartbeat never reached the router"
        time.sleep(0.1)
    rows = jobs_only.request(Stats()).services
    assert not [r for r in rows.values() if r.get("role") == "provider"], rows
