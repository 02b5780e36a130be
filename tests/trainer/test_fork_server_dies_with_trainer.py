"""A trainer service killed with SIGKILL (the out-of-memory killer, ``kill -9``, a node agent) takes its
fork server and the attempt it runs with it: none is left re-parented to PID 1, holding the job's
memory, its GPU or its dataset's connections. Against real router, provider and trainer processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.jobs import EntryCluster

#: How long the fork server and its attempt may take to notice (generous: a loaded machine).
GONE_WITHIN_S = 60


def stat(pid: int) -> tuple[int, str, str] | None:
    """``(ppid, state, start time)`` of a live process, None once it is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), fields[0], fields[19]


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (s := stat(int(entry.name))) is not None and s[0] == pid:
            out.append(int(entry.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_gone(pid: int, started: str, timeout: float) -> bool:
    """Whether the process ``pid`` that started at ``started`` is gone within ``timeout`` (a new process
    that reused the pid is not it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = stat(pid)
        if s is None or s[2] != started:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(300)
@pytest.mark.parametrize("entrypoint", ["stoppable", "stuck_in_c"])
def test_kill_9_of_a_trainer_leaves_no_fork_server_nor_attempt(tmp_path, entrypoint):
    """``stoppable`` steps on (its channel's reader sees the trainer go); ``stuck_in_c`` holds the GIL in
    a C call, so nothing in its process can notice: its fork server must end it."""
    cluster = EntryCluster(tmp_path / "state")
    watched: dict[int, str] = {}
    try:
        cluster.start_router()
        cluster.start_provider()
        cluster.endpoint_of("provider")
        trainer = cluster.start_trainer("trainer-k")
        spec = {"dataset": "mnist", "entrypoint": f"tests.support.entrypoints:{entrypoint}", "max_attempts": 1}
        job = cluster.submit_spec(spec)
        if entrypoint == "stuck_in_c":  # its last words, relayed by its trainer before the GIL is taken
            log = cluster.state / "trainer-k.log"
            cluster.wait(job, lambda i: f"{job} | entering the C call" in log.read_text(), timeout=180)
        else:
            cluster.wait(job, lambda i: (i.get("progress") or {}).get("step", 0) >= 3, timeout=180)

        servers = [p for p in children(trainer.pid) if "forkserver" in cmdline(p)]
        assert len(servers) == 1, [(p, cmdline(p)) for p in children(trainer.pid)]
        server = servers[0]
        attempts = children(server)
        assert attempts, "the running job's attempt is not a child of the fork server"
        watched.update({pid: s[2] for pid in [server, *attempts] if (s := stat(pid)) is not None})

        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(30)
        left = [pid for pid, started in watched.items() if not wait_gone(pid, started, GONE_WITHIN_S)]
        assert not left, {pid: (stat(pid), cmdline(pid)) for pid in left}
    finally:
        for pid, started in watched.items():  # what a failure left behind: not for the next test
            if (s := stat(pid)) is not None and s[2] == started:
                os.kill(pid, signal.SIGKILL)
        cluster.close()
