"""``busctl job eval``: score the current weights of a running job on its provider's private test
split, while it trains.

The router pushes an ``eval`` command; the trainer copies the weights between two batches (the only
time training waits), the provider scores the copy, and the trainer acknowledges the command with
the result. So this one request waits for the evaluation: up to the router's
``EVAL_ACK_TIMEOUT_S``, never resent (a resend would start a second evaluation). The job's
``evaluator`` (``busctl submit --evaluator``), when it names one, scores the copy; its extra metrics
are printed after the loss.
"""

from __future__ import annotations

import typer

from libbus.config import Settings
from libbus.jobs.commands import JobCommand
from libbus.jobs.state import JobState
from libbus.wire.messages import ControlJob, Ok
from services.router.jobs import EVAL_ACK_TIMEOUT_S

from . import scores
from .connection import admin_client
from .output import echo, fail, print_json

__all__ = ["describe", "evaluate_job"]

#: Beyond the router's own wait: its TIMEOUT reply, not ours, tells the user what happened.
REPLY_SLACK_S = 15.0


def evaluate_job(settings: Settings, job: str, *, json: bool = False) -> None:
    """Ask for the evaluation and print it; exits 1 when the trainer could not evaluate."""
    with admin_client(settings) as client:
        client.hello()  # a router that is down is reported within seconds, not after the long wait
        reply = client.request(
            ControlJob(job=job, command=JobCommand.EVAL), timeout_s=EVAL_ACK_TIMEOUT_S + REPLY_SLACK_S, retries=0
        )
    if not isinstance(reply, Ok):
        fail(f"the router answered eval with {reply.type}")
    detail = reply.detail
    if json:
        print_json(detail)
    else:
        echo(describe(job, detail))
    if detail.get("error"):
        raise typer.Exit(1)


def describe(job: str, d: dict) -> str:
    """One human line (two when it failed) for an ``eval`` acknowledgement's detail."""
    if d.get("error"):
        return f"{job}: evaluation at step {d.get('step', '?')} failed: {d['error']}"
    paused = " (the job is paused)" if d.get("state") == JobState.PAUSED else ""
    metrics = "".join(f", {k} {scores.score(d, k)}" for k in (d.get("test_metrics") or {}))
    note = scores.noise_note(d)
    return (
        f"{job}: step {d['step']} (epoch {d['epoch']}) scored on {d['provider']}: "
        f"test accuracy {scores.score(d, 'accuracy')}, loss {scores.score(d, 'loss')}{metrics} "
        f"on {d['test_n']} private samples\n"
        + (f"{note}\n" if note else "")
        + f"training paused {d['copy_ms']:.1f} ms for the copy of the weights; the evaluation took "
        f"{d['eval_s']:.1f} s{paused}"
    )
