"""The audit's replay (services/trainer/attempt/audit.py ``effective_epochs``): what the final model trained on,
told from the attempts' own files, whatever their timing.

The suite's exactly-once checks rest on it; a replay that drops a rank's batch calls a correct run wrong,
one that keeps a lost attempt's batches calls a wrong run right. The files are written here as the
trainer writes them (one head line, one line per batch), with the timings that misled the replay once:
a gang's second rank starting its resumed attempt after the first rank had already trained its last step.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson

from services.trainer.attempt.audit import effective_epochs

JOB = "j1"


def write_attempt(directory: Path, name: str, *, started: float, resumed: int, rank: int, attempt, batches) -> None:
    """One audit file: ``batches`` are ``(epoch, step, t, samples)``; ``attempt=None`` writes a head
    without the router's attempt number (files of an older trainer)."""
    head = {"job": JOB, "trainer": name, "started": started, "resumed_from_step": resumed, "rank": rank}
    if attempt is not None:
        head["attempt"] = attempt
    lines = [head] + [{"epoch": e, "step": s, "t": t, "samples": samples} for e, s, t, samples in batches]
    (directory / f"{JOB}.{name}.1.0.jsonl").write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))


def samples(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_a_gang_rank_starting_after_its_sibling_finished_cuts_nothing_of_that_sibling(tmp_path):
    # attempt 0: both ranks train steps 1-2, then the job is handed back; attempt 1 resumes both ranks from step 2,
    # and rank 0 trains its last step (3) before rank 1 has even begun: nothing of rank 0's step 3 is lost
    write_attempt(tmp_path, "a0r0", started=10.0, resumed=0, rank=0, attempt=0,
                  batches=[(0, 1, 10.1, samples("a", 2)), (0, 2, 10.2, samples("b", 2))])  # fmt: skip
    write_attempt(tmp_path, "a0r1", started=10.0, resumed=0, rank=1, attempt=0,
                  batches=[(0, 1, 10.1, samples("c", 2)), (0, 2, 10.2, samples("d", 2))])  # fmt: skip
    write_attempt(tmp_path, "a1r0", started=20.0, resumed=2, rank=0, attempt=1,
                  batches=[(0, 3, 20.001, samples("e", 2))])  # fmt: skip
    write_attempt(tmp_path, "a1r1", started=20.004, resumed=2, rank=1, attempt=1,
                  batches=[(0, 3, 20.005, samples("f", 2))])  # fmt: skip
    assert effective_epochs(tmp_path, JOB) == {0: Counter(samples("a", 2) + samples("b", 2) + samples("c", 2)
                                                          + samples("d", 2) + samples("e", 2) + samples("f", 2))}  # fmt: skip


def test_a_later_attempt_cuts_what_every_rank_of_the_earlier_one_trained_after_its_step(tmp_path):
    # attempt 0 (two ranks) trained to step 3 but its last checkpoint was step 2; attempt 1 resumed from step 2 on
    # one rank (an elastic gang that lost a trainer): both ranks' step 3 were lost with attempt 0's model
    for rank in (0, 1):
        write_attempt(tmp_path, f"a0r{rank}", started=10.0, resumed=0, rank=rank, attempt=0,
                      batches=[(0, s, 10.0 + s / 10, samples(f"r{rank}s{s}-", 2)) for s in (1, 2, 3)])  # fmt: skip
    write_attempt(tmp_path, "a1r0", started=20.0, resumed=2, rank=0, attempt=1,
                  batches=[(0, 3, 20.1, samples("new", 4))])  # fmt: skip
    kept = [d for rank in (0, 1) for s in (1, 2) for d in samples(f"r{rank}s{s}-", 2)] + samples("new", 4)
    assert effective_epochs(tmp_path, JOB) == {0: Counter(kept)}


def test_a_retry_of_the_same_rank_from_the_same_checkpoint_cuts_the_first_try(tmp_path):
    write_attempt(tmp_path, "first", started=10.0, resumed=4, rank=0, attempt=2,
                  batches=[(1, 5, 10.1, samples("lost", 3))])  # fmt: skip
    write_attempt(tmp_path, "retry", started=30.0, resumed=4, rank=0, attempt=3,
                  batches=[(1, 5, 30.1, samples("kept", 3))])  # fmt: skip
    assert effective_epochs(tmp_path, JOB) == {1: Counter(samples("kept", 3))}


def test_files_without_attempt_numbers_are_replayed_by_time(tmp_path):
    # an older trainer's files: a later attempt of the same rank cuts, whenever it began
    write_attempt(tmp_path, "first", started=10.0, resumed=0, rank=0, attempt=None,
                  batches=[(0, 1, 10.1, samples("a", 2)), (0, 2, 10.2, samples("lost", 2))])  # fmt: skip
    write_attempt(tmp_path, "second", started=20.0, resumed=1, rank=0, attempt=None,
                  batches=[(0, 2, 20.1, samples("b", 2))])  # fmt: skip
    assert effective_epochs(tmp_path, JOB) == {0: Counter(samples("a", 2) + samples("b", 2))}
