"""A remote dataset's reads in a helper process of the provider, so that they take no turns at the
serving loop's GIL.

A remote store's range reads are off the GIL while they wait, but each reader thread still holds it to
make its calls, parse what comes back and copy the bytes into the batch: beside a busy remote dataset,
the serving loop waited its turn behind them, and a local dataset's batches and ``Hello`` with it. A
:class:`ReadHelper` opens the same dataset (its URI) in a child process of its own, run at the readers'
lower priority, and reads its batches there; the provider's side of a read only waits for the reply
(no GIL held) and copies the bytes into the batch's destination (a numpy copy: no GIL held either).

**The bytes travel in memory, not the socket.** Each read creates an anonymous memory file
(``memfd_create``, no name in ``/dev/shm``: nothing is left behind whoever dies), holding the batch's
indices followed by room for its samples and labels; its descriptor goes to the helper with the request
over a ``SOCK_SEQPACKET`` Unix socket pair, and the helper reads the samples into it. A batch of named
fields comes back pickled in a memory file the helper makes. ``ReadAhead`` plans go to the helper too
(its RAM cache is the one that reads), and each reply carries the helper's remote-read counters for the
provider's stats.

**Safe by construction.** The helper exits when its socket reaches end of file: the provider closed it,
or died (however: the kernel closes its end). A helper that dies fails the batches it was reading
(``UNAVAILABLE``, which a loader retries) and nothing else; the next read starts a new one. A dataset
whose helper cannot open it (it fails at start) is read on the provider's own threads instead, and so
is one whose helper cannot be started again after it died (the next start is tried
:data:`RESTART_BACKOFF_S` later, not once per batch).
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from libbus.errors import BusError, Internal, Unavailable, error_from_code

from ..process import freeze_startup_heap
from .sources.base import ReadPolicy, Source
from .sources.storage.blockmemory import ReadStats
from .sources.storage.inflight import lower_process_priority

__all__ = ["HelpedSource", "HelperDown", "ReadHelper", "helped", "with_helpers"]

log = logging.getLogger(__name__)

#: Map a memory file's pages in one call (Linux), rather than a page fault per 4 KiB written.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: The largest message on the socket (a request or a reply: small; the bytes go through memory files).
_MSG_BYTES = 1 << 20
#: How long a starting helper may take to open its dataset (imports and the files' headers on a loaded
#: machine) before the dataset is read on the provider's threads instead.
START_TIMEOUT_S = 60.0
#: After a helper failed to start, how long no other is tried (its dataset read on the provider's
#: threads meanwhile, :class:`HelpedSource`): a store that is down costs no process per batch.
RESTART_BACKOFF_S = 5.0
#: How long the serving loop waits for the helper to plan a loader's next samples (it plans at once, on
#: the thread that receives, never behind reads that wait on the store), before going on without.
READ_AHEAD_WAIT_S = 1.0


def helped(source: Source) -> bool:
    """Whether ``source``'s reads may move to a helper: a remote dataset's files read side by side
    (``CONCURRENT``); not a pipeline (its stages' threads and timing live with it) nor a source whose
    reads share state with another dataset's (a mix)."""
    return bool(source.remote) and source.read_policy is ReadPolicy.CONCURRENT


_Row = TypeVar("_Row", bound=Mapping[str, Any])


def with_helpers(row: _Row, helpers: dict[str, HelpedSource]) -> _Row:
    """The provider's ``object_store`` stats ``row`` with its helpers' requests added (each process counts
    its own); the same row when the provider reads no object store."""
    out = dict(row)
    if "object_store" in out:
        store = dict(out["object_store"])
        for reader in helpers.values():
            for key, n in reader.helper.objects.items():
                if key in store:
                    store[key] += n
        out["object_store"] = store
    return cast(_Row, out)


class _Stats:
    """The helper's remote-read counters as its last reply said (the provider's ``remote_reads``)."""

    def __init__(self) -> None:
        self.last: ReadStats = {}

    def stats(self) -> ReadStats:
        return self.last.copy()


class HelperDown(Unavailable):
    """No helper runs and none could be started (just now, or within :data:`RESTART_BACKOFF_S`)."""


class ReadHelper:
    """The helper process reading dataset ``dataset`` (opened from ``uri``), started on the first read
    (or by :meth:`start`) and again after one died; ``threads`` batches are read in it at once."""

    def __init__(
        self,
        dataset: str,
        uri: str,
        *,
        threads: int,
        cache_dir: str = "",
        cache_limit: int = 0,
        user_modules: Collection[str] = (),
        gc_freeze: bool = True,
    ):
        self.dataset, self.uri, self.threads = dataset, uri, threads
        self._config = {"uri": uri, "threads": threads, "cache_dir": cache_dir, "cache_limit": cache_limit}
        self._config.update(user_modules=list(user_modules), gc_freeze=gc_freeze)
        self._lock = threading.Lock()  # start, send, close
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._pending: dict[int, Future] = {}
        self._next = 0
        self._closed = False
        #: Helpers started so far (a restart after a death counts); the provider's stats.
        self.started = 0
        self._failed_at: float | None = None  # monotonic time of the last start that failed
        self.location = _Stats()
        #: The object-store requests of this dataset's helpers (a process's own counters, summed over
        #: the helpers that ran): added to the provider's ``object_store`` stats (:func:`with_helpers`).
        self.objects: dict[str, int] = {}
        self._objects_before: dict[str, int] = {}  # those of the helpers that have ended
        #: The memory files batches are read into, reused: a new one per batch cost both processes a page
        #: fault per 4 KiB and the kernel a zeroed page (a third of a helper's CPU time at 30 ms a request).
        self._files = _MemoryFiles(keep=threads)

    @property
    def pid(self) -> int | None:
        """The running helper's process id, or ``None``."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the helper now (if none runs) and wait until it has opened the dataset. Raises
        :class:`BusError` when it cannot."""
        with self._lock:
            self._start()

    def _start(self) -> socket.socket:
        if self._closed:
            raise Unavailable(f"dataset {self.dataset}: the provider is closing")
        if self._sock is not None:
            return self._sock
        if self._failed_at is not None and time.monotonic() - self._failed_at < RESTART_BACKOFF_S:
            raise HelperDown(f"dataset {self.dataset}: its read helper failed to start moments ago")
        self._failed_at = time.monotonic()  # until it has started
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except OSError as err:
            ours.close()
            raise HelperDown(f"dataset {self.dataset}: its read helper did not start: {err}") from err
        finally:
            theirs.close()
        try:
            ours.settimeout(START_TIMEOUT_S)
            ours.send(pickle.dumps(self._config))
            ready = ours.recv(_MSG_BYTES)
            ours.settimeout(None)
        except OSError as err:
            ready = pickle.dumps(("error", f"no word within {START_TIMEOUT_S:.0f} s ({err})"))
        status, detail = pickle.loads(ready) if ready else ("error", "it exited")
        if status != "ready":
            ours.close()
            proc.kill()
            proc.wait()
            raise HelperDown(f"dataset {self.dataset}: its read helper could not open it: {detail}")
        self._sock, self._proc, self._failed_at = ours, proc, None
        self.started += 1
        threading.Thread(
            target=self._replies, args=(ours, proc), name=f"helper-{self.dataset}"[:15], daemon=True
        ).start()
        return ours

    def _replies(self, sock: socket.socket, proc: subprocess.Popen) -> None:
        """Resolve each read's Future as its reply arrives; when the helper is gone, fail the reads it
        held and forget it (the next read starts another)."""
        why = "it exited"
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MSG_BYTES, 1)
            except OSError as err:
                why = str(err)
                break
            if not data:
                break
            rid, failed, outcome, stats = pickle.loads(data)
            location, objects = stats
            if location:
                self.location.last = location
            self.objects = {k: self._objects_before.get(k, 0) + v for k, v in objects.items()}
            with self._lock:
                future = self._pending.pop(rid, None)
            if future is None:
                for fd in fds:
                    os.close(fd)
                continue
            future.set_result((failed, outcome, fds[0] if fds else None))
        self._objects_before = dict(self.objects)
        with self._lock:
            if self._sock is sock:
                self._sock, self._proc = None, None
            failed, self._pending = self._pending, {}
        sock.close()
        for future in failed.values():  # first: whatever its process is still doing, they are answered
            future.set_exception(Unavailable(f"dataset {self.dataset}: its read helper died ({why}); ask again"))
        code = proc.wait()
        if failed and not self._closed:
            log.warning(
                "the read helper of dataset %s died (%s, status %s): %d batches failed",
                self.dataset,
                why,
                code,
                len(failed),
            )

    def _call(
        self, request: tuple, fd: int | None = None, timeout: float | None = None, start: bool = True
    ) -> tuple[Any, int | None]:
        """Send ``request`` (with the memory file ``fd``) and wait for its outcome (``timeout``: at most
        that long, then :class:`Unavailable`); ``start``: start a helper if none runs (else
        :class:`Unavailable`)."""
        future: Future = Future()
        with self._lock:
            if not start and self._sock is None:
                raise Unavailable(f"dataset {self.dataset}: no read helper runs")
            sock = self._start()
            rid = self._next = self._next + 1
            self._pending[rid] = future
            try:
                socket.send_fds(sock, [pickle.dumps((rid, *request))], [fd] if fd is not None else [])
            except OSError as err:
                self._pending.pop(rid, None)
                raise Unavailable(f"dataset {self.dataset}: its read helper is gone ({err}); ask again") from err
        try:
            failed, outcome, reply_fd = future.result(timeout)
        except TimeoutError as err:
            with self._lock:
                self._pending.pop(rid, None)
            raise Unavailable(f"dataset {self.dataset}: its read helper did not answer within {timeout} s") from err
        if failed:
            if reply_fd is not None:
                os.close(reply_fd)
            raise error_from_code(*outcome)
        return outcome, reply_fd

    def serve_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray, epoch: int = 0) -> None:
        """Read samples ``indices`` of ``split`` into ``x`` and ``y``, in the helper, through a memory file
        of :attr:`_files` (one the last reads left, or a new one)."""
        index = np.ascontiguousarray(indices, "<i8")
        size = max(index.nbytes + x.nbytes + y.nbytes, 1)
        file = self._files.take(size)
        answered = False
        try:
            file.mem[: index.nbytes] = index.tobytes()
            self._call(("serve_into", split, len(index), epoch), file.fd)
            answered = True
            at = index.nbytes
            for out in (x, y):
                view = np.frombuffer(file.mem, out.dtype, out.size, at).reshape(out.shape)
                np.copyto(out, view)
                del view
                at += out.nbytes
        finally:
            # kept for the next read only once the helper said it is done with it: one whose read failed
            # or went unanswered may still be written by a helper thread, and is never handed out again
            self._files.give(file, reuse=answered)

    def read_fields(self, split: str, indices: np.ndarray, epoch: int = 0) -> Any:
        """A batch of named fields, read in the helper."""
        index = np.ascontiguousarray(indices, "<i8")
        fd = os.memfd_create("batchbus-read", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(index.nbytes, 1))
            with mmap.mmap(fd, max(index.nbytes, 1)) as mem:
                mem[: index.nbytes] = index.tobytes()
            size, reply_fd = self._call(("read_fields", split, len(index), epoch), fd)
        finally:
            os.close(fd)
        try:
            with mmap.mmap(reply_fd, size, prot=mmap.PROT_READ) as mem:  # type: ignore[arg-type]
                return pickle.loads(mem)
        finally:
            os.close(reply_fd)  # type: ignore[arg-type]

    def read_ahead(self, split: str, indices: np.ndarray, key: Any) -> int:
        """Plan a loader's next samples in the helper (its cache fetches their blocks ahead); called on
        the serving loop, so it starts no helper and waits at most :data:`READ_AHEAD_WAIT_S`."""
        index = np.ascontiguousarray(indices, "<i8")
        fd = os.memfd_create("batchbus-read", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(index.nbytes, 1))
            with mmap.mmap(fd, max(index.nbytes, 1)) as mem:
                mem[: index.nbytes] = index.tobytes()
            planned, _ = self._call(("read_ahead", split, len(index), key), fd, READ_AHEAD_WAIT_S, start=False)
        except Unavailable as err:  # a plan is a hint: the batches are read when asked for all the same
            log.warning("%s", err)
            return 0
        finally:
            os.close(fd)
        return int(planned)

    def close(self) -> None:
        """Stop the helper (its reads under way fail) and start no other."""
        with self._lock:
            self._closed = True
            sock, proc = self._sock, self._proc
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the helper sees end of file and exits; our reader thread ends
            except OSError:  # it died meanwhile: the reader thread has closed it
                pass
        if proc is not None:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._files.close()


