"""Same-host delivery through shared memory, with real processes, real sockets and real /dev/shm.

The ring's slot protocol (a slot in use is never written), what a provider refuses to attach, the
loader's fast path and its fall-back to sockets, and clean-up of a killed trainer's ring.
"""

import os
import resource
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import orjson
import pytest
import torch

from libbus.config import host_id
from libbus.connect.client import Client
from libbus.errors import BadRequest, Forbidden, Unavailable
from libbus.loader.deliveries import ring_layout
from libbus.loader.remote import RemoteLoader
from libbus.order.epochs import epoch_order
from libbus.wire.messages import AttachRing, BatchRequest, DatasetInfoRequest
from services.provider.sources import open_source
from shm import SHM_DIR, Ring, RingLayout, SlotState, collect_garbage, list_segments, new_name
from shm.ring import HEADER
from tests.support import busctl

MNIST = "mock://mnist?n=600"
DTYPES = ["float32", "float64", "uint8", "int16", "uint16", "int64"]


@pytest.fixture
def ring_provider(start_provider):
    datasets = ["mnist=" + MNIST, *(f"d-{d}=dummy://?shape=3,5&n=64&dtype={d}" for d in DTYPES)]
    return start_provider(*datasets)


@pytest.fixture
def local_client(client_for):
    """A client of a provider's same-host ipc endpoint that says it runs on this host (the
    provider accepts rings only so)."""
    return lambda provider: client_for(provider.service.handler.local_endpoint, host_id=host_id())


@pytest.fixture
def ring_for():
    rings = []

    def make(layout: RingLayout, **kw) -> Ring:
        ring = Ring.create(layout, **kw)
        rings.append(ring)
        return ring

    yield make
    for ring in rings:
        ring.close()


def attach(client: Client, ring: Ring, **override):
    lay = ring.layout
    fields = dict(name=ring.name, slots=lay.slots, slot_bytes=lay.slot_bytes, label_offset=lay.label_offset)
    return client.request(AttachRing(**{**fields, **override}))


def test_a_ring_is_private_unguessable_and_removed_by_its_creator(ring_for):
    ring = ring_for(RingLayout.for_batch(2, 4096, 64))
    path = SHM_DIR / ring.name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ring.name.startswith(f"batchbus-{os.getpid()}-") and len(ring.name.rsplit("-", 1)[1]) == 16
    assert ring.name != new_name()
    other = Ring.attach(ring.name, ring.layout)
    other.close()  # an attacher only closes...
    assert path.exists()
    ring.close()  # ...the creator unlinks
    assert not path.exists()


def test_the_mapping_outlives_close_while_a_tensor_views_it(ring_for):
    ring = ring_for(RingLayout.for_batch(2, 4096, 64))
    seq = ring.request(0)
    x, _ = ring.views(0, (4, 256), np.float32, (4,), np.int64)
    x[:] = 3.0
    ring.finish_fill(0, seq)
    tensor = torch.from_numpy(x)
    del x
    ring.close()  # unlinked, but the tensor still holds the pages
    assert not (SHM_DIR / ring.name).exists()
    assert float(tensor.sum()) == 3.0 * 1024


def test_a_rings_pages_exist_from_creation_and_an_attacher_never_allocates_any(ring_for):
    """Created, a ring's pages are allocated and mapped; attached, they are mapped before the first
    write (no fault per page inside the first pass). A sparse file planted under a ring name is
    attached without a page of it being allocated on the attacher's account."""
    layout = RingLayout.for_batch(3, 1 << 20, 4096)
    ring = ring_for(layout)
    assert (SHM_DIR / ring.name).stat().st_blocks * 512 >= layout.size
    producer = Ring.attach(ring.name, layout)
    try:
        x, y = producer.views(1, (256, 1024), np.float32, (512,), np.int64)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x[...], y[...] = 1.0, 7
        assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 32  # not one per page (256+)
        del x, y
    finally:
        producer.close()
    name = new_name()
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, layout.size)
        os.pwrite(fd, HEADER.pack(b"BBRING\x00\x00", 1, 3, layout.slot_bytes, layout.label_offset, os.getpid(), 0), 0)
        planted = Ring.attach(name, layout)
        assert not planted.segment.allocated
        assert os.fstat(fd).st_blocks * 512 <= 4096  # the header's page, nothing more
        planted.close()
    finally:
        os.close(fd)
        os.unlink(SHM_DIR / name)


