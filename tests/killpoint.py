"""Run ``busctl`` with a SIGKILL planted at one exact point of a trainer's work (a test helper).

``python -m tests.killpoint POINT N -- start trainer --name t1`` kills this very process with
SIGKILL the ``N``-th time it reaches ``POINT``:

- ``checkpoint`` (or ``entry_checkpoint``): right after a checkpoint's record reached the router;
- ``validation``: at the start of an epoch's validation (services.models.evaluate);
- ``test_eval``: at the start of the provider-side test evaluation;
- ``push_before``: just before the result is sent; ``push_after``: right after the router stored it.

The trainer dies; its attempt's process (where the job trains) dies with it. The points inside an
attempt (validation, test_eval) are planted in the fork server attempts start from.

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
    """A factory that calls ``sys.exit``: its job fails, its trainer lives on."""
    sys.exit(3)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


#: Where a kill point's trainer says so to its attempts' fork server (which imports this module).
ENV = "BATCHBUS_TEST_KILLPOINT"
#: Points inside an attempt's process (the built-in loop runs there): planted in the fork server.
IN_ATTEMPT = ("validation", "test_eval")


def plant(point: str, nth: int) -> None:
    from services.trainer.service import app
    from services.trainer.service import attempt_run as attempt

    count = {"n": 0}

    def hit() -> bool:
        count["n"] += 1
        return count["n"] == nth

    if point in ("checkpoint", "entry_checkpoint"):
        from libbus.wire.messages import Checkpointed

        original_deliver = attempt.AttemptRun._deliver

        def deliver(self, msg, timeout_s):
            reply = original_deliver(self, msg, timeout_s)
            if isinstance(msg, Checkpointed) and hit():
                _die()
            return reply

        attempt.AttemptRun._deliver = deliver
    elif point in IN_ATTEMPT:  # each attempt is forked from a server that imports this module first
        os.environ[ENV] = f"{point}:{nth}:{os.getpid()}"
        attempt.PRELOAD.append("tests.killpoint")
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


def plant_in_attempt(point: str, nth: int, trainer: int) -> None:
    """In the fork server of ``trainer``'s attempts: its attempt kills the trainer (and so itself,
    which dies with it) the ``nth`` time it reaches ``point``, as a trainer killed there would be."""
    from services.trainer.attempt import builtin, child

    count = {"n": 0}

    def die_here() -> None:
        count["n"] += 1
        if count["n"] == nth:
            os.kill(trainer, signal.SIGKILL)
            _die()

    if point == "validation":
        evaluate = builtin.evaluate

        def validation(*args, **kw):
            die_here()
            return evaluate(*args, **kw)

        builtin.evaluate = validation
    elif point == "test_eval":
        scored = child._scored

        def test_eval(*args, **kw):
            die_here()
            return scored(*args, **kw)

        child._scored = test_eval


_planted = os.environ.get(ENV, "")
if _planted and __name__ != "__main__":
    _point, _nth, _trainer = _planted.split(":")
    plant_in_attempt(_point, int(_nth), int(_trainer))


if __name__ == "__main__":
    point, nth, sep, *rest = sys.argv[1:]
    if sep != "--":
        raise SystemExit("usage: python -m tests.killpoint POINT N -- BUSCTL ARGS...")
    plant(point, int(nth))
    from cli.app import main

    sys.argv = ["busctl", *rest]
    main()
