"""A real multi-host run: router, provider and trainer each on its own "host" (a network namespace
with its own address, joined to the others by veth pairs on a bridge), CURVE on, EdDSA tokens
minted by an administrator who keeps the signing key, each host with only its own secrets.

- A job trains to completion across the hosts; the trainer on another host gets its batches over
  the socket, and a second trainer beside the provider gets them through shared memory.
- From a fourth namespace, clients without a listed key, without a token the cluster signed, or
  with another node's token get nothing.

Needs root (network namespaces); skipped elsewhere. Traffic stays inside the namespaces it creates.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from libbus.security.auth import generate_signing_key, issue_token, load_signing_key
from libbus.security.curve import generate_keys
from tests.support import REPO, wait_file

SUBNET = "10.213.7"
HOSTS = {"router": 1, "provider": 2, "trainer": 3, "intruder": 4}
CLUSTER = "batchbus"


def _can_make_namespaces() -> str:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    probe = f"bbprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


SKIP = _can_make_namespaces()
pytestmark = pytest.mark.skipif(bool(SKIP), reason=SKIP or "")


def ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)}: {out.stderr.strip()}")


class Network:
    """Namespaces ``<tag>-<host>`` on a bridge in ``<tag>-sw``, host N at 10.213.7.N/24."""

    def __init__(self):
        self.tag = f"bb{secrets.token_hex(2)}"
        self.made: list[str] = []
        switch = self.ns("sw")
        ip("netns", "add", switch)
        self.made.append(switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for host, n in HOSTS.items():
            ns = self.ns(host)
            ip("netns", "add", ns)
            self.made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{n}", "netns", switch)
            ip("-n", switch, "link", "set", f"p{n}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    @staticmethod
    def addr(host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def close(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Host:
    """One machine: its namespace, its own state directory (keys, public token key), its processes."""

    def __init__(self, net: Network, name: str, root: Path, host_id: str):
        self.net, self.name = net, name
        self.state = root / name
        (self.state / "curve" / "authorized").mkdir(parents=True)
        self.env = {
            **os.environ,
            "BATCHBUS_STATE_DIR": str(self.state),
            "BATCHBUS_CURVE": "1",
            "BATCHBUS_TOKEN_ALG": "EdDSA",
            "BATCHBUS_HOST_ID": host_id,
            "BATCHBUS_HEARTBEAT_MS": "200",
            "BATCHBUS_TORCH_THREADS": "1",
            "PYTHONPATH": str(REPO),
        }
        self.procs: list[subprocess.Popen] = []

    def cmd(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.net.ns(self.name), sys.executable, *args]

    def start(self, role: str, *args: str, env: dict) -> subprocess.Popen:
        log = open(self.state / f"{role}.log", "a")
        proc = subprocess.Popen(
            self.cmd("-m", "cli", "start", role, *args),
            env={**self.env, **env},
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def busctl(self, *args: str, env: dict) -> subprocess.CompletedProcess:
        out = subprocess.run(
            self.cmd("-m", "cli", *args), env={**self.env, **env}, cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, f"busctl {' '.join(args)} on {self.name}: {out.stderr}"
        return out

    def python(self, code: str, env: dict | None = None) -> dict:
        out = subprocess.run(
            self.cmd("-c", code), env={**self.env, **(env or {})}, cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stop(self) -> list[int]:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        return [p.wait(30) for p in self.procs]


PROBE = """
import json, sys
from libbus.connect.client import Client, Identity
from libbus.security.curve import load_keys
from libbus.errors import BusError
from libbus.wire.messages import BatchRequest, ListJobs
results = {}
for label, endpoint, server_key, key_file, token, role, msg in json.loads(sys.argv[1]):
    curve = load_keys(key_file) if key_file else None
    ident = Identity(role=role, name=curve.name if curve else "intruder", token=token, curve=curve)
    try:
        client = Client(endpoint, ident, timeout_s=2.0, retries=0, server_key=server_key.encode() or None)
        request = ListJobs() if msg == "jobs" else BatchRequest(dataset="mnist", split="train", range=[0, 8])
        reply = client.request(request)
        results[label] = "GOT " + reply.type
    except BusError as err:
        results[label] = err.code
    client.close()
