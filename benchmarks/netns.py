"""Two network namespaces joined by a veth pair: the hosts of the benchmarks that shape a link with ``htb``
(``benchmarks/flows.py``: per-flow caps; ``benchmarks/remote.py``: a store behind a capped link).

Traffic stays between namespaces this process made (addresses of its own in them), and the namespaces
are deleted by :meth:`VethHosts.close`, which the caller always calls (also when set-up fails half-way).
"""

from __future__ import annotations

import subprocess

__all__ = ["VethHosts", "run"]


def run(*cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    """``cmd``'s completed process; :class:`RuntimeError` with its message when it fails (and ``check``)."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


class VethHosts:
    """Namespaces ``<tag>-<a>`` and ``<tag>-<b>`` with loopback up, joined by veth ``dev_a``—``dev_b``
    addressed ``addr_a``/``addr_b`` (a /24). ``hosts`` is ``((suffix, dev, addr), (suffix, dev, addr))``."""

    def __init__(self, tag: str, hosts: tuple[tuple[str, str, str], tuple[str, str, str]]):
        (sa, dev_a, addr_a), (sb, dev_b, addr_b) = hosts
        self.a, self.b = f"{tag}-{sa}", f"{tag}-{sb}"
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
