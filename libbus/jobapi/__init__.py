"""The job API: what a training function submitted as a job is handed (``docs/jobs.md``).

A job names ``entrypoint = "package.module:function"``; a trainer whose operator allows that module
(its ``job_modules`` setting) runs ``function(job)`` in a process of its own, one per attempt, with
``job`` a :class:`Job`::

    def train(job: Job) -> None:
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=job.params["lr"])
        job.on_checkpoint(lambda: {"model": model, "optimizer": optimizer})
        state = job.restore()  # None on a first attempt
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        loader = job.loader(batch_size=64)  # at the resumed attempt's exact next sample
        for epoch in range(loader.epoch, job.params["epochs"]):
            for x, y in loader:
                ...
                job.step(loss=loss.item())  # commands apply here
            job.report(val_loss=..., val_accuracy=...)  # one epoch's record
        job.save_model(model.state_dict())
"""

from __future__ import annotations

from .checkpoint_state import StateError, decode_state, encode_state
from .job import CheckpointRecord, Job, JobEnded, ModelRecord

__all__ = ["CheckpointRecord", "Job", "JobEnded", "ModelRecord", "StateError", "decode_state", "encode_state"]
