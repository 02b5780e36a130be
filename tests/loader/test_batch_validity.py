"""Batches stay what they were for as long as they are held (DataLoader semantics), through the
shared-memory ring as over the socket: ``list(loader)``, a one-ahead prefetch, a gradient-accumulation
loop that keeps 8 batches, and a consumer that holds every slot of the ring."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from libbus.loader.remote import RemoteLoader
from shm import SlotState

DATA = "mock://mnist?n=1000"


@pytest.fixture
def mnist(start_provider):
    return start_provider(f"mnist={DATA}")


def _loader(endpoint: str, token: str, shm: bool, **kw) -> RemoteLoader:
    kw.setdefault("batch_size", 40)
    kw.setdefault("inflight", 3)
    return RemoteLoader("mnist", provider=endpoint, token=token, seed=5, shm=shm, **kw)


def _socket_batches(endpoint: str, token: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with _loader(endpoint, token, shm=False) as loader:
        assert loader.transport == "socket"
        return [(x.clone(), y.clone()) for x, y in loader]


def _same(held, want) -> None:
    assert len(held) == len(want)
    for i, ((x, y), (wx, wy)) in enumerate(zip(held, want)):
        assert torch.equal(x, wx) and torch.equal(y, wy), f"batch {i} changed while held"


def test_list_of_the_loader_holds_the_socket_paths_bytes(mnist, make_token):
    want = _socket_batches(mnist.endpoint, make_token())
    with _loader(mnist.endpoint, make_token(), shm=True) as loader:
        assert loader.transport == "shm"
        held = list(loader)
        _same(held, want)
        again = list(loader)  # a second epoch while the first is still held
        _same(held, want)
        assert len(again) == len(want)


def test_one_ahead_prefetch_and_gradient_accumulation_over_8_batches(mnist, make_token):
    want = _socket_batches(mnist.endpoint, make_token())
    with _loader(mnist.endpoint, make_token(), shm=True) as loader:
        it = iter(loader)
        ahead = next(it)
        seen = []
        for batch in it:  # what a framework that prefetches one batch ahead does
            current, ahead = ahead, batch
            seen.append(current)
        seen.append(ahead)
        _same(seen, want)
    with _loader(mnist.endpoint, make_token(), shm=True) as loader:
        held = []
        for i, (x, y) in enumerate(loader):  # accumulate 8, step, let them go
            held.append((x, y))
            if len(held) == 8:
                _same(held, want[i - 7 : i + 1])
                held.clear()
        _same(held, want[len(want) - len(held) :])


def test_a_consumer_holding_every_slot_gets_copies_not_a_deadlock_or_an_overwrite(mnist, make_token):
    want = _socket_batches(mnist.endpoint, make_token())
    with _loader(mnist.endpoint, make_token(), shm=True, inflight=1, shm_slots=2) as loader:
        ring = loader._delivery.ring
        held = list(itertools.islice(loader, 6))
        _same(held, want[:6])
        assert loader._delivery.copied >= 5  # two slots: only one batch could stay a view
        del held
        gc.collect()
        assert [ring.state(s) for s in range(2)] == [SlotState.FREE] * 2  # freed with the last tensor


def test_a_slot_returns_when_its_last_view_is_freed_not_before(mnist, make_token):
    with _loader(mnist.endpoint, make_token(), shm=True, inflight=1, shm_slots=3) as loader:
        ring = loader._delivery.ring
        x, y = next(iter(loader))
        part = x[:3]  # a view of the view: the slot stays held by it
        snapshot = part.clone()
        del x, y
        assert SlotState.IN_USE in [ring.state(s) for s in range(3)]
        for _ in loader:  # the ring keeps turning without that slot
            pass
        del _  # the last batch, held by the loop's variable
        assert torch.equal(part, snapshot)
        del part
        assert [ring.state(s) for s in range(3)] == [SlotState.FREE] * 3


def test_a_batch_outlives_its_loader(mnist, make_token):
    want = _socket_batches(mnist.endpoint, make_token())
    loader = _loader(mnist.endpoint, make_token(), shm=True)
    x, y = next(iter(loader))
    loader.close()
    assert torch.equal(x, want[0][0]) and torch.equal(y, want[0][1])
