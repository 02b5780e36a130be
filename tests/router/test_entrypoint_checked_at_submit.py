"""A job naming a module no connected trainer can import is refused at submit, with "did you mean":
trainers tell the router, as they connect, what their ``job_modules`` allow and which of those
modules they can import (found without importing any). With no trainer connected the job is
accepted and busctl says it could not be checked. A trainer's announcement is bounded: a hostile
one is refused and the router goes on serving. Against a real router, provider and trainer."""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

import orjson
import pytest

from libbus.connect.client import Client, Identity
from libbus.errors import BadRequest, BusError
from libbus.wire.messages import ListPeers, SubmitJob, SubmitStudy
from services.importable import MAX_NAMES, MAX_NAMES_BYTES, TrainerModules, announce, importable_modules
from tests.support import wait_job
from tests.support.busctl import REPO, busctl

GOOD = "tests.support.entrypoints:counter"
TYPO = "tests.support.entrypionts:counter"
JOB = {"dataset": "mnist", "entrypoint": GOOD, "params": {"steps": 2, "delta": 1}, "evaluate": False}


@contextmanager
def trainer_running(make_settings, router, name: str, job_modules: list[str]):
    """A trainer service on a thread of this process, registered with the router."""
    from services.trainer.service.app import TrainerService

    service = TrainerService(make_settings(router=router.endpoint, name=name, job_modules=job_modules))
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert service.link.wait_connected(30), "trainer did not register with the router"
        yield service
    finally:
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), "trainer did not stop within 30 s"


