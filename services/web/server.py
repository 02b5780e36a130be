"""``busctl web``: a read-only view of jobs, studies and services in a browser, on the standard library's
``ThreadingHTTPServer`` (docs/web.md).

Every page and JSON endpoint but the sign-in page needs a signed-in browser (:mod:`.logins`); each JSON
endpoint answers what the matching ``busctl ... --json`` prints, from the same functions
(:mod:`services.views`). The page is one HTML file with its script and style, served from this package:
nothing is fetched from anywhere else, and the Content-Security-Policy lets the page run only that
script. Everything a tenant wrote (job names, events, logs) is put in the page as text by the script,
never as markup; the sign-in page's one message is escaped here.
"""

from __future__ import annotations

import html
import ipaddress
import logging
import re
import socket
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

import orjson

from libbus.config import Settings
from libbus.connect.client import Client, Identity
from libbus.errors import (
    AuthExpired,
    AuthInvalid,
    AuthRequired,
    BadRequest,
    BusError,
    ConfigError,
    Forbidden,
    NotFound,
    PeerTimeout,
    RateLimited,
    Unavailable,
)
from libbus.jobs.spec import JOB_STATES
from services import credentials, views

from .logins import MAX_TOKEN_CHARS, Login, Logins, NotSignedIn

__all__ = ["COOKIE", "WebServer", "is_loopback", "parse_bind"]

log = logging.getLogger("batchbus.web")