def test_slot_state_machine_refuses_stale_and_duplicate_fills(ring_for):
    ring = ring_for(RingLayout.for_batch(2, 4096, 64))
    producer = Ring.attach(ring.name, ring.layout)
    try:
        first = ring.request(0)
        again = ring.request(0)  # a resend: fresh sequence number
        with pytest.raises(Exception, match="under sequence"):
            producer.begin_fill(0, first)  # the late request may not write
        producer.begin_fill(0, again)
        producer.finish_fill(0, again)
        with pytest.raises(Exception, match="filled"):
            producer.finish_fill(0, again)  # a duplicate may not mark it twice
        ring.take(0, again)
        assert ring.state(0) is SlotState.IN_USE
        with pytest.raises(Exception, match="in_use"):
            producer.begin_fill(0, again)
        ring.release(0)
        assert ring.state(0) is SlotState.FREE
    finally:
        producer.close()


def test_provider_writes_into_the_slot_and_refuses_stale_or_duplicate_requests(ring_provider, local_client, ring_for):
    client = local_client(ring_provider)
    info = client.request(DatasetInfoRequest(dataset="mnist")).info
    ring = ring_for(ring_layout(info, 32, 2))
    attach(client, ring)
    source = open_source(MNIST)
    idx = np.array([7, 3, 99, 3, 0], dtype="<i8")
    seq = ring.request(1)
    reply = client.request(BatchRequest(dataset="mnist", split="train", frames=[idx.tobytes()], slot=1, seq=seq))
    assert (reply.slot, reply.seq, reply.frames) == (1, seq, [])
    ring.take(1, seq)
    x, y = ring.views(1, tuple(reply.shapes[0]), reply.dtypes[0], tuple(reply.shapes[1]), reply.dtypes[1])
    want_x, want_y = source.read("train", idx)
    assert np.array_equal(x, want_x) and np.array_equal(y, want_y)
    before = x.copy()
    for stale in (seq, seq - 1, seq + 5):  # duplicate, older, never issued
        with pytest.raises(BadRequest, match="in_use|sequence"):
            client.request(BatchRequest(dataset="mnist", split="train", range=[100, 105], slot=1, seq=stale))
    assert np.array_equal(x, before) and ring.state(1) is SlotState.IN_USE
    with pytest.raises(BadRequest, match="slot 5 outside"):
        client.request(BatchRequest(dataset="mnist", split="train", range=[0, 1], slot=5, seq=1))
    with pytest.raises(BadRequest, match="does not fit"):
        seq = ring.request(0)
        client.request(BatchRequest(dataset="mnist", split="train", range=[0, 33], slot=0, seq=seq))
    seq = ring.request(0)
    ring._table[0] = 99  # a state word no slot state has (a trainer scribbling on its table)
    with pytest.raises(BadRequest, match="slot 0 .* is in unknown state 99"):
        client.request(BatchRequest(dataset="mnist", split="train", range=[0, 1], slot=0, seq=seq))
    assert ring_provider.service.handler.refused["stale_slot"] >= 6
    assert client.request(DatasetInfoRequest(dataset="mnist")).info  # and the provider serves on


def test_one_ring_attached_on_two_sessions_serves_both(ring_provider, local_client, ring_for):
    """A loader attaches its one ring on every session it has with a provider (two replicas on one
    endpoint, or a reconnect whose old session lingers): the second attach must not take the ring
    from the first session while it still names slots (CI saw a job fail so)."""
    first, second = local_client(ring_provider), local_client(ring_provider)
    info = first.request(DatasetInfoRequest(dataset="mnist")).info
    ring = ring_for(ring_layout(info, 8, 2))
    attach(first, ring)
    attach(second, ring)
    for slot, client in enumerate((first, second)):
        seq = ring.request(slot)
        reply = client.request(BatchRequest(dataset="mnist", split="train", range=[slot, slot + 8], slot=slot, seq=seq))
        assert (reply.slot, reply.seq) == (slot, seq)
        ring.take(slot, seq)
        x, _ = ring.views(slot, tuple(reply.shapes[0]), reply.dtypes[0], tuple(reply.shapes[1]), reply.dtypes[1])
        assert np.array_equal(x, open_source(MNIST).read("train", np.arange(slot, slot + 8))[0])
        ring.release(slot)


def write_header(ring: Ring, **fields) -> None:
    lay = ring.layout
    values = dict(
        magic=b"BBRING\x00\x00",
        version=1,
        slots=lay.slots,
        slot_bytes=lay.slot_bytes,
        label_offset=lay.label_offset,
        pid=os.getpid(),
        start=0,
    )
    values.update(fields)
    HEADER.pack_into(ring.segment.buf, 0, *values.values())


