"""The trainer's command handling (services/trainer/attempt/control.py) against the one list of job commands
(libbus/jobs/commands.py): every command the router accepts from an admin is applied and acknowledged,
each ``seq`` once, and a name the trainer does not know is logged and ignored, never half-applied."""

from __future__ import annotations

import logging
import queue
import threading

import pytest

from libbus.errors import BadRequest
from libbus.jobs.commands import ADMIN_COMMANDS, JobCommand
from libbus.jobs.state import JobState
from libbus.wire.messages import Command, CommandAck
from services.trainer.attempt.control import Controls, Stopped


class _Outbox:
    """What the trainer's Reporter offers Controls: ``put`` (acknowledgements go out in order),
    ``lost`` and ``stop_requested``. Kept in a list here: the acknowledgements are what is checked."""

    def __init__(self):
        self.sent: list = []
        self.lost = None
        self.stop_requested = threading.Event()

    def put(self, msg) -> None:
        self.sent.append(msg)


def _controls(outbox: _Outbox, commands: queue.Queue) -> Controls:
    def set_hyper(args: dict) -> dict:
        if "lr" not in args:
            raise BadRequest("only lr here")
        return {"lr": args["lr"]}

    return Controls(
        "j1",
        commands,
        outbox,  # type: ignore[arg-type]  # the Reporter's face Controls uses
        checkpoint=lambda: {"step": 3, "path": "/ckpt"},
        set_hyper=set_hyper,
        report=lambda: None,
        before_stop=lambda: None,
        evaluate=lambda done: done({"test_accuracy": 0.5}),
        adopt=lambda args: {"step": 2, "from": args["from"]},
        model=lambda: ({"sha256": "00", "step": 3}, b"weights"),
    )


ARGS = {JobCommand.SET: {"lr": 0.1}, JobCommand.ADOPT: {"checkpoint": {"path": "/c"}, "from": "j0"}}


@pytest.mark.parametrize("command", [c for c in ADMIN_COMMANDS if c not in (JobCommand.STOP, JobCommand.PAUSE)])
def test_every_admin_command_is_applied_and_acknowledged_once(command):
    outbox, commands = _Outbox(), queue.Queue()
    controls = _controls(outbox, commands)
    cmd = Command(job="j1", command=command.value, args=ARGS.get(command, {}), seq=7)
    commands.put(cmd)
    commands.put(cmd)  # repeated in a progress reply before the ack arrived: applied once
    controls.check()
    acks = [m for m in outbox.sent if isinstance(m, CommandAck)]
    assert len(acks) == 1 and acks[0].command == command and acks[0].seq == 7
    assert acks[0].state == JobState.RUNNING and "error" not in acks[0].detail
    if command is JobCommand.MODEL:
        assert acks[0].frames == [b"weights"]


def test_stop_is_acknowledged_then_ends_the_task_and_shutdown_hands_it_back():
    outbox, commands = _Outbox(), queue.Queue()
    controls = _controls(outbox, commands)
    commands.put(Command(job="j1", command=JobCommand.STOP.value, seq=1))
    with pytest.raises(Stopped) as stopped:
        controls.check()
    assert not stopped.value.handback and [m.state for m in outbox.sent] == ["stopping"]
    commands.put(Command(job="j1", command=JobCommand.SHUTDOWN.value))
    with pytest.raises(Stopped) as handed:
        controls.check()
    assert handed.value.handback and len(outbox.sent) == 1  # the trainer's own: no ack to anyone


def test_pause_holds_the_task_until_resume():
    outbox, commands = _Outbox(), queue.Queue()
    controls = _controls(outbox, commands)
    commands.put(Command(job="j1", command=JobCommand.PAUSE.value, seq=1))
    commands.put(Command(job="j1", command=JobCommand.CHECKPOINT.value, seq=2))  # applies while paused
    commands.put(Command(job="j1", command=JobCommand.RESUME.value, seq=3))
    controls.check()
    assert [(m.command, m.state) for m in outbox.sent] == [
        ("pause", "paused"),
        ("checkpoint", "paused"),
        ("resume", "running"),
    ]
    assert controls.state is JobState.RUNNING


def test_a_command_the_trainer_does_not_know_is_logged_and_ignored(caplog):
    outbox, commands = _Outbox(), queue.Queue()
    controls = _controls(outbox, commands)
    commands.put(Command(job="j1", command="explode", seq=1))
    with caplog.at_level(logging.WARNING, logger="services.trainer.attempt.control"):
        controls.check()
    assert outbox.sent == [] and "unknown command 'explode' ignored" in caplog.text
