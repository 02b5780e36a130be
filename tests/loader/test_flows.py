"""Flows: a loader spreads its requests to one provider over several connections.

A real provider on loopback TCP; the loader says it is on another host (``host_id``), so its batches
come over the socket as from a remote provider. Every epoch is checked byte for byte against the
dataset in the loader's order: a batch lost, duplicated or moved between flows fails the test. One
flow's connection is cut, or frozen, mid-epoch through a TCP proxy (:mod:`tests.support.tcpproxy`).
"""

from __future__ import annotations

import logging

import pytest

from libbus.config import load_settings
from libbus.errors import BadRequest, ConfigError
from libbus.loader.flows import FLOW_BATCH_BYTES, auto_flows, batch_bytes
from libbus.loader.remote import RemoteLoader
from tests.support.epochs import URI, assert_exact_epoch, read_epoch
from tests.support.tcpproxy import TcpProxy

REMOTE = "another-host"  # a host id that is not this machine's: the provider counts as remote


def live_flows(loader: RemoteLoader) -> list[int]:
    return sorted(r.flow for r in loader.replicas if r.up)


@pytest.fixture
def mnist(start_provider):
    return start_provider(f"mnist={URI}", name="provider-a")


@pytest.mark.parametrize("flows", [2, 3])
def test_every_sample_once_in_order_over_several_flows(mnist, make_token, flows):
    with RemoteLoader(
        "mnist",
        provider=mnist.service.endpoint,
        token=make_token(),
        batch_size=20,
        seed=3,
        inflight=4,
        flows=flows,
        host_id=REMOTE,
    ) as loader:
        assert loader.flows == flows and loader.transport == "socket"
        assert live_flows(loader) == list(range(flows))
        sockets = {id(r.client.socket) for r in loader.replicas}
        assert len(sockets) == flows  # each flow its own DEALER socket, its own connection
        for epoch in range(2):
            x, y = read_epoch(loader)
            assert_exact_epoch(loader, epoch, x, y)
        received = [r.received for r in loader.replicas]
    assert all(n > 0 for n in received), f"a flow carried nothing: {received}"
    assert sum(received) >= 60  # 30 batches a pass, each answered once
    # and at most inflight - 1 more: the next epoch's first batches, asked for ahead after a whole pass
    assert 60 <= mnist.service.handler.served["mnist"]["batches"] <= 60 + 3


def test_a_same_host_provider_keeps_one_flow_through_its_ring(mnist, make_token):
    with RemoteLoader(
        "mnist", provider=mnist.service.endpoint, token=make_token(), batch_size=20, seed=3, flows=2
    ) as loader:
        assert loader.transport == "shm"
        assert len(loader.replicas) == 1
        x, y = read_epoch(loader)
        assert_exact_epoch(loader, 0, x, y)
        ahead = loader.inflight - 1  # asked ahead for epoch 1, then closed
    assert 30 <= mnist.service.handler.served["mnist"]["shm_batches"] <= 30 + ahead


def test_the_default_is_one_flow_for_small_batches_and_two_for_large(start_provider, make_token):
    info = {"sample_shape": [3, 224, 224], "dtype": "uint8", "label_shape": [], "label_dtype": "int64"}
    assert batch_bytes(info, 32) == 32 * (3 * 224 * 224 + 8)
    assert auto_flows(info, 8, inflight=4) == 1  # 1.2 MB a batch
    assert auto_flows(info, 32, inflight=4) == 2  # 4.8 MB a batch
    assert auto_flows(info, 32, inflight=1) == 1  # a flow needs a request in flight of its own
    big = start_provider("big=dummy://?shape=3,224,224&n=64&dtype=uint8", name="provider-big")
    token = make_token()
    for batch_size, want in ((4, 1), (32, 2)):
        with RemoteLoader(
            "big", provider=big.service.endpoint, token=token, batch_size=batch_size, host_id=REMOTE
        ) as loader:
            assert (batch_bytes(loader.info, batch_size) >= FLOW_BATCH_BYTES) == (want == 2)
            assert loader.flows == want and live_flows(loader) == list(range(want))
            assert sum(len(x) for x, _ in loader) == 64


def test_flows_are_checked_where_they_are_set(mnist, make_token):
    with pytest.raises(BadRequest, match="inflight of at least 5"):
        RemoteLoader("mnist", provider=mnist.service.endpoint, token=make_token(), inflight=4, flows=5)
    with pytest.raises(BadRequest, match="flows must be"):
        RemoteLoader("mnist", provider=mnist.service.endpoint, token=make_token(), flows=-1)
    settings, sources = load_settings(env={"BATCHBUS_FLOWS": "2"})
    assert settings.flows == 2 and sources["flows"] == "env BATCHBUS_FLOWS"
    assert load_settings(env={})[0].flows == 0
    with pytest.raises(ConfigError, match="flows .env BATCHBUS_FLOWS. must be 0"):
        load_settings(env={"BATCHBUS_FLOWS": "9", "BATCHBUS_INFLIGHT": "4"})


# -- a flow that fails ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["cut", "frozen"])
def test_a_flow_dropped_mid_epoch_costs_no_batch(mnist, make_token, caplog, how):
    """One flow's connection is reset (or stops delivering) in the middle of an epoch: its requests
    go to the other flow, every batch arrives exactly once and in order, and the flow is opened
    again (a new connection) for the next pass."""
    caplog.set_level(logging.INFO, logger="libbus.loader.remote")
    with TcpProxy(mnist.service.endpoint) as proxy:
        with RemoteLoader(
            "mnist",
            provider=proxy.endpoint,
            token=make_token(),
            batch_size=20,
            seed=3,
            inflight=4,
            flows=2,
            host_id=REMOTE,
            timeout_s=1.5,
            retries=1,
        ) as loader:
            assert proxy.accepted == 2 and live_flows(loader) == [0, 1]

            def fail_second_flow(i: int) -> None:
                if i == 5:
                    (proxy.cut if how == "cut" else proxy.freeze)(1)

            x, y = read_epoch(loader, on_batch=fail_second_flow)
            assert_exact_epoch(loader, 0, x, y)
            assert proxy.accepted >= 3  # the failed flow came back on a connection of its own
            x, y = read_epoch(loader)
            assert_exact_epoch(loader, 1, x, y)
            assert live_flows(loader) == [0, 1]
    # A reset connection is seen lost (its monitor); or ZeroMQ reconnected the socket first, and the
    # provider no longer knows the new connection's session, or the requests the reset connection
    # carried go unanswered. A frozen one leaves its requests unanswered.
    seen = ("connection lost", "session expired", "no reply within") if how == "cut" else ("no reply within 1.5 s",)
    assert any(what in caplog.text for what in seen), caplog.text
