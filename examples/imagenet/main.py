"""ImageNet-style training (a ResNet, SGD with momentum, top-1/top-5), in the shape of the PyTorch
examples' ``imagenet/main.py``, reading through batchbus instead of an ``ImageFolder``.

    make serve-examples                                   # another terminal: serves imagenet (mock://cifar10)
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/imagenet/main.py --epochs 2

A real ImageNet is served the same way, decoded on the provider:
``busctl start provider --dataset 'imagenet=file:///data/imagenet?size=224&augment=1'``.
There is no ``--workers``, no ``DistributedSampler`` and no ``set_epoch`` bookkeeping beyond one call:
the provider decodes, the loader prefetches, finds its rank and shards. Val and test are read sharded,
every sample exactly once (``drop_uneven=False``), and the ranks' counts are all-reduced, so the
accuracy printed is the whole split's — the original example needs an extra loader for the samples
its sampler leaves out. The test split is scored only where the provider's operator made it readable
(``private_test=false``). ``--resume`` continues from ``checkpoint.pth.tar`` at the next epoch.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/: recipe_support
from recipe_support import loader_args  # noqa: E402

from libbus import RemoteLoader, as_float  # noqa: E402

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training, data through batchbus")
parser.add_argument("--dataset", default="imagenet", help="dataset name the router resolves (default: imagenet)")
parser.add_argument("--width", default=32, type=int, help="channels of the ResNet's first stage (default: 32)")
parser.add_argument("--epochs", default=90, type=int, help="number of total epochs to run")
parser.add_argument("-b", "--batch-size", default=64, type=int, help="mini-batch size per rank (default: 64)")
parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, help="initial learning rate", dest="lr")
parser.add_argument("--momentum", default=0.9, type=float, help="momentum")
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, help="weight decay", dest="weight_decay")
parser.add_argument("-p", "--print-freq", default=10, type=int, help="print frequency (default: 10)")
parser.add_argument("--resume", action="store_true", help="continue from checkpoint.pth.tar")
parser.add_argument("-e", "--evaluate", action="store_true", help="evaluate the model on val and test only")
parser.add_argument("--seed", default=0, type=int, help="seed of the data order and the model's init")
parser.add_argument("--checkpoint-dir", default=".", help="where checkpoint.pth.tar goes (default: .)")


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.down(x))


def resnet(channels: int, classes: int, width: int) -> nn.Module:
    """A small ResNet (three stages of basic blocks) for images of any size."""
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        BasicBlock(width, width, 1),
        BasicBlock(width, 2 * width, 2),
        BasicBlock(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, classes),
    )


def main():
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    distributed = "RANK" in os.environ  # under torchrun
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if use_cuda else "cpu")
    torch.manual_seed(args.seed)

    common = {**loader_args(), "device": str(device)}
    train_loader = RemoteLoader(args.dataset, batch_size=args.batch_size, seed=args.seed, **common)
    info = train_loader.info

    def eval_loader(split: str) -> RemoteLoader:
        """This rank's shard of ``split`` (the rank named: sharded), every sample once over the ranks."""
        shard = {"rank": rank, "world_size": world, "drop_uneven": False}
        return RemoteLoader(args.dataset, split=split, batch_size=args.batch_size, shuffle=False, **shard, **common)

    val_loader = eval_loader("val")
    test_loader = eval_loader("test") if info["splits"]["test"]["available"] else None

    model = resnet(info["sample_shape"][0], info["num_classes"], args.width).to(device)
    if distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)

    start_epoch, best_acc1 = 0, 0.0
    checkpoint_path = Path(args.checkpoint_dir) / "checkpoint.pth.tar"
    checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
    if args.resume and checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path, map_location=device, weights_only=True)
        start_epoch, best_acc1 = checkpoint["epoch"], checkpoint["best_acc1"]
        getattr(model, "module", model).load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        if rank == 0:
            print(f"=> loaded checkpoint '{checkpoint_path}' (epoch {start_epoch})", flush=True)

    if args.evaluate:
        validate(val_loader, model, criterion, device, "Val", distributed, rank)
        if test_loader is not None:
            validate(test_loader, model, criterion, device, "Test", distributed, rank)
        return

    for epoch in range(start_epoch, args.epochs):
        train_loader.set_epoch(epoch)  # the epoch's order (seeded): a resumed run replays it exactly
        train(train_loader, model, criterion, optimizer, epoch, device, args, rank)
        acc1 = validate(val_loader, model, criterion, device, "Val", distributed, rank)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if rank == 0:
            state = {
                "epoch": epoch + 1,
                "state_dict": getattr(model, "module", model).state_dict(),
                "best_acc1": best_acc1,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            }
            save_checkpoint(state, is_best, checkpoint_path)
    if test_loader is not None:
        validate(test_loader, model, criterion, device, "Test", distributed, rank)
    elif rank == 0:
        print("Test: private on the provider (its operator did not set private_test=false)", flush=True)
    for loader in (train_loader, val_loader, test_loader):
        if loader is not None:
            loader.close()
    if distributed:
        del model, optimizer, scheduler  # DDP holds the process group until collected (docs/python-api.md)
        gc.collect()
        dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, epoch, device, args, rank):
    batch_time, losses = AverageMeter("Time", ":6.3f"), AverageMeter("Loss", ":.4e")
    top1, top5 = AverageMeter("Acc@1", ":6.2f"), AverageMeter("Acc@5", ":6.2f")
    progress = ProgressMeter(len(train_loader), [batch_time, losses, top1, top5], prefix=f"Epoch: [{epoch}]")
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(train_loader):
        images, target = as_float(images), target.to(device)
        output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1 * 100.0 / images.size(0), images.size(0))
        top5.update(acc5 * 100.0 / images.size(0), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batch_time.update(time.time() - end)
        end = time.time()
        if rank == 0 and i % args.print_freq == 0:
            progress.display(i + 1)


def validate(loader, model, criterion, device, what: str, distributed: bool, rank: int) -> float:
    """Top-1/top-5 over the whole split: each rank sums its shard, the sums are all-reduced."""
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top-1 hits, top-5 hits, samples
    model.eval()
    with torch.no_grad():
        for images, target in loader:
            images, target = as_float(images), target.to(device)
            output = model(images)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            sums += torch.tensor(
                [criterion(output, target).item() * images.size(0), acc1, acc5, images.size(0)],
                dtype=torch.float64,
                device=device,
            )
    if distributed:
        dist.all_reduce(sums)
    loss, hits1, hits5, n = sums.tolist()
    top1 = 100.0 * hits1 / max(n, 1)
    if rank == 0:
        print(
            f" * {what}: Acc@1 {top1:.3f} ({int(hits1)}/{int(n)}) Acc@5 {100.0 * hits5 / max(n, 1):.3f} "
            f"({int(hits5)}/{int(n)}) Loss {loss / max(n, 1):.4f}",
            flush=True,
        )
    return top1


def save_checkpoint(state, is_best, path: Path):
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a kill mid-save keeps the previous checkpoint
    if is_best:
        shutil.copyfile(path, path.with_name("model_best.pth.tar"))


class AverageMeter:
    """Computes and stores the average and current value."""

    def __init__(self, name, fmt=":f"):
        self.name, self.fmt = name, fmt
        self.val = self.avg = self.sum = self.count = 0.0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)


class ProgressMeter:
    def __init__(self, num_batches, meters, prefix=""):
        width = len(str(num_batches))
        self.batch_fmt = "[{:" + str(width) + "d}/" + str(num_batches) + "]"
        self.meters, self.prefix = meters, prefix

    def display(self, batch):
        print("\t".join([self.prefix + self.batch_fmt.format(batch)] + [str(m) for m in self.meters]), flush=True)


def accuracy(output, target, topk=(1,)) -> list[float]:
    """How many of the batch's samples have their label among the top-k predictions, for each k."""
    k = min(max(topk), output.size(1))
    pred = output.topk(k, 1, True, True).indices.t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[: min(t, k)].reshape(-1).float().sum().item() for t in topk]


if __name__ == "__main__":
    main()
