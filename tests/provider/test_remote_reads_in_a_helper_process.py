"""A remote dataset that shares its provider with another one is read in a helper process of the
provider's (services/provider/read_helper.py), so its reads take no turns at the serving loop's GIL:
while its store answers nothing, the local dataset's batches keep coming, in the order asked, and a new
client is welcomed; a helper that dies fails only the batches it was reading and the next one starts a
new helper; a helper whose provider dies goes with it.

The store's answers are held (tests/support/held_store.py), so each check is an order of events, never
a timing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from libbus.errors import Unavailable
from libbus.wire.messages import BatchRequest, DatasetInfo, DatasetInfoRequest, Error
from services.provider.read_helper import ReadHelper
from services.provider.sources.storage.inflight import READER_NICE, lower_priority
from tests.support import REPO
from tests.support.held_store import (  # noqa: F401 - server_fixture: the `server` fixture
    LIVENESS,
    SLOW,
    WAIT_S,
    batch,
    every_batch_answered,
    in_flight,
    npy_pair,
    server_fixture,
    wait_until,
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _two_datasets(tmp_path, server, start_provider, **flags):
    remote = npy_pair(tmp_path / "remote", 64, 1)
    local = npy_pair(tmp_path / "local", 32, 2)
    provider = start_provider(
        f"web={server.url}/remote/?{SLOW}",
        f"disk=file://{tmp_path / 'local'}?memory=ram&val_fraction=0",
        heartbeat_liveness=LIVENESS,
        **flags,
    )
    return provider, remote, local


def test_local_batches_keep_flowing_in_order_while_the_helpers_store_answers_nothing(
    tmp_path, server, start_provider, client_for
):
    provider, (remote_x, remote_y), (local_x, local_y) = _two_datasets(tmp_path, server, start_provider)
    helper = provider.service.handler.helped["web"].helper
    assert helper.pid is not None and helper.pid != os.getpid(), "the remote dataset is not read in a helper"
    slow, fast = client_for(provider.endpoint, timeout_s=WAIT_S), client_for(provider.endpoint, timeout_s=WAIT_S)
    slow.hello(), fast.hello()

    server.hold()
    wanted = [np.array(i, "<i8") for i in ([5, 1, 2], [60, 40], [9, 33, 17])]
    asked = [slow.send(BatchRequest(dataset="web", split="train", frames=[idx.tobytes()])) for idx in wanted]
    in_flight(server, 6)  # the three batches' x and y, all at the silent store from the helper

    # many local batches, asked for ahead, each answered in the order asked and whole
    local = [np.array([(7 * k + j) % 32 for j in range(4)], "<i8") for k in range(24)]
    ids = [fast.send(BatchRequest(dataset="disk", split="train", frames=[idx.tobytes()])) for idx in local]
    for rid, idx in zip(ids, local):
        reply = fast.recv(WAIT_S)
        assert reply is not None and reply.id == rid, "a local batch waited behind the silent store"
        x, y = batch(reply, len(idx))
        assert np.array_equal(x, local_x[idx]) and np.array_equal(y, local_y[idx])
    newcomer = client_for(provider.endpoint, timeout_s=WAIT_S)
    newcomer.hello()
    info = newcomer.request(DatasetInfoRequest(dataset="web"))
    assert isinstance(info, DatasetInfo) and info.info["splits"]["train"]["num_samples"] == 64
    assert slow.recv(0) is None, "a remote batch was answered while its store had answered nothing"

    server.release()
    every_batch_answered(slow, asked, wanted, remote_x, remote_y)
    # the helper's reads are the provider's to show (its requests' limit, from the helper's counters)
    assert provider.service.handler.stats()["remote_reads"]["web"]["inflight_limit"] >= 1


def test_a_helpers_every_thread_yields_the_cores_and_the_serving_loop_does_not(
    tmp_path, server, start_provider, client_for
):
    """The helper's threads (its readers and obstore's, started after it began reading) run niced and under
    ``SCHED_BATCH``, so a reply waking one of them never preempts the serving loop or a trainer's loop; the
    provider's own loop keeps the policy it was started with."""
    provider, (remote_x, remote_y), _ = _two_datasets(tmp_path, server, start_provider)
    helper = provider.service.handler.helped["web"].helper
    client = client_for(provider.endpoint, timeout_s=WAIT_S)
    client.hello()
    idx = np.array([5, 1, 60], "<i8")
    x, y = batch(client.request(BatchRequest(dataset="web", split="train", frames=[idx.tobytes()])), 3)
    assert np.array_equal(x, remote_x[idx]) and np.array_equal(y, remote_y[idx])
    threads = [int(t) for t in os.listdir(f"/proc/{helper.pid}/task")]
    assert len(threads) > 1, "the helper read with no thread of its own"
    for tid in threads:
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH, f"helper thread {tid} can preempt on waking"
        assert os.getpriority(os.PRIO_PROCESS, tid) == READER_NICE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER, "the serving loop (this process) was lowered too"