#: The session cookie: a random id, HttpOnly (no script reads it), SameSite=Strict (no other site sends it).
COOKIE = "batchbus_session"
#: Progress reports and events a job's page asks for (the router's own caps apply as well).
JOB_REPORTS = 1000
JOB_EVENTS = 100
#: A job or study id in a path: what the router names them with, nothing else reaches it.
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: Everything the browser may load: this server's own script, style and data.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_STATIC = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8"}


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port).

    Raises:
        ConfigError: naming the form expected.
    """
    host, sep, port = bind.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--bind {bind!r}: expected HOST:PORT such as 127.0.0.1:8765")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only: ``localhost`` or an address in 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    web: WebServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client gone mid-reply (the base class prints a traceback to stderr): a line in the debug log
        log.debug("busctl web: connection from %s ended early", client_address, exc_info=True)


class _V6Server(_Server):
    address_family = socket.AF_INET6


class WebServer:
    """The HTTP server of ``busctl web``: bind with :meth:`start`, serve with :meth:`serve_forever` (or
    on a thread), end with :meth:`close`.

    ``connect(token)`` makes the router client a signed-in browser uses (default: the settings' router,
    timeouts and CURVE keys, with the browser's token)."""

    def __init__(self, settings: Settings, host: str, port: int, connect: Callable[[str], Client] | None = None):
        self.settings = settings
        self.host, self.port = host, port
        self.logins = Logins(connect or self._client)
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._served = False
        self.allowed_hosts: set[str] = set()

    def _client(self, token: str) -> Client:
        curve = credentials.curve_keys(self.settings, "admin")
        identity = Identity(
            role="admin",
            name="busctl-web",
            token=token,
            curve=curve,
            router_key=credentials.router_key(self.settings),
            handshake=self.settings.handshake_auth,
        )
        return Client(
            self.settings.router,
            identity,
            timeout_s=self.settings.request_timeout_s,
            retries=self.settings.request_retries,
            server_key=identity.router_key,
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> str:
        """Bind (port 0: any free one) and return the URL to open."""
        cls = _V6Server if ":" in self.host else _Server
        self._httpd = cls((self.host, self.port), _Handler)
        self._httpd.web = self
        self.port = self._httpd.server_address[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        # DNS rebinding: a page of another site whose name resolves here must not reach the API
        self.allowed_hosts = {f"{h}:{self.port}" for h in (host, "localhost", "127.0.0.1", "[::1]")}
        return self.url

    def serve_forever(self) -> None:
        """Serve until :meth:`close` (from another thread) or an exception (Ctrl-C) ends it."""
        if self._httpd is None:
            self.start()
        self._served = True
        cast(_Server, self._httpd).serve_forever(poll_interval=0.2)

    def start_thread(self) -> str:
        """Bind and serve on a daemon thread; returns the URL."""
        url = self.start()
        self._served = True
        self._thread = threading.Thread(target=self.serve_forever, name="busctl-web", daemon=True)
        self._thread.start()
        return url

    def close(self) -> None:
        """Stop serving, sign everyone out (their router sessions say Goodbye), close the socket."""
        if self._httpd is not None:
            if self._served:  # (returns at once when serve_forever has already ended)
                self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(10)
        self.logins.close()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "batchbus-web"
    protocol_version = "HTTP/1.1"
    #: A connection silent this long is closed (its thread ends): no client holds one open for nothing.
    timeout = 30

    # -- plumbing ---------------------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    @property
    def web(self) -> WebServer:
        return self.server.web

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", _CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Referrer-Policy", "same-origin")  # (no-referrer: a browser posts forms with Origin: null)
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, value: Any) -> None:
        self._send(status, orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS), "application/json")

    def _redirect(self, where: str, headers: dict[str, str] | None = None) -> None:
        self._send(HTTPStatus.SEE_OTHER, b"", "text/plain", {"Location": where, **(headers or {})})

    def _login_page(self, status: int = HTTPStatus.OK, message: str = "", headers: dict[str, str] | None = None):
        page = _resource("login.html").replace("{message}", html.escape(message, quote=True))
        self._send(status, page.encode(), "text/html; charset=utf-8", headers)

    def _sid(self) -> str | None:
        try:
            cookie = SimpleCookie(self.headers.get("Cookie", ""))
        except CookieError:
            return None
        morsel = cookie.get(COOKIE)
        return morsel.value if morsel is not None else None

    def _host_allowed(self) -> bool:
        """The Host header names this server (loopback binds only: a page of another site whose name
        resolves to 127.0.0.1 must not reach it with the browser's cookie, DNS rebinding)."""
        if not is_loopback(self.web.host):
            return True
        return self.headers.get("Host", "") in self.web.allowed_hosts

    def _same_origin(self) -> bool:
        """A form posted from this server's own page (or by a client that sends no Origin, not a browser)."""
        origin = self.headers.get("Origin")
        return origin is None or origin == f"http://{self.headers.get('Host', '')}"

    # -- routes -----------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self._guarded(self._get)

    def do_POST(self) -> None:
        self._guarded(self._post)

    def _guarded(self, route: Callable[[str, dict[str, list[str]]], None]) -> None:
        """Answer the request; no error a request can cause ends the server or shows a traceback."""
        try:
            if not self._host_allowed():
                self._send(HTTPStatus.MISDIRECTED_REQUEST, b"unknown Host\n", "text/plain; charset=utf-8")
                return
            parts = urlsplit(self.path)
            try:
                query = parse_qs(parts.query, max_num_fields=20)
            except ValueError:  # more fields than any page here asks with
                self.close_connection = True
                self._send(HTTPStatus.BAD_REQUEST, b"too many query fields\n", "text/plain; charset=utf-8")
                return
            route(parts.path, query)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:  # noqa: BLE001 - a bug: logged with its traceback, one line to the browser
            log.exception("busctl web: %s %s", self.command, self.path)
            try:
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error (a bug: see busctl web's log)"})
            except OSError:
                pass

    def _get(self, path: str, query: dict[str, list[str]]) -> None:
        if path == "/login":
            return self._login_page()
        if path.startswith("/static/") and path[len("/static/") :] in _STATIC:
            name = path[len("/static/") :]
            return self._send(HTTPStatus.OK, _resource(name).encode(), _STATIC[name])
        if path == "/":
            try:
                self.web.logins.get(self._sid())
            except NotSignedIn as err:
                return self._login_page(HTTPStatus.UNAUTHORIZED, "" if self._sid() is None else str(err))
            return self._send(HTTPStatus.OK, _resource("index.html").encode(), "text/html; charset=utf-8")
        if path.startswith("/api/"):
            return self._api(path[len("/api/") :].split("/"), query)
        self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")

    def _post(self, path: str, query: dict[str, list[str]]) -> None:
        # the body is read whatever the answer, so the next request on this connection starts where it should
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit() or int(length) > MAX_TOKEN_CHARS + 64:
            self.close_connection = True
            return self._login_page(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "that is longer than any batchbus token")
        body = self.rfile.read(int(length))
        if not self._same_origin():
            return self._send(HTTPStatus.FORBIDDEN, b"cross-origin form refused\n", "text/plain; charset=utf-8")
        if path == "/logout":
            self.web.logins.sign_out(self._sid())
            return self._redirect("/login", {"Set-Cookie": _cookie("", max_age=0)})
        if path != "/login":
            return self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")
        try:
            form = parse_qs(body.decode("ascii", "replace"), max_num_fields=4)
        except ValueError:
            form = {}
        token = (form.get("token") or [""])[0]
        try:
            sid = self.web.logins.sign_in(token)
        except ValueError as err:
            return self._login_page(HTTPStatus.UNAUTHORIZED, str(err))
        except (AuthInvalid, AuthExpired, AuthRequired, Forbidden, RateLimited) as err:
            return self._login_page(HTTPStatus.UNAUTHORIZED, f"the router refused this token: {err}")
        except BusError as err:
            return self._login_page(HTTPStatus.BAD_GATEWAY, f"the router at {self.web.settings.router}: {err}")
        self._redirect("/", {"Set-Cookie": _cookie(sid)})

    # -- the JSON endpoints ----------------------------------------------------------------------
    def _api(self, parts: list[str], query: dict[str, list[str]]) -> None:
        try:
            login = self.web.logins.get(self._sid())
        except NotSignedIn as err:
            return self._json(HTTPStatus.UNAUTHORIZED, {"error": str(err), "login": "/login"})
        try:
            value = self._answer(login, parts, query)
        except _NoRoute:
            return self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: /api/{'/'.join(parts)}"})
        except BadRequest as err:
            return self._json(HTTPStatus.BAD_REQUEST, {"error": str(err)})
        except (AuthInvalid, AuthExpired, AuthRequired) as err:  # expired or revoked since signing in
            reason = f"the router no longer accepts this token: {err}"
            self.web.logins.sign_out(self._sid(), reason)
            return self._json(HTTPStatus.UNAUTHORIZED, {"error": reason, "login": "/login"})
        except Forbidden as err:
            return self._json(HTTPStatus.FORBIDDEN, {"error": str(err)})
        except NotFound as err:
            return self._json(HTTPStatus.NOT_FOUND, {"error": str(err)})
        except (PeerTimeout, Unavailable, RateLimited) as err:
            return self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"the router is not answering: {err}"})
        except BusError as err:
            return self._json(HTTPStatus.BAD_GATEWAY, {"error": f"{err} [{err.code}]"})
        self._json(HTTPStatus.OK, value)

    def _answer(self, login: Login, parts: list[str], query: dict[str, list[str]]) -> Any:
        """The JSON of ``/api/<parts>``: each what the ``busctl`` command named beside it prints with --json."""
        match parts:
            case ["me"]:
                return {**login.summary(), "router": self.web.settings.router}
            case ["jobs"]:  # busctl jobs --json (and the router's note when it cut the list)
                state = _arg(query, "state", "")
                if state and state not in JOB_STATES:
                    raise BadRequest(f"state must be one of {', '.join(JOB_STATES)}, got {state!r}")
                limit, offset = _int(query, "limit", 100, 1, 1000), _int(query, "offset", 0, 0, 10**9)
                rows, note = login.call(views.jobs, state or None, limit, offset)
                return {"jobs": rows, "note": note}
            case ["jobs", job_id]:  # busctl job show --json
                info, note = login.call(views.job, _id(job_id), 0, JOB_EVENTS)
                return {"job": info, "note": note, "test_scores": views.test_scores(info.get("result"))}
            case ["jobs", job_id, "metrics"]:  # busctl job metrics --json
                metrics, _ = login.call(views.job_metrics, _id(job_id), JOB_REPORTS)
                return metrics
            case ["jobs", job_id, "logs"]:  # busctl job logs --json
                after = _int(query, "after", 0, 0, 10**12)
                return login.call(views.job_logs, _id(job_id), _int(query, "attempt", -1, -1, 10**6), after)
            case ["studies"]:  # busctl studies --json
                return {"studies": login.call(views.studies)}
            case ["studies", study_id]:  # busctl study show --json
                return {"study": login.call(views.study, _id(study_id))}
            case ["services"]:  # busctl top --once --json and busctl datasets --json
                taken = login.call(views.snapshot)
                frame = views.frame(taken, login.previous)
                login.previous = taken
                return {"frame": frame, "datasets": login.call(views.datasets)}
        raise _NoRoute


class _NoRoute(Exception):
    pass


def _cookie(value: str, max_age: int | None = None) -> str:
    # no Expires: a session cookie, gone when the browser closes; no Secure: loopback is plain HTTP
    return f"{COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict" + (
        f"; Max-Age={max_age}" if max_age is not None else ""
    )


def _arg(query: dict[str, list[str]], name: str, default: str) -> str:
    return (query.get(name) or [default])[0]


def _int(query: dict[str, list[str]], name: str, default: int, lo: int, hi: int) -> int:
    text = _arg(query, name, str(default))
    try:
        value = int(text)
    except ValueError:
        raise BadRequest(f"{name} must be a whole number, got {text[:40]!r}") from None
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _id(text: str) -> str:
    """A job or study id from the path; anything else is no page here (it never reaches the router)."""
    if not _ID.match(text):
        raise _NoRoute
    return text


def _resource(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")
