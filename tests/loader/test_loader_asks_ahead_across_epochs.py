"""A pass taken to its end leaves its requests running into the next epoch (libbus.loader.batch_stream):
the window stays full across the boundary, and the next ``iter()`` finds its first batches on their way.
What a user relies on stays: every batch is exactly the one the order names (each sample compared with
the dataset), and a next pass that is not that epoch from its start (``set_epoch`` to another epoch, a
loaded cursor, ``close``, a loader dropped unclosed) discards what was asked ahead, ring slots included;
a provider still writing a discarded batch writes into no batch the loop holds."""

import gc
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np

from libbus.loader.batch_stream import BatchStream
from libbus.loader.remote import RemoteLoader
from services.provider.sources import open_source
from services.provider.sources.mock import MockImages
from services.provider.sources.registry import OPENERS
from shm import SlotState, list_segments
from tests.support import REPO

#: A liveness bound, not a timing: far above anything the checks below take on a loaded machine.
STUCK_S = 120
MNIST = "mock://mnist?n=600"


def pass_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("batchbus-pass-")]


def eventually(check, what: str) -> None:
    deadline = time.monotonic() + STUCK_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def assert_epoch(loader: RemoteLoader, epoch: int, batches: list, start: int = 0) -> None:
    """``batches`` are ``epoch``'s order from sample ``start`` on, every sample's bytes the dataset's."""
    want_x, want_y = open_source(MNIST).read("train", loader.order(epoch)[start:])
    assert np.array_equal(np.concatenate([y.numpy() for _, y in batches]), want_y)
    assert np.array_equal(np.concatenate([x.numpy() for x, _ in batches]), want_x)


def ring_states(loader: RemoteLoader) -> list[SlotState]:
    ring = loader._delivery.ring
    return [ring.state(s) for s in range(ring.layout.slots)]


def served(provider) -> int:
    return provider.service.handler.served["mnist"]["shm_batches"]


def test_the_next_epochs_first_batches_are_asked_for_before_its_pass_begins(start_provider, make_token):
    provider = start_provider("mnist=" + MNIST)
    with RemoteLoader(
        "mnist", provider=provider.endpoint, token=make_token(), batch_size=50, seed=3, inflight=4
    ) as loader:
        assert loader.transport == "shm" and len(loader) == 12
        first = [(x.clone(), y.clone()) for x, y in loader]
        assert_epoch(loader, 0, first)
        # the provider serves epoch 1's first batches while the loop does something else
        eventually(lambda: served(provider) > 12, "no batch of epoch 1 was asked for ahead")
        assert loader.epoch == 1 and loader.position == 0  # a batch asked ahead is no batch handed out
        assert loader.state_dict()["position"] == 0
        loader.set_epoch(1)  # a DataLoader habit: the epoch it asked ahead for, so nothing is discarded
        assert len(pass_threads()) == 1
        second = [(x.clone(), y.clone()) for x, y in loader]
        assert_epoch(loader, 1, second)
        assert not np.array_equal(second[0][1].numpy(), first[0][1].numpy())  # another order, not a replay
        # each batch was read once: the two passes, and at most inflight - 1 asked ahead of epoch 2
        assert 24 <= served(provider) <= 24 + 3


def test_set_epoch_to_another_epoch_discards_the_batches_asked_ahead(start_provider, make_token):
    provider = start_provider("mnist=" + MNIST)
    with RemoteLoader(
        "mnist", provider=provider.endpoint, token=make_token(), batch_size=50, seed=3, inflight=4
    ) as loader:
        assert sum(1 for _ in loader) == 12
        eventually(lambda: served(provider) > 12, "no batch of epoch 1 was asked for ahead")
        loader.set_epoch(5)
        assert pass_threads() == [], "the requests asked ahead outlived set_epoch"
        assert ring_states(loader) == [SlotState.FREE] * len(ring_states(loader))  # every slot back
        fifth = [(x.clone(), y.clone()) for x, y in loader]
        assert loader.epoch == 6 and len(fifth) == 12
        assert_epoch(loader, 5, fifth)