@pytest.mark.parametrize(
    "damage, message",
    [
        (dict(magic=b"NOTARING"), "bad magic"),
        (dict(version=99), "ring version 99"),
        (dict(slot_bytes=1 << 20), "header says"),
    ],
)
def test_provider_refuses_a_ring_with_bad_magic_version_or_sizes(
    ring_provider, local_client, ring_for, damage, message
):
    client = local_client(ring_provider)
    ring = ring_for(RingLayout.for_batch(2, 8192, 256))
    write_header(ring, **damage)
    with pytest.raises(BadRequest, match=message):
        attach(client, ring)


def test_provider_refuses_rings_it_should_not_touch(ring_provider, local_client, ring_for, client_for):
    client = local_client(ring_provider)
    ring = ring_for(RingLayout.for_batch(2, 8192, 256))
    with pytest.raises(BadRequest, match="header says"):  # geometry differs from the header
        attach(client, ring, slots=3)
    with pytest.raises(BadRequest, match="not a batchbus ring name"):
        attach(client, ring, name="../../etc/passwd")
    with pytest.raises(BadRequest, match="no shared memory"):
        attach(client, ring, name=new_name())
    os.chmod(SHM_DIR / ring.name, 0o644)
    with pytest.raises(BadRequest, match="mode 644"):
        attach(client, ring)
    os.chmod(SHM_DIR / ring.name, 0o600)
    with pytest.raises(BadRequest, match="slots must be"):
        attach(client, ring, slots=10_000)
    with pytest.raises(Unavailable, match="another-host"):
        attach(client_for(ring_provider.service.handler.local_endpoint, host_id="another-host"), ring)
    with pytest.raises(Forbidden, match="only over this provider's same-host ipc:// endpoint"):
        attach(client_for(ring_provider.endpoint, host_id=host_id()), ring)  # TCP, even from this host
    with pytest.raises(BadRequest, match="attached no ring"):
        client.request(BatchRequest(dataset="mnist", split="train", range=[0, 1], slot=0, seq=1))
    assert attach(client, ring).name == ring.name  # and the good one still attaches


@pytest.mark.parametrize("dataset", ["mnist", *(f"d-{d}" for d in DTYPES)])
def test_loader_bytes_through_the_ring_equal_the_source_bytes(ring_provider, make_token, dataset):
    uri = MNIST if dataset == "mnist" else f"dummy://?shape=3,5&n=64&dtype={dataset[2:]}"
    source = open_source(uri)
    with RemoteLoader(
        dataset, provider=ring_provider.endpoint, token=make_token(), batch_size=24, seed=3, inflight=2
    ) as loader:
        assert loader.transport == "shm"
        order = epoch_order(loader.num_samples, epoch=0, seed=3, shuffle=True)
        start = 0
        for x, y in loader:
            want_x, want_y = source.read("train", order[start : start + len(x)])
            assert x.dtype == torch.from_numpy(want_x).dtype
            assert np.array_equal(x.numpy(), want_x) and np.array_equal(y.numpy(), want_y)
            start += len(x)
        assert start == loader.num_samples
        # and at most inflight - 1 asked ahead of epoch 1 by the pass taken to its end
        assert len(loader) <= ring_provider.service.handler.served[dataset]["shm_batches"] <= len(loader) + 1


def test_slow_consumer_fast_producer_never_sees_its_batch_change(ring_provider, make_token):
    """The provider fills ahead while the consumer sleeps on a batch: the slot in use never moves."""
    with RemoteLoader(
        "mnist", provider=ring_provider.endpoint, token=make_token(), batch_size=50, shuffle=False, inflight=3
    ) as loader:
        ring = loader._delivery.ring
        assert ring.layout.slots == 5
        for i, batch in enumerate(loader):
            x = batch[0]
            snapshot = x.clone()
            time.sleep(0.05)  # the producer has filled every free slot by now
            states = [ring.state(s) for s in range(ring.layout.slots)]
            # the batch held, and the next one the pass's thread made ready: the previous batch went
            # with its tensors (a slot kept past its tensors would make it 3, then more)
            assert 1 <= states.count(SlotState.IN_USE) <= 2
            assert all(
                s in (SlotState.FILLED, SlotState.REQUESTED, SlotState.FREE)
                for s in states
                if s is not SlotState.IN_USE
            )
            assert torch.equal(x, snapshot)
            want, _ = open_source(MNIST).read("train", np.arange(i * 50, i * 50 + len(x)))
            assert np.array_equal(x.numpy(), want)
        # between passes every slot no tensor views is free again (once the batches asked ahead of
        # epoch 1 are discarded, as another epoch is named)
        del x, batch
        loader.set_epoch(5)
        assert [ring.state(s) for s in range(ring.layout.slots)] == [SlotState.FREE] * 5