def test_a_trainer_lists_what_it_can_import_without_importing_it(tmp_path, monkeypatch):
    package = tmp_path / "labpkg"
    (package / "sub").mkdir(parents=True)
    ran = tmp_path / "ran"
    # a package whose code would leave a mark if anything imported it
    for init in (package / "__init__.py", package / "sub" / "__init__.py"):
        init.write_text(f"open({str(ran)!r}, 'w').close()\n")
    (package / "train.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    (package / "sub" / "deep.py").write_text("")
    (package / "not-a-module.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    names, complete = importable_modules(["labpkg.", "labpkg.train", "labpkg.missing", "os.path."])
    assert complete
    assert set(names) == {"labpkg.train", "labpkg.sub", "labpkg.sub.deep"}, names
    assert not ran.exists() and "labpkg" not in sys.modules
    for i in range(30):  # more modules than the list may hold: it is cut and says so
        (package / f"m{i:02}.py").write_text("")
    names, complete = importable_modules(["labpkg."], limit=10)
    assert len(names) == 10 and not complete
    long = package / ("x" * 60)  # names that would make the trainer's Hello too large to register: cut
    long.mkdir()
    (long / "__init__.py").write_text("")
    for i in range(1000):
        (long / f"m{i:03}{'y' * 120}.py").write_text("")  # 192 characters with the package
    names, complete = importable_modules(["labpkg."])
    assert not complete and 500 < len(names) < 1000 and len(orjson.dumps(names)) <= MAX_NAMES_BYTES, len(names)
    assert importable_modules([]) == ([], True)


def test_the_router_tells_a_module_not_found_from_one_not_allowed_and_an_incomplete_list():
    modules = TrainerModules()
    modules.register("s1", "t1", {"job_modules": announce(["tests.support."])})
    modules.register("s2", "t2", {"job_modules": {"allow": ["mylab."], "modules": [], "complete": True}})
    with pytest.raises(BadRequest) as refused:
        modules.check_ref("entrypoint", "tests.support.entrypionts:counter")
    said = str(refused.value)
    assert "did you mean 'tests.support.entrypoints'?" in said, said
    assert "t1 allow tests.support. (not found there); t2 allow mylab. (not allowed)" in said, said
    assert modules.check_ref("entrypoint", GOOD) == ""
    # a trainer whose list was cut might hold it: accepted, saying so
    modules.register("s3", "t3", {"job_modules": {"allow": ["mylab."], "modules": ["mylab.a"], "complete": False}})
    assert "did not list all it can import" in modules.check_ref("entrypoint", "mylab.b:main")
    # a trainer whose token may not take the job's dataset is not asked
    scoped = TrainerModules()
    scoped.register("s5", "t5", {"job_modules": announce([])}, takes=lambda dataset: dataset == "other")
    assert "no trainer that may take dataset 'mnist' is connected" in scoped.check_ref("entrypoint", GOOD, "mnist")
    with pytest.raises(BadRequest, match="t5 allow nothing"):
        scoped.check_ref("entrypoint", GOOD, "other")
    # a trainer that announced nothing (an older one): nothing is refused
    modules.drop("s3")
    modules.register("s4", "t4", {})
    assert "not checked" in modules.check_ref("entrypoint", "nowhere.at_all:main")


def test_a_module_typo_is_refused_at_submit_and_the_right_one_runs(
    router, start_provider, make_settings, client_for, make_token
):
    start_provider("mnist=mock://mnist?n=600")
    admin = client_for(router.endpoint, role="admin", timeout_s=10)
    # no trainer connected: accepted, and the reply says it was not checked
    queued = admin.request(SubmitJob(spec={**JOB, "entrypoint": TYPO}))
    assert "not checked: no trainer is connected" in queued.note, queued.note
    with trainer_running(make_settings, router, "trainer-a", ["tests.support.entrypoints"]):
        with pytest.raises(BadRequest) as typo:
            admin.request(SubmitJob(spec={**JOB, "entrypoint": TYPO}))
        said = str(typo.value)
        assert "no connected trainer can import module 'tests.support.entrypionts'" in said, said
        assert "did you mean 'tests.support.entrypoints'?" in said, said
        assert "trainer-a allow tests.support.entrypoints (not allowed)" in said, said
        # a module it does not allow at all, and a factory model: refused the same way
        with pytest.raises(BadRequest, match=r"can import module 'os'.*\(not allowed\)"):
            admin.request(SubmitJob(spec={**JOB, "entrypoint": "os:system"}))
        factory = {"dataset": "mnist", "model": "pydoc:pipepager", "model_kwargs": {"cmd": "id"}}
        with pytest.raises(BadRequest, match="model 'pydoc:pipepager': no connected trainer can import"):
            admin.request(SubmitJob(spec=factory))
        # a study whose trials would all name the typo is refused before any trial is queued
        study = {"base": {**JOB, "entrypoint": TYPO}, "space": {"params.delta": {"choice": [1, 2]}}}
        with pytest.raises(BadRequest, match="did you mean 'tests.support.entrypoints'"):
            admin.request(SubmitStudy(spec=study))
        # the right name is accepted, checked, and runs
        good = admin.request(SubmitJob(spec=JOB))
        assert good.note == "", good.note
        assert wait_job(admin, good.job, 120)["state"] == "succeeded"
        # the job queued unchecked before any trainer came is failed by the trainer, with its advice
        info = wait_job(admin, queued.job, 120)
        assert info["state"] == "failed" and "did you mean" in info["error"].lower(), info["error"]


def test_busctl_submit_says_what_it_could_not_check_and_refuses_in_one_line(router, make_settings, state_dir):
    env = {
        **os.environ,
        "BATCHBUS_STATE_DIR": str(state_dir),
        "BATCHBUS_ROUTER": router.endpoint,
        "PYTHONPATH": str(REPO),
    }
    args = ("submit", "--dataset", "mnist", "--entrypoint", TYPO)
    out = busctl(*args, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().startswith("j"), (out.stdout, out.stderr)
    assert "not checked: no trainer is connected" in out.stderr, out.stderr
    shown = orjson.loads(busctl(*args, "--json", env=env, timeout=120).stdout)  # --json: the note beside the id
    assert shown["job"].startswith("j") and "not checked: no trainer is connected" in shown["note"], shown
    # (a trainer that does not allow the queued job's module fails it at once: no provider is needed)
    with trainer_running(make_settings, router, "trainer-b", ["tests.support.entrypoints"]):
        out = busctl(*args, env=env, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "did you mean 'tests.support.entrypoints'?" in lines[0], out.stderr
    assert "trainer-b allow tests.support.entrypoints (not allowed)" in lines[0], lines[0]


@pytest.mark.parametrize(
    ("announced", "says"),
    [
        ({"modules": [f"m{i}" for i in range(10**6)]}, "TOO_LARGE"),  # ~8 MB: past any message's header
        ({"modules": ["a" * 10_000_000]}, "TOO_LARGE"),  # one 10 MB name
        ({"modules": [f"m{i}" for i in range(MAX_NAMES + 1)]}, f"at most {MAX_NAMES} are accepted"),
        ({"modules": ["a" * 201]}, "module names of at most 200 characters"),
        ({"modules": ["os; rm -rf /"]}, "module names of at most"),
        ({"modules": "tests.support.entrypoints"}, "must be a list of names"),
        ({"allow": [7]}, "module names of at most"),
        ({"complete": "yes"}, "complete must be true or false"),
        (["tests."], "must be a table"),
    ],
)
def test_a_hostile_trainers_announcement_is_refused_and_the_router_serves_on(
    router, client_for, make_token, announced, says
):
    hostile = Client(
        router.endpoint,
        Identity(role="trainer", name="hostile", token=make_token("trainer"), caps={"job_modules": announced}),
        timeout_s=10,
        retries=0,
    )
    try:
        with pytest.raises(BusError) as refused:
            hostile.request(ListPeers())
        assert says in f"{refused.value} {refused.value.code}", refused.value
    finally:
        hostile.close()
    admin = client_for(router.endpoint, role="admin", timeout_s=10)
    assert "hostile" not in str(admin.request(ListPeers()))
    # nothing of it counts as a trainer: a job is accepted as unchecked
    assert "no trainer is connected" in admin.request(SubmitJob(spec=JOB)).note
