"""A real HTTP/1.1 file server on 127.0.0.1 for tests of ``http://`` sources: keep-alive, HEAD,
single byte ranges (``Range: bytes=A-B`` → 206), and faults on demand (dropped connections, short
bodies, no HEAD, no ranges). It records every request and connection it sees."""

from __future__ import annotations

import re
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["RangeServer"]

RANGE = re.compile(r"bytes=(\d+)-(\d+)")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.owner.connections += 1

    def log_message(self, *args) -> None:  # quiet: the test reads .requests instead
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        owner = self.server.owner
        rng = self.headers.get("Range")
        with self.server.lock:
            owner.requests.append((self.command, self.path, rng))
            owner.inflight += 1
            owner.max_inflight = max(owner.max_inflight, owner.inflight)
            drop = rng is not None and owner.drops > 0
            if drop:
                owner.drops -= 1
        try:  # in flight until its delay ends, before any byte of the answer goes (see s3server._forward)
            if owner.delay_s:
                time.sleep(owner.delay_s)
            if rng is not None and not owner.held.wait(HOLD_LIMIT_S):
                return  # never released: hang up (a test that forgot to release ends anyway)
        finally:
            with self.server.lock:
                owner.inflight -= 1
        self._answer(rng, drop, head)

    def _answer(self, rng: str | None, drop: bool, head: bool) -> None:
        owner = self.server.owner
        if drop:  # hang up without a word, as a dying load balancer does
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        for old, new in owner.redirects.items():
            if self.path.startswith(old):
                self.send_response(302)
                self.send_header("Location", new + self.path[len(old) :])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        path = owner.root / self.path.split("?")[0].lstrip("/")
        if not path.is_file():
            self._reply(404, b"not found\n")
            return
        if head and owner.no_head:
            self._reply(405, b"")
            return
        size = path.stat().st_size
        match = RANGE.fullmatch(rng or "")
        if match is None or owner.no_ranges:
            etag = f'"{path.stat().st_mtime_ns:x}-{size:x}"'  # what a real server derives it from
            self._reply(200, b"" if head else path.read_bytes(), length=size, etag=etag)
            return
        a, b = int(match.group(1)), min(int(match.group(2)), size - 1)
        with path.open("rb") as f:
            f.seek(a)
            body = f.read(b + 1 - a)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {a}-{b}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if owner.short_body:  # promise the range, send half of it, hang up
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)

    def _reply(self, status: int, body: bytes, length: int | None = None, etag: str | None = None) -> None:
        self.send_response(status)
        if etag is not None:
            self.send_header("ETag", etag)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


#: The longest a held GET waits for :meth:`RangeServer.release` before the server hangs up on it.
HOLD_LIMIT_S = 60.0


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    #: Connections waiting to be accepted, as a store's: socketserver's 5 dropped most of the 100 a provider
    #: opens at once when its requests in flight climb, and the kernel retried each a second later.
    request_queue_size = 1024
    owner: RangeServer
    lock: threading.Lock


class RangeServer:
    """Serve ``root`` on 127.0.0.1 (or ``host``: an address of a network namespace the caller made) on a
    free port the OS picks, until :meth:`close`; over TLS with ``tls=(certificate file, key file)``.

    Faults, settable while it runs: ``drops`` (hang up on the next N range requests),
    ``short_body``, ``no_head`` (HEAD answers 405), ``no_ranges`` (GET ignores Range), ``delay_s``,
    ``redirects`` (path prefix → replacement, answered with 302), and ``held``: range GETs wait until it
    is set (:meth:`hold`, :meth:`release`; a store whose answer is outstanding for as long as a test needs).
    """

    def __init__(self, root: Path, tls: tuple[Path, Path] | None = None, host: str = "127.0.0.1"):
        self.root = root
        self.requests: list[tuple[str, str, str | None]] = []
        self.connections = self.inflight = self.max_inflight = 0
        self.drops, self.short_body, self.no_head, self.no_ranges, self.delay_s = 0, False, False, False, 0.0
        self.redirects: dict[str, str] = {}  # path prefix → where to send it (302)
        self.held = threading.Event()
        self.held.set()
        self._server = _Server((host, 0), _Handler)
        self._server.owner, self._server.lock = self, threading.Lock()
        if tls is not None:  # (certificate, key): serve https
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*tls)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def hold(self) -> None:
        """Range GETs from now on wait (in flight, no byte answered) until :meth:`release`."""
        self.held.clear()

    def release(self) -> None:
        self.held.set()

    def gets(self) -> list[tuple[str, str | None]]:
        """(path, Range) of each GET with a Range header so far."""
        return [(p, r) for m, p, r in self.requests if m == "GET" and r is not None]

    def close(self) -> None:
        self.held.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
