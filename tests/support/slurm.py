"""A Slurm cluster of its own for tests: munged, slurmctld and one slurmd (``CPUs=4`` on whatever this machine
has, oversubscribed) under a temporary directory, on ports of 127.0.0.1 nobody else uses, with its own munge key.

Nothing is installed system-wide beyond Debian's ``slurm-wlm`` and ``munge`` packages (installed here when
missing and we are root, as ``make tools`` does), and nothing is left running: :meth:`SlurmCluster.close` cancels
every job, then stops slurmd, slurmctld and munged (the processes this module started, by their ids).

Commands reach this cluster through :attr:`SlurmCluster.env` (``SLURM_CONF``); the ``slurm`` fixture skips, with
the reason, only where the packages cannot be had.

Also here: :class:`SignedAdmin`, batchbus's default set-up (EdDSA) for a :class:`tests.support.Cluster` whose
services the recipes run or join, and :func:`assert_nothing_mints`, which reads the environment and command line
of running services (``/proc``) for anything that mints a token or acts as an admin.
"""

from __future__ import annotations

import getpass
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libbus.security.auth import generate_signing_key, issue_token, load_signing_key

__all__ = [
    "NODE",
    "SignedAdmin",
    "SlurmCluster",
    "assert_nothing_mints",
    "assert_no_token_on_a_command_line",
    "service_processes",
    "slurm",
    "slurm_missing",
]

#: The one node's name (its address is 127.0.0.1, whatever this host is called).
NODE = "bbnode1"
#: Programs the cluster needs, and the Debian package of each.
PROGRAMS = {"munged": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm"}
START_TIMEOUT_S = 30.0
#: The daemons' own paths: munged looks for its tools in /usr/sbin, which a venv's PATH may lack.
SBIN = ("/usr/sbin", "/sbin")


def _which(program: str) -> str | None:
    return shutil.which(program) or shutil.which(program, path=os.pathsep.join(SBIN))


def slurm_missing() -> str:
    """Why no Slurm cluster can run here ("" when one can): installs the packages first where it may."""
    missing = sorted({pkg for prog, pkg in PROGRAMS.items() if _which(prog) is None})
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], env=env, capture_output=True, timeout=600)
        missing = sorted({pkg for prog, pkg in PROGRAMS.items() if _which(prog) is None})
    if missing:
        how = "apt-get install" if os.geteuid() == 0 else "as root: apt-get install"
        return f"Slurm tests need {', '.join(missing)} ({how} {' '.join(missing)}; `make tools` does it)"
    return ""


