"""A stand-in for the Hugging Face Hub on 127.0.0.1, for tests of ``hf://`` sources (there is no network here).

It answers the part of the Hub's HTTP API that ``huggingface_hub`` (``HfApi``, ``HfFileSystem``) calls to
list and read a dataset repository, found by running the client against it and logging what it asked:

- ``GET /api/datasets/ORG/NAME[/revision/REV]``: the repository's info (``sha`` the commit of ``REV``);
- ``GET /api/datasets/ORG/NAME/tree/REV[/PATH]?recursive=…``: the files and folders under ``PATH``;
- ``POST /api/datasets/ORG/NAME/paths-info/REV``: the entries of named paths;
- ``GET|HEAD /datasets/ORG/NAME/resolve/REV/PATH``: a file's bytes, a ``Range`` answered ``206``,
  with the headers the client reads (``ETag``, ``X-Repo-Commit``, ``Content-Length``).

Each repository is a local folder per commit, named by revisions (a branch, or ``refs/convert/parquet`` as
the Hub's Parquet conversion is reached); a branch moved to another commit keeps its old commits readable,
as on the Hub. A revision is answered by its name or by its commit. (The client also asks
``/api/agent-harnesses`` to build its user agent: answered 404, which it ignores.) A repository given a
``token`` is private: without ``Authorization: Bearer TOKEN`` it answers ``401`` as the Hub does, with
``X-Error-Code: RepoNotFound``. Files are sent as plain HTTP (no Xet headers), which the client reads as
it does a Hub file without Xet. :attr:`requests` logs (method, path, Range).
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["HubServer"]


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


class _Repo:
    def __init__(self, repo_id: str, token: str | None):
        self.repo_id, self.token = repo_id, token
        self.revisions: dict[str, str] = {}  # name -> commit (a branch moves: its old commits stay)
        self.commits: dict[str, Path] = {}  # commit -> folder

    def find(self, rev: str) -> tuple[str, Path] | None:
        commit = self.revisions.get(rev, rev)
        return (commit, self.commits[commit]) if commit in self.commits else None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def _route(self) -> None:
        hub = self.server.hub
        url = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with hub.lock:
            hub.requests.append((self.command, url.path, self.headers.get("Range")))
        parts = [unquote(p) for p in url.path.split("/") if p]
        api = parts[:2] == ["api", "datasets"]
        rest = parts[2:] if api else parts[1:] if parts[:1] == ["datasets"] else None
        if rest is None or len(rest) < 2:
            return self._error(404, "EntryNotFound", f"no route {url.path}")
        repo = hub.repos.get(f"{rest[0]}/{rest[1]}")
        if repo is None or (repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}"):
            # the Hub answers a private repository as a missing one: 401 without a valid token
            return self._error(401, "RepoNotFound", "Repository not found")
        action, tail = (rest[2], rest[3:]) if len(rest) > 2 else ("info", [])
        rev, path = self._revision(tail)
        found = repo.find(rev if action != "info" or rev else "main")
        if found is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        commit, folder = found
        if api and action in ("info", "revision"):
            return self._json(self._info(repo, commit, folder))
        if api and action == "tree":
            recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
            target = folder / path
            if not target.is_dir():
                return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}")
            below = target.rglob("*") if recursive else target.iterdir()
            return self._json([self._entry(folder, p) for p in sorted(below)])
        if api and action == "paths-info":
            form = parse_qs(body.decode())
            asked = form.get("paths", [])
            return self._json([self._entry(folder, folder / p) for p in asked if (folder / p).exists()])
        if not api and action == "resolve":
            return self._file(commit, folder / path)
        return self._error(404, "EntryNotFound", f"no route {url.path}")

    @staticmethod
    def _revision(tail: list[str]) -> tuple[str, str]:
        """(revision, path) from what follows the action: ``refs/convert/NAME`` and ``refs/pr/N`` are one."""
        if not tail:
            return "", ""
        n = 3 if tail[0] == "refs" and len(tail) >= 3 else 1
        if "/" in tail[0]:  # quoted as one segment (refs%2Fconvert%2Fparquet)
            n = 1
        return "/".join(tail[:n]), "/".join(tail[n:])

    @staticmethod
    def _entry(root: Path, p: Path) -> dict:
        rel = p.relative_to(root).as_posix()
        if p.is_dir():
            return {"type": "directory", "oid": _sha(rel), "path": rel}
        data = p.read_bytes()
        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
        entry = {"type": "file", "oid": oid, "size": len(data), "path": rel}
        if p.suffix == ".parquet":  # the Hub keeps large files in LFS: their entries carry the content's sha256
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _info(self, repo: _Repo, commit: str, folder: Path) -> dict:
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        return {
            "_id": _sha(repo.repo_id),
            "id": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": commit,
            "private": bool(repo.token),
            "gated": False,
            "disabled": False,
            "lastModified": "2026-01-01T00:00:00.000Z",
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "siblings": [{"rfilename": f} for f in files],
        }

    def _file(self, commit: str, path: Path) -> None:
        if not path.is_file():
            return self._error(404, "EntryNotFound", "Entry not found")
        data = path.read_bytes()
        status, first, last = 200, 0, len(data) - 1
        if (rng := self.headers.get("Range")) and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            first, last = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
            if first >= len(data):
                return self._error(416, "RangeNotSatisfiable", "Range Not Satisfiable")
            status = 206
        chunk = data[first : last + 1]
        headers = {
            "Content-Type": "application/octet-stream",
            "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
            "X-Repo-Commit": commit,
            "Accept-Ranges": "bytes",
        }
        if status == 206:
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
        self._send(status, chunk, headers)

    def _json(self, value) -> None:
        self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(
            status, json.dumps({"error": message}).encode(), {"Content-Type": "application/json", "X-Error-Code": code}
        )

    def _send(self, status: int, data: bytes, headers: dict) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubServer


class HubServer:
    """The Hub's file API for the repositories :meth:`add` names, at :attr:`url` (``HF_ENDPOINT``)."""

    def __init__(self):
        self.repos: dict[str, _Repo] = {}
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, str | None]] = []
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def add(self, repo_id: str, folder: Path, revision: str = "main", token: str | None = None) -> str:
        """Serve ``folder`` as dataset ``repo_id`` at ``revision``; returns that revision's commit."""
        repo = self.repos.setdefault(repo_id, _Repo(repo_id, token))
        commit = _sha(f"{repo_id}@{revision}:{sorted(str(p) for p in folder.rglob('*'))}")
        repo.revisions[revision], repo.commits[commit] = commit, folder
        return commit

    def ranged_gets(self) -> list[tuple[str, str | None]]:
        with self.lock:
            return [(p, r) for m, p, r in self.requests if m == "GET" and "/resolve/" in p]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
