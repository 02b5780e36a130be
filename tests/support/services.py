"""Services on a thread of the test process (fast, and their state is inspectable), and waits on jobs."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from libbus.config import Settings
from libbus.jobs.spec import TERMINAL_STATES
from libbus.wire.messages import GetJob, GetStudy

__all__ = ["CLUSTER", "Running", "run_service", "wait_job", "wait_study"]

#: The cluster name (token audience) every test service runs under: the default in settings.
CLUSTER = "batchbus"


@dataclass
class Running:
    service: object
    endpoint: str
    stop: threading.Event
    thread: threading.Thread
    settings: Settings

    def shutdown(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive(), "service did not stop within 10 s"


def run_service(service, settings: Settings) -> Running:
    """Bind ``service`` (a router or provider service object) and run it on a daemon thread."""
    endpoint = service.start()
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    return Running(service, endpoint, stop, thread, settings)


def wait_job(admin, job: str, timeout: float) -> dict:
    """The job's record once it has ended; fails naming the state it is stuck in."""
    deadline = time.monotonic() + timeout
    while True:
        info = admin.request(GetJob(job=job)).job
        if info["state"] in TERMINAL_STATES:
            return info
        assert time.monotonic() < deadline, f"job {job} stuck in {info['state']}"
        time.sleep(0.2)


def wait_study(admin, study: str, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = admin.request(GetStudy(study=study)).study
        if info["state"] != "running" and all(t["state"] not in ("running", "pruning") for t in info["trials"]):
            return info
        assert time.monotonic() < deadline, f"study {study} stuck: {info['trials']}"
        time.sleep(0.2)