SLURM_CONF = """\
ClusterName=bbtest{port}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={port}
SlurmdPort={dport}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# CPUs=4 on a 2-core machine: slurmd takes the configured count instead of draining the node
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=30
MailProg=/bin/true
NodeName={node} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmCluster:
    """munged + slurmctld + slurmd under ``root`` (created, mode 0700). :meth:`start` brings them up."""

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = root / "slurm.conf"
        #: Lay this over a command's environment for it to talk to this cluster.
        self.env = {"SLURM_CONF": str(self.conf)}

    # -- daemons -----------------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        """Start the three daemons and wait until the node is idle; a port someone else holds: try others."""
        (self.root / "munge").mkdir(mode=0o700, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        munge = self.root / "munge"
        self._spawn(
            "munged",
            "--foreground",
            "--force",
            f"--socket={munge}/munge.socket",
            f"--key-file={key}",
            f"--pid-file={munge}/munged.pid",
            f"--log-file={munge}/munged.log",
            f"--seed-file={munge}/munged.seed",
        )
        self._wait(lambda: (munge / "munge.socket").exists(), "munged never made its socket")
        for _ in range(5):
            # Slurm binds its ports itself (no port 0): pick two at random from a range few use, and
            # start again elsewhere when slurmctld or slurmd could not bind them
            port = random.randrange(20000, 30000, 2)
            self._write_conf(port)
            for name in ("slurmctld", "slurmd"):
                (self.root / f"{name}.log").unlink(missing_ok=True)
            self._spawn("slurmctld", "-D", "-f", str(self.conf))
            self._spawn("slurmd", "-D", "-N", NODE, "-f", str(self.conf))
            if self._node_idle():
                return self
            self._stop_daemons()
        raise AssertionError(f"no Slurm cluster came up\n{self.logs()}")

    def _write_conf(self, port: int) -> None:
        for sub in ("ctld", "spool"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        self.conf.write_text(
            SLURM_CONF.format(port=port, dport=port + 1, root=self.root, user=getpass.getuser(), node=NODE)
        )

    def _spawn(self, name: str, *args: str) -> None:
        with open(self.root / f"{name}.out", "ab") as out:
            self.procs[name] = subprocess.Popen(
                [_which(name) or name, *args], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
            )

    def _node_idle(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if any(self.procs[n].poll() is not None for n in ("slurmctld", "slurmd")):
                return False
            out = self.run("sinfo", "-h", "-n", NODE, "-o", "%t", check=False).stdout.strip()
            if out == "idle":
                return True
            time.sleep(0.2)
        return False

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}\n{self.logs()}")
            time.sleep(0.05)

    # -- commands ----------------------------------------------------------------------------------

    def run(self, *cmd: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm command (``sbatch``, ``scontrol``...) against this cluster, output captured."""
        out = subprocess.run(
            list(cmd), env={**os.environ, **(env or {}), **self.env}, capture_output=True, text=True, timeout=30
        )
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr}{out.stdout}")
        return out

    def sbatch(
        self,
        script: Path,
        *options: str,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> str:
        """Submit ``script`` with sbatch ``options`` and the script's own ``args``; returns the job id."""
        out = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args],
            env={**os.environ, **(env or {}), **self.env},
            capture_output=True,
            text=True,
            timeout=30,
            cwd=cwd,
        )
        if out.returncode != 0:
            raise AssertionError(f"sbatch {script} exited {out.returncode}: {out.stderr}")
        return out.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job JOB`` as a dict (JobState, Restarts, ExitCode...); one array task's id for arrays."""
        out = self.run("scontrol", "-o", "show", "job", job).stdout
        first = out.splitlines()[0]
        return dict(field.split("=", 1) for field in first.split() if "=" in field)

    def tasks(self, array_job: str) -> dict[str, dict[str, str]]:
        """Every task of an array (or the one job): ``{JobId: fields}``, ArrayTaskId among the fields."""
        out = self.run("scontrol", "-o", "show", "job", array_job).stdout
        jobs = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.splitlines() if line]
        return {j["JobId"]: j for j in jobs}

    def wait_job(self, job: str, until, timeout: float, why: str = "", logs: str = "") -> dict[str, str]:
        """Poll ``scontrol show job`` until ``until(fields)``; fails with the job's fields and the logs."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job)
            if until(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm job {job} never {why}: {fields}\n{logs}\n{self.logs()}")
            time.sleep(0.2)

    def release(self, job: str) -> None:
        """Let a requeued ``job`` start now rather than after Slurm's requeue delay (two minutes).

        The delay is there for a reason this one keeps: slurmd refuses to launch a job whose credential was
        made in the same second as the requeue revoked the last run's, so the release waits for a later second.
        """
        requeued = self.job(job)["SubmitTime"]  # the requeue's time, to the second
        while time.strftime("%Y-%m-%dT%H:%M:%S") <= requeued:
            time.sleep(0.1)
        self.run("scontrol", "update", f"JobId={job}", "StartTime=now")

    def cancel_all(self, timeout: float = 45) -> None:
        """Cancel every job and wait until none is left (the steps' processes are gone then)."""
        self.run("scancel", "--user", getpass.getuser(), check=False)
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.2)

    def logs(self, lines: int = 20) -> str:
        out = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name} ---\n" + "\n".join(tail))
        return "\n".join(out)

    # -- teardown ----------------------------------------------------------------------------------

    def _stop_daemons(self, names: tuple[str, ...] = ("slurmd", "slurmctld")) -> None:
        for name in names:
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            self.cancel_all()
        self._stop_daemons(("slurmd", "slurmctld", "munged"))


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[SlurmCluster]:
    """A running one-node Slurm cluster of this test module's own; skipped only without the packages."""
    why = slurm_missing()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.close()


# -- the default set-up (EdDSA) and what processes hold -------------------------------------------------


