"""A fresh state directory is private outside systemd too: the secret, keys, tokens and the job
database are made under mode 0700 directories and 0600 files whatever the umask, by the real CLI and a real
SQLite file. An existing directory keeps the mode its operator gave it."""

from __future__ import annotations

import os
import stat

from libbus.jobs.spec import JobSpec
from services.router.store import JobStore
from tests.support import busctl


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_busctl_token_secret_makes_a_private_state_directory(tmp_path):
    state = tmp_path / "fresh" / "state"
    env = {**os.environ, "BATCHBUS_STATE_DIR": str(state)}
    busctl("token", "secret", str(state / "secret"), env=env, check=True)
    assert _mode(state) == 0o700 and _mode(state.parent) == 0o700
    assert _mode(state / "secret") == 0o600


def test_the_job_database_is_private_from_its_first_byte(tmp_path):
    old = os.umask(0o022)  # the usual umask of a login shell: files 0644, directories 0755
    try:
        store = JobStore(str(tmp_path / "state" / "router.db"))
        store.submit(JobSpec.from_dict({"dataset": "mnist"}))  # the WAL file exists once something is written
    finally:
        os.umask(old)
    assert _mode(tmp_path / "state") == 0o700
    assert _mode(tmp_path / "state" / "router.db") == 0o600
    assert _mode(tmp_path / "state" / "router.db-wal") == 0o600


def test_an_existing_directory_keeps_its_operators_mode(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o750)
    os.chmod(shared, 0o750)
    JobStore(str(shared / "router.db"))
    assert _mode(shared) == 0o750 and _mode(shared / "router.db") == 0o600