def test_a_cursor_loaded_between_passes_discards_the_batches_asked_ahead(start_provider, make_token):
    provider = start_provider("mnist=" + MNIST)
    with RemoteLoader(
        "mnist", provider=provider.endpoint, token=make_token(), batch_size=50, seed=3, inflight=4
    ) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        saved = loader.state_dict()  # epoch 0 after 150 samples
        assert saved["epoch"] == 0 and saved["position"] == 150
        assert sum(1 for _ in it) == 9  # the rest of epoch 0, none of it held
        eventually(lambda: served(provider) > 12, "no batch of epoch 1 was asked for ahead")
        loader.load_state_dict(saved)
        assert pass_threads() == [], "the requests asked ahead outlived load_state_dict"
        assert ring_states(loader) == [SlotState.FREE] * len(ring_states(loader))
        rest = [(x.clone(), y.clone()) for x, y in loader]
        assert len(rest) == 9
        assert_epoch(loader, 0, rest, start=150)
        # the resumed pass was whole: it asked ahead for epoch 1, which the next pass takes
        eventually(lambda: len(pass_threads()) == 1 and served(provider) > 12 + 9, "nothing asked ahead")
        whole = [(x.clone(), y.clone()) for x, y in loader]
        assert_epoch(loader, 1, whole)


class GatedImages(MockImages):
    """Mock mnist whose first read of the batch ``hold`` (its samples, in any order) waits at ``gate``
    before it writes: a provider's fill thread that checked its ring slot, then took its time."""

    gate = threading.Event()
    hold: set[int] = set()
    waiting = threading.Event()
    wrote = threading.Event()

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        held = split == "train" and bool(self.hold) and self.hold == set(indices.tolist())
        if held:
            GatedImages.hold = set()  # one read waits; later reads do not
            GatedImages.waiting.set()
            self.gate.wait(STUCK_S)
        super().read_into(split, indices, x, y)
        if held:
            GatedImages.wrote.set()


def gated_provider(start_provider, monkeypatch):
    monkeypatch.setitem(OPENERS, "gated", lambda req: GatedImages(req.uri, "mnist", n=600))
    monkeypatch.setattr(GatedImages, "gate", threading.Event())
    for flag in ("waiting", "wrote"):
        monkeypatch.setattr(GatedImages, flag, threading.Event())
    return start_provider("gated=gated://mnist", fill_threads=2)


def test_a_discarded_batch_still_being_written_lands_in_no_batch_of_the_next_pass(
    start_provider, make_token, monkeypatch
):
    provider = gated_provider(start_provider, monkeypatch)
    with RemoteLoader(
        "gated", provider=provider.endpoint, token=make_token(), batch_size=50, seed=5, inflight=4, timeout_s=1.0
    ) as loader:
        assert loader.transport == "shm"
        monkeypatch.setattr(GatedImages, "hold", set(loader.order(1)[:50].tolist()))  # epoch 1's first batch
        assert sum(1 for _ in loader) == 12
        assert GatedImages.waiting.wait(STUCK_S), "epoch 1's first batch was not asked for ahead"
        loader.set_epoch(3)  # its read is under way, into its slot: that slot must carry nothing else
        held = list(loader)  # epoch 3, every batch held as it was handed out (views of the ring)
        GatedImages.gate.set()
        assert GatedImages.wrote.wait(STUCK_S)
        want_x, want_y = MockImages("mock://mnist", "mnist", n=600).read("train", loader.order(3))
    assert np.array_equal(np.concatenate([y.numpy() for _, y in held]), want_y)
    assert np.array_equal(np.concatenate([x.numpy() for x, _ in held]), want_x), "a late write landed in a held batch"


def test_closing_the_loader_while_it_asks_ahead_leaves_no_thread_and_no_ring(start_provider, make_token, monkeypatch):
    provider = gated_provider(start_provider, monkeypatch)
    ours = lambda: {s.name for s in list_segments() if s.pid == os.getpid()}  # noqa: E731
    before = ours()
    loader = RemoteLoader(
        "gated", provider=provider.endpoint, token=make_token(), batch_size=50, seed=5, inflight=4, timeout_s=1.0
    )
    monkeypatch.setattr(GatedImages, "hold", set(loader.order(1)[:50].tolist()))
    assert sum(1 for _ in loader) == 12
    assert GatedImages.waiting.wait(STUCK_S), "epoch 1's first batch was not asked for ahead"
    closer = threading.Thread(target=loader.close)
    closer.start()
    closer.join(STUCK_S)
    assert not closer.is_alive(), "close() waited on the read asked ahead"
    assert pass_threads() == []
    assert ours() <= before, "the ring outlived close()"
    GatedImages.gate.set()  # the provider finishes its write into a ring no one holds
    assert GatedImages.wrote.wait(STUCK_S)
    with RemoteLoader(
        "gated", provider=provider.endpoint, token=make_token(), batch_size=50, seed=5, inflight=4
    ) as again:
        got = list(again)
        want_x, want_y = MockImages("mock://mnist", "mnist", n=600).read("train", again.order(0))
    assert np.array_equal(np.concatenate([x.numpy() for x, _ in got]), want_x)
    assert np.array_equal(np.concatenate([y.numpy() for _, y in got]), want_y)