class SignedAdmin:
    """Mixed in before :class:`tests.support.Cluster`: the default set-up (EdDSA). The admin's token is read
    from :attr:`admin_token_file` when set (one a recipe minted), else signed with :attr:`signing_key`;
    starting a service makes no HS256 secret (``Cluster.start`` would)."""

    signing_key: Path | None = None
    admin_token_file: Path | None = None

    def keygen(self, key: Path) -> None:
        """A new key pair: ``key`` signs this test's admin tokens; its public key becomes STATE/token.pub,
        what a router started on STATE checks tokens with."""
        (self.state / "token.pub").unlink(missing_ok=True)
        generate_signing_key(key, self.state / "token.pub")
        self.signing_key, self.admin_token_file = key, None

    @property
    def admin_token(self) -> str:
        if self.admin_token_file is not None:
            return self.admin_token_file.read_text().strip()
        assert self.signing_key is not None, "no signing key: keygen() first"
        return issue_token(
            load_signing_key(self.signing_key), sub="test-admin", role="admin", audience="batchbus", algorithm="EdDSA"
        )

    def start(self, name, role, *args, ready=False, named=True, env=None):
        extra = ["--name", name] if named else []
        if ready:
            self.ready_file(name).unlink(missing_ok=True)
            extra += ["--ready-file", str(self.ready_file(name))]
        return self.spawn(name, "start", role, *extra, *args, env=env)


def _proc(pid: str, what: str) -> bytes:
    try:
        return (Path("/proc") / pid / what).read_bytes()
    except OSError:  # gone, or not ours
        return b""


def service_processes(root: Path) -> dict[int, tuple[str, dict[str, str]]]:
    """The running processes whose ``BATCHBUS_STATE_DIR`` lies under ``root`` (services, their attempts):
    ``{pid: (command line, environment)}``, read from ``/proc``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        env = dict(
            kv.split("=", 1) for kv in _proc(entry.name, "environ").decode(errors="replace").split("\0") if "=" in kv
        )
        state = env.get("BATCHBUS_STATE_DIR", "")
        if state and Path(state).is_relative_to(root):
            out[int(entry.name)] = (_proc(entry.name, "cmdline").decode(errors="replace").replace("\0", " "), env)
    return out


def _handed(env: dict[str, str]) -> list[Path]:
    """The paths a process's environment hands it: batchbus's and the recipes' settings, its directories."""
    names = [k for k in env if k.startswith(("BATCHBUS_", "BB_"))] + ["PWD", "SLURM_SUBMIT_DIR"]
    return [Path(env[k]) for k in names if env.get(k, "").startswith("/") and Path(env[k]).exists()]


def assert_nothing_mints(procs: dict[int, tuple[str, dict[str, str]]], private: list[Path], admin: list[str]) -> None:
    """No process of ``procs`` holds what mints a token or acts as an admin: no secret or signing key named in
    its environment or command line; no path there leads to the ``private`` paths (where the signing key and
    the admin's token are); no file under those paths is a private key or holds one of the ``admin`` tokens."""
    assert procs, "no service process found"
    for pid, (cmdline, env) in procs.items():
        assert "BATCHBUS_SECRET_FILE" not in env and "BATCHBUS_SIGNING_KEY_FILE" not in env, (pid, cmdline)
        text = cmdline + "\n".join(f"{k}={v}" for k, v in env.items())
        assert "PRIVATE KEY" not in text, (pid, cmdline)
        for secret in [*map(str, private), *admin]:
            assert secret not in text, f"process {pid} ({cmdline}) names {secret[:40]}"
        for path in _handed(env):
            for where in private:
                assert not where.is_relative_to(path) and not path.is_relative_to(where), (pid, path, where)
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            for file in files:
                try:
                    data = file.read_bytes()
                except FileNotFoundError:  # (replaced while we looked: a checkpoint written anew)
                    continue
                assert b"PRIVATE KEY" not in data, f"{file} (reached by process {pid} through {path})"
                for token in admin:
                    assert token.encode() not in data, f"{file} holds the admin token (process {pid})"


def assert_no_token_on_a_command_line(tokens: list[str]) -> None:
    """No process on this machine, whoever runs it, shows one of ``tokens`` on its command line (``ps``)."""
    assert tokens and all(tokens)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            cmdline = _proc(entry.name, "cmdline").decode(errors="replace")
            for token in tokens:
                assert token not in cmdline, f"process {entry.name} has a token on its command line: {cmdline[:200]}"
