"""The examples' cluster as ``make serve-examples`` runs it (``examples/serve.py``), for tests that run
what README, docs/ and examples/ show against it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .busctl import REPO

__all__ = ["serve_examples"]


@contextmanager
def serve_examples(state: Path, samples: int) -> Iterator[dict[str, str]]:
    """Run ``examples/serve.py --samples N`` with its state in ``state``; yield the environment a user's
    shell would have (no ``BATCHBUS_*`` but ``BATCHBUS_EXAMPLES_DIR``, this checkout on ``PYTHONPATH``).
    The settings file it writes is ``state / "batchbus.toml"``. On exit: SIGTERM, and it must have
    stopped its router and provider cleanly and removed its files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHBUS_")}
    env.update(BATCHBUS_EXAMPLES_DIR=str(state), PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "serve.py"), "--samples", str(samples)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    connection = state / "connection.json"
    try:
        deadline = time.monotonic() + 120
        while not connection.exists():
            if proc.poll() is not None:
                raise AssertionError(f"serve.py exited {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
            assert time.monotonic() < deadline, "serve.py wrote no connection.json in 120 s"
            time.sleep(0.1)
        json.loads(connection.read_text())  # whole: written last
        yield env
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "router exit 0" in out and "provider exit 0" in out, out
