"""torchdata's StatefulDataLoader over RemoteLoader: ``python examples/stateful_dataloader.py CKPT_DIR``.

``StatefulDataLoader(loader, batch_size=None)`` checkpoints the loader's cursor through its own
``state_dict()`` (RemoteLoader is a ``Stateful`` iterable dataset): resuming it from a checkpoint
continues at the exact sample, in the middle of an epoch too. RemoteLoader prefetches by itself, so
the DataLoader runs no workers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from recipe_support import Killer, Ledger, dataset, loader_args, save_atomically
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from libbus import RemoteLoader, as_float

EPOCHS, EVERY = 2, 3


def main(ckpt_dir: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = RemoteLoader(dataset(), batch_size=4, seed=2, **loader_args())
    data = StatefulDataLoader(loader, batch_size=None)
    ckpt = Path(ckpt_dir) / "ckpt.pt"
    ledger = Ledger(Path(ckpt_dir) / "ledger.txt")
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data.load_state_dict(state["data"])
        step = state["step"]
        ledger.cut(state["ledger"])
    killer = Killer()
    while loader.epoch < EPOCHS:
        epoch = loader.epoch
        for x, y in data:  # each pass is the loader's next epoch (or the rest of the resumed one)
            loss = nn.functional.cross_entropy(model(as_float(x)), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ledger.add(epoch, x)
            step += 1
            if step % EVERY == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                save_atomically({**state, "data": data.state_dict(), "ledger": ledger.count}, ckpt)
            killer.step()
    loader.close()


if __name__ == "__main__":
    main(sys.argv[1])