print(json.dumps(results))
"""


def test_a_job_trains_across_three_hosts_with_curve_and_a_fourth_gets_nothing(tmp_path):
    net = Network()
    hosts: dict[str, Host] = {}
    try:
        # The administrator's machine (here: the test) makes every key; each host gets only its own.
        admin_dir = tmp_path / "admin"
        signing, public = generate_signing_key(admin_dir / "token.key")
        sign = load_signing_key(signing)

        def token(sub: str, role: str) -> str:
            return issue_token(sign, sub=sub, role=role, audience=CLUSTER, ttl_s=3600, algorithm="EdDSA")

        for name, host_id in (
            ("router", "host-r"),
            ("provider", "host-p"),
            ("trainer", "host-t"),
            ("intruder", "host-x"),
        ):
            hosts[name] = Host(net, name, tmp_path, host_id)
            shutil.copy(public, hosts[name].state / "token.pub")
        keys = {
            n: generate_keys(admin_dir / "keys", n)
            for n in ("router", "provider", "trainer", "trainer-local", "admin", "intruder-listed")
        }
        placement = {
            "router": ["router", "admin"],
            "provider": ["provider", "trainer-local"],
            "trainer": ["trainer"],
            "intruder": ["intruder-listed"],
        }
        for host, names in placement.items():
            for n in names:
                shutil.copy(keys[n][1], hosts[host].state / "curve" / f"{n}.key_secret")
                os.chmod(hosts[host].state / "curve" / f"{n}.key_secret", 0o600)
            shutil.copy(keys["router"][0], hosts[host].state / "curve" / "router.key")
        # Who each server admits: the router, every node and the admin; the provider, the trainers
        # (and the admin); "intruder-listed" is admitted by the provider, but holds no valid token.
        for n in ("provider", "trainer", "trainer-local", "admin"):
            shutil.copy(keys[n][0], hosts["router"].state / "curve" / "authorized")
        for n in ("trainer", "trainer-local", "admin", "intruder-listed"):
            shutil.copy(keys[n][0], hosts["provider"].state / "curve" / "authorized")

        r, p, t, x = (hosts[n] for n in ("router", "provider", "trainer", "intruder"))
        admin_env = {
            "BATCHBUS_TOKEN": token("admin", "admin"),
            "BATCHBUS_CURVE_KEY_FILE": str(r.state / "curve" / "admin.key_secret"),
        }
        router_ep = f"tcp://{net.addr('router')}:5555"
        r.start("router", "--bind", router_ep, "--ready-file", str(r.state / "ready"), env={})
        wait_file(r.state / "ready", r.procs)
        p.start(
            "provider",
            "--router",
            router_ep,
            "--bind",
            f"tcp://{net.addr('provider')}:0",
            "--dataset",
            "mnist=mock://mnist?n=600",
            "--ready-file",
            str(p.state / "ready"),
            env={"BATCHBUS_TOKEN": token("provider", "provider")},
        )
        provider_ep = wait_file(p.state / "ready", p.procs)
        assert provider_ep.startswith(f"tcp://{net.addr('provider')}:")

        def run_job(trainer_host: Host, name: str) -> dict:
            trainer = trainer_host.start(
                "trainer",
                "--router",
                router_ep,
                "--name",
                name,
                env={
                    "BATCHBUS_TOKEN": token(name, "trainer"),
                    "BATCHBUS_CURVE_KEY_FILE": str(trainer_host.state / "curve" / f"{name}.key_secret"),
                },
            )
            job = r.busctl(
                "submit",
                "--router",
                router_ep,
                "--dataset",
                "mnist",
                "--model",
                "mlp",
                "--epochs",
                "1",
                "--batch-size",
                "50",
                "--json",
                env=admin_env,
            )
            job_id = json.loads(job.stdout)["job"]
            deadline = time.monotonic() + 120
            while True:
                info = json.loads(
                    r.busctl("job", "show", job_id, "--router", router_ep, "--json", env=admin_env).stdout
                )
                if info["state"] in ("succeeded", "failed", "stopped"):
                    break
                assert trainer.poll() is None, f"trainer exited {trainer.returncode}"
                assert time.monotonic() < deadline, f"job stuck in {info['state']}"
                time.sleep(0.5)
            trainer.send_signal(signal.SIGTERM)
            assert trainer.wait(30) == 0
            return info

        remote = run_job(t, "trainer")  # another host: batches over the socket
        assert remote["state"] == "succeeded", remote.get("error")
        assert remote["progress"]["transport"] == "socket"
        assert remote["result"]["val_accuracy"] > 0.8 and remote["result"]["test_n"] > 0
        local = run_job(p, "trainer-local")  # beside the provider: shared memory
        assert local["state"] == "succeeded", local.get("error")
        assert local["progress"]["transport"] == "shm"

        # The fourth host: nothing without a listed key and a token this cluster signed.
        router_key = (r.state / "curve" / "router.key").read_text()
        provider_key = next(
            line.split("=", 1)[1].strip().strip('"')
            for line in (p.state / "curve" / "provider.key_secret").read_text().splitlines()
            if line.strip().startswith("public-key")
        )
        router_pub = next(
            line.split("=", 1)[1].strip().strip('"')
            for line in router_key.splitlines()
            if line.strip().startswith("public-key")
        )
        stray = generate_keys(x.state / "curve", "stray")[1]
        listed = x.state / "curve" / "intruder-listed.key_secret"
        forged = issue_token(b"x" * 32, sub="intruder-listed", role="trainer", audience=CLUSTER)
        stolen_sub = token("trainer", "trainer")  # a real token, of another node's key
        attempts = [
            ["router, no CURVE", router_ep, "", "", token("admin", "admin"), "admin", "jobs"],
            ["provider, no CURVE", provider_ep, "", "", stolen_sub, "trainer", "batch"],
            ["router, unlisted key", router_ep, router_pub, str(stray), forged, "admin", "jobs"],
            ["provider, unlisted key", provider_ep, provider_key, str(stray), forged, "trainer", "batch"],
            ["provider, listed key, forged token", provider_ep, provider_key, str(listed), forged, "trainer", "batch"],
            [
                "provider, listed key, another node's token",
                provider_ep,
                provider_key,
                str(listed),
                stolen_sub,
                "trainer",
                "batch",
            ],
        ]
        got = x.python(PROBE.replace("sys.argv[1]", repr(json.dumps(attempts))))
        # (an unlisted key's handshake is refused by the ZAP handler: the client sees it on its
        # socket monitor and says so; a client with no CURVE at all never even completes a greeting)
        assert got == {
            "router, no CURVE": "TIMEOUT",
            "provider, no CURVE": "TIMEOUT",
            "router, unlisted key": "AUTH_INVALID",
            "provider, unlisted key": "AUTH_INVALID",
            "provider, listed key, forged token": "AUTH_INVALID",
            "provider, listed key, another node's token": "FORBIDDEN",
        }, got
        for host in (p, r):
            assert host.stop() == [0] * len(host.procs), f"{host.name} did not exit 0 on SIGTERM"
    finally:
        for host in hosts.values():
            for proc in host.procs:
                if proc.poll() is None:
                    proc.kill()
        net.close()
