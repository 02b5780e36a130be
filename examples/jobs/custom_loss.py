"""A job with a loss of its own (focal loss, Lin et al. 2017), a cosine schedule with warm-up, and
gradient clipping: what the built-in loop cannot express, as a training function.

    busctl submit --dataset mnist --entrypoint examples.jobs.custom_loss:train --param epochs=3 --param gamma=2.0
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from libbus import Job, as_float


def focal_loss(logits: torch.Tensor, target: torch.Tensor, gamma: float) -> torch.Tensor:
    """Cross-entropy that weighs down samples the model already gets right."""
    logp = F.log_softmax(logits, dim=1).gather(1, target[:, None]).squeeze(1)
    return (-((1 - logp.exp()) ** gamma) * logp).mean()


def train(job: Job) -> None:
    p = job.params
    torch.manual_seed(p.get("seed", 0))
    train_loader, val_loader = job.loader("train"), job.loader("val")
    x, _ = next(iter(val_loader))
    model = nn.Sequential(nn.Flatten(), nn.Linear(x[0].numel(), 128), nn.ReLU(), nn.Linear(128, p.get("classes", 10)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=p.get("lr", 3e-3), weight_decay=0.01)
    epochs, warmup = p.get("epochs", 3), p.get("warmup_steps", 20)
    total = epochs * len(train_loader)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    job.on_checkpoint(lambda: {"model": model, "optimizer": optimizer, "schedule": schedule})
    state = job.restore()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
    print(f"attempt {job.attempt} starts at epoch {train_loader.epoch}, sample {train_loader.position}")
    for _ in range(train_loader.epoch, epochs):
        model.train()
        for data, target in train_loader:
            loss = focal_loss(model(as_float(data)), target.long(), p.get("gamma", 2.0))
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), p.get("clip", 1.0))
            optimizer.step()
            schedule.step()
            job.step(loss=loss.item())
        model.eval()
        hits, n, loss_sum = 0, 0, 0.0
        with torch.no_grad():
            for data, target in val_loader:
                logits = model(as_float(data))
                loss_sum += F.cross_entropy(logits, target.long(), reduction="sum").item()
                hits += (logits.argmax(1) == target).sum().item()
                n += len(target)
        job.report(val_loss=loss_sum / n, val_accuracy=hits / n)
    job.save_model(model.state_dict())
