"""Serve the examples' datasets on this machine: ``make serve-examples`` (or ``python examples/serve.py``).

Starts a router and a provider as real processes (``busctl start router|provider``, logs under the
state directory) and serves what the scripts in ``examples/`` read. It is an EdDSA cluster: the router
makes its signing key in the state directory on its first start (a state directory an older version gave
an HS256 ``secret`` keeps it). The datasets:

- ``ids``: 48 train, 6 val and 5 test samples whose first feature is the sample's index (the recipes
  prove "every sample exactly once" with it), generated as ``.npy`` pairs;
- ``mnist``: ``mock://mnist`` (generated, learnable, MNIST-shaped), for ``examples/mnist/main.py``;
- ``imagenet``: ``mock://cifar10`` (generated, learnable, 3-channel images), for ``examples/imagenet/main.py``;
- ``multi``: ``mock://fields`` (50 samples of named fields: images of varying size, tokens, text), for
  docs/datasets.md §8's loader block.

Nothing here needs hiding, so every test split is readable (``private_test=false``). It writes
``connection.json`` (the router's endpoint and a reader token scoped to these datasets: it reads them and
can take no job) into the state
directory, where ``recipe_support.loader_args`` finds it when ``BATCHBUS_ROUTER`` is not set, and the
same as settings: ``batchbus.toml`` (``router``, ``token_file``), for any script run with
``BATCHBUS_CONFIG`` naming it. It serves until Ctrl-C or SIGTERM and then removes both. The state directory is ``state/examples`` in the checkout, or
``BATCHBUS_EXAMPLES_DIR``. ``--samples N`` sets the mock datasets' train size (val and test: N/5).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout, as `python examples/serve.py`

from libbus.config import load_settings  # noqa: E402
from libbus.security.auth import private_dir  # noqa: E402
from services import credentials  # noqa: E402
from services.launch import ServiceProcs  # noqa: E402

IDS = {"train": 48, "val": 6, "test": 5}


def state_dir() -> Path:
    """Where the examples' cluster keeps its signing key, logs, data and ``connection.json``."""
    return Path(os.environ.get("BATCHBUS_EXAMPLES_DIR") or REPO / "state" / "examples")


def write_ids(root: Path) -> Path:
    """Sample i of each split is ``[i, i % 5]`` (its id in the first feature), label ``i % 2``."""
    root.mkdir(parents=True, exist_ok=True)
    for split, n in IDS.items():
        i = np.arange(n)
        np.save(root / f"{split}_x.npy", np.stack([i, i % 5], axis=1).astype(np.float32))
        np.save(root / f"{split}_y.npy", (i % 2).astype(np.int64))
    return root


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=5000, help="train samples of mnist and imagenet")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="the router's address (default: a free port)")
    args = parser.parse_args(argv)
    # It holds the cluster's signing key (the router makes it on its first start) and a reader token.
    state = private_dir(state_dir())
    connection, config = state / "connection.json", state / "batchbus.toml"
    connection.unlink(missing_ok=True)
    config.unlink(missing_ok=True)
    n = args.samples
    datasets = {
        "ids": f"file://{write_ids(state / 'data' / 'ids')}?private_test=false",
        "mnist": f"mock://mnist?n={n}&private_test=false",
        "imagenet": f"mock://cifar10?n={n}&private_test=false",
        "multi": "mock://fields?n=50&private_test=false",
    }
    procs = ServiceProcs(state)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        router = procs.start("router", "--bind", args.bind)
        served = [a for name, uri in datasets.items() for a in ("--dataset", f"{name}={uri}")]
        provider = procs.start("provider", "--router", router, *served)
        settings, _ = load_settings(env={}, flags={"state_dir": str(state)})
        key = credentials.signing_key(settings)
        token = credentials.mint_token(settings, key, role="reader", sub="examples", datasets=sorted(datasets))
        token_file = state / "token"
        token_file.touch(mode=0o600)
        token_file.write_text(token + "\n")
        config.write_text(
            "# examples/serve.py: the examples' router and a reader token (BATCHBUS_CONFIG=this file)\n"
            f"router = {json.dumps(router)}\ntoken_file = {json.dumps(str(token_file))}\n"
        )
        tmp = connection.with_suffix(".tmp")
        tmp.write_text(json.dumps({"router": router, "token": token, "datasets": sorted(datasets)}))
        tmp.replace(connection)  # whole or absent (and written last): a script never reads half of it
        print(f"router   {router}\nprovider {provider} serving {', '.join(datasets)} (state and logs in {state})")
        print("run an example in another terminal, e.g.: .venv/bin/python examples/stateful_dataloader.py /tmp/bb-sdl")
        print("Ctrl-C stops", flush=True)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        connection.unlink(missing_ok=True)
        config.unlink(missing_ok=True)
        codes = procs.stop()
        print("stopped: " + ", ".join(f"{role} exit {code}" for role, code in codes.items()), flush=True)


if __name__ == "__main__":
    main()
