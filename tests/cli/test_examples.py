"""examples/ run as written: ``examples/serve.py`` (what ``make serve-examples`` runs) serves
the data, and every command of examples/README.md's run block runs as shown — no environment variable
set, the scripts find the cluster where the make target wrote it — and does what it claims: the
recipes train on every sample exactly once per epoch, the MNIST and ImageNet scripts under torchrun
print accuracy totals over the whole val and test splits."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from libbus.config import load_settings
from tests.support import REPO

EXAMPLES = REPO / "examples"
SAMPLES = 1000  # mock train size the test serves (val and test: a fifth); the make target serves 5000
HELD = SAMPLES // 5
IDS = 48  # examples/serve.py's ids train split


def readme_blocks() -> list[list[str]]:
    """The ``sh`` blocks of examples/README.md, as lists of command lines."""
    text = (EXAMPLES / "README.md").read_text()
    return [
        [line for line in block.splitlines() if line.strip()] for block in re.findall(r"```sh\n(.*?)```", text, re.S)
    ]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    state = tmp_path_factory.mktemp("examples-state")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHBUS_")}
    env.update(BATCHBUS_EXAMPLES_DIR=str(state), PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "serve.py"), "--samples", str(SAMPLES)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    connection = state / "connection.json"
    deadline = time.monotonic() + 120
    while not connection.exists():
        assert proc.poll() is None, f"serve.py exited {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}"
        assert time.monotonic() < deadline, "serve.py wrote no connection.json in 120 s"
        time.sleep(0.1)
    written = json.loads(connection.read_text())
    assert sorted(written["datasets"]) == ["ids", "imagenet", "mnist", "multi"]
    # the same as settings, for scripts run with BATCHBUS_CONFIG naming the file
    settings, _ = load_settings(config_file=str(state / "batchbus.toml"), env={})
    assert (settings.router, settings.token) == (written["router"], written["token"])
    yield env
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "router exit 0" in out and "provider exit 0" in out, out
    assert not connection.exists(), "serve.py left its connection file behind"
    assert not (state / "batchbus.toml").exists(), "serve.py left its settings file behind"


def test_the_make_target_runs_the_serve_script():
    assert readme_blocks()[0] == ["make serve-examples"]
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^serve-examples:.*\n\t(.+)$", makefile, re.M)
    assert recipe is not None and recipe.group(1) == "$(BIN)/python examples/serve.py"


def run_line(line: str, env: dict, tmp_path: Path) -> str:
    """One README command, as shown: ``.venv/bin/X`` is this venv's X, ``/tmp/bb-NAME`` a fresh
    directory of this test's."""
    argv = []
    for word in shlex.split(line):
        if word.startswith(".venv/bin/"):
            word = str(Path(sys.executable).with_name(word.removeprefix(".venv/bin/")))
        elif word.startswith("/tmp/bb-"):
            word = str(tmp_path / word.removeprefix("/tmp/"))
        argv.append(word)
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{line}\n{output[-4000:]}"
    return done.stdout


def exactly_once(ckpt: Path, epochs: int = 2) -> None:
    seen: dict[int, Counter] = {}
    for path in ckpt.glob("ledger*.txt"):
        for row in path.read_text().splitlines():
            epoch, sample = map(int, row.split())
            seen.setdefault(epoch, Counter())[sample] += 1
    assert sorted(seen) == list(range(epochs)), f"{ckpt}: epochs {sorted(seen)}"
    for epoch, counts in seen.items():
        assert sorted(counts) == list(range(IDS)) and set(counts.values()) == {1}, f"{ckpt}: epoch {epoch}"


RUN_BLOCK = readme_blocks()[1]


@pytest.mark.parametrize("line", RUN_BLOCK, ids=[re.sub(r"\W+", "-", line.split("examples/")[1]) for line in RUN_BLOCK])
def test_every_example_runs_as_shown(served, line, tmp_path):
    script = re.search(r"examples/(\S+)", line).group(1)
    needs = {"lightning_datamodule.py": "lightning", "accelerate_prepare.py": "accelerate"}
    needs["stateful_dataloader.py"] = "torchdata"
    if script in needs:
        pytest.importorskip(needs[script], reason="needs the recipes extra (make install installs it)")
    out = run_line(line, served, tmp_path)
    if script == "mnist/main.py":
        # every rank trained; the totals are the whole splits', on val (all-reduced) and test (read whole)
        val = re.findall(r"Val set: Average loss: [\d.]+, Accuracy: (\d+)/(\d+)", out)
        test = re.findall(r"Test set: Average loss: [\d.]+, Accuracy: (\d+)/(\d+)", out)
        assert [int(n) for _, n in val] == [HELD] and [int(n) for _, n in test] == [HELD], out
        assert int(test[0][0]) > HELD // 5, f"no better than chance (10%): {out}"
    elif script == "imagenet/main.py":
        val = re.findall(r"\* Val: Acc@1 [\d.]+ \((\d+)/(\d+)\)", out)
        test = re.findall(r"\* Test: Acc@1 [\d.]+ \((\d+)/(\d+)\)", out)
        assert [int(n) for _, n in val] == [HELD, HELD] and [int(n) for _, n in test] == [HELD], out
        assert (tmp_path / "bb-imagenet" / "checkpoint.pth.tar").exists()
    else:  # the recipes: a ledger of every sample trained on, each exactly once per epoch
        exactly_once(tmp_path / re.search(r"/tmp/(bb-\S+)", line).group(1))


def test_the_readmes_training_script_runs_as_shown(served, tmp_path):
    """README's "Your own training script", saved as train.py and run as its first lines say, against
    the examples' cluster (BATCHBUS_CONFIG: the settings file serve.py wrote)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Your own training script", 1)[1]
    script = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"#\s+(BATCHBUS_CONFIG=\S+ \S+ train\.py)", script).group(1)
    assert shown == "BATCHBUS_CONFIG=state/examples/batchbus.toml .venv/bin/python train.py"
    (tmp_path / "train.py").write_text(script)
    config = Path(served["BATCHBUS_EXAMPLES_DIR"]) / "batchbus.toml"  # this test's state/examples
    env = {**served, "BATCHBUS_CONFIG": str(config)}
    done = subprocess.run(
        [sys.executable, "train.py"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    epochs = re.findall(r"epoch (\d+): (\d+) samples, last loss [\d.]+", done.stdout)
    assert epochs == [(str(e), str(SAMPLES)) for e in range(3)], done.stdout
