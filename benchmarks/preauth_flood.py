"""Memory before authentication: a peer with no token streams one endless multipart message.

It speaks ZMTP 3.0 by hand over TCP (greeting with the NULL mechanism, READY, then 1 MiB frames that
all carry MORE and never end), at a router and at a provider started as real processes, and samples
their resident memory (``VmRSS`` from ``/proc/PID/status``). With the default settings every server
socket admits only a handshake that carries a valid token (libbus/security/admission.py), so the peer is cut
off at its greeting and memory stays flat; with ``--no-handshake-auth`` (``handshake_auth = false``)
libzmq buffers the endless message and memory grows with what was sent (the attack then stops at
``--cap-mib`` so as not to exhaust the machine).

    python -m benchmarks.preauth_flood --seconds 60
    python -m benchmarks.preauth_flood --seconds 10 --no-handshake-auth --cap-mib 512
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["rss", "flood", "start_services", "stop_services", "run"]

MiB = 1 << 20
FRAME = 1 * MiB


def rss(pid: int) -> int:
    """Resident memory of ``pid`` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _greeting() -> bytes:
    mechanism = b"NULL".ljust(20, b"\0")
    return b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + mechanism + b"\0" + b"\0" * 31


def _ready() -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    return bytes([0x04, len(body)]) + body


def flood(endpoint: str, seconds: float, cap_bytes: int | None = None, stop: threading.Event | None = None) -> dict:
    """Stream an endless multipart message at ``endpoint`` (``tcp://host:port``) for ``seconds``,
    reconnecting whenever the service drops the connection. Returns what it did."""
    host, port = endpoint[len("tcp://") :].rsplit(":", 1)
    frame = bytes([0x03]) + FRAME.to_bytes(8, "big") + b"\xa5" * FRAME  # MORE | LONG, never a last frame
    sent = connections = refused = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (stop and stop.is_set()):
        if cap_bytes is not None and sent >= cap_bytes:
            time.sleep(0.05)
            continue
        try:
            with socket.create_connection((host, int(port)), timeout=1.0) as s:
                connections += 1
                s.sendall(_greeting() + _ready())
                while time.monotonic() < deadline and (cap_bytes is None or sent < cap_bytes):
                    s.sendall(frame)
                    sent += FRAME
        except OSError:
            refused += 1
            time.sleep(0.01)
    return {"sent_bytes": sent, "connections": connections, "dropped": refused}


def start_services(
    state: Path, handshake_auth: bool = True, dataset: str = "mnist=mock://mnist?n=600", env: dict | None = None
) -> tuple[list[subprocess.Popen], str, str]:
    """A router and a provider (``busctl start``) of ``dataset`` in ``state``, with ``env`` added to
    their environment (settings); returns the processes and endpoints."""
    from libbus.security.auth import ensure_secret  # noqa: PLC0415 - the benchmark's own imports stay light

    state.mkdir(parents=True, exist_ok=True)
    ensure_secret(state / "secret")
    env = {
        **os.environ,
        "BATCHBUS_STATE_DIR": str(state),
        "BATCHBUS_HANDSHAKE_AUTH": str(handshake_auth).lower(),
        "BATCHBUS_LOG_LEVEL": "WARNING",
        **(env or {}),
    }
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> None:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "cli", "start", *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )

    def ready(path: Path) -> str:
        deadline = time.monotonic() + 60
        while not path.exists() or not path.read_text().strip():
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                stop_services(procs)
                raise RuntimeError(f"a service did not start (waiting for {path})")
            time.sleep(0.05)
        return path.read_text().strip()

    start("router", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(state / "router.ep"))
    router = ready(state / "router.ep")
    start(
        "provider",
        "--dataset",
        dataset,
        "--router",
        router,
        "--bind",
        "tcp://127.0.0.1:0",
        "--ready-file",
        str(state / "provider.ep"),
    )
    provider = ready(state / "provider.ep")
    return procs, router, provider


def stop_services(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(state: Path, seconds: float, handshake_auth: bool = True, cap_bytes: int | None = None) -> dict:
    """Flood both services at once for ``seconds``; resident memory before, at its peak and after."""
    procs, router, provider = start_services(state, handshake_auth)
    try:
        time.sleep(1.0)  # let start-up allocations settle
        targets = {"router": (procs[0].pid, router), "provider": (procs[1].pid, provider)}
        before = {name: rss(pid) for name, (pid, _) in targets.items()}
        peak = dict(before)
        results: dict[str, dict] = {}
        threads = [
            threading.Thread(target=lambda n=name, ep=ep: results.__setitem__(n, flood(ep, seconds, cap_bytes)))
            for name, (_, ep) in targets.items()
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for name, (pid, _) in targets.items():
                peak[name] = max(peak[name], rss(pid))
            time.sleep(0.1)
        after = {name: rss(pid) for name, (pid, _) in targets.items()}
        alive = all(p.poll() is None for p in procs)
        return {
            name: {
                "rss_before_mib": before[name] / MiB,
                "rss_peak_mib": peak[name] / MiB,
                "growth_mib": (peak[name] - before[name]) / MiB,
                "rss_after_mib": after[name] / MiB,
                "sent_mib": results[name]["sent_bytes"] / MiB,
                "connections": results[name]["connections"],
            }
            for name in targets
        } | {"alive": alive, "endpoints": {"router": router, "provider": provider}}
    finally:
        stop_services(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--no-handshake-auth", action="store_true", help="run the services with handshake_auth = false")
    ap.add_argument("--cap-mib", type=int, default=None, help="stop sending after this much (per service)")
    ap.add_argument("--state", default="", help="state directory (default: a temporary one)")
    args = ap.parse_args()
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        out = run(
            Path(args.state or tmp),
            args.seconds,
            not args.no_handshake_auth,
            args.cap_mib * MiB if args.cap_mib else None,
        )
    mode = "handshake_auth = false" if args.no_handshake_auth else "default settings (handshake_auth = true)"
    print(f"endless multipart message from a peer with no token, {args.seconds:.0f} s, {mode}")
    for name in ("router", "provider"):
        r = out[name]
        print(
            f"  {name:8s} sent {r['sent_mib']:8.0f} MiB over {r['connections']:5d} connection(s); resident "
            f"{r['rss_before_mib']:.0f} MiB before, {r['rss_peak_mib']:.0f} MiB at peak "
            f"(+{r['growth_mib']:.1f} MiB), {r['rss_after_mib']:.0f} MiB after"
        )
    print(f"  services alive afterwards: {out['alive']}")


if __name__ == "__main__":
    main()