class _MemoryFile:
    """An anonymous memory file of ``size`` bytes and the provider's mapping of it."""

    def __init__(self, size: int):
        self.size = size
        self.fd = os.memfd_create("batchbus-read", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mem = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        try:
            self.mem.close()
        except BufferError:  # a view still held somewhere: unmapped when it goes
            pass
        os.close(self.fd)


class _MemoryFiles:
    """Memory files for batches read in a helper, at most ``keep`` of them kept between reads (the batches
    a helper reads at once): a read takes the smallest kept one that holds it, or a new one. The pages of a
    kept file stay allocated (``keep`` batches' bytes, a few MiB each), so its next read faults none in."""

    def __init__(self, keep: int):
        self.keep = max(1, keep)
        self._lock = threading.Lock()
        self._idle: list[_MemoryFile] = []
        self._closed = False

    def take(self, size: int) -> _MemoryFile:
        with self._lock:
            fits = [f for f in self._idle if size <= f.size <= 2 * size]  # a small batch keeps no large file busy
            if fits:
                file = min(fits, key=lambda f: f.size)
                self._idle.remove(file)
                return file
        return _MemoryFile(size)

    def give(self, file: _MemoryFile, reuse: bool) -> None:
        """``file``'s read is over: kept for another (``reuse``, room left, not closed), else closed."""
        with self._lock:
            if reuse and not self._closed:
                self._idle.append(file)
                if len(self._idle) <= self.keep:
                    return
                file = min(self._idle, key=lambda f: f.size)  # the smallest goes: batches grow less often
                self._idle.remove(file)
        file.close()

    def close(self) -> None:
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for file in idle:
            file.close()


class HelpedSource:
    """``source`` as the provider's batch writer sees it, its reads made by ``helper`` (by ``source``
    itself while no helper can be started: :class:`HelperDown`): shapes, dtypes and everything else are
    the source's own."""

    def __init__(self, source: Source, helper: ReadHelper):
        self.source, self.helper = source, helper
        self.location = helper.location

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def serve_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray, epoch: int = 0) -> None:
        try:
            self.helper.serve_into(split, indices, x, y, epoch)
        except HelperDown:  # none could be started: read here, as without a helper
            self.source.serve_into(split, indices, x, y, epoch=epoch)

    def read_fields(self, split: str, indices: np.ndarray, epoch: int = 0) -> Any:
        try:
            return self.helper.read_fields(split, indices, epoch)
        except HelperDown:
            return self.source.read_fields(split, indices, epoch)

    def read_ahead(self, split: str, indices: np.ndarray, key: Any) -> int:
        return self.helper.read_ahead(split, indices, key)


