"""A Lightning ``Trainer`` with a ``LightningDataModule`` around RemoteLoader:
``python examples/lightning_datamodule.py CKPT_DIR``.

``train_dataloader`` returns the RemoteLoader itself: Lightning iterates it like a DataLoader and,
since it has ``state_dict``/``load_state_dict``, saves its cursor in every checkpoint and restores
it on ``fit(ckpt_path=...)`` — a run killed mid-epoch resumes at the exact sample. Under Lightning's
DDP strategy the loader finds its rank in the process group (Lightning adds no sampler to it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from recipe_support import Killer, Ledger, dataset, loader_args
from torch import nn

from libbus import RemoteLoader, as_float

EPOCHS, EVERY = 2, 3


class RemoteData(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.train: RemoteLoader | None = None

    def setup(self, stage: str) -> None:
        if self.train is None:
            self.train = RemoteLoader(dataset(), batch_size=4, seed=3, **loader_args())

    def train_dataloader(self) -> RemoteLoader:
        return self.train

    def teardown(self, stage: str) -> None:
        if self.train is not None:
            self.train.close()


class Model(L.LightningModule):
    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.net = nn.Linear(2, 2)
        self.ledger, self.killer = ledger, Killer()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.ledger.add(self.current_epoch, x)
        return nn.functional.cross_entropy(self.net(as_float(x)), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.killer.step()  # after the step's checkpoint (callbacks run first)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["ledger"] = self.ledger.count

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.ledger.cut(checkpoint["ledger"])


def main(ckpt_dir: str) -> None:
    torch.manual_seed(0)
    last = Path(ckpt_dir) / "last.ckpt"
    every = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=EVERY, save_last=True, save_top_k=0)
    trainer = L.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        devices=1,
        callbacks=[every],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Model(Ledger(Path(ckpt_dir) / "ledger.txt"))
    trainer.fit(model, datamodule=RemoteData(), ckpt_path=str(last) if last.exists() else None)


if __name__ == "__main__":
    main(sys.argv[1])
