"""The loaders' ZeroMQ context: one per process, its I/O threads on SCHED_BATCH, the script's own
``zmq.Context.instance()`` left as it was."""

import os
import subprocess
import sys

import pytest
import zmq

from libbus.loader.context import loader_context

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduling policies read from /proc")


IO_THREADS = """
import os, time
from pathlib import Path
import zmq
from libbus.loader.context import loader_context

def policies(ctx):
    before = {t.name for t in Path("/proc/self/task").iterdir()}
    sock = ctx.socket(zmq.DEALER)  # libzmq starts a context's threads with its first socket
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        new = [t for t in Path("/proc/self/task").iterdir() if t.name not in before]
        if new and all((t / "comm").read_text().startswith("ZMQbg/") for t in new):
            break
        time.sleep(0.01)
    sock.close(0)
    return sorted({os.sched_getscheduler(int(t.name)) for t in new})

print(policies(zmq.Context.instance()), policies(loader_context()), os.sched_getscheduler(0))
"""


def test_loader_io_threads_never_preempt_the_loop():
    run = subprocess.run([sys.executable, "-c", IO_THREADS], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    script, loader, caller = run.stdout.split("] ")
    # the script's own context keeps the default policy; the loaders' I/O threads never preempt;
    # the calling thread is untouched
    assert script == f"[{os.SCHED_OTHER}" and loader == f"[{os.SCHED_BATCH}" and int(caller) == os.SCHED_OTHER


def test_one_context_per_process():
    assert loader_context() is loader_context()


def test_the_scripts_own_context_is_left_alone():
    assert loader_context() is not zmq.Context.instance()
    assert zmq.Context.instance().get(zmq.THREAD_SCHED_POLICY) == -1  # libzmq's default


def test_a_forked_child_gets_a_context_of_its_own():
    parent = loader_context()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a fresh context (a forked one's threads are gone)
        ok = loader_context() is not parent and loader_context().get(zmq.THREAD_SCHED_POLICY) == os.SCHED_BATCH
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    os.waitpid(pid, 0)
