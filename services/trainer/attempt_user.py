"""Attempts that run as another user (the trainer's ``attempt_user`` setting), out of reach of its files.

An attempt runs a tenant's code. Where the operator runs the trainer as root, the attempt's process
runs as ``attempt_user`` instead: that user's uid and group, no supplementary groups. It then reads
neither the trainer's token file (mode 0600, root's), nor other jobs' checkpoint folders, nor a
co-located provider's files that root alone may read. Who does what:

- the trainer, as it starts (:func:`resolve`): the user must exist and not be root, the trainer must
  run as root, and ``checkpoint_dir`` must be the trainer's and reachable by that user; it becomes mode
  0711 (its job folders are reached by name, none listed) and every job folder in it root's, mode 0700;
- the trainer, around each attempt: :func:`lend_folder` hands the job's own folder
  (``<checkpoint_dir>/<job>``) to the user before the attempt starts; once the attempt has ended,
  :func:`end_leftovers` kills every process left running as that user (one its job's code forked and
  left behind would read the next job's folder) and :func:`take_back_folder` makes the folder root's
  again, so an attempt reaches its own job's folder only;
- the attempt's process, before it runs anything of the job's (:func:`become`): drops root for the user.

Folders are walked by file descriptor without following links (``os.fwalk``), and a file with more than
one hard link is never handed to the user: a link planted in a job's folder turns nothing of root's into
the user's. What this leaves to the operator is in docs/security.md §4.1.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.context
import os
import pwd
import signal
import stat
from dataclasses import dataclass
from pathlib import Path

from libbus.config import Settings
from libbus.errors import ConfigError

__all__ = ["AttemptUser", "become", "end_leftovers", "job_folder", "lend_folder", "resolve", "take_back_folder"]

log = logging.getLogger(__name__)

#: A job's checkpoint folder (its own, lent to the attempt user while its attempt runs), and the folder above.
FOLDER_MODE, ROOT_MODE = 0o700, 0o711
#: How long the process that ends the user's leftover processes may take (it forks from the fork server).
END_LEFTOVERS_S = 10.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class AttemptUser:
    """The user attempts run as: its name, uid, primary group and home folder."""

    name: str
    uid: int
    gid: int
    home: str

    def as_dict(self) -> dict:
        return {"name": self.name, "uid": self.uid, "gid": self.gid, "home": self.home}

    @classmethod
    def from_dict(cls, d: dict) -> AttemptUser:
        return cls(name=str(d["name"]), uid=int(d["uid"]), gid=int(d["gid"]), home=str(d["home"]))


def job_folder(checkpoint_dir: str, job: str) -> Path:
    """Where job ``job``'s checkpoints and final model are written on this trainer."""
    return Path(checkpoint_dir) / job


def resolve(settings: Settings) -> AttemptUser | None:
    """The user ``settings.attempt_user`` names, checked as the trainer starts, and its
    ``checkpoint_dir`` made ready for it (see the module); None when the setting is empty.

    Raises:
        ConfigError: the trainer does not run as root, the user does not exist or is root, or
            ``checkpoint_dir`` is not the trainer's or not reachable by the user.
    """
    name = settings.attempt_user
    if not name:
        return None
    if os.geteuid() != 0:
        raise ConfigError(
            f"attempt_user = {name!r}: this trainer runs as uid {os.geteuid()}, not root, and only root can "
            "start its attempts as another user; start the trainer as root, or leave attempt_user empty "
            "(attempts then run as the trainer's user)"
        )
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(
            f"attempt_user = {name!r}: no such user on this host; make one for this trainer's attempts alone "
            f"(useradd --system --no-create-home --shell /usr/sbin/nologin {name}) or name an existing one"
        ) from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise ConfigError(
            f"attempt_user = {name!r} is root (uid {entry.pw_uid}, gid {entry.pw_gid}): name another user"
        )
    user = AttemptUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir)
    try:
        _prepare_root(Path(settings.checkpoint_dir), user)
    except OSError as err:
        raise ConfigError(
            f"checkpoint_dir {settings.checkpoint_dir} cannot be made ready for attempt_user {name!r}: "
            f"{err.strerror or err} ({err.filename}); attempt_user needs a checkpoint_dir of this trainer's own "
            "on a file system whose owners root may change"
        ) from err
    return user


