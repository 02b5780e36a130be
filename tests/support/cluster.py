"""The one launcher of batchbus processes in tests: ``busctl start`` router, providers and trainers (and any
other busctl command that runs for a while) sharing one state directory.

Each process logs to ``STATE/NAME.log``; a process that dies before it is ready, or a job that gets stuck,
fails the test with the tail of every log. :meth:`Cluster.close` leaves nothing behind: every process it
started is stopped (SIGTERM, then SIGKILL), every shared-memory segment one of them owned is removed, and
every socket file under the state directory is deleted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from libbus.connect.client import Client, Identity
from libbus.jobs.spec import TERMINAL_STATES
from libbus.security.auth import ensure_secret, issue_token
from libbus.wire.messages import ControlJob, GetJob, SubmitJob
from shm import SegmentInfo, list_segments

from .busctl import BUSCTL, REPO, busctl

__all__ = ["Cluster", "wait_file"]

READY_TIMEOUT_S = 60.0


def wait_file(path: Path, procs: list, timeout: float = READY_TIMEOUT_S) -> str:
    """The contents of ``path`` (a ready file) once a process writes it; fails if one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in procs:
            assert p.poll() is None, f"{p.args} exited {p.returncode}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text().strip()


class Cluster:
    """batchbus services as ``busctl start`` processes sharing the state directory ``state``.

    ``env`` is laid over this process's environment (plus ``BATCHBUS_STATE_DIR``); ``prefix`` runs every
    command under another (e.g. ``ip netns exec NS``).
    """

    def __init__(self, state: Path, env: dict[str, str] | None = None, prefix: list[str] | None = None):
        self.state = state
        self.state.mkdir(parents=True, exist_ok=True)
        # Exact test scores (no privacy noise) unless a test asks for it, as tests/conftest.py's settings.
        self.env = {
            **os.environ,
            "BATCHBUS_STATE_DIR": str(state),
            "BATCHBUS_TORCH_THREADS": "1",
            "BATCHBUS_EVAL_EPSILON": "0",
            **(env or {}),
        }
        self.prefix = list(prefix or [])
        #: The latest process started under each name (a restart replaces it).
        self.procs: dict[str, subprocess.Popen] = {}
        self._all: list[subprocess.Popen] = []
        self.endpoint = ""
        self.leaked: list[SegmentInfo] = []
        self.admin: Client | None = None

    @property
    def admin_token(self) -> str:
        """An admin token from the cluster's secret (created here if no one has yet)."""
        secret = ensure_secret(self.state / "secret")
        return issue_token(secret, sub="test-admin", role="admin", audience="batchbus", ttl_s=3600)

    # -- processes ---------------------------------------------------------------------------------

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
        """``busctl ARGS`` as a process under ``name`` (output to ``STATE/NAME.log`` unless ``popen`` says)."""
        if "stdout" not in popen:
            with open(self.state / f"{name}.log", "a") as log:
                return self.spawn(name, *args, env=env, stdout=log, stderr=subprocess.STDOUT, **popen)
        proc = subprocess.Popen([*self.prefix, *BUSCTL, *args], env={**self.env, **(env or {})}, cwd=REPO, **popen)
        self.procs[name] = proc
        self._all.append(proc)
        return proc

    def adopt(self, name: str, proc: subprocess.Popen) -> subprocess.Popen:
        """Track ``proc``, started some other way, under ``name``: teardown stops it like the others."""
        self.procs[name] = proc
        self._all.append(proc)
        return proc

    def start(
        self,
        name: str,
        role: str,
        *args: str,
        ready: bool = False,
        named: bool = True,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """``busctl start ROLE [--name NAME] ARGS``; with ``ready``, it writes its endpoint to a ready file
        that :meth:`endpoint_of` waits for. The cluster's secret is created first if no one has yet."""
        ensure_secret(self.state / "secret")
        extra = ["--name", name] if named else []
        if ready:
            self.ready_file(name).unlink(missing_ok=True)
            extra += ["--ready-file", str(self.ready_file(name))]
        return self.spawn(name, "start", role, *extra, *args, env=env)

    def ready_file(self, name: str) -> Path:
        return self.state / f"{name}.ep"

    def endpoint_of(self, name: str, timeout: float = READY_TIMEOUT_S) -> str:
        """The endpoint ``name`` bound, once it is ready; fails with the logs if it exits first."""
        deadline = time.monotonic() + timeout
        path, proc = self.ready_file(name), self.procs[name]
        while not path.exists():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode} before it was ready\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} was not ready in {timeout:.0f} s\n{self.logs()}")
            time.sleep(0.05)
        return path.read_text().strip()

    def start_router(self, bind: str = "tcp://127.0.0.1:0", *args: str) -> str:
        """Start the router (again, after a stop: same name), point every later process at it, connect
        an admin client; returns its endpoint."""
        self.start("router", "router", "--bind", bind, *args, ready=True)
        self.endpoint = self.endpoint_of("router")
        self.env["BATCHBUS_ROUTER"] = self.endpoint
        if self.admin is None:
            self.admin = Client(
                self.endpoint,
                Identity(role="admin", name="test-admin", token=self.admin_token),
                timeout_s=10,
                retries=2,
            )
        return self.endpoint

    def start_trainer(self, name: str, *args: str) -> subprocess.Popen:
        return self.start(name, "trainer", *args)

    def busctl(
        self, *args: str, env: dict[str, str] | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """``busctl ARGS`` against this cluster (its state directory and router)."""
        return busctl(*args, env={**self.env, **(env or {})}, check=check, timeout=timeout)

    def logs(self, lines: int = 30) -> str:
        """The last ``lines`` of every log, for a failure message."""
        out = []
        for path in sorted(self.state.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name} ---\n" + "\n".join(tail))
        return "\n".join(out)

    # -- jobs through the admin client -----------------------------------------------------------

    def submit_spec(self, spec: dict) -> str:
        return self.admin.request(SubmitJob(spec=spec)).job

    def job(self, job: str) -> dict:
        return self.admin.request(GetJob(job=job)).job

    def control(self, job: str, command: str, **args) -> dict:
        return self.admin.request(ControlJob(job=job, command=command, args=args)).detail

    def wait(self, job: str, until: Callable[[dict], bool], timeout: float = 60) -> dict:
        """Poll ``job`` until ``until(info)``; fails naming the job's state, with the logs."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if until(info):
                return info
            if info["state"] in TERMINAL_STATES:
                raise AssertionError(f"job {job} ended {info['state']}: {info.get('error')}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} stuck in {info['state']}\n{self.logs()}")
            time.sleep(0.02)

    def later_reports(self, job: str, n: int = 1, timeout: float = 60) -> dict:
        """The job once the router has taken ``n`` progress reports after the one it holds now (each
        report's ``elapsed_s`` differs from the last: it grows through an attempt). Reports and command
        acknowledgements reach the router one at a time, in the order made, so after a command returns
        acknowledged, the next report is one its attempt made after applying it: never a stale look."""
        seen = (self.job(job)["progress"] or {}).get("elapsed_s")
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            now = (info["progress"] or {}).get("elapsed_s")
            if now != seen:
                seen, n = now, n - 1
                if n <= 0:
                    return info
            if info["state"] in TERMINAL_STATES:
                raise AssertionError(f"job {job} ended {info['state']}: {info.get('error')}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job}: {n} more progress report(s) never came\n{self.logs()}")
            time.sleep(0.02)

    def wait_end(self, job: str, timeout: float = 60) -> dict:
        """The job's record once it has ended, whatever the end."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if info["state"] in TERMINAL_STATES:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} stuck in {info['state']}\n{self.logs()}")
            time.sleep(0.1)

    # -- teardown ----------------------------------------------------------------------------------

    def close(self, timeout: float = 20, sig: int = signal.SIGTERM) -> list[int]:
        """Stop every process started (``sig``, SIGKILL after ``timeout``), remove the shared memory they
        owned and the socket files under the state directory. Returns the exit codes, in start order."""
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        for proc in self._all:
            if proc.poll() is None:
                proc.send_signal(sig)
        codes = []
        for proc in self._all:
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        #: What the processes left in shared memory (a service that drains leaves nothing); removed here.
        self.leaked = self.leaked_segments()
        for seg in self.leaked:
            seg.path.unlink(missing_ok=True)
        for path in self.state.rglob("*"):
            if path.is_socket():
                path.unlink(missing_ok=True)
        return codes

    def leaked_segments(self) -> list[SegmentInfo]:
        """Shared-memory segments still there whose owner is one of this cluster's processes."""
        pids = {proc.pid for proc in self._all}
        return [seg for seg in list_segments() if seg.pid in pids]
