"""``busctl web`` over a real router, provider and trainer (threads of this process; each attempt a child
process), with finished jobs, a study, another tenant's job and a job still running: sign-in with the
user's own token (an HttpOnly, SameSite=Strict session cookie), no page or endpoint without it, refused
tokens shown the sign-in page with the reason, each JSON endpoint equal to what ``busctl --json`` prints,
a tenant shown only what its token grants, hostile input answered without a traceback; and, in headless
Chromium (Debian's, driven by Playwright), the pages as a user sees them, a running job's curve growing,
a job named with markup shown as text, with screenshots kept (docs/web.md shows them)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.cookiejar import CookieJar
from pathlib import Path

import jwt
import orjson
import pytest

from libbus.config import Settings, load_settings
from libbus.connect.client import Client, Identity
from libbus.security.auth import ensure_secret, issue_token
from libbus.wire.messages import GetJob, GetStudy, RevokeToken, SubmitJob, SubmitStudy
from tests.support import BUSCTL, CLUSTER, REPO, busctl_in_process, run_service, wait_file, wait_job, wait_study

CHROMIUM = Path("/usr/bin/chromium")
#: A job name a tenant chose: markup that must reach the page as text.
HOSTILE_NAME = "<script>document.title='owned'</script><img src=x onerror=\"document.title='owned'\">"
STUDY = {
    "base": {"dataset": "mnist", "entrypoint": "tests.support.entrypoints:parabola", "params": {"epochs": 3}},
    "space": {"params": {"x": {"uniform": [0.0, 1.0]}}},
    "study": {
        "trials": 4,
        "concurrent": 1,
        "sampler": "random",
        "pruner": "median",
        "seed": 4,
        "objective": "val_loss",
    },
}


@dataclass
class World:
    state: Path
    secret: bytes
    router: str
    url: str
    admin: Client
    trained: str  # a finished job named HOSTILE_NAME, with curves and logs
    theirs: str  # another tenant's job (dataset "other")
    running: str  # a job that runs until the module ends
    study: str

    def token(self, role: str = "admin", sub: str = "alice", **kw) -> str:
        return issue_token(kw.pop("key", self.secret), sub=sub, role=role, audience=CLUSTER, **kw)

    def expired_token(self) -> str:
        """An admin token of this cluster, signed with its secret, that expired two minutes ago."""
        claims = jwt.decode(self.token(), options={"verify_signature": False})
        now = int(time.time())
        return jwt.encode({**claims, "iat": now - 600, "nbf": now - 600, "exp": now - 120}, self.secret, "HS256")

    def env(self) -> dict[str, str]:
        return {"BATCHBUS_STATE_DIR": str(self.state), "BATCHBUS_ROUTER": self.router}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from services.provider.app import ProviderService
    from services.router.app import RouterService
    from services.trainer.service.app import TrainerService
    from services.web import WebServer

    state = tmp_path_factory.mktemp("web")
    ensure_secret(state / "secret")

    def settings(**flags) -> Settings:
        base = {"state_dir": str(state), "heartbeat_ms": 100, "heartbeat_liveness": 10, "request_timeout_s": 5.0}
        base.update(request_retries=1, lease_s=4.0, eval_epsilon=0.0, torch_threads=1)
        return load_settings(env={}, flags={**base, **flags})[0]

    s = settings(bind="tcp://127.0.0.1:0")
    router = run_service(RouterService(s), s)
    s = settings(router=router.endpoint, datasets=["mnist=mock://mnist?n=600", "other=mock://mnist?n=60"])
    provider = run_service(ProviderService(s), s)
    assert provider.service.link.wait_connected(10), "provider did not register with the router"
    trainer = TrainerService(
        settings(router=router.endpoint, name="trainer-web", job_modules=["tests.support.entrypoints"])
    )
    stop = threading.Event()
    thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    thread.start()
    secret = (state / "secret").read_bytes().strip()
    admin = Client(
        router.endpoint,
        Identity(
            role="admin", name="test-admin", token=issue_token(secret, sub="root", role="admin", audience=CLUSTER)
        ),
        timeout_s=5.0,
        retries=1,
    )
    web = WebServer(settings(router=router.endpoint), "127.0.0.1", 0)
    try:
        trained = admin.request(
            SubmitJob(
                spec={
                    "dataset": "mnist",
                    "entrypoint": "tests.support.entrypoints:custom_loss",
                    "params": {"epochs": 2, "lr": 0.05},
                    "name": HOSTILE_NAME,
                    "batch_size": 64,
                }
            )
        ).job
        assert wait_job(admin, trained, timeout=120)["state"] == "succeeded"
        study = admin.request(SubmitStudy(spec=STUDY)).study["id"]
        wait_study(admin, study, timeout=120)
        theirs = admin.request(
            SubmitJob(
                spec={"dataset": "other", "entrypoint": "tests.support.entrypoints:parabola", "params": {"x": 0.5}}
            )
        ).job
        wait_job(admin, theirs, timeout=60)
        running = admin.request(
            SubmitJob(
                spec={
                    "dataset": "mnist",
                    "entrypoint": "tests.support.entrypoints:counter",
                    "params": {"steps": 10**6, "delta": 0.5},
                    "name": "long-run",
                }
            )
        ).job
        deadline = time.monotonic() + 60
        while admin.request(GetJob(job=running, events=0)).job["state"] != "running":
            assert time.monotonic() < deadline, "the long job never started"
            time.sleep(0.2)
        url = web.start_thread()
        yield World(state, secret, router.endpoint, url, admin, trained, theirs, running, study)
    finally:
        web.close()
        admin.close()
        stop.set()
        thread.join(30)
        provider.shutdown()
        router.shutdown()


# -- a small HTTP client that keeps cookies and does not follow redirects --------------------------


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


class Browser:
    def __init__(self, url: str):
        self.url = url
        self.jar = CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar), _NoRedirect)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
        return self._open(urllib.request.Request(self.url.rstrip("/") + path, headers=headers or {}))

    def post(self, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
        h = {"Content-Type": "application/x-www-form-urlencoded", **(headers or {})}
        return self._open(urllib.request.Request(self.url.rstrip("/") + path, data=body, headers=h, method="POST"))

    def sign_in(self, token: str) -> tuple[int, dict, bytes]:
        return self.post("/login", b"token=" + urllib.request.quote(token).encode())

    def api(self, path: str) -> tuple[int, object]:
        status, _, body = self.get("/api/" + path)
        return status, orjson.loads(body)

    def _open(self, request) -> tuple[int, dict, bytes]:
        try:
            with self.opener.open(request, timeout=30) as reply:
                return reply.status, dict(reply.headers), reply.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()


def signed_in(world: World, token: str | None = None) -> Browser:
    b = Browser(world.url)
    status, headers, _ = b.sign_in(token or world.token())
    assert status == 303 and headers["Location"] == "/", (status, headers)
    return b


# -- HTTP --------------------------------------------------------------------------------------------


def test_no_page_or_endpoint_answers_without_signing_in(world):
    b = Browser(world.url)
    status, _, body = b.get("/")
    assert status == 401 and b'name="token"' in body and b"batchbus" in body
    for path in ("jobs", f"jobs/{world.trained}", f"jobs/{world.trained}/logs", "studies", "services", "me"):
        status, reply = b.api(path)
        assert status == 401 and reply["login"] == "/login", (path, reply)
    # a made-up session cookie is no session
    b.jar.set_cookie(_cookie("batchbus_session", "A" * 43, world.url))
    assert b.api("jobs")[0] == 401


def test_signing_in_sets_an_httponly_strict_cookie_and_signing_out_forgets_it(world):
    b = Browser(world.url)
    status, headers, _ = b.sign_in(world.token())
    assert status == 303
    cookie = headers["Set-Cookie"]
    assert cookie.startswith("batchbus_session=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert world.token() not in cookie  # the token stays on the server
    status, page, _ = b.get("/")
    assert status == 200 and page["Content-Security-Policy"].startswith("default-src 'none'; script-src 'self'")
    assert b.api("me") == (
        200,
        {"sub": "alice", "role": "admin", "exp": pytest.approx(time.time() + 3600, abs=120), "router": world.router},
    )
    assert b.post("/logout", b"")[0] == 303
    # the old cookie, replayed, is no longer a session
    replay = Browser(world.url)
    replay.jar.set_cookie(_cookie("batchbus_session", cookie.split(";")[0].split("=", 1)[1], world.url))
    assert replay.api("jobs")[0] == 401


def test_each_endpoint_answers_what_busctl_json_prints(world):
    b = signed_in(world)
    env = world.env()

    def cli(*args: str):
        code, out, err = busctl_in_process(*args, "--json", env=env)
        assert code == 0, err
        return json.JSONDecoder().raw_decode(out)[0]  # (job logs prints a document per reply: the first)

    status, jobs = b.api("jobs")
    assert status == 200
    ids = [j["id"] for j in jobs["jobs"]]
    assert ids == [j["id"] for j in cli("jobs", "--limit", "100")] and world.trained in ids
    assert b.api(f"jobs/{world.trained}")[1]["job"] == cli("job", "show", world.trained, "--events", "100")
    assert b.api(f"jobs/{world.trained}/metrics")[1] == cli("job", "metrics", world.trained)
    logs = b.api(f"jobs/{world.trained}/logs")[1]
    assert logs == cli("job", "logs", world.trained) and any("epoch 2: val accuracy" in line for line in logs["lines"])
    assert b.api("studies")[1]["studies"] == cli("studies")
    assert b.api(f"studies/{world.study}")[1]["study"] == cli("study", "show", world.study)
    services = b.api("services")[1]
    assert [d["dataset"] for d in services["datasets"]] == [d["dataset"] for d in cli("datasets")] == ["mnist", "other"]
    assert [p["name"] for p in services["frame"]["providers"]] and services["frame"]["trainers"][0][
        "name"
    ] == "trainer-web"


def test_a_tenant_sees_only_what_its_token_grants(world):
    b = signed_in(world, world.token(sub="tenant-other", datasets=["other"]))
    status, jobs = b.api("jobs")
    assert status == 200 and [j["id"] for j in jobs["jobs"]] == [world.theirs]
    # the other tenant's job, study and datasets, asked for by name
    status, reply = b.api(f"jobs/{world.trained}")
    assert status == 403 and "Traceback" not in reply["error"], reply
    assert b.api(f"jobs/{world.trained}/logs")[0] == 403
    assert b.api("studies") == (200, {"studies": []})
    assert b.api(f"studies/{world.study}")[0] == 403
    services = b.api("services")[1]
    assert [d["dataset"] for d in services["datasets"]] == ["other"] and "mnist" not in repr(services["frame"])


def test_a_token_revoked_while_signed_in_signs_the_browser_out_saying_so(world):
    token = world.token(sub="mallory")
    b = signed_in(world, token)
    assert b.api("jobs")[0] == 200
    claims = jwt.decode(token, options={"verify_signature": False})
    world.admin.request(RevokeToken(jti=claims["jti"], exp=claims["exp"], reason="laptop stolen"))
    deadline = time.monotonic() + 30  # the router closes the token's sessions at its next turn
    while (status := b.api("jobs")[0]) == 200:
        assert time.monotonic() < deadline, "the router never refused the revoked token"
        time.sleep(0.1)
    assert status == 401
    status, _, page = b.get("/")
    assert status == 401 and b'name="token"' in page and b"no longer accepts this token" in page, page
    assert Browser(world.url).sign_in(token)[0] == 401  # nor signs in again


def test_the_longest_idle_browser_is_signed_out_past_the_limit(world):
    from services.web import Logins, NotSignedIn

    clients: list[Client] = []

    def connect(token: str) -> Client:
        clients.append(Client(world.router, Identity(role="admin", name="web-test", token=token), timeout_s=5.0))
        return clients[-1]

    logins = Logins(connect, max_sessions=2)
    try:
        first, second = logins.sign_in(world.token()), logins.sign_in(world.token())
        logins.get(first)  # used: now the second is the longest idle
        logins.sign_in(world.token())
        with pytest.raises(NotSignedIn, match="more than 2 browsers"):
            logins.get(second)
        assert logins.get(first) and len(logins) == 2 and clients[1].session is None  # its router session closed
    finally:
        logins.close()


@pytest.mark.parametrize("case", ["expired", "other key", "trainer role", "not a token", "empty"])
def test_a_refused_token_gets_the_sign_in_page_with_the_reason(world, case):
    token = {
        "expired": world.expired_token,
        "other key": lambda: world.token(key=b"k" * 32),
        "trainer role": lambda: world.token(role="trainer"),
        "not a token": lambda: "hunter2",
        "empty": lambda: "",
    }[case]()
    b = Browser(world.url)
    status, headers, body = b.sign_in(token)
    assert status in (401, 502) and "Set-Cookie" not in headers, (case, status)
    text = body.decode()
    assert 'name="token"' in text and "Traceback" not in text
    message = text.split('id="message">')[1].split("</p>")[0]
    assert message.strip(), f"{case}: the page says nothing of why"
    assert b.api("jobs")[0] == 401


def test_hostile_requests_are_answered_and_the_server_goes_on(world):
    b = signed_in(world)
    assert b.api("jobs?limit=abc")[0] == 400
    assert b.api("jobs?state=<b>")[0] == 400
    assert b.api("jobs?limit=100000000")[0] == 400
    assert b.api("jobs/%3Cscript%3E")[0] == 404  # never reaches the router
    assert b.api("jobs/j0000000000")[0] == 404
    assert b.api("studies/s-none")[0] == 404
    assert b.api("../../etc/passwd")[0] == 404
    assert b.get("/static/../server.py")[0] == 404
    # a form posted by another site, a Host another site's name resolves to, an oversized form
    assert b.post("/login", b"token=x", {"Origin": "http://evil.example"})[0] == 403
    assert b.get("/", {"Host": "evil.example:80"})[0] == 421
    assert b.post("/login", b"token=" + b"a" * 20000)[0] == 413
    assert b.get("/api/jobs?" + "&".join(f"f{i}=1" for i in range(50)))[0] == 400
    status, _, page = b.post("/login", b"&".join(b"f%d=1" % i for i in range(50)))
    assert status == 401 and b"not a batchbus token" in page
    assert b.api("jobs")[0] == 200


def test_busctl_web_refuses_to_serve_beyond_loopback_without_being_told(tmp_path):
    env = {"BATCHBUS_STATE_DIR": str(tmp_path)}
    code, _, err = busctl_in_process("web", "--bind", "0.0.0.0:0", env=env)
    assert code == 2 and "not a loopback address" in err and "--allow-remote" in err, err
    code, _, err = busctl_in_process("web", "--bind", "nowhere", env=env)
    assert code == 2 and "HOST:PORT" in err, err
    with socket.socket() as taken:  # a port another program holds
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, _, err = busctl_in_process("web", "--bind", f"127.0.0.1:{taken.getsockname()[1]}", env=env)
    assert code == 1 and "cannot serve on" in err and "Traceback" not in err, err


def test_busctl_web_serves_until_sigterm_and_exits_0(world, tmp_path):
    ready = tmp_path / "url"
    proc = subprocess.Popen(
        [*BUSCTL, "web", "--bind", "127.0.0.1:0", "--ready-file", str(ready)],
        env={**os.environ, **world.env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = wait_file(ready, [proc])
        b = Browser(url)
        assert b.get("/")[0] == 401
        assert b.sign_in(world.token())[0] == 303 and b.api("jobs")[0] == 200
        host, port = url.split("//")[1].rstrip("/").split(":")
        for junk in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n"):
            with socket.create_connection((host, int(port))) as rude:  # says nonsense and hangs up
                rude.sendall(junk)
        assert b.api("jobs")[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"busctl web: {url}" in out and "Traceback" not in err


def _cookie(name: str, value: str, url: str):
    from http.cookiejar import Cookie

    host = url.split("//")[1].split(":")[0]
    return Cookie(0, name, value, None, False, host, False, False, "/", True, False, None, False, None, None, {})


# -- a real browser ----------------------------------------------------------------------------------


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make tools` installs Debian's chromium")
def test_the_pages_in_headless_chromium(world):
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra (make install)")
    shots = Path(os.environ.get("BATCHBUS_WEB_SCREENSHOTS", REPO / ".pytest_cache" / "web-screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 860}, device_scale_factor=1)
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.set_default_timeout(60_000)  # a loaded 2-core machine: every wait is on a condition

            # a refused token: the sign-in page again, saying why
            page.goto(world.url)
            page.fill("#token", world.expired_token())
            page.click("button[type=submit]")
            page.wait_for_selector("#message:has-text('refused')")
            page.screenshot(path=str(shots / "web-sign-in.png"))

            page.fill("#token", world.token())
            page.click("button[type=submit]")
            row = page.wait_for_selector(f"#jobs tr:has-text('{world.trained}')")
            # the tenant's markup is text: shown as written, never run
            assert HOSTILE_NAME in row.inner_text()
            assert page.title() == "batchbus" and not dialogs
            page.wait_for_selector(f"#jobs tr:has-text('{world.running}') .state-running")
            # a trial pruned at an epoch's report trained that many epochs, not one more
            trials = world.admin.request(GetStudy(study=world.study)).study["trials"]
            for t in trials:
                shown = page.inner_text(f"#jobs tr:has-text('{t['job']}') td:nth-child(7)")
                assert shown.startswith(f"epoch {len(t['reports'])}/3"), (t, shown)
            page.screenshot(path=str(shots / "web-jobs.png"), full_page=True)

            # the running job: its curves grow while the page is open (it reports an epoch a second)
            page.click(f"#jobs a:has-text('{world.running}')")
            page.wait_for_selector("#epoch-chart circle")
            first = int(page.get_attribute("#epoch-chart", "data-points") or 0)
            page.wait_for_function(
                "n => Number(document.querySelector('#epoch-chart').dataset.points) > n", arg=first, timeout=60_000
            )
            # the finished job: its curve has every point the router kept, its log its lines
            page.goto(f"{world.url}#/job/{world.trained}")
            page.wait_for_selector(f"#job-id:has-text('{world.trained}')")
            metrics = world.admin.request(GetJob(job=world.trained, progress=1000, events=0)).job
            with_loss = [r for r in metrics["progress_history"] if isinstance(r.get("loss"), (int, float))]
            page.wait_for_selector("#logs:has-text('epoch 2: val accuracy')")
            assert int(page.get_attribute("#loss-chart", "data-points") or 0) == len(with_loss) > 0
            records = metrics["result"]["history"]  # two epochs of train_loss, val_loss, val_accuracy
            numbers = [v for r in records for k, v in r.items() if k != "epoch" and isinstance(v, (int, float))]
            assert len(records) == 2 and int(page.get_attribute("#epoch-chart", "data-points") or 0) == len(numbers)
            assert HOSTILE_NAME in page.inner_text("h2") and page.title() == "batchbus" and not dialogs
            page.screenshot(path=str(shots / "web-job.png"), full_page=True)

            # the study: its history has a point per trial with a value, pruned ones too
            page.goto(f"{world.url}#/study/{world.study}")
            page.wait_for_selector("#trials tbody tr")
            rows = page.locator("#trials tbody tr").count()
            assert rows == STUDY["study"]["trials"]
            assert int(page.get_attribute("#history-chart", "data-points") or 0) >= rows
            assert int(page.get_attribute("#parallel-chart", "data-lines") or 0) == rows
            page.screenshot(path=str(shots / "web-study.png"), full_page=True)
            # a trial's job page leads back to its study
            page.click(f"#trials a:has-text('{trials[0]['job']}')")
            page.click(f"a[href='#/study/{world.study}']")
            page.wait_for_selector("#trials tbody tr")

            page.click("#nav-services")
            page.wait_for_selector("#providers tbody tr")
            page.wait_for_selector("#trainers tr:has-text('trainer-web')")
            page.screenshot(path=str(shots / "web-services.png"), full_page=True)

            assert page.inner_text("#status") == ""  # no request of any page went wrong on the way
            # signing out: the next page is the sign-in page
            page.click("#logout")
            page.wait_for_selector("#token")
            assert not errors, errors
        finally:
            browser.close()
