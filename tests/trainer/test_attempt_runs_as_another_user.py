"""A trainer run as root runs its attempts as another user (``attempt_user``).

The attempt's process (a tenant's code) then holds that user's uid and group and no supplementary
group: it reads neither the trainer's token file (0600, root's), nor another job's checkpoint folder,
nor a co-located provider's private file, and lists no job folder, while its own job trains,
checkpoints and saves its model; what it left running is ended with it, and its folder is root's again
after. The trainer refuses, as it starts, a user that does not exist, a trainer that is not root, and a
``checkpoint_dir`` the user cannot reach. Real processes, a real system user (made here when missing:
the tests run as root); skipped where they do not run as root.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from libbus.errors import ConfigError
from libbus.wire.messages import GetJob, SubmitJob
from services.trainer import attempt_user
from tests.support import wait_job
from tests.support.busctl import busctl_in_process
from tests.support.formats import write_mnist_idx

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="attempts run as another user only under a root trainer")

#: A system user of these tests' own (no login, no home): attempts run as it.
USER = "bb-attempt-test"


@pytest.fixture(scope="module")
def user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        pytest.skip("no useradd here to make a user for attempts")
    made = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pytest.skip(f"could not make a user for attempts: {made.stderr.strip()}")


@pytest.fixture
def place():
    """A folder the attempt user may pass through (``/tmp/pytest-of-root`` lets no other user in)."""
    base = Path(tempfile.mkdtemp(prefix="bb-attempt-"))
    base.chmod(0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status  # ended, not yet reaped by whoever adopted it


@pytest.mark.timeout(300)
def test_an_attempt_run_as_another_user_reads_none_of_the_trainers_files_and_trains(
    router, start_provider, make_settings, make_token, client_for, user, place
):
    provider_files = place / "provider"  # a co-located provider's dataset, its private test labels among its files
    labels = write_mnist_idx(provider_files, n=200) / "t10k-labels-idx1-ubyte"
    for path in provider_files.iterdir():
        path.chmod(0o600)
    provider_files.chmod(0o755)
    start_provider("mnist=mock://mnist?n=300", f"private=file://{provider_files}")
    checkpoints = place / "checkpoints"
    other = checkpoints / "j-other-tenant"  # another job's folder, as an earlier attempt left it
    other.mkdir(parents=True)
    (other / "model.safetensors").write_bytes(b"another tenant's weights")
    (other / "model.safetensors").chmod(0o644)
    creds = place / "creds"
    creds.mkdir(mode=0o755)
    token_file = creds / "token"
    token_file.write_text(make_token("trainer", sub="trainer-as-root"))
    token_file.chmod(0o600)
    out = place / "out"
    out.mkdir()
    out.chmod(0o777)

    from services.trainer.service.app import TrainerService

    trainer = TrainerService(
        make_settings(
            router=router.endpoint,
            name="trainer-as-root",
            token_file=str(token_file),
            job_modules=["tests.support.entrypoints"],
            checkpoint_dir=str(checkpoints),
            attempt_user=USER,
        )
    )
    assert stat.S_IMODE(checkpoints.stat().st_mode) == 0o711  # job folders reached by name, none listed
    assert (other.stat().st_uid, stat.S_IMODE(other.stat().st_mode)) == (0, 0o700)
    stop = threading.Event()
    thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        admin = client_for(router.endpoint, role="admin", timeout_s=10)
        probe = {
            "token": str(token_file),
            "other_job": str(other / "model.safetensors"),
            "provider": str(labels),
        }
        params = {"probe": probe, "list": str(checkpoints), "out": str(out / "found.json")}
        spec = {"dataset": "mnist", "entrypoint": "tests.support.entrypoints:probes_files", "params": params}
        job = wait_job(admin, admin.request(SubmitJob(spec=spec | {"evaluate": False, "max_attempts": 1})).job, 120)
        assert job["state"] == "succeeded", job["error"]
        found = json.loads((out / "found.json").read_text())
        assert (found["uid"], found["gid"], found["groups"]) == (user.pw_uid, user.pw_gid, []), found
        assert found["probes"] == {
            "token": "PermissionError",
            "other_job": "PermissionError",
            "provider": "PermissionError",
            "listing": "PermissionError",
        }, found
        # its own job trained, checkpointed and saved its model in its own folder, the trainer's again now
        own = checkpoints / job["id"]
        assert Path(found["checkpoint"]).parent == own and Path(found["checkpoint"]).is_file()
        assert admin.request(GetJob(job=job["id"])).job["result"]["model"]["path"] == found["model"]
        assert (own.stat().st_uid, stat.S_IMODE(own.stat().st_mode)) == (0, 0o700)
        assert all(p.stat().st_uid == 0 for p in own.rglob("*")), list(own.rglob("*"))
        deadline = time.monotonic() + 30
        while not _gone(found["leftover"]):  # the process it left behind was ended with it
            assert time.monotonic() < deadline, f"process {found['leftover']} left by the attempt still runs"
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive(), "trainer did not stop within 30 s"


def test_a_trainer_refuses_an_attempt_user_it_cannot_run_as(make_settings, user, place, tmp_path):
    with pytest.raises(ConfigError, match="no such user on this host"):
        attempt_user.resolve(make_settings(attempt_user="bb-no-such-user", checkpoint_dir=str(place / "c")))
    with pytest.raises(ConfigError, match="is root"):
        attempt_user.resolve(make_settings(attempt_user="root", checkpoint_dir=str(place / "c")))
    # pytest's own folders let no other user pass: its checkpoints would be out of the attempt's reach
    with pytest.raises(ConfigError, match=f"cannot reach checkpoint_dir {tmp_path / 'c'}"):
        attempt_user.resolve(make_settings(attempt_user=USER, checkpoint_dir=str(tmp_path / "c")))
    # a trainer that is not root cannot run its attempts as anyone else: busctl says so, in one line
    state = place / "state"
    state.mkdir()
    os.chown(state, user.pw_uid, user.pw_gid)
    context = multiprocessing.get_context("forkserver")
    ours, theirs = context.Pipe()
    started = context.Process(target=_start_trainer_as, args=(user.pw_uid, user.pw_gid, str(state), theirs))
    started.start()
    deadline = time.monotonic() + 120
    while not ours.poll(0.2):
        assert started.is_alive() or ours.poll(0), f"busctl, run as the attempt user, died ({started.exitcode})"
        assert time.monotonic() < deadline, "busctl start trainer, run as the attempt user, did not end"
    code, out, err = ours.recv()
    started.join(30)
    assert code == 2, (out, err)
    assert f"attempt_user = {USER!r}: this trainer runs as uid {user.pw_uid}, not root" in err, err
    assert "Traceback" not in out + err, (out, err)


def _start_trainer_as(uid: int, gid: int, state: str, reply: Connection) -> None:
    """``busctl start trainer --attempt-user``, in a process of uid ``uid`` (not root); its
    exit code and output go to ``reply``. The same command runs first as root, naming no user that exists
    (refused as well): what it imports is imported before this process stops being root, since the
    interpreter's own library may lie where only root reads it (as under /root/.pyenv)."""
    args = ("start", "trainer", "--state-dir", state)
    code, _, err = busctl_in_process(*args, env={"BATCHBUS_ATTEMPT_USER": "bb-no-such-user"})
    if code != 2 or "no such user on this host" not in err:
        reply.send((code, "", f"as root, with a user that does not exist: {err}"))
        return
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    reply.send(busctl_in_process(*args, "--attempt-user", USER))


