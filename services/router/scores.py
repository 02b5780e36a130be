"""A job's test score comes from the provider that computed it, never from a trainer's word.

A trainer's ``PushResult`` may say anything: a token that can take jobs could report test accuracy
1.0 without any evaluation. So the router drops the ``test_*`` numbers of every result, and a
provider reports each evaluation it released for a job (``EvaluationReport``, over its own link,
before it replies to the trainer). When the job's trainer then pushes a result that says it was
scored, the router records the score the provider reported for that trainer and job — the last one,
which is the final evaluation's — and with it the provider's name, the sha256 of the weights scored and
the privacy parameter the scores were released at (``test_epsilon``, 0 when exact).

A score is recorded only for the weights the router keeps for the job: the final model its trainer sent
(for an evaluation task, the model it was handed). A job's code runs in its attempt and could have other
weights scored than those it hands back (swap the file between the save and the scoring, or send other
bytes); a report whose sha256 is not the kept model's is not recorded, and ``test_unrecorded`` says why.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict

from libbus.jobs.state import JobState
from libbus.wire.messages import EvaluationReport, Ok

from .store import JobRow, stored_spec

__all__ = ["TEST_KEYS", "TestScores"]

log = logging.getLogger(__name__)

#: Result keys only a provider's report may set.
TEST_KEYS = (
    "test_loss",
    "test_accuracy",
    "test_n",
    "test_perplexity",
    "test_metrics",
    "test_provider",
    "test_sha256",
    "test_epsilon",
    "test_unrecorded",
)
#: Reports kept for jobs whose result has not arrived yet (oldest forgotten first).
MAX_PENDING = 4096


class TestScores:
    """Providers' reports, held until their job's result arrives."""

    def __init__(self) -> None:
        #: job -> (trainer subject, provider name, report), the latest per job.
        self._pending: OrderedDict[str, tuple[str, str, EvaluationReport]] = OrderedDict()

    def on_report(self, provider: str, msg: EvaluationReport, job: JobRow | None) -> Ok:
        """Keep ``msg`` (from ``provider``) if ``job`` (the stored row, None if unknown) runs on the
        subject that asked for the evaluation, on the dataset scored; else say why it was not kept."""
        if job is None or not JobState(job["state"]).holding or job["trainer"] != msg.subject:
            return Ok(detail={"recorded": False, "why": f"job {msg.job} is not running on {msg.subject!r}"})
        if stored_spec(job["spec"]).dataset != msg.dataset or msg.split != "test":
            return Ok(detail={"recorded": False, "why": f"job {msg.job} is not scored on {msg.dataset}/{msg.split}"})
        self._pending.pop(msg.job, None)
        self._pending[msg.job] = (msg.subject, provider, msg)
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
        return Ok(detail={"recorded": True})

    def result(self, job: str, trainer: str, result: dict, weights: str) -> dict:
        """``result`` with its ``test_*`` keys replaced by what a provider reported for ``job`` from
        ``trainer`` (when the trainer says it was scored) of the weights whose sha256 is ``weights``
        (the model the router keeps for the job), or dropped (``test_unrecorded`` then says why)."""
        claimed = "test_accuracy" in result or "test_loss" in result
        kept = {k: v for k, v in result.items() if k not in TEST_KEYS}
        held = self._pending.pop(job, None)
        if not claimed:
            return kept
        if held is None or held[0] != trainer:
            log.warning("job %s: %s claims a test score no provider reported; not recorded", job, trainer)
            return kept
        _, provider, report = held
        if report.sha256 != weights:
            why = (
                f"the weights scored (sha256 {report.sha256[:12]}…) are not the model kept for the job "
                f"(sha256 {weights[:12] or 'none'}…)"
            )
            log.warning("job %s: test score not recorded: %s", job, why)
            kept["test_unrecorded"] = why
            return kept
        kept.update(
            test_loss=report.loss,
            test_accuracy=report.accuracy,
            test_n=report.n,
            test_provider=provider,
            test_sha256=report.sha256,
        )
        if "val_perplexity" in result:  # a token model: perplexity is how they are compared
            kept["test_perplexity"] = math.exp(min(report.loss, 50.0))
        if report.metrics:
            kept["test_metrics"] = report.metrics
        if report.epsilon is not None:  # the privacy noise's parameter: busctl shows each score's margin
            kept["test_epsilon"] = report.epsilon
        return kept
