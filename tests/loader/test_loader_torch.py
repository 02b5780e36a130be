"""RemoteLoader where PyTorch code puts a data loader: inside a DataLoader, under launcher-set ranks,
resumed at another world size, with a trainer-side transform, and reporting its data stall."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import orjson
import pytest
import torch
from torch.utils.data import DataLoader

from libbus import RemoteLoader, merge_cursors
from libbus.errors import BadRequest
from services.provider.sources import open_source


def labels_of(loader) -> list[int]:
    return [int(v) for _, y in loader for v in y]


_X, _ = open_source("mock://mnist?n=600").read("train", np.arange(600))
_INDEX = {row.tobytes(): i for i, row in enumerate(_X)}


def ids_of(batches) -> list[int]:
    """The sample indices of ``batches`` of the provider's mock mnist, found by their bytes."""
    return [_INDEX[row.tobytes()] for x, _ in batches for row in x.numpy()]


def test_inside_a_dataloader_it_yields_what_it_yields_alone(provider, make_token):
    kw = dict(provider=provider.endpoint, token=make_token(), batch_size=50, seed=1, rank=0, world_size=1)
    with RemoteLoader("mnist", **kw) as alone:
        want = labels_of(alone)
    with RemoteLoader("mnist", **kw) as loader:
        assert isinstance(loader, torch.utils.data.IterableDataset)
        wrapped = DataLoader(loader, batch_size=None)
        assert len(wrapped) == 12
        assert labels_of(wrapped) == want
        with pytest.raises(BadRequest, match="num_workers=0"):  # a worker process cannot share its sockets
            next(iter(DataLoader(loader, batch_size=None, num_workers=1)))


def test_ranks_from_the_launchers_variables_split_the_epoch_evenly(provider, make_token, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="libbus.loader.remote")
    parts = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        with RemoteLoader("zeros", provider=provider.endpoint, token=make_token(), batch_size=8) as loader:
            assert (loader.rank, loader.world_size) == (rank, 2)
            parts.append([len(y) for _, y in loader])
            parts[-1].append(list(loader.order(1)))
    assert parts[0][:-1] == parts[1][:-1] == [8] * 6 + [2]  # 50 each: the same number of batches
    assert not set(parts[0][-1]) & set(parts[1][-1])
    assert "rank 1 of 2 (environment, local rank 0) reads shard [50, 100)" in caplog.text


def test_a_cursor_saved_at_two_ranks_resumes_at_three_and_at_one_exactly(provider, make_token):
    kw = dict(provider=provider.endpoint, token=make_token(), batch_size=20, seed=4, shuffle="block", block_size=30)
    seen: list[int] = []
    states = []
    for rank, steps in ((0, 4), (1, 3)):  # rank 1 was one step behind when the job was stopped
        with RemoteLoader("mnist", rank=rank, world_size=2, **kw) as loader:
            for i, (x, y) in enumerate(loader):
                seen += ids_of([(x, y)])
                if i + 1 == steps:
                    break
            states.append(orjson.loads(orjson.dumps(loader.state_dict())))
    for world, saved in ((3, states), (1, merge_cursors(states))):
        rest: list[int] = []
        for rank in range(world):
            with RemoteLoader("mnist", rank=rank, world_size=world, drop_uneven=False, **kw) as loader:
                loader.load_state_dict(saved)
                rest += ids_of(loader)
                assert loader.epoch == 1
        counts = Counter(seen + rest)
        assert sorted(counts) == list(range(600)) and set(counts.values()) == {1}, f"world {world}"
    with RemoteLoader("mnist", rank=0, world_size=3, drop_uneven=False, **kw) as loader:
        loader.load_state_dict(states)
        assert len(loader.order(0)) == 154  # rank 0 of 3: a third of the 460 left, rounded up
        loader.rewind()  # starting over forgets the resumed epoch's plan
        assert len(loader.order(0)) == 200 and loader.state_dict()["plan"] is None


def test_a_transform_runs_on_each_batch_in_the_script(provider, make_token):
    def to_half(batch):
        x, y = batch
        return x.half(), y + 1

    with RemoteLoader(
        "zeros", provider=provider.endpoint, token=make_token(), batch_size=25, transform=to_half
    ) as loader:
        batches = list(loader)
    assert [x.dtype for x, _ in batches] == [torch.float16] * 4
    assert all(int(y.min()) >= 1 for _, y in batches)
    with pytest.raises(BadRequest, match="transform must be a callable"):
        RemoteLoader("zeros", provider=provider.endpoint, token=make_token(), transform="mymodule:fn")


def test_the_data_stall_is_counted_by_replica_and_exported(provider, make_token):
    from prometheus_client import CollectorRegistry, generate_latest

    with RemoteLoader("mnist", provider=provider.endpoint, token=make_token(), batch_size=100, inflight=1) as loader:
        list(loader)
        total, by_replica = loader.stall.snapshot()
    assert total > 0 and total == pytest.approx(loader.wait_s) and list(by_replica) == [provider.endpoint]
    registry = CollectorRegistry()
    registry.register(loader.stall)
    text = generate_latest(registry).decode()
    assert 'batchbus_loader_data_wait_seconds_total{dataset="mnist",replica="' in text


def test_a_loop_that_stops_at_len_batches_starts_the_next_epoch_on_the_next_pass(provider, make_token):
    """Lightning takes ``len(loader)`` batches and never asks for one more: the epoch is still over."""
    with RemoteLoader("zeros", provider=provider.endpoint, token=make_token(), batch_size=25, shuffle=False) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(len(loader))]
        assert (loader.epoch, loader.position) == (0, 100) and len(first) == 4
        assert len(list(loader)) == 4 and loader.epoch == 2  # epoch 1, whole; the next pass is epoch 2


def test_the_public_api_is_one_import_and_costs_no_torch_until_used():
    import subprocess
    import sys

    code = (
        "import sys, libbus; assert 'torch' not in sys.modules, 'import libbus pulled in torch'; "
        "from libbus import RemoteLoader, as_float, merge_cursors, errors; "
        "assert issubclass(errors.BadRequest, errors.BusError) and 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_torch_distributed_checkpoint_saves_and_loads_the_cursor(provider, make_token, tmp_path):
    import torch.distributed.checkpoint as dcp

    kw = dict(provider=provider.endpoint, token=make_token(), batch_size=20, seed=2, rank=0, world_size=1)
    with RemoteLoader("mnist", **kw) as loader:
        it = iter(loader)
        for _ in range(4):
            next(it)
        dcp.save({"loader": loader}, checkpoint_id=str(tmp_path))  # a Stateful: its state_dict() is saved
        rest = ids_of(it)
    with RemoteLoader("mnist", **kw) as resumed:
        dcp.load({"loader": resumed}, checkpoint_id=str(tmp_path))
        assert (resumed.epoch, resumed.position) == (0, 80)
        assert ids_of(resumed) == rest
