"""What a DataLoader user does by habit, done to RemoteLoader against a real provider: whole passes
(after a ``break``, after ``set_epoch``, after a state loaded directly or through torchdata's
``StatefulDataLoader``), DataLoader's names (``len(loader)``, ``len(loader.dataset)``), wrapping in a
``DataLoader``, DataLoader arguments, evaluation on every rank or sharded, the private test split,
and a script that finds its router and token as busctl does (a real process)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from torch.utils.data import DataLoader

from libbus import RemoteLoader
from libbus.errors import BadRequest, SplitPrivate
from services.provider.sources import open_source
from tests.support import REPO

MNIST = "mock://mnist?n=600"  # the provider fixture serves it as "mnist": train 600, val 120
_SOURCE = open_source(MNIST)
_INDEX = {
    split: {row.tobytes(): i for i, row in enumerate(_SOURCE.read(split, np.arange(n))[0])}
    for split, n in (("train", 600), ("val", 120))
}


def ids_of(batches, split: str = "train") -> list[int]:
    """The sample indices of mock mnist ``batches``, found by their bytes."""
    return [_INDEX[split][row.tobytes()] for x, _ in batches for row in x.numpy()]


def take(loader, n: int) -> list:
    """The first ``n`` batches of a pass, then the pass is left (a ``break``)."""
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


@pytest.fixture
def kw(provider, make_token) -> dict:
    return dict(provider=provider.endpoint, token=make_token(), batch_size=50, seed=4)


def test_a_pass_left_early_leaves_no_trace_on_the_next(kw):
    with RemoteLoader("mnist", **kw) as train:
        assert len(take(train, 3)) == 3 and (train.epoch, train.position) == (0, 150)
        whole = ids_of(train)  # the next pass: epoch 1, from its start
        assert whole == list(train.order(1)) and len(whole) == 600
        assert (train.epoch, train.position) == (2, 0)
    with RemoteLoader("mnist", split="val", **kw) as val:
        first = ids_of(take(val, 1), "val")
        assert ids_of(val, "val") == list(range(120))  # the whole split, in order (val is not shuffled)
        assert first == list(range(50))


def test_set_epoch_names_the_epoch_of_the_next_pass_from_its_start(kw):
    with RemoteLoader("mnist", **kw) as train:
        take(train, 2)
        train.set_epoch(0)  # the epoch a pass already began: whole again, as DistributedSampler
        assert ids_of(train) == list(train.order(0))
        train.set_epoch(5)
        assert ids_of(take(train, 1)) == list(train.order(5)[:50]) and train.epoch == 5


def test_only_the_first_pass_after_load_state_dict_continues_at_the_cursor(kw):
    with RemoteLoader("mnist", **kw) as first:
        take(first, 4)
        state = first.state_dict()
    with RemoteLoader("mnist", **kw) as resumed:
        resumed.load_state_dict(state)
        assert (resumed.epoch, resumed.position) == (0, 200)  # at once, before any pass
        resumed.set_epoch(0)  # a training loop's call at the resumed epoch keeps the cursor
        assert ids_of(resumed) == list(resumed.order(0)[200:])
        assert ids_of(resumed) == list(resumed.order(1))  # then whole passes again
        resumed.load_state_dict(state)
        take(resumed, 1)  # the resumed pass, left early
        assert ids_of(resumed) == list(resumed.order(1))


def test_a_state_saved_after_the_last_batch_reads_as_the_next_epoch(kw):
    with RemoteLoader("mnist", **kw) as loader:
        it = iter(loader)
        for _ in range(len(loader)):  # Lightning stops at len(loader) and asks no more
            next(it)
        state = loader.state_dict()
        assert (state["epoch"], state["position"]) == (0, 600)
        loader.load_state_dict(state)
        assert (loader.epoch, loader.position) == (1, 0)
        assert ids_of(loader) == list(loader.order(1))


def test_a_readme_loop_over_a_resumed_stateful_dataloader_trains_what_was_left(kw):
    from torchdata.stateful_dataloader import StatefulDataLoader

    epochs, seen = 2, []
    with RemoteLoader("mnist", **kw) as loader:
        data = StatefulDataLoader(loader, batch_size=None)
        for batch in data:
            seen += ids_of([batch])
            if len(seen) == 250:
                break
        saved = data.state_dict()
    with RemoteLoader("mnist", **kw) as loader:
        data = StatefulDataLoader(loader, batch_size=None)
        data.load_state_dict(saved)
        assert (loader.epoch, loader.position) == (0, 250)  # before the DataLoader's iter() applies it
        for epoch in range(loader.epoch, epochs):  # the README's loop
            loader.set_epoch(epoch)
            for batch in data:
                seen += ids_of([batch])
        assert seen == list(loader.order(0)) + list(loader.order(1))  # no epoch too many, no sample twice
        assert loader.epoch == epochs


def test_len_is_this_ranks_batches_and_len_dataset_the_splits_samples(kw):
    with RemoteLoader("mnist", rank=1, world_size=4, **{**kw, "batch_size": 64}) as train:
        assert len(train) == 3 and train.shard_size == 150  # 150 samples: 64 + 64 + 22
        assert len(train.dataset) == 600 and train.dataset.name == str(train.dataset) == "mnist"
        assert sum(len(y) for _, y in train) == train.shard_size
    with RemoteLoader("mnist", split="val", **kw) as val:
        assert len(val.dataset) == 120 and len(val) == 3 and val.dataset.split == "val"


def test_a_dataloader_that_would_batch_the_batches_fails_at_once_naming_batch_size_none(kw):
    with RemoteLoader("mnist", **kw) as loader:
        for wrapped in (DataLoader(loader), DataLoader(loader, batch_size=64)):
            with pytest.raises(BadRequest, match=r"batch_size=None"):
                iter(wrapped)
        x, _ = next(iter(DataLoader(loader, batch_size=None)))
        assert x.shape == (50, 1, 28, 28)  # the loader's own batch, no added dimension


@pytest.mark.parametrize(
    ("argument", "replacement"),
    [
        ("sampler", "shuffle="),
        ("batch_sampler", "batch_size="),
        ("num_workers", "inflight="),
        ("collate_fn", "transform="),
        ("pin_memory", "device="),
        ("prefetch_factor", "inflight="),
        ("worker_init_fn", "user stage"),
    ],
)
def test_a_dataloader_argument_is_answered_with_its_batchbus_equivalent(argument, replacement):
    with pytest.raises(BadRequest, match=f"takes no {argument}=.*{replacement}"):
        RemoteLoader("mnist", provider="tcp://127.0.0.1:1", token="t", **{argument: None})
    with pytest.raises(TypeError, match="unexpected keyword argument 'bach_size'"):
        RemoteLoader("mnist", provider="tcp://127.0.0.1:1", token="t", bach_size=3)  # type: ignore[call-arg]


def test_val_reads_the_whole_split_on_every_rank_unless_sharded(kw, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    whole, parts = [], []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        with RemoteLoader("mnist", split="val", **kw) as val:
            assert (val.rank, val.world_size, val.shard) == (rank, 3, False)
            whole.append(ids_of(val, "val"))
        with RemoteLoader("mnist", split="val", shard=True, **kw) as sharded:
            parts.append(ids_of(sharded, "val"))
            assert len(parts[-1]) == sharded.shard_size
    assert whole == [list(range(120))] * 3
    assert sorted(sum(parts, [])) == list(range(120))  # each sample on one rank, none dropped
    monkeypatch.setenv("RANK", "0")
    with RemoteLoader("zeros", split="val", shard=True, **{**kw, "batch_size": 4}) as val:
        assert len(val.dataset) == 20 and val.shard_size == 7  # 20 over 3 ranks: 7, 7, 6, none left out


def test_the_private_test_split_is_refused_when_the_loader_is_made(kw):
    with pytest.raises(SplitPrivate, match="test split of 'mnist' never leaves its provider"):
        RemoteLoader("mnist", split="test", **kw)


SCRIPT = """
from libbus import RemoteLoader
with RemoteLoader("mnist", split="val", batch_size=40) as val:
    print(sum(len(y) for _, y in val), len(val.dataset))