# -- the helper's side ---------------------------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    """Open the dataset the provider names, say so, then read what it asks until it hangs up."""
    config = pickle.loads(sock.recv(_MSG_BYTES))
    lower_process_priority()  # and every thread it starts after (its readers', obstore's) inherits it
    try:
        from .sources.objstore import configure_cache
        from .sources.registry import open_source
        from .sources.storage import objects

        configure_cache(config["cache_dir"], config["cache_limit"])
        source = open_source(config["uri"], None, user_modules=config["user_modules"])
    except Exception as err:  # noqa: BLE001 - the provider reads this dataset itself instead
        sock.send(pickle.dumps(("error", f"{type(err).__name__}: {err}")))
        return
    if config.get("gc_freeze", True):  # a provider started before the setting existed sends none
        freeze_startup_heap()  # its reads' garbage collections walk only what reading made
    sock.send(pickle.dumps(("ready", "")))
    send = threading.Lock()
    location = getattr(source, "location", None)

    def counters() -> tuple[dict | None, dict[str, int]]:
        """What the provider shows of this process's reads: its location's and its object-store requests."""
        with objects.STATS_LOCK:
            return (location.stats() if location is not None else None), dict(objects.STATS)

    def read(mem: mmap.mmap, op: str, split: str, n: int, arg: Any, reply_fds: list[int]) -> Any:
        """One request's work on its memory file ``mem``: its outcome (memory files it made go in ``reply_fds``)."""
        indices = np.frombuffer(mem, "<i8", n).copy()
        if op == "serve_into":
            x_shape, y_shape = (n, *source.sample_shape), (n, *source.label_shape)
            x = np.frombuffer(mem, source.dtype, int(np.prod(x_shape)), indices.nbytes)
            y = np.frombuffer(mem, source.label_dtype, int(np.prod(y_shape)), indices.nbytes + x.nbytes)
            source.serve_into(split, indices, x.reshape(x_shape), y.reshape(y_shape), epoch=arg)
            return None
        if op == "read_fields":
            data = pickle.dumps(source.read_fields(split, indices, arg), pickle.HIGHEST_PROTOCOL)
            out = os.memfd_create("batchbus-fields", os.MFD_CLOEXEC)
            reply_fds.append(out)
            os.ftruncate(out, max(len(data), 1))
            os.pwrite(out, data, 0)
            return len(data)
        return source.read_ahead(split, indices, arg)

    def answer(rid: int, op: str, split: str, n: int, arg: Any, fd: int) -> None:
        reply_fds: list[int] = []
        failed = False  # outcome is then (the error's wire code, its message): plain data, as everything sent
        mem = None
        try:
            mem = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | _POPULATE)  # its pages at once, not a fault each
            outcome = read(mem, op, split, n, arg, reply_fds)
        except BusError as err:  # said as the provider's own read would have raised it
            outcome, failed = (err.code, str(err)), True
        except Exception as err:  # noqa: BLE001 - the batch fails, the helper lives on
            outcome, failed = (Internal.code, f"{type(err).__name__}: {err}"), True
        finally:  # the error (and the views its frames held) is gone by now
            os.close(fd)
            try:
                if mem is not None:
                    mem.close()
            except BufferError:  # a view still held somewhere: unmapped when it goes
                pass
        reply = pickle.dumps((rid, failed, outcome, counters()))
        with send:
            try:
                socket.send_fds(sock, [reply], reply_fds)
            except OSError:
                os._exit(0)  # the provider is gone
        for out in reply_fds:
            os.close(out)

    pool = ThreadPoolExecutor(config["threads"], thread_name_prefix="read")
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MSG_BYTES, 1)
        except OSError:
            break
        if not data:
            break  # the provider hung up, or died
        rid, op, split, n, arg = pickle.loads(data)
        if op == "read_ahead":  # a plan, at once: not behind reads waiting on the store
            answer(rid, op, split, n, arg, fds[0])
        else:
            pool.submit(answer, rid, op, split, n, arg, fds[0])
    os._exit(0)  # reads stuck on a silent store are not waited for


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