def _prepare_root(root: Path, user: AttemptUser) -> None:
    """``root`` (the trainer's ``checkpoint_dir``): the trainer's, mode 0711, every job folder in it
    the trainer's and mode 0700; the user must be able to pass through every folder above it."""
    root.mkdir(parents=True, exist_ok=True)
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ConfigError(
            f"checkpoint_dir {root} must be a folder of this trainer's (uid {os.geteuid()}) for attempt_user "
            f"{user.name!r}: it is owned by uid {st.st_uid}"
        )
    for above in root.resolve().parents:
        if not _may_pass(above.stat(), user):
            raise ConfigError(
                f"attempt_user {user.name!r} cannot reach checkpoint_dir {root}: {above} lets neither its uid "
                f"{user.uid} nor its group {user.gid} pass (mode {stat.S_IMODE(above.stat().st_mode):04o}); "
                f"allow them (chmod o+x {above}) or choose a checkpoint_dir under folders they may pass"
            )
    os.chmod(root, ROOT_MODE)
    for folder in root.iterdir():  # left by an attempt, or made before attempt_user was set
        if folder.is_dir() and not folder.is_symlink():
            take_back_folder(folder)


def _may_pass(st: os.stat_result, user: AttemptUser) -> bool:
    if st.st_uid == user.uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == user.gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def lend_folder(folder: Path, user: AttemptUser) -> None:
    """Make ``folder`` (a job's own, made if missing) and what it holds the user's, mode 0700."""
    folder.mkdir(mode=FOLDER_MODE, exist_ok=True)
    _chown_tree(folder, user.uid, user.gid, lend=True)


def take_back_folder(folder: Path) -> None:
    """Make ``folder`` and what it holds the trainer's again, mode 0700 (no other job's attempt reads it)."""
    try:
        _chown_tree(folder, os.geteuid(), os.getegid(), lend=False)
    except FileNotFoundError:
        pass


def _chown_tree(folder: Path, uid: int, gid: int, *, lend: bool) -> None:
    """``folder`` and everything under it owned by ``uid``:``gid``, walked by file descriptor and never
    through a link (an attempt may have replaced a folder of it by a link meanwhile). Lending skips
    files of more than one hard link (one to a file outside, which the user must not be given)."""
    top = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(top, uid, gid)
        os.fchmod(top, FOLDER_MODE)
        for _, dirs, files, dir_fd in os.fwalk(dir_fd=top, follow_symlinks=False):
            for name in dirs + files:
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if lend and not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
                        log.warning("%s/%s: %d hard links; not handed to the attempt", folder, name, st.st_nlink)
                        continue
                    os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:  # removed meanwhile
                    continue
    finally:
        os.close(top)


def end_leftovers(user: AttemptUser, context: multiprocessing.context.ForkServerContext) -> None:
    """Kill every process running as the user (what an attempt forked and left behind): a process
    started from ``context`` (the attempts' fork server), run as the user, signals them all
    (``kill(-1)`` reaches exactly the processes of its uid, itself left out). Nothing is executed: the
    user may run no file of root's."""
    try:
        ender = context.Process(target=_kill_all, args=(user.as_dict(),), name=f"end-{user.name}")
        ender.start()
        ender.join(END_LEFTOVERS_S)
    except OSError as err:
        log.warning("could not end the processes left running as %s: %s", user.name, err)
        return
    if ender.exitcode != 0:
        log.warning("the processes left running as %s may not have ended (exit %s)", user.name, ender.exitcode)
        if ender.exitcode is None:
            ender.kill()


def _kill_all(user: dict) -> None:
    """In a process of its own: become ``user`` and kill every other process of its uid."""
    os.setgroups([])
    os.setresgid(user["gid"], user["gid"], user["gid"])
    os.setresuid(user["uid"], user["uid"], user["uid"])
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:  # none left
        pass


def become(user: AttemptUser, folder: Path) -> None:
    """In the attempt's process, before anything of the job's runs: run as ``user`` from here on (its
    uid and group, no supplementary groups; every thread, as glibc changes them all). The kernel clears
    the parent-death signal on a change of credentials: it is set again, so the attempt still dies with
    its trainer. ``HOME``, ``USER`` and ``LOGNAME`` name the user (``HOME`` its home folder where it may
    write there, else ``folder``: the job's own).

    Raises:
        OSError: the credentials could not be changed (the attempt must not run as root then).
    """
    os.setgroups([])
    os.setresgid(user.gid, user.gid, user.gid)
    os.setresuid(user.uid, user.uid, user.uid)
    if os.getuid() != user.uid or os.geteuid() != user.uid or os.getgroups():
        raise OSError(f"still uid {os.geteuid()} after becoming {user.name} (uid {user.uid})")
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died while the credentials changed
        os._exit(1)
    os.environ.update(USER=user.name, LOGNAME=user.name)
    writable = os.path.isdir(user.home) and os.access(user.home, os.W_OK | os.X_OK)
    os.environ["HOME"] = user.home if writable else str(folder)