"""


def test_a_script_finds_the_router_and_token_as_busctl_does(router, provider, make_token, tmp_path):
    token_file = tmp_path / "trainer.token"
    token_file.write_text(make_token() + "\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("BATCHBUS_")}
    base["PYTHONPATH"] = str(REPO)

    def script(env: dict) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", SCRIPT], env={**base, **env}, capture_output=True, text=True, timeout=120
        )

    by_env = script({"BATCHBUS_ROUTER": router.endpoint, "BATCHBUS_TOKEN_FILE": str(token_file)})
    assert by_env.returncode == 0 and by_env.stdout.split() == ["120", "120"], by_env.stderr
    config = tmp_path / "batchbus.toml"
    config.write_text(f'router = "{router.endpoint}"\ntoken_file = "{token_file}"\n')
    by_file = script({"BATCHBUS_CONFIG": str(config)})
    assert by_file.returncode == 0 and by_file.stdout.split() == ["120", "120"], by_file.stderr
    none = script({"BATCHBUS_ROUTER": router.endpoint})
    assert none.returncode != 0 and "RemoteLoader needs a token" in none.stderr and "--role reader" in none.stderr
    assert "BATCHBUS_TOKEN_FILE" in none.stderr


DDP_EVAL = """
import sys
import torch
import torch.distributed as dist
from libbus import RemoteLoader

