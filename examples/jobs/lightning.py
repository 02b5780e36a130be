"""A Lightning ``Trainer`` run inside a job: the module and the trainer are yours, batchbus feeds the
data and holds the job (checkpoints, commands, reports, the model).

    busctl submit --dataset mnist --entrypoint examples.jobs.lightning:train --param epochs=2

Lightning fetches one batch ahead of the step it trains, so the job checkpoints and applies commands
at epoch ends, where the loader's cursor is exact (``job.report`` in ``on_validation_epoch_end``): a
stop mid-epoch ends the attempt at the next epoch end, and a resumed attempt starts at the epoch after
its last report. (Mid-epoch exactness needs the step-level calls of ``examples/jobs/mnist.py``.)
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from libbus import Job, as_float


class Classifier(L.LightningModule):
    def __init__(self, features: int, classes: int, lr: float):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, classes))
        self.lr = lr
        self.val_sums = torch.zeros(3, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(as_float(x)), y.long())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(as_float(x))
        self.val_sums += torch.tensor(
            [F.cross_entropy(logits, y.long(), reduction="sum").item(), (logits.argmax(1) == y).sum().item(), len(y)],
            dtype=torch.float64,
        )

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class JobReports(L.Callback):
    """Each epoch's validation to the job (a record, a checkpoint, the router's verdict)."""

    def __init__(self, job: Job):
        self.job = job

    def on_validation_epoch_start(self, trainer, module):
        module.val_sums.zero_()

    def on_validation_epoch_end(self, trainer, module):
        if trainer.sanity_checking:
            return
        loss, hits, n = module.val_sums.tolist()
        self.job.report(val_loss=loss / n, val_accuracy=hits / n)


def train(job: Job) -> None:
    p = job.params
    L.seed_everything(p.get("seed", 0), verbose=False)
    train_loader, val_loader = job.loader("train"), job.loader("val")
    x, _ = next(iter(val_loader))
    module = Classifier(x[0].numel(), p.get("classes", 10), p.get("lr", 3e-3))
    trainer = L.Trainer(
        max_epochs=p.get("epochs", 2),
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the loader shards itself
        callbacks=[JobReports(job)],
    )
    optimizers: list = []
    job.on_checkpoint(
        lambda: {"model": module, "optimizers": [o.state_dict() for o in optimizers], "epoch": trainer.current_epoch}
    )
    state = job.restore()
    start = 0
    if state is not None:
        module.load_state_dict(state["model"])
        start = train_loader.epoch  # the epoch after the last report

    class Resume(L.Callback):
        def on_train_start(self, trainer, module):
            optimizers[:] = trainer.optimizers
            if state is not None:
                for opt, saved in zip(trainer.optimizers, state["optimizers"]):
                    opt.load_state_dict(saved)
                trainer.fit_loop.epoch_progress.current.completed = start
                trainer.fit_loop.epoch_progress.current.processed = start

    trainer.callbacks.append(Resume())
    print(f"attempt {job.attempt}: Lightning fit from epoch {start}")
    trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader)
    job.save_model(module.state_dict())
