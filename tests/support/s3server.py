"""A real S3 API on 127.0.0.1 for tests of object-store sources: moto in server mode (a process),
with IAM authentication on (requests must be signed with the test user's key, as on AWS), behind a
small proxy that injects latency and failures (503 SlowDown, 429, dropped connections) on demand and
records every request it forwards."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import pytest

__all__ = ["S3Server"]

#: Requests moto serves before it checks signatures: create the user, its key, its policy.
SETUP_ACTIONS = 3
POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
ERROR = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>%s</Code><Message>injected</Message></Error>'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._forward()

    def do_HEAD(self) -> None:
        self._forward()

    def do_PUT(self) -> None:
        self._forward()

    def do_POST(self) -> None:
        self._forward()

    def do_DELETE(self) -> None:
        self._forward()

    def _forward(self) -> None:
        owner = self.server.owner
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with owner.lock:
            owner.requests.append((self.command, self.path, self.headers.get("Range")))
            fault = (
                owner.faults.pop(0) if owner.faults and self.command == "GET" and self.headers.get("Range") else None
            )
            # In flight from its arrival to the end of its delay, before any byte of the answer goes:
            # a client that has its whole answer (and may send its next request) never still counts
            # here, so the most at once is never more than the client really had out.
            owner.inflight += 1
            owner.max_inflight = max(owner.max_inflight, owner.inflight)
        try:
            if owner.delay_s:
                time.sleep(owner.delay_s)
        finally:
            with owner.lock:
                owner.inflight -= 1
        self._answer(body, fault)

    def _answer(self, body: bytes, fault) -> None:
        owner = self.server.owner
        if fault == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault is not None:
            status, code = fault
            self._send(status, ERROR % code.encode(), {"Content-Type": "application/xml"})
            return
        conn = http.client.HTTPConnection("127.0.0.1", owner.moto_port, timeout=30)
        try:
            conn.request(self.command, self.path, body=body or None, headers=dict(self.headers.items()))
            resp = conn.getresponse()
            data = resp.read()
            headers = {k: v for k, v in resp.getheaders() if k.lower() not in ("transfer-encoding", "connection")}
            self._send(resp.status, data, headers, head=self.command == "HEAD")
        finally:
            conn.close()

    def _send(self, status: int, data: bytes, headers: dict, head: bool = False) -> None:
        self.send_response(status)
        for k, v in headers.items():
            if k.lower() != "content-length":
                self.send_header(k, v)
        self.send_header("Content-Length", headers.get("Content-Length", str(len(data))) if head else str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: S3Server


class S3Server:
    """moto on a free port behind the fault proxy (:attr:`url`); :attr:`s3` a boto3 client to fill buckets.

    Faults, settable while it runs: ``faults`` (answers for the next ranged GETs, in order: ``(status,
    code)`` such as ``(503, "SlowDown")``, or ``"drop"`` to hang up), ``delay_s`` (every request).
    ``max_inflight``: the most requests it held at once, each from its arrival to the end of its delay (reset
    it to measure).
    """

    def __init__(self):
        self.moto_port = _free_port()
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(SETUP_ACTIONS)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.moto_port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.moto_port), 0.2).close()
                break
            except OSError:
                assert self.proc.poll() is None, "moto server exited"
                assert time.monotonic() < deadline, "moto server never listened"
                time.sleep(0.05)
        direct = f"http://127.0.0.1:{self.moto_port}"
        iam = boto3.client(
            "iam",
            endpoint_url=direct,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="batchbus")
        key = iam.create_access_key(UserName="batchbus")["AccessKey"]
        iam.put_user_policy(UserName="batchbus", PolicyName="s3", PolicyDocument=json.dumps(POLICY))
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        self.s3 = boto3.client(
            "s3",
            endpoint_url=direct,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, str | None]] = []
        self.faults: list = []
        self.delay_s = 0.0
        self.inflight = self.max_inflight = 0  # requests being answered now, and the most at once
        self._proxy = _ProxyServer(("127.0.0.1", 0), _Proxy)
        self._proxy.owner = self
        self.url = f"http://127.0.0.1:{self._proxy.server_address[1]}"
        self._thread = threading.Thread(target=self._proxy.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def env(self, **changes: str) -> dict[str, str]:
        """The ``AWS_*`` variables a provider needs to read this server's buckets (through the proxy)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.url,
            "AWS_REGION": "us-east-1",
            **changes,
        }

    def put_dir(self, bucket: str, prefix: str, folder) -> None:
        """Upload every file under ``folder`` to ``bucket/prefix/`` (the bucket is created if new)."""
        try:
            self.s3.create_bucket(Bucket=bucket)
        except self.s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                key = f"{prefix.strip('/')}/{path.relative_to(folder).as_posix()}".lstrip("/")
                self.s3.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())

    def gets(self) -> list[tuple[str, str | None]]:
        """(path, Range) of each ranged GET so far."""
        with self.lock:
            return [(p, r) for m, p, r in self.requests if m == "GET" and r is not None]

    def close(self) -> None:
        self._proxy.shutdown()
        self._proxy.server_close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def s3_in_env() -> Iterator[S3Server]:
    """A loopback S3 server whose endpoint and credentials are in this process's environment (the
    ``AWS_*`` variables a provider reads) while the block runs; the server closed after it."""
    server = S3Server()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in server.env().items():
                mp.setenv(k, v)
            yield server
    finally:
        server.close()