def test_a_job_folder_lent_to_the_attempt_user_gives_it_nothing_a_link_points_at(make_settings, user, place):
    """What an attempt (or a process it left) plants in its folder: a link to a root file, a link in place
    of a sub-folder, a hard link to a root file. Lending the folder again changes none of their targets."""
    secret = place / "secret"  # root's, outside the job's folder
    secret.write_text("root only")
    secret.chmod(0o600)
    elsewhere = place / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "inside").write_text("root only")
    checkpoints = place / "checkpoints"
    folder = attempt_user.job_folder(str(checkpoints), "j-planted")
    folder.mkdir(parents=True)
    (folder / "step-1.ckpt").write_bytes(b"weights")
    (folder / "to-secret").symlink_to(secret)
    (folder / "sub").symlink_to(elsewhere, target_is_directory=True)
    os.link(secret, folder / "hard")
    lent = attempt_user.AttemptUser(name=USER, uid=user.pw_uid, gid=user.pw_gid, home="/nonexistent")
    attempt_user.lend_folder(folder, lent)
    assert (folder.stat().st_uid, (folder / "step-1.ckpt").stat().st_uid) == (user.pw_uid, user.pw_uid)
    for target in (secret, elsewhere, elsewhere / "inside"):
        assert target.stat().st_uid == 0, f"{target} was handed to the attempt user"
    attempt_user.take_back_folder(folder)
    assert {p.lstat().st_uid for p in [folder, *folder.iterdir()]} == {0}
    # a checkpoint_dir that is not the trainer's (the attempt user's own) is refused as the trainer starts
    os.chown(checkpoints, user.pw_uid, user.pw_gid)
    with pytest.raises(ConfigError, match=f"must be a folder of this trainer's .* owned by uid {user.pw_uid}"):
        attempt_user.resolve(make_settings(attempt_user=USER, checkpoint_dir=str(checkpoints)))
