"""A LightningModule written from docs/python-api.md ("Validation in Lightning") against a real
provider: every validation epoch reads the whole val split, after the sanity check's two batches
too, and with ``limit_val_batches`` every epoch reads the same first batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from libbus import RemoteLoader, as_float
from services.provider.sources import open_source

L = pytest.importorskip("lightning", reason="needs the recipes extra (pip install -e '.[recipes]')")

_VAL, _ = open_source("mock://mnist?n=600").read("val", np.arange(120))  # the provider fixture's "mnist"
_INDEX = {row.tobytes(): i for i, row in enumerate(_VAL)}


class RemoteData(L.LightningDataModule):
    def __init__(self, **where) -> None:
        super().__init__()
        self.where = where

    def setup(self, stage: str) -> None:
        self.train = RemoteLoader("mnist", batch_size=100, **self.where)
        self.val = RemoteLoader("mnist", split="val", batch_size=40, **self.where)  # whole split, every rank

    def train_dataloader(self) -> RemoteLoader:
        return self.train

    def val_dataloader(self) -> RemoteLoader:
        return self.val

    def teardown(self, stage: str) -> None:
        self.train.close()
        self.val.close()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(784, 10)
        self.seen: list[int] = []
        self.epochs: list[tuple[bool, list[int]]] = []  # (sanity check?, val samples seen) per validation

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(as_float(x).flatten(1)), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.seen += [_INDEX[row.tobytes()] for row in x.cpu().numpy()]
        correct = (self.net(as_float(x).flatten(1)).argmax(1) == y).sum()
        self.log("val_correct", correct.float(), reduce_fx="sum")

    def on_validation_epoch_end(self) -> None:
        self.epochs.append((self.trainer.sanity_checking, self.seen))
        self.seen = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(tmp_path, where: dict, **trainer_args) -> Model:
    model = Model()
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=1,
        **trainer_args,
    )
    trainer.fit(model, datamodule=RemoteData(**where))
    return model


@pytest.fixture
def where(provider, make_token) -> dict:
    return {"provider": provider.endpoint, "token": make_token()}


def test_every_validation_reads_the_whole_val_split_after_the_sanity_check(where, tmp_path):
    model = fit(tmp_path, where, limit_train_batches=2)
    sanity, *epochs = model.epochs
    assert [sorted(seen) for _, seen in epochs] == [list(range(120))] * 3  # every sample, every epoch
    assert sanity == (True, list(range(40)))  # one batch, then Lightning leaves the pass
    assert epochs == [(False, list(range(120)))] * 3  # in order: val is not shuffled


def test_limit_val_batches_reads_the_same_first_batches_every_epoch(where, tmp_path):
    model = fit(tmp_path, where, limit_train_batches=2, limit_val_batches=2)
    first, *epochs = [seen for _, seen in model.epochs]
    assert len(epochs) == 3 and all(seen == epochs[0] for seen in epochs) and len(epochs[0]) == 80
    assert first == epochs[0][:40] and epochs[0] == list(range(80))
