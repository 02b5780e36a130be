"""The job lifecycle as one state machine (libbus/jobs/state.py): the table, the guard in the job
store (a real SQLite file), refusals counted, and no state spelled in the store's SQL."""

from __future__ import annotations

import re

import pytest

from libbus.jobs.spec import JOB_STATES, TERMINAL_STATES, JobSpec
from libbus.jobs.state import REFUSED, TRANSITIONS, IllegalTransition, JobState, check_transition
from services.router.store import JobStore
from tests.support import REPO


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


def test_job_states_and_commands_are_spelled_only_where_they_are_defined():
    """A state or command is a JobState / JobCommand everywhere but its definition (and the wire's
    docs and messages): a name one side spells differently would silently match nothing."""
    states = r"queued|running|paused|succeeded|failed|stopped"
    commands = r"stop|pause|resume|checkpoint|set|eval|adopt|model|shutdown"
    # a state compared, returned, stored or bound; a command sent, compared or dispatched
    uses = [
        re.compile(rf"(==|!=|\bin\b \(|return |state=|\[\"state\"\] = |, )\s*[\"']({states})[\"']"),
        re.compile(rf"(command ?==|command=|control\([^)]*, )\s*[\"']({commands})[\"']"),
        re.compile(rf"^(COMMANDS|[A-Z_]*STATES) = \([\"']({states}|{commands})[\"']", re.M),
    ]
    # (a pipeline stage's commands, StageControl's "get"/"set"/"reset", are another vocabulary)
    defined = {"libbus/jobs/state.py", "libbus/jobs/commands.py", "services/provider/sources/pipeline/stages.py"}
    found = []
    for root in ("services", "cli", "benchmarks", "libbus"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in defined:
                continue
            text = path.read_text()
            found += [f"{rel}: {m.group(0).strip()}" for pattern in uses for m in pattern.finditer(text)]
    assert not found, "spelled instead of JobState / JobCommand:\n" + "\n".join(found)


def test_every_command_an_admin_may_send_is_one_the_cli_or_the_router_sends():
    from libbus.jobs.commands import ADMIN_COMMANDS, JobCommand

    assert JobCommand.SHUTDOWN not in ADMIN_COMMANDS  # the trainer's own: never from the wire
    assert {c for c in ADMIN_COMMANDS if c.takes_args} == {JobCommand.SET, JobCommand.ADOPT}
    assert str(JobCommand.STOP) == "stop" and JobCommand("eval").slow


def test_a_job_handed_to_a_new_trainer_shows_no_progress_of_the_attempt_before(tmp_path):
    """busctl job show, top and job watch read the job row's last report: after a lost lease, the next
    attempt (alone, or a gang) must not show the last one's step and its "paused" until it reports."""
    store = JobStore(str(tmp_path / "router.db"))
    job = store.submit(JobSpec.from_dict({"dataset": "mnist"}))
    store.claim("t1", 10)
    store.set_progress(job, {"step": 15, "state": "paused"}, 10)
    assert store.get(job)["progress"] == {"step": 15, "state": "paused"}
    store.release(job, "lease lapsed", lost=True)
    row = store.claim("t2", 10)
    assert row is not None and row["trainer"] == "t2" and row["attempts"] == 2 and row["progress"] is None
    store.set_progress(job, {"step": 3}, 10)
    assert store.get(job)["progress"] == {"step": 3}
    # the last report is kept in the history all the same
    assert [p["step"] for p in store.progress_history(job)] == [15, 3]
    store.release(job, "lease lapsed", lost=True)
    store.form_gang(job, ["t3", "t4"], 10)
    assert store.get(job)["progress"] is None
