"""MNIST with a small CNN, in the shape of the PyTorch examples' ``mnist/main.py``, reading through batchbus.

    make serve-examples                                   # another terminal: serves mnist (mock://mnist)
    .venv/bin/python examples/mnist/main.py --epochs 1
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/mnist/main.py --epochs 1

Under torchrun every rank trains on its own shard of train (the loader finds its rank; DDP averages
the gradients). Evaluation is never partial: val is read *sharded* and the ranks' sums are
all-reduced (the DistributedSampler habit, made exact with ``drop_uneven=False``), the test split is
read *whole* on every rank (nothing to reduce). The totals printed are the whole split's. The test
split is readable only where the provider's operator allowed it (``private_test=false``); otherwise
the script says so and skips it (the provider can still score a model: ``busctl submit --evaluate``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/: recipe_support
from recipe_support import loader_args  # noqa: E402

from libbus import RemoteLoader, as_float  # noqa: E402


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


def train(args, model, device, train_loader, optimizer, epoch, rank, world):
    model.train()
    train_loader.set_epoch(epoch)
    seen = 0
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = as_float(data).to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        seen += len(data)
        if rank == 0 and batch_idx % args.log_interval == 0:
            shard = train_loader.num_samples // world  # this rank's shard (every rank the same count)
            print(
                f"Train Epoch: {epoch} [{seen}/{shard} ({100.0 * (batch_idx + 1) / len(train_loader):.0f}%)]"
                f"\tLoss: {loss.item():.6f}",
                flush=True,
            )
            if args.dry_run:
                break


def evaluate(model, device, loader, what: str, reduce: bool, rank: int) -> tuple[int, int]:
    """Loss and accuracy over the whole split: summed here, all-reduced when ``loader`` is sharded."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss, correct, samples
    with torch.no_grad():
        for data, target in loader:
            data, target = as_float(data).to(device), target.to(device)
            output = model(data)
            sums[0] += F.nll_loss(output, target, reduction="sum").item()
            sums[1] += output.argmax(dim=1).eq(target).sum().item()
            sums[2] += len(data)
    if reduce:
        dist.all_reduce(sums)  # every rank's shard: the whole split
    loss, correct, n = sums[0].item(), int(sums[1]), int(sums[2])
    if rank == 0:
        print(
            f"{what} set: Average loss: {loss / max(n, 1):.4f}, Accuracy: {correct}/{n} ({100.0 * correct / max(n, 1):.0f}%)",
            flush=True,
        )
    return correct, n


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example, data through batchbus")
    parser.add_argument("--dataset", default="mnist", help="dataset name the router resolves (default: mnist)")
    parser.add_argument("--batch-size", type=int, default=64, help="input batch size per rank (default: 64)")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="batch size for val and test (default: 1000)")
    parser.add_argument("--epochs", type=int, default=14, help="number of epochs to train (default: 14)")
    parser.add_argument("--lr", type=float, default=1.0, help="learning rate (default: 1.0)")
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate step gamma (default: 0.7)")
    parser.add_argument("--no-cuda", action="store_true", help="disables CUDA training")
    parser.add_argument("--dry-run", action="store_true", help="quickly check a single pass")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
    parser.add_argument("--log-interval", type=int, default=10, help="batches between training logs")
    parser.add_argument("--save-model", action="store_true", help="save the model to mnist_cnn.pt")
    args = parser.parse_args()

    use_cuda = not args.no_cuda and torch.cuda.is_available()
    distributed = "RANK" in os.environ  # under torchrun
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    torch.manual_seed(args.seed)

    where = loader_args()
    common = {**where, "device": str(device)}
    # train: this rank's shard (rank and world size found). val: sharded by naming the rank, every
    # sample once over the ranks (drop_uneven=False), the sums all-reduced
    train_loader = RemoteLoader(args.dataset, batch_size=args.batch_size, seed=args.seed, **common)
    val_loader = RemoteLoader(
        args.dataset,
        split="val",
        batch_size=args.test_batch_size,
        shuffle=False,
        rank=rank,
        world_size=world,
        drop_uneven=False,
        **common,
    )
    readable_test = train_loader.info["splits"]["test"]["available"]
    test_loader = (  # the whole test split on every rank: nothing to reduce
        RemoteLoader(
            args.dataset,
            split="test",
            batch_size=args.test_batch_size,
            shuffle=False,
            rank=0,
            world_size=1,
            **common,
        )
        if readable_test
        else None
    )

    channels = train_loader.info["sample_shape"][0]
    model = Net(channels, train_loader.info["num_classes"]).to(device)
    model(torch.zeros(1, *train_loader.info["sample_shape"], device=device))  # size the lazy layer
    if distributed:
        model = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch, rank, world)
        evaluate(model, device, val_loader, "Val", distributed, rank)
        scheduler.step()
    if test_loader is not None:
        evaluate(model, device, test_loader, "Test", False, rank)
    elif rank == 0:
        print(
            f"Test set: private on the provider (its operator did not set private_test=false); "
            f"score the saved model there with busctl submit --evaluate --dataset {args.dataset} --split test",
            flush=True,
        )
    if args.save_model and rank == 0:
        torch.save(getattr(model, "module", model).state_dict(), "mnist_cnn.pt")
    for loader in (train_loader, val_loader, test_loader):
        if loader is not None:
            loader.close()
    if distributed:
        del model, optimizer, scheduler  # DDP holds the process group until collected (docs/python-api.md)
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
