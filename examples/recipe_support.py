"""What the recipes share: where the data is, and a ledger of the samples trained on.

Each recipe reads its connection from the environment, as a real script would take it from its
launcher: ``BATCHBUS_ROUTER`` (or ``BATCHBUS_PROVIDER``, one provider's data endpoint),
``BATCHBUS_TOKEN`` and ``BATCHBUS_DATASET``; with none of them set, from the ``connection.json``
that ``make serve-examples`` (``examples/serve.py``) writes while it serves the examples' datasets.

The ledger is how the recipes prove what they claim: each appends the sample ids of every batch it
trains on (``epoch id`` per line), records the ledger's length in each checkpoint, and cuts it back
to that length when it resumes, so that after a ``kill -9`` and a resume the ledger holds exactly
the samples the final model was trained on. ``RECIPE_DIE_AT=N`` makes a run kill itself with
SIGKILL right after its N-th step (counting steps since the run started), to test exactly that.
The datasets the tests serve hold the sample's index in its first feature, so an id is ``x[:, 0]``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def loader_args() -> dict:
    """``router=``/``provider=`` and ``token=`` for :class:`libbus.RemoteLoader`: from the environment,
    else from what ``make serve-examples`` wrote. Exits with what to do when neither is there."""
    router, provider = os.environ.get("BATCHBUS_ROUTER"), os.environ.get("BATCHBUS_PROVIDER")
    if router or provider:
        where = {"router": router} if router else {"provider": provider}
        return {**where, "token": os.environ["BATCHBUS_TOKEN"]}
    served = Path(os.environ.get("BATCHBUS_EXAMPLES_DIR") or REPO / "state" / "examples") / "connection.json"
    if not served.exists():
        raise SystemExit(
            f"no cluster to read from: run `make serve-examples` in another terminal (it writes {served}), "
            "or set BATCHBUS_ROUTER and BATCHBUS_TOKEN"
        )
    connection = json.loads(served.read_text())
    return {"router": connection["router"], "token": connection["token"]}


def dataset() -> str:
    return os.environ.get("BATCHBUS_DATASET", "ids")


class Ledger:
    """Lines ``epoch id``, one per sample trained on; cut back to a checkpoint's count on resume."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self.count = len(self.path.read_text().splitlines())

    def add(self, epoch: int, x: torch.Tensor) -> None:
        ids = x[:, 0].long().tolist()
        with self.path.open("a") as f:  # written through at once: a SIGKILL keeps what was written
            f.writelines(f"{epoch} {i}\n" for i in ids)
        self.count += len(ids)

    def cut(self, count: int) -> None:
        """Forget what was trained on after the checkpoint we resume from."""
        lines = self.path.read_text().splitlines()[:count]
        self.path.write_text("".join(f"{line}\n" for line in lines))
        self.count = len(lines)

    @property
    def marks(self) -> Path:
        return self.path.with_name(f"{self.path.name}.marks")

    def mark(self, step: int) -> None:
        """Note this ledger's length at global ``step`` (a line ``step count``), for :meth:`cut_at`:
        how a rank keeps its own count of a checkpoint without gathering it to the rank that saves."""
        with self.marks.open("a") as f:
            f.write(f"{step} {self.count}\n")
            f.flush()
            os.fsync(f.fileno())

    def cut_at(self, step: int) -> None:
        """Cut back to this ledger's length at the checkpoint of global ``step``: its last mark at or
        before that step (none: everything in it came after the checkpoint)."""
        marks = (
            [tuple(map(int, line.split())) for line in self.marks.read_text().splitlines()]
            if self.marks.exists()
            else []
        )
        self.cut(max((count for at, count in marks if at <= step), default=0))


class Killer:
    """``RECIPE_DIE_AT=N``: SIGKILL this process after its N-th step (a crash, not an exit)."""

    def __init__(self) -> None:
        self.at = int(os.environ.get("RECIPE_DIE_AT", "0"))
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def save_atomically(obj: object, path: str | Path) -> None:
    """torch.save to a temporary file, then rename: a kill mid-save leaves the previous checkpoint."""
    tmp = Path(f"{path}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
