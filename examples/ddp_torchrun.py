"""DDP under torchrun, with no rank arguments: ``torchrun --nproc_per_node 2 examples/ddp_torchrun.py CKPT_DIR``.

The loader finds its rank in the process group, reads its own shard, and gives every rank the same
number of batches (DDP's collectives stay in step). So the ranks are in lock-step, and rank 0's
cursor stands for every rank's: rank 0 saves it with the model, nothing is gathered, and the job
resumes exactly — after a ``kill -9`` — at this world size or another (``torchrun --nproc_per_node 3``
on the same checkpoint re-splits what is left of the epoch).

The DDP model is let go of, and collected, before ``destroy_process_group()``: with torch 2.13 on
Python 3.11 a DDP model keeps the gloo process group alive past ``destroy_process_group()`` until it is
collected, and gloo's threads torn down while the interpreter finalizes abort the rank ("terminate
called without an active exception", SIGABRT; docs/python-api.md has the counts, pytorch/pytorch#179291).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from recipe_support import Killer, Ledger, dataset, loader_args, save_atomically
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from libbus import RemoteLoader, as_float

EPOCHS, EVERY = 2, 3  # checkpoint every 3 steps


def main(ckpt_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = RemoteLoader(dataset(), batch_size=4, seed=1, **loader_args())  # rank and world: found
    ckpt = Path(ckpt_dir) / "ckpt.pt"
    ledger = Ledger(Path(ckpt_dir) / f"ledger-w{world}-r{rank}.txt")
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])  # rank 0's cursor, for every rank: any world size resumes
        step = state["step"]
        if rank == 0:  # what was trained on after the checkpoint never happened
            for path in Path(ckpt_dir).glob("ledger-*.txt"):
                Ledger(path).cut_at(step)
        dist.barrier()
        ledger = Ledger(ledger.path)
    killer = Killer()
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(as_float(x)), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ledger.add(epoch, x)
            step += 1
            if step % EVERY == 0:
                ledger.mark(step)
                dist.barrier()  # every rank's ledger marked before the checkpoint that counts on it
                if rank == 0:
                    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                    save_atomically({**state, "loader": loader.state_dict()}, ckpt)
                dist.barrier()  # no rank runs ahead of a checkpoint being written
            killer.step()
    loader.close()
    del model, optimizer  # DDP holds the process group until it is collected: let go of it first
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
