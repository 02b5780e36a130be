"""batchbus services as child processes on this host: what ``busctl demo`` and the delivery benchmark run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from libbus.errors import BusError, PeerTimeout
from libbus.security.auth import private_dir

__all__ = ["READY_TIMEOUT_S", "ServiceProcs"]

READY_TIMEOUT_S = 60.0


class ServiceProcs:
    """batchbus services as child processes (``python -m cli start ...``), logs in ``state/logs``."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.logs = state_dir / "logs"
        self.logs = private_dir(state_dir / "logs")
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, role: str, *args: str, ready: bool = True) -> str:
        """Start ``busctl start ROLE ARGS``; with ``ready``, wait for and return its bound endpoint."""
        ready_file = self.state_dir / f"{role}.endpoint"
        ready_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "cli", "start", role, "--state-dir", str(self.state_dir), *args]
        if ready:
            cmd += ["--ready-file", str(ready_file)]
        log = open(self.logs / f"{role}.log", "ab")
        self.procs[role] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if not ready:
            return ""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready_file.exists():
            if self.procs[role].poll() is not None:
                raise BusError(f"{role} exited with {self.procs[role].returncode}; see {self.logs / (role + '.log')}")
            if time.monotonic() > deadline:
                raise PeerTimeout(f"{role} did not become ready in {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        return ready_file.read_text().strip()

    def stop(self, timeout_s: float = 15.0) -> dict[str, int]:
        """SIGTERM every service (trainer first), wait, and return their exit codes."""
        codes = {}
        for role in sorted(self.procs, key=lambda r: ("trainer", "provider", "router").index(r)):
            proc = self.procs[role]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                codes[role] = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[role] = proc.wait()
        return codes