def test_a_loader_dropped_unclosed_after_a_whole_pass_ends_its_thread(start_provider, make_token):
    provider = start_provider("mnist=" + MNIST)
    loader = RemoteLoader("mnist", provider=provider.endpoint, token=make_token(), batch_size=50)
    assert sum(1 for _ in loader) == 12
    assert len(pass_threads()) == 1
    del loader
    gc.collect()
    eventually(lambda: pass_threads() == [], "a collected loader's thread kept asking ahead")


def test_each_request_asked_ahead_names_its_own_epoch(start_provider, make_token, monkeypatch):
    """A pipeline dataset's random stages are seeded by the request's epoch: a batch of epoch 1 asked
    for during epoch 0's pass carries epoch 1."""
    from libbus.loader import replica  # noqa: PLC0415

    sent: list[tuple[int, np.ndarray]] = []
    real = replica.Replica.send

    def send(self, batch_no, message):
        sent.append((message.epoch, message.indices(600)))
        return real(self, batch_no, message)

    monkeypatch.setattr(replica.Replica, "send", send)
    provider = start_provider("mnist=" + MNIST)
    with RemoteLoader("mnist", provider=provider.endpoint, token=make_token(), batch_size=50, seed=3) as loader:
        assert sum(1 for _ in loader) == 12
        assert sum(1 for _ in loader) == 12
        orders = {e: loader.order(e) for e in (0, 1, 2)}
        ahead = loader.inflight - 1
    by_epoch = {0: 0, 1: 0, 2: 0}
    for epoch, indices in sent:
        n = by_epoch[epoch]
        assert np.array_equal(indices, orders[epoch][n * 50 : n * 50 + 50]), f"batch {n} of epoch {epoch}"
        by_epoch[epoch] = n + 1
    assert by_epoch[0] == 12 and by_epoch[1] == 12 and 1 <= by_epoch[2] <= ahead


def test_the_stream_numbers_batches_on_across_epochs_and_stops_at_an_empty_one():
    follow = {1: [np.array([4, 5]), np.array([6])], 2: []}
    stream = BatchStream(0, [np.array([0, 1]), np.array([2, 3])], lambda e: follow[e])
    assert len(stream) == 2 and stream.epoch_of(1) == 0
    assert stream.extend() and len(stream) == 4
    assert stream.epoch_of(2) == 1 and list(stream[3]) == [6]
    assert [list(b) for b in stream[1:3]] == [[2, 3], [4, 5]]  # a read-ahead plan spans the boundary
    assert stream.segment_at(2).epoch == 1 and stream.segment_at(1) is None
    assert not stream.extend() and not stream.extend()  # epoch 2 has no batch: nothing more ahead
    stream.forget_below(2)
    assert stream.segment_at(0) is None and stream.segment_at(2) is not None


NEVER_CLOSED = """
import atexit, sys, threading


@atexit.register  # registered first, so it runs last of the exit handlers: after libbus's own
def pass_threads_left():
    print("pass threads left at exit:", sum(t.name.startswith("batchbus-pass-") for t in threading.enumerate()))


from libbus.loader.remote import RemoteLoader

loader = RemoteLoader("mnist", provider=sys.argv[1], token=sys.argv[2], name="never-closed", batch_size=50, inflight=4)
for x, y in loader:  # one whole epoch: the pass thread goes on asking for the next one
    pass
print("pass threads at the end:", sum(t.name.startswith("batchbus-pass-") for t in threading.enumerate()))
"""


def test_a_script_that_never_closes_its_loader_exits_cleanly_and_says_goodbye(
    start_provider, make_token, tmp_path, caplog
):
    """A script that ends after its last epoch without ``close()`` leaves its pass thread asking ahead
    for the next epoch. The interpreter's exit closes the loader before it finalizes, so no pass thread
    runs into finalization (where a daemon thread is ended by an unwind that can abort the process
    where it crosses a C++ frame); the script exits 0, and its sessions on the provider end with
    ``Goodbye``, none left to expire."""
    caplog.set_level(logging.INFO, logger="libbus.serve.server")
    provider = start_provider("mnist=" + MNIST)
    script = tmp_path / "train.py"
    script.write_text(NEVER_CLOSED)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script), provider.endpoint, make_token()],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=STUCK_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pass threads at the end: 1" in done.stdout  # it was still asking ahead when the script ended
    assert "pass threads left at exit: 0" in done.stdout  # and it had ended before the interpreter finalized

    def closes() -> list[str]:
        return [r.getMessage() for r in caplog.records if "never-closed) closed:" in r.getMessage()]

    eventually(lambda: closes(), "the script's session never closed")
    assert all(m.endswith("closed: said Goodbye") for m in closes()), closes()
