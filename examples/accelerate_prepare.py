"""Hugging Face Accelerate: ``python examples/accelerate_prepare.py CKPT_DIR`` (or ``accelerate launch``).

``Accelerator.prepare`` takes the model and the optimizer; the RemoteLoader is registered for
checkpointing (``register_for_checkpointing``: it has ``state_dict``/``load_state_dict``), so
``save_state``/``load_state`` carry its cursor with the rest. The loader is not passed through
``prepare``: it shards by itself (under ``accelerate launch`` it finds its rank in the process
group), and Accelerate's own data-loader wrapping would shard or dispatch its batches a second time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from recipe_support import Killer, Ledger, dataset, loader_args
from torch import nn

from libbus import RemoteLoader, as_float

EPOCHS, EVERY = 2, 3


def main(ckpt_dir: str) -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loader = RemoteLoader(dataset(), batch_size=4, seed=4, device=str(accelerator.device), **loader_args())
    accelerator.register_for_checkpointing(loader)
    latest, ledger = Path(ckpt_dir) / "latest.json", Ledger(Path(ckpt_dir) / "ledger.txt")
    step = 0
    if latest.exists():
        meta = json.loads(latest.read_text())
        accelerator.load_state(meta["dir"])  # model, optimizer, random state and the loader's cursor
        step = meta["step"]
        ledger.cut(meta["ledger"])
    killer = Killer()
    while loader.epoch < EPOCHS:
        epoch = loader.epoch
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(as_float(x)), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            ledger.add(epoch, x)
            step += 1
            if step % EVERY == 0:
                state_dir = str(Path(ckpt_dir) / f"state-{step}")
                accelerator.save_state(state_dir)
                # the pointer is replaced last, in one rename: a kill mid-save leaves the previous state
                tmp = Path(f"{latest}.tmp")
                tmp.write_text(json.dumps({"dir": state_dir, "step": step, "ledger": ledger.count}))
                tmp.replace(latest)
            killer.step()
    loader.close()


if __name__ == "__main__":
    main(sys.argv[1])
