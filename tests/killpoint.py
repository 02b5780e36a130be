"""Run ``busctl`` with a SIGKILL planted at one exact point of a trainer's work (a test helper).

``python -m tests.killpoint POINT N -- start trainer --name t1`` kills this very process with
SIGKILL the ``N``-th time it reaches ``POINT``:

- ``checkpoint``: right after a checkpoint was written and its record delivered to the router;
- ``validation``: at the start of an epoch's validation (services.models.evaluate);
- ``test_eval``: at the start of the provider-side test evaluation;
- ``push_before``: just before the result is sent; ``push_after``: right after the router stored it;
- ``entry_checkpoint``: right after an entrypoint attempt's checkpoint record reached the router
  (the trainer dies; its attempt's process dies with it).

The process dies as a real trainer killed there would; nothing else is changed. Only the tests use it.
"""

from __future__ import annotations

import os
import signal
import sys


def raising_model(info: dict, **kwargs):
    """A user's ``module:factory`` that raises: its job must fail, its trainer live on."""
    raise ValueError("this factory always fails")


def exiting_model(info: dict, **kwargs):
    """A factory that calls ``sys.exit`` (issue 30 #7): its job fails, its trainer lives on."""
    sys.exit(3)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def plant(point: str, nth: int) -> None:
    from services.trainer import app, run

    count = {"n": 0}

    def hit() -> bool:
        count["n"] += 1
        return count["n"] == nth

    if point == "checkpoint":
        original = run.TaskRun._checkpoint

        def checkpoint(self):
            record = original(self)
            if hit():
                self.reporter.flush(5.0)
                _die()
            return record

        run.TaskRun._checkpoint = checkpoint
    elif point == "validation":
        evaluate = run.evaluate

        def validation(*args, **kw):
            if hit():
                _die()
            return evaluate(*args, **kw)

        run.evaluate = validation
    elif point == "test_eval":
        original_eval = run.TaskRun._evaluate

        def test_eval(self, *args, **kw):
            if hit():
                _die()
            return original_eval(self, *args, **kw)

        run.TaskRun._evaluate = test_eval
    elif point == "entry_checkpoint":
        from libbus.wire.messages import Checkpointed
        from services.trainer import attempt

        original_deliver = attempt.EntrypointRun._deliver

        def deliver(self, msg, timeout_s):
            reply = original_deliver(self, msg, timeout_s)
            if isinstance(msg, Checkpointed) and hit():
                _die()
            return reply

        attempt.EntrypointRun._deliver = deliver
    elif point in ("push_before", "push_after"):
        original_push = app.TrainerService._push_result

        def push(self, msg, stop):
            if point == "push_before" and hit():
                _die()
            original_push(self, msg, stop)
            if point == "push_after" and hit():
                _die()

        app.TrainerService._push_result = push
    else:
        raise SystemExit(f"unknown kill point {point!r}")


if __name__ == "__main__":
    point, nth, sep, *rest = sys.argv[1:]
    if sep != "--":
        raise SystemExit("usage: python -m tests.killpoint POINT N -- BUSCTL ARGS...")
    plant(point, int(nth))
    from cli.app import main

    sys.argv = ["busctl", *rest]
    main()