def test_copy_true_yields_batches_that_survive_the_next_one(ring_provider, make_token):
    with RemoteLoader(
        "mnist", provider=ring_provider.endpoint, token=make_token(), batch_size=100, shuffle=False, copy=True
    ) as loader:
        batches = list(loader)
    want, _ = open_source(MNIST).read("train", np.arange(600))
    assert np.array_equal(torch.cat([x for x, _ in batches]).numpy(), want)


def test_a_provider_on_another_host_id_gets_batches_over_the_socket(start_provider, make_token, caplog):
    elsewhere = start_provider("mnist=" + MNIST, host_id="node-b-simulated")
    with caplog.at_level("INFO", logger="libbus.loader.remote"):
        loader = RemoteLoader("mnist", provider=elsewhere.endpoint, token=make_token(), batch_size=100, shuffle=False)
    with loader:
        assert loader.transport == "socket"
        xs = [x.clone() for x, _ in loader]
    assert "provider is on host node-b-simulated" in caplog.text
    want, _ = open_source(MNIST).read("train", np.arange(600))
    assert np.array_equal(torch.cat(xs).numpy(), want)
    assert "shm_batches" not in elsewhere.service.handler.served["mnist"]


def test_shm_can_be_switched_off(ring_provider, make_token):
    with RemoteLoader("mnist", provider=ring_provider.endpoint, token=make_token(), shm=False) as loader:
        assert loader.transport == "socket"
        assert len([1 for _ in loader]) == len(loader)


def test_leaving_a_pass_early_frees_the_ring_for_the_next(ring_provider, make_token):
    with RemoteLoader(
        "mnist", provider=ring_provider.endpoint, token=make_token(), batch_size=50, shuffle=False, inflight=2
    ) as loader:
        for i, _ in enumerate(loader):
            if i == 2:
                break
        ring = loader._delivery.ring
        assert [ring.state(s) for s in range(ring.layout.slots)].count(SlotState.IN_USE) == 1  # the batch held
        del _
        assert all(ring.state(s) is not SlotState.IN_USE for s in range(ring.layout.slots))
        assert loader.position == 150
        first = next(iter(loader))[0].clone()  # the next pass is the next epoch, whole: from sample 0
        assert (loader.epoch, loader.position) == (1, 50)
    want, _ = open_source(MNIST).read("train", np.arange(0, 50))
    assert np.array_equal(first.numpy(), want)


CREATE_AND_WAIT = """
import sys, time
from shm import Ring, RingLayout
ring = Ring.create(RingLayout.for_batch(2, 65536, 512))
print(ring.name, flush=True)
time.sleep(60)
"""


@pytest.mark.serial  # every provider's start-up sweeps dead rings machine-wide: run alone
def test_gc_removes_a_killed_trainers_ring_and_keeps_live_ones(ring_for, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CREATE_AND_WAIT], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert (SHM_DIR / name).exists()
        mine = ring_for(RingLayout.for_batch(2, 4096, 64))
        listed = {s.name: s for s in list_segments()}
        assert listed[name].alive and listed[name].pid == proc.pid and listed[mine.name].alive
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (SHM_DIR / name).exists()  # SIGKILL: nobody unlinked it
    assert not {s.name: s for s in list_segments()}[name].alive
    out = busctl("shm", "gc")
    assert out.returncode == 0 and name in out.stdout and "removed" in out.stdout
    assert not (SHM_DIR / name).exists()
    assert (SHM_DIR / mine.name).exists()  # ours is alive: left alone
    assert mine.name not in {s.name for s in collect_garbage()}


def test_shm_ls_lists_rings_as_json(ring_for):
    ring = ring_for(RingLayout.for_batch(3, 4096, 64))
    out = busctl("shm", "ls", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in orjson.loads(out.stdout)}
    assert rows[ring.name]["alive"] is True and rows[ring.name]["slots"] == 3
    assert rows[ring.name]["pid"] == os.getpid()


