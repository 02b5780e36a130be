"""A reader that leaves early (``busctl job logs --json | head``) ends busctl quietly, as a shell's
own commands end: no error line, no traceback, the status of a pipe closed under it."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO

# A command registered as busctl's are (a typer app, the guard every command runs under), printing
# line after line as `busctl job logs --follow` does.
PROGRAM = """
import typer
from cli.output import echo, guard

app = typer.Typer()

@app.command()
@guard
def logs() -> None:
    for i in range(200_000):
        echo(f"line {i} of what a job printed")

app()
"""


def test_a_command_whose_reader_left_ends_quietly_with_the_status_of_a_closed_pipe():
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader leaves, as `head -1` does
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141
    assert first == b"line 0 of what a job printed\n"
    assert err == b""  # no "Broken pipe" line, no "Exception ignored" at exit
