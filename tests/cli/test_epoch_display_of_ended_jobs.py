"""A job that ended at an epoch's end is shown at that epoch, not the next: a study trial pruned at its first
epoch's report trained 1 epoch of 3 (``busctl jobs`` said ``epoch 2/3``), a job early-stopped after 2 of 3
epochs trained 2 (it said ``epoch 3/3``). A running job at a boundary is in the next epoch, and a job stopped
within an epoch is in that epoch, as before. ``busctl web`` counts the same way (tests/cli/test_web.py)."""

from __future__ import annotations

import pytest

from cli import tables
from cli.tables import epoch_of

#: progress reports as the router keeps them (only the fields the count reads)
PRUNED_AT_FIRST_REPORT = {"epoch": 1, "epochs": 3, "step": 1, "steps_per_epoch": None, "history": [{"epoch": 1}]}
EARLY_STOPPED_AFTER_TWO = {"epoch": 2, "epochs": 3, "step": 20, "steps_per_epoch": 10, "history": [{}, {}]}
STOPPED_WITHIN_SECOND = {"epoch": 1, "epochs": 3, "step": 15, "steps_per_epoch": 10, "history": [{}]}
AT_FIRST_BOUNDARY = {"epoch": 1, "epochs": 3, "step": 10, "steps_per_epoch": 10, "history": [{}]}
ALL_DONE = {"epoch": 3, "epochs": 3, "step": 30, "steps_per_epoch": 10, "history": [{}, {}, {}]}


@pytest.mark.parametrize(
    ("report", "state", "shown"),
    [
        (PRUNED_AT_FIRST_REPORT, "stopped", "1/3"),
        (PRUNED_AT_FIRST_REPORT, "running", "2/3"),  # its next epoch is under way
        (EARLY_STOPPED_AFTER_TWO, "succeeded", "2/3"),
        (EARLY_STOPPED_AFTER_TWO, "stopped", "2/3"),
        (STOPPED_WITHIN_SECOND, "stopped", "2/3"),
        (STOPPED_WITHIN_SECOND, "failed", "2/3"),
        (AT_FIRST_BOUNDARY, "running", "2/3"),
        (AT_FIRST_BOUNDARY, "failed", "1/3"),
        (ALL_DONE, "succeeded", "3/3"),
        (ALL_DONE, "running", "3/3"),
    ],
)
def test_the_epoch_shown_is_the_one_the_job_was_in(report, state, shown):
    assert epoch_of(report, state == "succeeded", state in ("succeeded", "failed", "stopped")) == shown


def test_busctl_jobs_shows_a_pruned_trial_at_the_epoch_it_was_pruned(capsys):
    row = {"id": "j0123456789", "state": "stopped", "spec": {"dataset": "mnist", "entrypoint": "lab.train:fit"}}
    tables.jobs([{**row, "progress": PRUNED_AT_FIRST_REPORT, "updated": None}])
    out = capsys.readouterr().out
    assert "1/3" in out and "2/3" not in out  # (a narrow terminal wraps "epoch" and "1/3")
