"""``busctl demo``: the whole system on localhost, as three real processes, training a real model."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from rich.console import Console

from libbus.errors import BusError, PeerTimeout
from libbus.jobs.state import JobState
from libbus.security.auth import private_dir
from libbus.wire.messages import ListPeers, SubmitJob
from services.launch import READY_TIMEOUT_S, ServiceProcs

from .connection import admin_client, settings_from
from .watch import watch_job

__all__ = ["run_demo"]


def run_demo(*, epochs: int, uri: str, model: str, state_dir: str | None) -> None:
    console = Console()
    state = Path(state_dir or tempfile.mkdtemp(prefix="batchbus-demo-"))
    private_dir(state)  # the router makes the cluster's EdDSA key pair here on its first start (one machine:
    # the provider and trainer beside it mint their own tokens with it; on a cluster they get token.pub
    # and a token from 'busctl token node' instead, docs/security.md)
    console.print(f"[bold]batchbus demo[/]: router, provider and trainer on localhost; state and logs in {state}")
    procs = ServiceProcs(state)
    try:
        router = procs.start("router", "--bind", "tcp://127.0.0.1:0")
        console.print(f"router    {router}")
        provider = procs.start("provider", "--router", router, "--dataset", f"demo={uri}")
        console.print(f"provider  {provider} serving demo={uri}")
        procs.start("trainer", "--router", router, ready=False)
        settings = settings_from(router=router, state_dir=str(state))
        with admin_client(settings) as client:
            _wait_for_peers(client)
            console.print("trainer   registered")
            spec = {
                "dataset": "demo",
                "model": model,
                "epochs": epochs,
                "batch_size": 64,
                "lr": 2e-3,
                "optimizer": "adam",
                "seed": 0,
            }
            job = client.request(SubmitJob(spec=spec)).job
            console.print(f"submitted job {job}: {model}, adam, {epochs} epoch(s) on demo")
            final = watch_job(client, job, console)
    finally:
        codes = procs.stop()
    console.print("services stopped: " + ", ".join(f"{r} exit {c}" for r, c in codes.items()))
    if final["state"] != JobState.SUCCEEDED:
        raise BusError(f"demo job ended {final['state']}: {final.get('error') or 'see the logs in ' + str(state)}")


def _wait_for_peers(client, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        roles = {p["role"] for p in client.request(ListPeers()).peers}
        if {"provider", "trainer"} <= roles:
            return
        time.sleep(0.1)
    raise PeerTimeout("provider and trainer did not register with the router in time")
