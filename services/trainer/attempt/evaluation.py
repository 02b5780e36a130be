"""``busctl job eval``: score the weights of a running task on its provider's private test split.

Training pauses only for the copy of the weights (a CPU clone of the state dict, taken between
batches); serialising them to safetensors, the ``Evaluate`` round trip and the wait for the provider
run on a thread of their own while training goes on. The result (test loss, accuracy, n, the step
and epoch the weights are from, the copy time) goes to ``done``, which acknowledges the command.
One evaluation at a time per task: a second ``eval`` while one runs is refused, not queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import torch
from safetensors.torch import save as save_safetensors

from libbus.connect.client import Client, Identity
from libbus.errors import BusError
from libbus.security.curve import curve_key_of
from libbus.wire.messages import Evaluate, EvaluateModel

__all__ = ["LiveEvaluations", "snapshot"]

log = logging.getLogger(__name__)


def snapshot(weights: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """A CPU copy of a model's state dict ``weights`` (never a view: training goes on changing
    them) and how long the copy took, in milliseconds."""
    started = time.perf_counter()
    state = {str(k): v.detach().to("cpu", copy=True) for k, v in weights.items()}
    return state, 1000 * (time.perf_counter() - started)


class LiveEvaluations:
    """Runs one task's evaluations of copied weights on its provider, one at a time, off the
    training thread.

    Args:
        job: the task's job.
        identity: the trainer's identity (its token entitles it to its job's dataset).
        timeout_s: how long one evaluation may take on the provider.
    """

    def __init__(self, job: str, identity: Identity, timeout_s: float):
        self.job = job
        self.identity = identity
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._running_step: int | None = None

    def start(
        self,
        weights: Mapping[str, torch.Tensor],
        model_spec: EvaluateModel,
        dataset: str,
        provider: dict,
        *,
        step: int,
        epoch: int,
        done: Callable[[dict], None],
    ) -> None:
        """Copy ``weights`` (a state dict) now and score them in the background; ``done(detail)`` gets the
        result, or ``{"error": ...}``, with the ``step`` and (1-based) ``epoch`` the weights are from.
        A second call while an evaluation runs calls ``done`` at once with an error."""
        if self.running:
            done(
                {
                    "error": f"an evaluation of step {self._running_step} is still running; ask again when it is done",
                    "step": step,
                }
            )
            return
        state, copy_ms = snapshot(weights)
        where = {"step": step, "epoch": epoch, "copy_ms": round(copy_ms, 3), "provider": provider["name"]}
        self._running_step = step
        self._thread = threading.Thread(
            target=self._run,
            name=f"eval-{self.job}",
            daemon=True,
            args=(state, model_spec, dataset, provider, where, done),
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        """Wait (bounded) for a running evaluation, so its acknowledgement precedes the task's result."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(
        self,
        state: dict[str, torch.Tensor],
        model_spec: EvaluateModel,
        dataset: str,
        provider: dict,
        where: dict,
        done: Callable[[dict], None],
    ) -> None:
        started = time.monotonic()
        try:
            blob = save_safetensors({k: v.contiguous() for k, v in state.items()})
            del state
            msg = Evaluate(dataset=dataset, job=self.job, model=dict(model_spec), frames=[blob])
            with Client(
                provider["endpoint"],
                self.identity,
                timeout_s=self.timeout_s,
                retries=0,
                server_key=curve_key_of(provider),
            ) as client:
                evaluation = client.request(msg)
        except BusError as err:
            log.warning("job %s: evaluation of step %d failed: %s", self.job, where["step"], err)
            done({**where, "error": f"{type(err).__name__}: {err}"})
            return
        except Exception as err:  # whatever went wrong, the admin waiting hears of it
            log.exception("job %s: evaluation of step %d failed", self.job, where["step"])
            done({**where, "error": f"{type(err).__name__}: {err}"})
            return
        eval_s = time.monotonic() - started
        log.info(
            "job %s: step %d scored on %s: test accuracy %.4f on %d samples (%.1f s)",
            self.job,
            where["step"],
            provider["name"],
            evaluation.accuracy,
            evaluation.n,
            eval_s,
        )
        done(
            {
                **where,
                "test_loss": evaluation.loss,
                "test_accuracy": evaluation.accuracy,
                "test_n": evaluation.n,
                **({"test_metrics": evaluation.metrics} if evaluation.metrics else {}),
                # the privacy noise's parameter (busctl prints each score's margin from it)
                **({"test_epsilon": evaluation.epsilon} if evaluation.epsilon is not None else {}),
                "eval_s": round(eval_s, 3),
            }
        )
