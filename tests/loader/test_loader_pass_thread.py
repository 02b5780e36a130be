"""A pass's requests and replies run on a thread of the pass's own (libbus.loader.handoff): the
training loop only takes batches. What a user relies on stays as it was: batches held stay what they
were, a pass left early or closed leaves no thread behind, and a pass waiting for a provider that is
gone ends when the loader is closed. (An error the pass thread meets is raised by ``next()``:
tests/loader/test_loader.py's killed provider.)"""

import signal
import threading

import numpy as np

from libbus.errors import BusError
from libbus.loader.remote import RemoteLoader
from libbus.order.epochs import epoch_order
from services.provider.sources import open_source
from services.provider.sources.mock import MockImages
from services.provider.sources.registry import OPENERS
from tests.support import Cluster

#: A liveness bound, not a timing: far above anything the checks below take on a loaded machine.
STUCK_S = 120


def pass_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("batchbus-pass-")]


def test_every_batch_of_a_pass_held_at_once_stays_what_was_read(provider, make_token):
    """The pass thread hands batches out ahead of the loop: none may land in a slot a held batch views."""
    with RemoteLoader(
        "mnist", provider=provider.endpoint, token=make_token(), batch_size=50, seed=3, inflight=4
    ) as loader:
        assert loader.transport == "shm"
        held = list(loader)  # no copies: every batch's tensors still view (or own) its data
        order = epoch_order(600, epoch=0, seed=3, shuffle=True)
    want_x, want_y = open_source("mock://mnist?n=600").read("train", order)
    assert np.array_equal(np.concatenate([x.numpy() for x, _ in held]), want_x)
    assert np.array_equal(np.concatenate([y.numpy() for _, y in held]), want_y)


def test_a_pass_left_early_or_closed_leaves_no_thread(provider, make_token):
    before = set(pass_threads())
    with RemoteLoader("mnist", provider=provider.endpoint, token=make_token(), batch_size=50) as loader:
        it = iter(loader)
        next(it)
        assert [t for t in pass_threads() if t not in before], "the pass runs on a thread of its own"
        it.close()  # what a `break` out of the loop does once the iterator is dropped
        assert set(pass_threads()) <= before
        assert sum(1 for _ in loader) == len(loader)  # the next pass is whole
        # a pass run to its end keeps its one thread, asking ahead for the next epoch's first batches
        assert len(set(pass_threads()) - before) == 1
        it = iter(loader)
        next(it)
        assert len(set(pass_threads()) - before) == 1  # the next pass took it over
    assert set(pass_threads()) <= before  # close() ends a pass still open


def test_closing_the_loader_ends_a_pass_that_waits_for_a_provider_gone_for_good(router, make_token, state_dir):
    before = set(pass_threads())
    cluster = Cluster(state_dir)
    proc = cluster.start(
        "provider", "provider", "--router", router.endpoint, "--dataset", "gone=mock://mnist", ready=True, named=False
    )
    try:
        loader = RemoteLoader(
            "gone",
            provider=cluster.endpoint_of("provider"),
            token=make_token(datasets=["gone"]),
            batch_size=50,
            inflight=2,
            timeout_s=1.0,
            retries=1,
            provider_wait_s=3600,  # the pass would wait an hour for the provider to come back
        )
        it = iter(loader)
        next(it)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        raised: list[BaseException] = []

        def train() -> None:
            try:
                for _ in it:
                    pass
            except BaseException as err:  # noqa: BLE001 (checked below)
                raised.append(err)

        trainer = threading.Thread(target=train)
        trainer.start()
        closer = threading.Thread(target=loader.close)  # e.g. a signal handler's shutdown
        closer.start()
        closer.join(STUCK_S)
        trainer.join(STUCK_S)
        assert not closer.is_alive() and not trainer.is_alive(), "close() left the pass waiting"
        assert len(raised) == 1 and isinstance(raised[0], BusError)
        assert "closed during the pass" in str(raised[0])
        assert set(pass_threads()) <= before
    finally:
        cluster.close(sig=signal.SIGKILL)


class GatedImages(MockImages):
    """Mock mnist whose first read of a sample in ``hold`` waits at ``gate`` before it writes: a
    provider's fill thread that checked its ring slot and then took its time (a slow page, a busy core)."""

    gate = threading.Event()
    hold: set[int] = set()
    waiting = threading.Event()
    wrote = threading.Event()

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        held = split == "train" and bool(self.hold & set(indices.tolist()))
        if held:
            GatedImages.hold = set()  # one read waits; the samples' later reads do not
            GatedImages.waiting.set()
            self.gate.wait(STUCK_S)
        super().read_into(split, indices, x, y)
        if held:
            GatedImages.wrote.set()


def test_a_pass_left_with_a_fill_in_flight_lends_its_slot_to_no_other_batch(start_provider, make_token, monkeypatch):
    """Leaving a pass while a provider thread still fills one of its ring slots: the slot may carry no
    batch of the next pass, or that thread's late write lands in a batch the loop holds."""
    monkeypatch.setitem(OPENERS, "gated", lambda req: GatedImages(req.uri, "mnist", n=400))
    monkeypatch.setattr(GatedImages, "gate", threading.Event())
    for flag in ("waiting", "wrote"):
        monkeypatch.setattr(GatedImages, flag, threading.Event())
    provider = start_provider("gated=gated://mnist", fill_threads=2)
    with RemoteLoader(
        "gated", provider=provider.endpoint, token=make_token(), batch_size=50, seed=5, inflight=4, timeout_s=1.0
    ) as loader:
        assert loader.transport == "shm"
        monkeypatch.setattr(GatedImages, "hold", {int(loader.order(0)[100])})  # the first sample of batch 2
        it = iter(loader)
        next(it), next(it)
        assert GatedImages.waiting.wait(STUCK_S), "batch 2's read never began"
        it.close()  # batch 2's read is under way, into its slot
        held = list(loader)  # epoch 1, every batch held as it was handed out
        GatedImages.gate.set()
        assert GatedImages.wrote.wait(STUCK_S)
        want_x, want_y = MockImages("mock://mnist", "mnist", n=400).read("train", loader.order(1))
    assert np.array_equal(np.concatenate([y.numpy() for _, y in held]), want_y)
    assert np.array_equal(np.concatenate([x.numpy() for x, _ in held]), want_x), "a late write landed in a held batch"


def test_the_training_loops_thread_sends_receives_and_hands_out_nothing_during_a_pass(
    provider, make_token, monkeypatch
):
    """What keeps the loop's next() cheap: every request, reply and hand-out of a pass happens on the
    pass's thread (a regression that moves one back shows here, not only in `busctl bench --wait`)."""
    from libbus.loader import deliveries, pass_pipeline, replica  # noqa: PLC0415

    seen: dict[str, set[str]] = {}

    def spy(owner, name):
        real = getattr(owner, name)

        def call(*args, **kwargs):
            seen.setdefault(name, set()).add(threading.current_thread().name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, call)

    spy(replica.Replica, "send")
    spy(pass_pipeline, "recv_any")
    spy(deliveries.RingDelivery, "receive")
    spy(deliveries.RingDelivery, "hand_out")
    with RemoteLoader("mnist", provider=provider.endpoint, token=make_token(), batch_size=50) as loader:
        assert loader.transport == "shm"
        for _ in range(2):  # two whole passes
            assert sum(1 for _ in loader) == len(loader)
        during = {name: set(names) for name, names in seen.items()}  # close() settles the requests asked ahead
    assert set(during) == {"send", "recv_any", "receive", "hand_out"}
    assert all(name.startswith("batchbus-pass-") for names in during.values() for name in names), during
