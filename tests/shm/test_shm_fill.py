"""Ring slots filled on the provider's fill thread (services/provider/fillers.py), with a real
provider, real loaders and real shared memory: the bytes, the stale-slot refusal and errors reach
the trainer as on the loop's thread, and a closed provider leaves no thread. The server's wake-up
for deferred replies (libbus/serve/wakeup.py) is checked on its own."""

import os
import select
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from libbus.config import host_id
from libbus.errors import BadRequest, DatasetError
from libbus.loader.deliveries import ring_layout
from libbus.loader.remote import RemoteLoader
from libbus.order.epochs import epoch_order
from libbus.serve.wakeup import Wakeup
from libbus.wire.messages import AttachRing, BatchRequest, DatasetInfoRequest
from services.provider import fillers
from shm import Ring, SlotState


def fill_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fill")]


@pytest.fixture
def npy_dir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(5)
    np.save(tmp_path / "train_x.npy", rng.standard_normal((200, 3, 4, 4), dtype=np.float32))
    np.save(tmp_path / "train_y.npy", rng.integers(0, 10, 200).astype(np.int64))
    return tmp_path


@pytest.fixture
def fill_provider(start_provider, npy_dir, monkeypatch):
    """A provider that fills ring slots on its fill thread (the default needs 4 cores)."""
    monkeypatch.setattr(fillers, "FILL_THREAD", True)
    return start_provider(f"d=file://{npy_dir}?memory=ram&val_fraction=0")


class Spy:
    """The provider's source, recording on which thread each batch is written (and failing on demand)."""

    def __init__(self, source, fail_at: int = -1, during=None):
        self.source, self.fail_at, self.during = source, fail_at, during
        self.threads: list[str] = []

    def __getattr__(self, name):
        return getattr(self.source, name)

    def serve_into(self, split, indices, x, y, *, epoch=0):
        self.threads.append(threading.current_thread().name)
        if len(self.threads) - 1 == self.fail_at:
            raise DatasetError("train_x.npy: shrank under the provider (the test's planted failure)")
        if self.during is not None:
            self.during()
        self.source.serve_into(split, indices, x, y, epoch=epoch)


def test_ring_batches_filled_on_the_fill_thread_are_the_source_bytes(fill_provider, make_token, npy_dir):
    handler = fill_provider.service.handler
    spy = handler.datasets["d"] = Spy(handler.datasets["d"])
    want_x, want_y = np.load(npy_dir / "train_x.npy"), np.load(npy_dir / "train_y.npy")
    with RemoteLoader(
        "d", provider=fill_provider.endpoint, token=make_token(), batch_size=16, seed=2, inflight=4
    ) as loader:
        assert loader.transport == "shm"
        order = epoch_order(200, epoch=0, seed=2, shuffle=True)
        got = [(x.clone(), y.clone()) for x, y in loader]
    xs, ys = torch.cat([x for x, _ in got]).numpy(), torch.cat([y for _, y in got]).numpy()
    assert np.array_equal(xs, want_x[order]) and np.array_equal(ys, want_y[order])
    # each batch filled once, and at most inflight - 1 asked ahead of epoch 1 before the loader closed
    assert len(got) <= len(spy.threads) <= len(got) + 3 and all(name.startswith("fill") for name in spy.threads)
    assert len(got) <= handler.served["d"]["shm_batches"] <= len(got) + 3
    # the loader removed its ring: the provider unmaps it, on the fill thread after its fills
    deadline = time.monotonic() + 5
    while handler.rings:
        assert time.monotonic() < deadline, "provider still maps a ring its trainer removed"
        time.sleep(0.1)


def test_an_error_on_the_fill_thread_reaches_the_loader_and_the_provider_serves_on(fill_provider, make_token):
    handler = fill_provider.service.handler
    handler.datasets["d"] = Spy(handler.datasets["d"], fail_at=3)
    with RemoteLoader("d", provider=fill_provider.endpoint, token=make_token(), batch_size=16, inflight=4) as loader:
        with pytest.raises(BadRequest, match="shrank under the provider"):  # its code, BAD_REQUEST
            for _ in loader:
                pass
        assert len(list(loader)) > 0  # the next pass is served (the failure was one batch)


def test_a_slot_requested_again_during_its_fill_is_refused_not_marked_filled(fill_provider, client_for):
    client = client_for(fill_provider.service.handler.local_endpoint, host_id=host_id())
    info = client.request(DatasetInfoRequest(dataset="d")).info
    ring = Ring.create(ring_layout(info, 8, 2))
    try:
        lay = ring.layout
        client.request(
            AttachRing(name=ring.name, slots=lay.slots, slot_bytes=lay.slot_bytes, label_offset=lay.label_offset)
        )
        handler = fill_provider.service.handler
        # the trainer gives up on the request mid-fill and asks again (a resend: a new sequence)
        handler.datasets["d"] = Spy(handler.datasets["d"], during=lambda: ring.request(0))
        seq = ring.request(0)
        with pytest.raises(BadRequest, match="batch not written"):
            client.request(BatchRequest(dataset="d", split="train", range=[0, 8], slot=0, seq=seq))
        assert ring.state(0) is SlotState.REQUESTED and ring.seq(0) != seq
        assert handler.refused["stale_slot"] == 1
    finally:
        ring.close()


def test_a_stopped_provider_leaves_no_fill_thread(fill_provider, make_token):
    with RemoteLoader("d", provider=fill_provider.endpoint, token=make_token(), batch_size=50) as loader:
        assert sum(1 for _ in loader) == 4
        assert fill_threads()
    fill_provider.shutdown()  # the service closes its handler on the way out
    deadline = time.monotonic() + 5
    while fill_threads():
        assert time.monotonic() < deadline, f"left running: {fill_threads()}"
        time.sleep(0.05)


def test_the_wakeup_is_set_from_another_thread_cleared_and_harmless_once_closed():
    wake = Wakeup()
    assert select.select([wake.fd], [], [], 0)[0] == []
    threading.Thread(target=wake.set, args=(object(),)).start()  # as a Future's done callback
    assert select.select([wake.fd], [], [], 5)[0] == [wake.fd]
    wake.set()
    wake.clear()  # one read takes every set
    assert select.select([wake.fd], [], [], 0)[0] == []
    fd = wake.fd
    wake.close()
    wake.set()  # a Future finishing after its server stopped: nothing written anywhere
    wake.clear()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_wakeup_with_nothing_pending_is_cleared_not_spun_on(router):
    """A Future that finishes while the loop is already sending it sets the wake-up after the loop
    looked; with nothing left pending, the loop must still clear it, or its poll never waits again."""
    server = router.service.server
    server._wake.set()
    deadline = time.monotonic() + 5
    while select.select([server._wake.fd], [], [], 0)[0]:
        assert time.monotonic() < deadline, "the loop left its wake-up set: every poll returns at once"
        time.sleep(0.02)
    assert not server._pending