def test_a_reader_pools_threads_run_niced_under_sched_batch():
    with ThreadPoolExecutor(2, initializer=lower_priority) as pool:
        policy, nice = pool.submit(
            lambda: (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        ).result()
    assert (policy, nice) == (os.SCHED_BATCH, READER_NICE)


def test_a_helper_that_dies_fails_only_its_batches_and_the_next_read_starts_another(
    tmp_path, server, start_provider, client_for
):
    provider, (remote_x, remote_y), (local_x, _) = _two_datasets(tmp_path, server, start_provider)
    helper = provider.service.handler.helped["web"].helper
    first = helper.pid
    slow, fast = client_for(provider.endpoint, timeout_s=WAIT_S), client_for(provider.endpoint, timeout_s=WAIT_S)
    slow.hello(), fast.hello()

    server.hold()
    doomed = np.array([3, 4], "<i8")
    rid = slow.send(BatchRequest(dataset="web", split="train", frames=[doomed.tobytes()]))
    in_flight(server, 2)
    os.kill(first, signal.SIGKILL)  # an out-of-memory kill, say
    reply = slow.recv(WAIT_S)
    assert isinstance(reply, Error) and reply.id == rid and reply.code == "UNAVAILABLE", reply
    assert "read helper died" in reply.message
    idx = np.array([1, 30], "<i8")
    x, _ = batch(fast.request(BatchRequest(dataset="disk", split="train", frames=[idx.tobytes()])), 2)
    assert np.array_equal(x, local_x[idx]), "the local dataset suffered from the remote one's helper dying"

    server.release()
    again = np.array([3, 4, 50], "<i8")
    x, y = batch(slow.request(BatchRequest(dataset="web", split="train", frames=[again.tobytes()])), 3)
    assert np.array_equal(x, remote_x[again]) and np.array_equal(y, remote_y[again])
    assert helper.started == 2 and helper.pid not in (None, first)
    wait_until(lambda: not _alive(first), "the killed helper was never reaped")


def test_a_helper_that_cannot_be_started_again_leaves_its_batches_to_the_providers_threads(
    tmp_path, server, start_provider, client_for
):
    """Killed, and its dataset no longer opened by a new helper (here: its URI made unreadable for it): the
    next batches are read on the provider's threads, right, and no helper is tried per batch."""
    provider, (remote_x, remote_y), _ = _two_datasets(tmp_path, server, start_provider)
    helper = provider.service.handler.helped["web"].helper
    client = client_for(provider.endpoint, timeout_s=WAIT_S)
    helper._config["uri"] = "http://127.0.0.1:9/gone/?retries=0&timeout=2"  # what a new helper would open
    first = helper.pid
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: helper.pid is None, "the provider never saw its helper die")
    for idx in (np.array([3, 4], "<i8"), np.array([60, 0, 7], "<i8")):
        x, y = batch(client.request(BatchRequest(dataset="web", split="train", frames=[idx.tobytes()])), len(idx))
        assert np.array_equal(x, remote_x[idx]) and np.array_equal(y, remote_y[idx])
    assert helper.started == 1 and helper.pid is None  # one failed start, then the backoff: no process per batch


_ORPHAN = """
import sys
from services.provider.read_helper import ReadHelper
helper = ReadHelper("web", sys.argv[1], threads=2)
helper.start()
print(helper.pid, flush=True)
sys.stdin.read()
"""


def test_a_helper_goes_with_its_provider_however_the_provider_ends(tmp_path, server):
    """The provider's process killed outright (no chance to close anything): its helper exits too."""
    npy_pair(tmp_path / "remote", 8, 1)
    provider = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN, f"{server.url}/remote/?{SLOW}"],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid = int(provider.stdout.readline())  # type: ignore[union-attr]
        assert _alive(pid)
        provider.kill()
        provider.wait()
        wait_until(lambda: not _alive(pid) or _zombie(pid), "the helper outlived its provider")
    finally:
        provider.kill()
        provider.wait()


def _zombie(pid: int) -> bool:
    """Exited, its parent (killed) not yet replaced by a reaper that got to it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_helper_that_cannot_open_its_dataset_says_so_and_runs_nothing(tmp_path):
    """A URI the helper cannot open (its store gone since the provider opened it) is refused at its start,
    naming the dataset; no process is left running."""
    helper = ReadHelper("gone", "http://127.0.0.1:9/nothing/?retries=0&timeout=2", threads=1)
    with pytest.raises(Unavailable, match="dataset gone: its read helper could not open it"):
        helper.start()
    assert helper.pid is None
    helper.close()


def test_a_helper_reads_named_fields_and_plans_as_its_source_does():
    """A batch of named fields comes back whole (variable-size fields included), equal to the source's own
    read; a plan for a source that keeps none is none; a helper closed answers no more."""
    from services.provider.sources import open_source  # noqa: PLC0415

    uri = "mock://fields?n=50"
    helper = ReadHelper("multi", uri, threads=2)
    helper.start()
    try:
        idx = np.array([49, 0, 7, 7], "<i8")
        got, want = helper.read_fields("train", idx, 0), open_source(uri).read_fields("train", idx, 0)
        assert got.keys() == want.keys()
        for name in want:
            assert len(got[name]) == len(want[name]) == len(idx)
            for a, b in zip(got[name], want[name]):
                assert np.array_equal(np.asarray(a), np.asarray(b)), name
        assert helper.read_ahead("train", idx, "loader") == 0
    finally:
        helper.close()
    assert helper.pid is None
    with pytest.raises(Unavailable, match="closing"):
        helper.read_fields("train", np.array([1], "<i8"), 0)
