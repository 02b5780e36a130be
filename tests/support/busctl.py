"""The one way tests run ``busctl``: as a process, as a user does (or in-process through typer's runner,
where a test needs many quick calls against an in-thread router)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["BUSCTL", "REPO", "busctl", "busctl_in_process", "interruptible", "sigint_state"]

REPO = Path(__file__).resolve().parents[2]
#: The project's busctl (the venv's console script), or ``python -m cli`` where it is not installed.
BUSCTL = (
    [str(Path(sys.executable).with_name("busctl"))]
    if Path(sys.executable).with_name("busctl").exists()
    else [sys.executable, "-m", "cli"]
)


def busctl(
    *args: str, env: Mapping[str, str] | None = None, check: bool = False, timeout: float = 60, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """``busctl ARGS`` in its own process, ``env`` over this process's environment; text output captured.

    With ``check``, a non-zero exit fails the test with busctl's stderr.
    """
    out = subprocess.run(
        [*BUSCTL, *args], env={**os.environ, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    if check and out.returncode != 0:
        raise AssertionError(f"busctl {' '.join(args)} exited {out.returncode}: {out.stderr}")
    return out


def busctl_in_process(*args: str, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """``busctl ARGS`` in this process (typer's CliRunner): (exit code, stdout, stderr)."""
    from typer.testing import CliRunner  # noqa: PLC0415 - the CLI loads only in the tests that use it

    from cli.app import app  # noqa: PLC0415

    result = CliRunner().invoke(app, list(args), env=dict(env or {}))
    return result.exit_code, result.stdout, result.stderr


def interruptible() -> None:
    """``preexec_fn`` of a busctl that a test will interrupt: SIGINT unblocked and at its default (so
    Python turns it into ``KeyboardInterrupt``), as a shell hands it to a foreground job. A child inherits
    its parent thread's blocked and ignored signals, and a library in the test process may have either
    set while the test started its child."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sigint_state(pid: int) -> str:
    """How process ``pid`` takes SIGINT (from /proc: ignored, blocked, caught), for a failure message."""
    bit, found = 1 << (signal.SIGINT - 1), []
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("SigBlk", "SigIgn", "SigCgt"):
                found.append(f"{key}={'yes' if int(value, 16) & bit else 'no'}")
    except (OSError, ValueError):
        return "gone"
    return " ".join(found)
