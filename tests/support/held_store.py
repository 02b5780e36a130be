"""A store whose answers a test holds (the range server's ``hold``/``release``), and what the tests of
remote reads share: a small ``.npy`` pair to serve, bounded waits for what the provider must have done,
and the provider settings under which a client may wait on a held store."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.support.httpd import RangeServer

__all__ = [
    "LIVENESS",
    "SLOW",
    "WAIT_S",
    "batch",
    "every_batch_answered",
    "in_flight",
    "npy_pair",
    "server_fixture",
    "wait_until",
]

#: A held GET must not time out on the provider's side while the test looks (the server hangs up after 60 s).
SLOW = "retries=0&timeout=120&val_fraction=0"
#: How long a test waits for the provider to have done what it must (a bound, not a measure).
WAIT_S = 30.0
#: Heartbeats a provider lets a session miss (at the tests' 100 ms): a client waiting on a held store
#: sends nothing, and at the tests' default of 10 its session could end before the store is released.
LIVENESS = 600


@pytest.fixture(name="server")
def server_fixture(tmp_path: Path):
    """A range server over ``tmp_path``, closed (and released) after the test."""
    srv = RangeServer(tmp_path)
    yield srv
    srv.close()


def npy_pair(d: Path, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``train_x.npy`` (n × 3×4×4 float32) and ``train_y.npy`` (class ids) in a new folder ``d``."""
    d.mkdir()
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((n, 3, 4, 4)).astype(np.float32), rng.integers(0, 10, n)
    np.save(d / "train_x.npy", x)
    np.save(d / "train_y.npy", y)
    return x, y


def wait_until(check: Callable[[], bool], what: str) -> None:
    """Wait (at most :data:`WAIT_S`) until ``check()``; fail saying ``what`` never happened."""
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.01)


def in_flight(server: RangeServer, n: int) -> None:
    """Wait until ``n`` range GETs are outstanding at the (held) store."""
    wait_until(lambda: server.inflight >= n, lambda: f"{server.inflight} GETs outstanding, never {n}: {server.gets()}")


def batch(reply, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A socket batch reply's ``x`` and ``y`` (``n`` samples each), checked to be a batch."""
    from libbus.wire.messages import BatchResponse  # noqa: PLC0415

    assert isinstance(reply, BatchResponse), reply
    x = np.frombuffer(reply.frames[0].buffer, reply.dtypes[0]).reshape(reply.shapes[0])
    y = np.frombuffer(reply.frames[1].buffer, reply.dtypes[1]).reshape(reply.shapes[1])
    assert len(x) == len(y) == n
    return x, y


def every_batch_answered(
    client, asked: list[int], wanted: list[np.ndarray], x: np.ndarray, y: np.ndarray, why: str = ""
) -> None:
    """Collect a reply to every request id in ``asked`` (in whatever order they come), then check each is
    the batch of its indices in ``wanted``: the samples ``x[idx]`` and labels ``y[idx]``. ``why`` is added
    to the failure of a request never answered."""
    replies = {}
    while len(replies) < len(asked):
        reply = client.recv(WAIT_S)
        assert reply is not None, f"only {sorted(replies)} of {asked} answered{why}"
        replies[reply.id] = reply
    for rid, idx in zip(asked, wanted, strict=True):
        got_x, got_y = batch(replies[rid], len(idx))
        assert np.array_equal(got_x, x[idx]) and np.array_equal(got_y, y[idx]), f"request {rid}: not the batch of {idx}"
