"""PyTorch's MNIST example as a batchbus job: the training function, written on the job API.

    busctl submit --dataset mnist --entrypoint examples.jobs.mnist:train --param epochs=3 --param lr=1.0

The trainer that runs it must allow the module (``job_modules = ["examples.jobs."]`` in its settings,
or ``BATCHBUS_JOB_MODULES=examples.jobs.``) and import it (an installed package, or ``PYTHONPATH``).
Each attempt resumes where the last checkpoint left it: model, optimizer, scheduler, the random
generators and the train loader's cursor, at the exact next sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR

from libbus import Job, as_float


class Net(nn.Module):
    def __init__(self, channels: int = 1, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.LazyLinear(128)
        self.fc2 = nn.Linear(128, classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def images(data: torch.Tensor) -> torch.Tensor:
    """Samples as a (N, C, H, W) float batch (MNIST's 28×28 come without a channel axis)."""
    data = as_float(data)
    return data.unsqueeze(1) if data.dim() == 3 else data


def train(job: Job) -> None:
    p = job.params
    torch.manual_seed(p.get("seed", 1))
    device = job.device
    train_loader = job.loader("train")
    val_loader = job.loader("val", batch_size=p.get("test_batch_size", 1000))
    model = Net(classes=int(p.get("classes", 10))).to(device)
    model(images(next(iter(val_loader))[0][:1]).to(device))  # LazyLinear takes its shape from a sample
    optimizer = torch.optim.Adadelta(model.parameters(), lr=p.get("lr", 1.0))
    scheduler = StepLR(optimizer, step_size=1, gamma=p.get("gamma", 0.7))
    job.on_checkpoint(lambda: {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    state = job.restore()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    for epoch in range(train_loader.epoch, p.get("epochs", 14)):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = images(data).to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            job.step(loss=loss.item())
            if batch_idx % p.get("log_interval", 10) == 0:
                print(
                    f"Train Epoch: {epoch} [{train_loader.position}/{len(train_loader.dataset)}]\tLoss: {loss.item():.6f}"
                )
        scheduler.step()
        model.eval()
        loss_sum, correct, n = 0.0, 0, 0
        with torch.no_grad():
            for data, target in val_loader:
                data, target = images(data).to(device), target.to(device)
                output = model(data)
                loss_sum += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(dim=1).eq(target).sum().item()
                n += len(data)
        print(f"Val set: Average loss: {loss_sum / n:.4f}, Accuracy: {correct}/{n} ({100.0 * correct / n:.0f}%)")
        job.report(val_loss=loss_sum / n, val_accuracy=correct / n)
    job.save_model(model.state_dict())
