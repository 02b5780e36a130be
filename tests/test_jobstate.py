"""The job lifecycle as one state machine (libbus/jobs/state.py): the table, the guard in the job
store (a real SQLite file), refusals counted, and no state spelled in the store's SQL."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from libbus.jobs.spec import JOB_STATES, TERMINAL_STATES, JobSpec
from libbus.jobs.state import REFUSED, TRANSITIONS, IllegalTransition, JobState, check_transition
from services.router.store import JobStore

REPO = Path(__file__).resolve().parents[1]


def test_the_table_covers_every_state_and_only_resume_leaves_an_end():
    assert set(TRANSITIONS) == set(JobState) and JOB_STATES == tuple(s.value for s in JobState)
    assert TERMINAL_STATES == ("succeeded", "failed", "stopped")
    assert TRANSITIONS[JobState.SUCCEEDED] == frozenset()
    for end in (JobState.FAILED, JobState.STOPPED):
        assert TRANSITIONS[end] == {JobState.QUEUED}
    assert check_transition("j1", "queued", "running") is JobState.RUNNING


def test_the_store_refuses_an_impossible_transition_clearly_and_counts_it(tmp_path):
    store = JobStore(str(tmp_path / "router.db"))
    job = store.submit(JobSpec.from_dict({"dataset": "mnist"}))
    store.claim("t1", 10)
    store.finish(job, "succeeded", "finished on t1", result={"ok": 1})
    before = REFUSED["succeeded->queued"]
    with pytest.raises(IllegalTransition, match=r"is succeeded and cannot become queued; .* nothing \(it is final\)"):
        store.release(job, "late lease lapse", lost=True)
    with pytest.raises(IllegalTransition, match="cannot become stopped"):
        store.finish(job, "stopped", "late stop")
    assert REFUSED["succeeded->queued"] == before + 1
    info = store.get(job)
    assert info["state"] == "succeeded" and info["result"] == {"ok": 1}  # nothing changed
    assert [e["state"] for e in info["events"]] == ["queued", "running", "succeeded"]
    with pytest.raises(IllegalTransition, match="states are queued, running"):
        check_transition(job, "succeeded", "finished")


def test_no_state_is_spelled_in_the_store_sql():
    source = (REPO / "services/router/store.py").read_text()
    spelled = re.findall(r"'(queued|running|paused|succeeded|failed|stopped)'", source)
    assert not spelled, f"states spelled in SQL: {spelled}; bind JobState values"
