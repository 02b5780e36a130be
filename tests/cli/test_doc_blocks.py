"""Every ```python block of README.md and docs/*.md runs as a user would run it: saved as a
file in a fresh directory and run with this venv's python, against the examples' cluster that
``make serve-examples`` serves (``examples/serve.py``), the settings it writes named by
``BATCHBUS_CONFIG`` — nothing else set.

A block says how it runs with an HTML comment right before its fence, which a reader of the markdown
sees too:

- ``<!-- not run: REASON -->``: deliberately not runnable alone (a signature, …). Each is listed in
  :data:`NOT_RUN` below with its reason, so a new one is a visible decision;
- ``<!-- continues the block above -->``: joined to the file's previous ```python block, run as one
  script (the earlier block does not run alone);
- ``<!-- run with: torchrun --nproc_per_node 2 -->``: run as ``LAUNCHER block.py`` (the launcher from
  this venv) instead of ``python block.py``.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.examples import serve_examples

SAMPLES = 200  # the mock datasets' train size the test serves (val and test: a fifth)
TIMEOUT_S = 240
MARK = re.compile(r"<!--\s*(not run|continues the block above|run with)\s*:?\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    path: str  # relative to the checkout
    line: int  # of the fence
    code: str
    marks: dict[str, str]

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0] if self.code else ""

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of one markdown file (fences at the start of a line; other fences, ``` or
    ```sh, are skipped whole so a ```python inside one is not taken), each with the marks of the HTML
    comments on the lines right before its fence (blank lines between are allowed)."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(```+|~~~+)\s*(\S*)", lines[i])
        if not fence:
            i += 1
            continue
        close = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), len(lines))
        if fence.group(2) == "python":
            marks, k = {}, i - 1
            while k >= 0 and (not lines[k].strip() or MARK.match(lines[k].strip())):
                if found := MARK.match(lines[k].strip()):
                    marks[found.group(1)] = found.group(2)
                k -= 1
            code = "\n".join(lines[i + 1 : close]) + "\n"
            blocks.append(Block(str(path.relative_to(REPO)), i + 1, code, marks))
        i = close + 1
    return blocks


def scripts() -> list[tuple[Block, str]]:
    """What runs: each block not marked "not run", joined with the blocks that continue it, as (its
    first block, the script); the launcher is the first block's."""
    groups: list[list[Block]] = []
    for path in markdown_files():
        previous = None
        for block in python_blocks(path):
            if "continues the block above" in block.marks:
                assert previous is not None and "not run" not in previous.marks, f"{block.id} continues no run block"
                assert "not run" not in block.marks, f"{block.id}: a block that continues another runs with it"
                groups[-1].append(block)
            elif "not run" not in block.marks:
                groups.append([block])
            previous = block
    return [(group[0], "".join(b.code for b in group)) for group in groups]


ALL_BLOCKS = [b for path in markdown_files() for b in python_blocks(path)]
SCRIPTS = scripts()

# Every block marked "not run", by file and first line, with its reason as the mark gives it.
NOT_RUN = {
    (
        "docs/python-api.md",
        'RemoteLoader(dataset, *, token=None, split="train", router=None, provider=None, resolver=None,',
    ): (
        "the signature, not a call"  # test_the_signature_shown_is_the_loaders checks it
    ),
    ("docs/jobs.md", "# mylab/train.py, importable on the trainers (an installed package, or on their PYTHONPATH)"): (
        "a job's function, called by a trainer (tests/trainer/test_entrypoints.py runs one like it)"
    ),
}


def test_the_blocks_not_run_are_these_with_their_reasons():
    marked = {(b.path, b.first_line): b.marks["not run"] for b in ALL_BLOCKS if "not run" in b.marks}
    assert marked == NOT_RUN
    assert all(reason.strip() for reason in marked.values())


def test_the_blocks_are_found():
    """The parser finds the blocks a reader sees: README's training script and the API's import line."""
    firsts = {(b.path, b.first_line) for b in ALL_BLOCKS}
    assert ("docs/python-api.md", "from libbus import RemoteLoader, as_float, merge_cursors, errors") in firsts
    assert any(p == "README.md" and line.startswith("# train.py") for p, line in firsts)
    assert len(ALL_BLOCKS) == sum(p.read_text().count("\n```python\n") for p in markdown_files())


def test_the_signature_shown_is_the_loaders():
    """docs/python-api.md's signature block names RemoteLoader's arguments, in order, with its defaults
    (``...``: a default the table explains)."""
    from libbus import RemoteLoader  # noqa: PLC0415

    (block,) = [b for b in ALL_BLOCKS if b.first_line.startswith("RemoteLoader(dataset, *,")]
    shown = ast.parse("def " + block.code.strip() + ": pass").body[0]
    assert isinstance(shown, ast.FunctionDef)
    real = inspect.signature(RemoteLoader).parameters
    args = shown.args
    assert [a.arg for a in args.args] == [n for n, p in real.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [a.arg for a in args.kwonlyargs] == [n for n, p in real.items() if p.kind is p.KEYWORD_ONLY]
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        value = ast.literal_eval(default) if default is not None else inspect.Parameter.empty
        if value is not Ellipsis:
            assert real[arg.arg].default == value, f"{arg.arg}: shown {value!r}, is {real[arg.arg].default!r}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One examples' cluster for every block; the environment a block runs in."""
    state = tmp_path_factory.mktemp("examples-state")
    with serve_examples(state, SAMPLES) as env:
        yield {**env, "BATCHBUS_CONFIG": str(state / "batchbus.toml")}


@pytest.mark.parametrize(("block", "code"), SCRIPTS, ids=[b.id for b, _ in SCRIPTS])
def test_the_block_runs_as_shown(served, block, code, tmp_path):
    (tmp_path / "block.py").write_text(code)
    launcher = block.marks.get("run with", "python").split()
    argv = [str(Path(sys.executable).with_name(launcher[0])), *launcher[1:], "block.py"]
    done = subprocess.run(argv, env=served, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{block.id} ({block.first_line})\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"