def test_a_pid_reused_by_another_process_does_not_keep_a_ring_alive(ring_for):
    ring = ring_for(RingLayout.for_batch(2, 4096, 64))
    write_header(ring, start=12345)  # as if our pid's start time were different
    seg = {s.name: s for s in list_segments()}[ring.name]
    assert seg.pid == os.getpid() and not seg.alive


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_come_from_the_pinned_ring(ring_provider, make_token):
    with RemoteLoader(
        "mnist",
        provider=ring_provider.endpoint,
        token=make_token(),
        batch_size=64,
        shuffle=False,
        device="cuda:0",
        inflight=3,
    ) as loader:
        assert loader.transport == "shm"
        xs = []
        for x, y in loader:
            assert x.is_cuda and y.is_cuda
            xs.append((x * 1).cpu())  # used on the current stream, as a model would
    want, _ = open_source(MNIST).read("train", np.arange(600))
    assert np.array_equal(torch.cat(xs).numpy(), want)


class SlowOnce:
    """A real source whose first batch takes longer than the loader's timeout (a busy disk)."""

    def __init__(self, source, delay_s: float):
        self.source, self.delay_s = source, delay_s

    def __getattr__(self, name):
        return getattr(self.source, name)

    def read_into(self, split, indices, x, y):
        if self.delay_s:
            time.sleep(self.delay_s)
            self.delay_s = 0
        self.source.read_into(split, indices, x, y)


def test_a_slow_provider_is_resent_to_through_the_ring_and_the_bytes_are_right(start_provider, make_token):
    provider = start_provider("mnist=" + MNIST)
    handler = provider.service.handler
    handler.datasets["mnist"] = SlowOnce(handler.datasets["mnist"], delay_s=1.5)
    with RemoteLoader(
        "mnist", provider=provider.endpoint, token=make_token(), batch_size=100, shuffle=False, timeout_s=1.0, retries=2
    ) as loader:
        assert loader.transport == "shm"
        xs = [x.clone() for x, _ in loader]  # the first batch times out once, then is resent
    want, _ = open_source(MNIST).read("train", np.arange(600))
    assert np.array_equal(torch.cat(xs).numpy(), want)


def test_the_provider_unmaps_a_ring_its_loader_removed(ring_provider, make_token):
    handler = ring_provider.service.handler
    with RemoteLoader("mnist", provider=ring_provider.endpoint, token=make_token(), batch_size=50) as loader:
        next(iter(loader))
        name = loader._delivery.ring.name
        assert name in {r.name for r in handler.rings.values()}
    deadline = time.monotonic() + 5
    while name in {r.name for r in handler.rings.values()}:
        assert time.monotonic() < deadline, "provider still maps a ring its trainer removed"
        time.sleep(0.1)


def test_a_fifo_planted_in_the_shm_directory_does_not_hang_ls_or_gc(tmp_path):
    os.mkfifo(tmp_path / new_name(pid=1))
    os.symlink("/etc/passwd", tmp_path / new_name(pid=1))
    (tmp_path / new_name(pid=999_999)).write_bytes(b"garbage")  # a dead owner's unreadable file
    listed = list_segments(tmp_path)  # returns at once
    assert [s.pid for s in listed] == [999_999]
    assert [s.pid for s in collect_garbage(tmp_path)] == [999_999]
    assert len(list(tmp_path.iterdir())) == 2  # the FIFO and link are left alone


def test_closing_a_pass_after_its_loader_is_harmless(ring_provider, make_token):
    loader = RemoteLoader("mnist", provider=ring_provider.endpoint, token=make_token(), batch_size=50)
    passes = iter(loader)
    next(passes)
    loader.close()
    passes.close()  # no error from a closed ring


def test_a_provider_that_refuses_rings_gets_the_socket_path_with_the_reason(start_provider, make_token, caplog):
    provider = start_provider("mnist=" + MNIST, shm=False)
    # this process's rings only: /dev/shm is shared with every other test process on the machine
    ours = lambda: {s.name for s in list_segments() if s.pid == os.getpid()}  # noqa: E731
    before = ours()
    with caplog.at_level("INFO", logger="libbus.loader.remote"):
        loader = RemoteLoader("mnist", provider=provider.endpoint, token=make_token(), batch_size=100, shuffle=False)
    with loader:
        assert loader.transport == "socket" and loader.endpoint == provider.endpoint  # and TCP
        xs = [x.clone() for x, _ in loader]
    assert "shared memory is disabled on this provider" in caplog.text
    assert ours() <= before  # the refused ring was removed
    want, _ = open_source(MNIST).read("train", np.arange(600))
    assert np.array_equal(torch.cat(xs).numpy(), want)
