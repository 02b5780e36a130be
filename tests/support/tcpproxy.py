"""A TCP proxy in front of a real service, whose connections a test can cut or freeze one by one.

:class:`TcpProxy` listens on ``127.0.0.1`` (a port the kernel picks, kept bound) and forwards every
connection it accepts to ``upstream``, both ways, on one thread with a selector. Connections are
numbered in the order they were accepted; :meth:`TcpProxy.cut` resets one (both of its ends: the
client sees its connection dropped, as when a middlebox or a NIC resets it) and :meth:`TcpProxy.freeze`
stops forwarding what the server sends on one (its replies never arrive, the connection stays open).
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading

__all__ = ["TcpProxy"]

_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


class _Pair:
    def __init__(self, client: socket.socket, server: socket.socket):
        self.client, self.server = client, server
        self.frozen = False
        self.closed = False


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` (``tcp://HOST:PORT``); :attr:`endpoint` is where to connect."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.pairs: list[_Pair] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()

    @property
    def accepted(self) -> int:
        """Connections accepted so far."""
        with self._lock:
            return len(self.pairs)

    def cut(self, n: int) -> None:
        """Reset connection ``n`` (numbered from 0 in the order accepted), both of its ends."""
        with self._lock:
            pair = self.pairs[n]
            self._close(pair, reset=True)

    def freeze(self, n: int) -> None:
        """From now on, drop what the server sends on connection ``n`` (the client's requests still go)."""
        with self._lock:
            self.pairs[n].frozen = True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            for pair in self.pairs:
                self._close(pair)
        self._sel.close()
        self.listener.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the forwarding thread --------------------------------------------------------------------
    def _close(self, pair: _Pair, reset: bool = False) -> None:
        if pair.closed:
            return
        pair.closed = True
        for sock in (pair.client, pair.server):
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            events = self._sel.select(0.05)
            with self._lock:
                for key, _ in events:
                    if key.data is None:
                        self._accept()
                    else:
                        self._forward(key.fileobj, *key.data)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except BlockingIOError:
            return
        server = socket.create_connection(self.upstream, timeout=5)
        pair = _Pair(client, server)
        for sock in (client, server):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pairs.append(pair)
        self._sel.register(client, selectors.EVENT_READ, (pair, server))
        self._sel.register(server, selectors.EVENT_READ, (pair, client))

    def _forward(self, src: socket.socket, pair: _Pair, dst: socket.socket) -> None:
        if pair.closed:
            return
        try:
            data = src.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(pair)
            return
        if pair.frozen and src is pair.server:
            return  # the reply is swallowed: the client waits in vain
        try:
            dst.setblocking(True)  # the test's traffic is small: a blocking send keeps the order simple
            dst.sendall(data)
            dst.setblocking(False)
        except OSError:
            self._close(pair)
