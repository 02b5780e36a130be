"""What a job prints is bounded by the bytes it takes on the wire, and costs no service anything.

A line of Cyrillic takes 2 bytes a character in a message, a line of control characters 6: output
is cut by bytes as the trainer reads it, sent in batches sized by their encoded bytes, stored and
served back (``busctl job logs``) in replies sized the same way. A request that still cannot be
encoded fails alone; the router link's thread serves on. End to end: a job printing 1.1 MB of
non-ASCII text in one burst ends alone, its trainer takes the next job, and its logs read back.
"""

from __future__ import annotations

import socket
import sqlite3
import threading
import time

import pytest

from libbus.connect.client import Identity
from libbus.connect.link import Link
from libbus.constants import MAX_HEADER_BYTES
from libbus.errors import TooLarge
from libbus.wire.messages import JobLog, JobLogs, Stats, encode
from services.router.logs import JobOutput
from services.trainer.service.attempt_run import MAX_LINE_BYTES, AttemptLog, read_lines
from tests.support.jobs import EntryCluster

CYRILLIC = "Ж" * 3000
CONTROL = "\x01" * 3000


def _fits(msg) -> int:
    """The message's header bytes (it encodes, so it fits in what a peer accepts)."""
    return len(encode(msg)[1])


def test_a_request_too_large_to_encode_fails_alone_and_the_link_serves_on(router, make_token):
    link = Link(router.endpoint, Identity(role="trainer", name="loud", token=make_token(sub="loud")))
    link.start()
    try:
        assert link.wait_connected(10)
        with pytest.raises(TooLarge, match="bytes"):
            link.request(JobLog(job="j", attempt=0, seq=0, lines=[CYRILLIC] * 250), timeout_s=5)
        assert link.fatal is None
        assert link.request(Stats(), timeout_s=5).type == "StatsReply"  # the same link, still serving
    finally:
        link.close()


def test_output_is_cut_by_bytes_while_read_not_held_to_its_newline():
    theirs, ours = socket.socketpair()
    lines: list[str] = []
    reader = threading.Thread(target=read_lines, args=(ours.makefile("rb"), lines.append), daemon=True)
    reader.start()
    try:
        text = "aЯ" * 400_000  # 1.2 MB with no newline, a 2-byte character across every other cut
        theirs.sendall(text.encode())
        deadline = time.monotonic() + 30
        while sum(map(len, lines)) < len(text) - MAX_LINE_BYTES:  # pieces arrive while the line is open
            assert time.monotonic() < deadline, f"{len(lines)} pieces read of a line not ended"
            time.sleep(0.01)
        theirs.sendall(b"\n\xff tail\n")
    finally:
        theirs.close()
    reader.join(10)
    assert not reader.is_alive()
    assert all(len(x.encode()) <= MAX_LINE_BYTES for x in lines)
    assert "".join(lines[:-1]) == text and lines[-1] == "\ufffd tail"  # nothing lost, no character split


def test_batches_of_lines_and_a_failures_tail_are_sized_by_encoded_bytes():
    log = AttemptLog(16 << 20)
    for _ in range(250):
        log.add(CYRILLIC)
    for _ in range(100):
        log.add(CONTROL)
    log.add("Я" * 100_000)  # cut to MAX_LINE_BYTES
    sent = []
    while lines := log.take():
        assert _fits(JobLog(job="j", attempt=0, seq=len(sent), lines=lines)) <= MAX_HEADER_BYTES
        sent += lines
    assert sent[:350] == [CYRILLIC[: MAX_LINE_BYTES // 2]] * 250 + [CONTROL] * 100  # each cut to its bytes
    assert len(sent) == 351 and len(sent[-1].encode()) <= MAX_LINE_BYTES
    assert sum(len(x) for x in log.tail()) < 16 << 10  # quoted in an error: bounded too


def test_job_logs_replies_fit_whatever_the_lines_hold(tmp_path):
    output = JobOutput(sqlite3.connect(tmp_path / "logs.db"))
    for seq in range(0, 200, 20):
        output.add("j", 0, seq, [CONTROL] * 20)
    after, got = 0, []
    for _ in range(100):
        attempt, lines, nxt, dropped, attempts = output.read("j", -1, after, 1000)
        assert _fits(JobLogs(job="j", attempt=attempt, lines=lines, next=nxt, dropped=dropped)) <= MAX_HEADER_BYTES
        if not lines:
            break
        got += lines
        after = nxt
    assert got and set(got) == {CONTROL} and len(got) + dropped == 200


@pytest.mark.timeout(600)
def test_a_job_printing_a_megabyte_burst_ends_alone_and_its_trainer_takes_the_next(tmp_path):
    cluster = EntryCluster(tmp_path / "state")
    try:
        cluster.start_router()
        cluster.start_provider()
        cluster.start_trainer("only")
        job = cluster.submit_spec(
            {"dataset": "mnist", "entrypoint": "tests.support.entrypoints:loud", "max_attempts": 1, "evaluate": False}
        )
        loud = cluster.wait_end(job, timeout=180)
        assert loud["state"] in ("succeeded", "failed"), loud
        assert cluster.procs["only"].poll() is None, cluster.logs()  # the trainer lives on
        shown = cluster.busctl("job", "logs", job)
        assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
        assert shown.stdout.splitlines()[-1] == "\\x01" * 3000  # shown escaped, whole, the last one too
        # the same trainer, the only one, takes and ends the next job
        nxt = cluster.submit_spec(
            {"dataset": "mnist", "entrypoint": "tests.support.entrypoints:constant", "params": {"value": 2.0}}
        )
        assert cluster.wait_end(nxt, timeout=180)["state"] == "succeeded", cluster.logs()
        assert cluster.job(nxt)["trainer"] == "only"
    finally:
        cluster.close()