dist.init_process_group("gloo")
where = dict(provider=sys.argv[1], batch_size=32)  # the token: BATCHBUS_TOKEN_FILE, as busctl reads it
with RemoteLoader("mnist", split="val", **where) as val:
    ys = torch.cat([y for _, y in val])
with RemoteLoader("mnist", split="val", shard=True, **where) as part:
    totals = torch.zeros(2, dtype=torch.long)
    for _, y in part:
        totals += torch.tensor([int(y.sum()), len(y)])
    dist.all_reduce(totals)
    row = [dist.get_rank(), int(ys.sum()), len(ys), *totals.tolist(), part.shard_size, len(part.dataset)]
    with open(f"{sys.argv[2]}/rank{dist.get_rank()}.txt", "w") as out:  # one file a rank: no interleaving
        out.write(" ".join(map(str, row)))
dist.destroy_process_group()
"""


def test_under_torchrun_val_is_whole_on_every_rank_and_sharded_totals_sum_right(provider, make_token, tmp_path):
    script = tmp_path / "ddp_eval.py"
    script.write_text(DDP_EVAL)
    token_file = tmp_path / "trainer.token"
    token_file.write_text(make_token())
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHBUS_")}
    env.update(PYTHONPATH=str(REPO), BATCHBUS_TOKEN_FILE=str(token_file))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3", str(script)]
    done = subprocess.run(
        [*cmd, provider.endpoint, str(tmp_path)], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    labels = int(_SOURCE.read("val", np.arange(120))[1].sum())
    rows = sorted(path.read_text().split() for path in tmp_path.glob("rank*.txt"))
    assert [row[0] for row in rows] == ["0", "1", "2"]
    for _, whole_labels, whole_n, summed_labels, summed_n, shard_size, split_n in rows:
        assert (int(whole_labels), int(whole_n)) == (labels, 120)  # every rank: the whole split
        assert (int(summed_labels), int(summed_n)) == (labels, 120)  # shards summed: every sample once
        assert int(shard_size) == 40 and int(split_n) == 120


def test_a_scripts_connection_comes_from_busctls_settings_curve_keys_included(tmp_path):
    from libbus.config import script_connection

    env = {"BATCHBUS_STATE_DIR": str(tmp_path), "BATCHBUS_TOKEN_FILE": str(tmp_path / "t")}
    (tmp_path / "t").write_text("a-token\n")
    plain = script_connection(env=env)
    assert (plain.router, plain.token, plain.curve_key_file) == ("tcp://127.0.0.1:5555", "a-token", "")
    curve = script_connection(env={**env, "BATCHBUS_CURVE": "true", "BATCHBUS_ROUTER": "tcp://head:5555"})
    assert curve.router == "tcp://head:5555"
    assert curve.curve_key_file == str(tmp_path / "curve" / "trainer.key_secret")
    assert curve.curve_router_key == str(tmp_path / "curve" / "router.key")
