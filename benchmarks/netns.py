"""Two network namespaces joined by a veth pair, one end's traffic capped by ``htb``: the hosts of the
benchmarks that shape a link (``benchmarks/flows.py``: a cap per connection; ``benchmarks/remote/``: a store
behind a capped link).

Traffic stays between namespaces this process made (addresses of its own in them), and the namespaces
are deleted by :meth:`VethHosts.close`, which the caller always calls (also when set-up fails half-way).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import tempfile

__all__ = ["CappedLink", "VethHosts", "netns_unavailable", "run"]

#: A capped link's unshaped class: what no per-port class catches (the cap is per connection, not the link's).
UNSHAPED = "1:999"
#: The class that caps all of a link's traffic (one cap for the link, not a flow's).
WHOLE_LINK = "1:10"


def run(*cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    """``cmd``'s completed process; :class:`RuntimeError` with its message when it fails (and ``check``)."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def netns_unavailable() -> str:
    """Why a capped link cannot be made here ("" when it can): root, ``ip``, ``tc``, a namespace."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces and qdiscs"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's {tool}"
    probe = f"bbfprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    try:
        run("ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        run("tc", "-n", probe, "qdisc", "add", "dev", "probe0", "root", "handle", "1:", "htb")
    except RuntimeError as err:
        return f"cannot make a veth pair with an htb qdisc: {err}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


class VethHosts:
    """Namespaces ``<tag>-<a>`` and ``<tag>-<b>`` with loopback up, joined by veth ``dev_a``—``dev_b``
    addressed ``addr_a``/``addr_b`` (a /24). ``hosts`` is ``((suffix, dev, addr), (suffix, dev, addr))``."""

    def __init__(self, tag: str, hosts: tuple[tuple[str, str, str], tuple[str, str, str]]):
        (sa, dev_a, addr_a), (sb, dev_b, addr_b) = hosts
        self.a, self.b = f"{tag}-{sa}", f"{tag}-{sb}"
        self.dev_a, self.dev_b = dev_a, dev_b
        self.made: list[str] = []
        try:
            for ns in (self.a, self.b):
                run("ip", "netns", "add", ns)
                self.made.append(ns)
                run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "link", "add", dev_a, "netns", self.a, "type", "veth", "peer", "name", dev_b, "netns", self.b)
            for ns, dev, addr in ((self.a, dev_a, addr_a), (self.b, dev_b, addr_b)):
                run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                run("ip", "-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def exec(ns: str) -> tuple[str, ...]:
        """The command prefix that runs a program in namespace ``ns``."""
        return ("ip", "netns", "exec", ns)

    def close(self) -> None:
        """Delete the namespaces (and with them the veth pair); idempotent."""
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()


def htb_lines(dev: str, mbit: int, ports: range | None) -> list[str]:
    """``tc -batch`` lines for an ``htb`` qdisc on ``dev`` sending at most ``mbit``: with no ``ports``, one class
    (:data:`WHOLE_LINK`) for all its traffic; with ``ports``, one class per TCP destination port (a ``u32``
    filter each), every connection to those ports capped alone, the rest unshaped (:data:`UNSHAPED`)."""
    cap = f"htb rate {mbit}mbit ceil {mbit}mbit quantum 60000"
    if ports is None:
        return [
            f"qdisc add dev {dev} root handle 1: htb default {WHOLE_LINK.partition(':')[2]}",
            f"class add dev {dev} parent 1: classid {WHOLE_LINK} {cap}",
        ]
    lines = [
        f"qdisc add dev {dev} root handle 1: htb default {UNSHAPED.partition(':')[2]}",
        f"class add dev {dev} parent 1: classid {UNSHAPED} htb rate 10gbit quantum 60000",
    ]
    for i, port in enumerate(ports):
        classid = f"1:{0x100 + i:x}"
        lines.append(f"class add dev {dev} parent 1: classid {classid} {cap}")
        match = f"match ip protocol 6 0xff match ip dport {port} 0xffff"
        lines.append(f"filter add dev {dev} parent 1: protocol ip prio 1 u32 {match} flowid {classid}")
    return lines


class CappedLink(VethHosts):
    """:class:`VethHosts` whose ``a`` end sends at most ``mbit`` Mbit/s (:func:`htb_lines`): the whole link's
    traffic through one class, or, with ``ports``, each connection from ``b``'s ports through a class of its own
    (as a cloud NIC caps a flow), ``b``'s ephemeral ports narrowed to ``ports`` so that every one it opens is
    shaped."""

    def __init__(
        self, tag: str, hosts: tuple[tuple[str, str, str], tuple[str, str, str]], mbit: int, ports: range | None = None
    ):
        super().__init__(tag, hosts)
        try:
            if ports is not None:  # b's connections leave from these ports only: each has its class
                run("ip", "netns", "exec", self.b, "sysctl", "-q", "-w",
                    f"net.ipv4.ip_local_port_range={ports.start} {ports.stop - 1}")  # fmt: skip
            with tempfile.NamedTemporaryFile("w", suffix=".tc") as batch:
                batch.write("\n".join(htb_lines(self.dev_a, mbit, ports)) + "\n")
                batch.flush()
                run("tc", "-n", self.a, "-batch", batch.name)
        except BaseException:
            self.close()
            raise

    def class_bytes(self) -> dict[str, int]:
        """Bytes each capped class has sent so far (``a`` → ``b``), by class id."""
        out = run("tc", "-n", self.a, "-s", "class", "show", "dev", self.dev_a).stdout
        found = re.findall(r"^class htb (\S+) .*\n Sent (\d+) bytes", out, flags=re.MULTILINE)
        return {handle: int(sent) for handle, sent in found if handle != UNSHAPED}
