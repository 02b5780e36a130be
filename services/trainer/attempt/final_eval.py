"""The final, provider-side test evaluation of a task: a wait that stays responsive.

Scoring a whole test split may take minutes, so the reply gets :data:`EVALUATE_TIMEOUT_S`; but the
wait must not deafen the trainer. Every :data:`CHECK_S` it applies commands (a SIGTERM's
``shutdown`` hands the job back at once: its epoch-end checkpoint resumes it exactly, at this very
evaluation) and feeds the watchdog; and it asks the router whether the provider is still online:
one gone for ``provider_wait_s`` fails the attempt as retryable (``Unavailable``), and the next
attempt scores on a live replica, instead of waiting out the whole timeout. A provider restarted
meanwhile (the request died with its process) gets the request again at once.

A provider limits evaluations (its queue, and a rate per job and per token subject: the test split
must not become a training signal). A job's one final evaluation that meets the limit waits and asks
again, within the same :data:`EVALUATE_TIMEOUT_S`: a trainer that finishes many short jobs a minute
must not fail them for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import cast

from safetensors.torch import save as save_safetensors
from torch import nn

from libbus.config import Settings
from libbus.connect.client import Client, Identity, pick_provider
from libbus.connect.link import Link
from libbus.errors import AuthRequired, BusError, NotFound, PeerTimeout, RateLimited, Unavailable
from libbus.jobs.spec import JobSpec
from libbus.security.curve import curve_key_of
from libbus.wire.messages import DatasetInfoRequest, Error, Evaluate, EvaluateModel, Evaluation, Resolve

__all__ = ["CHECK_S", "EVALUATE_TIMEOUT_S", "model_spec", "score_final", "score_on_provider", "score_saved"]

log = logging.getLogger(__name__)

#: An evaluation scores the whole test split on the provider: give it longer than a batch.
EVALUATE_TIMEOUT_S = 300.0
#: How often the wait applies commands and feeds the watchdog.
CHECK_S = 0.5
#: How often it asks the router whether the provider is still online.
PROVIDER_CHECK_S = 2.0
#: How long a final evaluation the provider rate-limited waits before it asks again.
RATE_LIMITED_WAIT_S = 2.0


def model_spec(spec: JobSpec) -> EvaluateModel:
    """What ``Evaluate.model`` says for ``spec``: its evaluator (an operator-allowed
    ``module:function`` on the provider) with ``evaluator_kwargs``, or its built-in model."""
    if spec.evaluator:
        return {"evaluator": spec.evaluator, "kwargs": spec.evaluator_kwargs}
    return {"name": spec.model, "kwargs": spec.model_kwargs}


class _Restarted(Exception):
    """The provider scoring the weights restarted or is stopping (it forgot the session, the router
    lists it at another endpoint, or it answered UNAVAILABLE): the request is lost there and must be
    sent again, to ``provider`` (``{}``: wherever the router lists it next)."""

    def __init__(self, provider: dict, why: str):
        super().__init__(why)
        self.provider = provider


def score_on_provider(
    msg: Evaluate,
    provider: dict,
    identity: Identity,
    *,
    link,
    request_timeout_s: float,
    provider_wait_s: float,
    check: Callable[[], None],
    timeout_s: float = EVALUATE_TIMEOUT_S,
) -> Evaluation:
    """Send ``msg`` to ``provider`` and wait for its :class:`Evaluation`, calling ``check`` (which
    may raise to end the wait) every :data:`CHECK_S`. A provider that stops or restarts meanwhile (it
    answers UNAVAILABLE, or, checked every :data:`PROVIDER_CHECK_S`, no longer knows our session or
    is listed at another endpoint) gets the request again once the router lists it, within the same
    ``timeout_s``.

    Raises the provider's typed error, :class:`PeerTimeout` after ``timeout_s``, and
    :class:`Unavailable` when the router has not listed the provider for ``provider_wait_s``.
    """
    deadline = time.monotonic() + timeout_s
    missing_since: float | None = None
    while True:
        try:
            return _try_once(msg, provider, identity, link, request_timeout_s, provider_wait_s, check, deadline)
        except _Restarted as restarted:
            log.warning("job %s: %s; sending the evaluation again", msg.job or "-", restarted)
            provider = restarted.provider or provider
        except PeerTimeout:
            if time.monotonic() >= deadline:
                raise
            log.info("job %s: provider %s does not answer; looking for it again", msg.job or "-", provider["name"])
        msg.id = 0  # a fresh id on the next session
        _wait(CHECK_S, check)
        listed = _listed(link, msg.dataset, provider["name"], request_timeout_s)
        if listed is None:  # gone from the router's list: wait a while for it (or fail the attempt)
            missing_since = missing_since or time.monotonic()
            if time.monotonic() - missing_since >= provider_wait_s:
                raise Unavailable(f"provider {provider['name']} went away during the test evaluation")
        else:
            missing_since = None
            provider = listed or provider


def _try_once(
    msg: Evaluate,
    provider: dict,
    identity: Identity,
    link,
    request_timeout_s: float,
    provider_wait_s: float,
    check: Callable[[], None],
    deadline: float,
) -> Evaluation:
    with Client(
        provider["endpoint"], identity, timeout_s=request_timeout_s, retries=0, server_key=curve_key_of(provider)
    ) as client:
        client.hello(request_timeout_s)
        request_id = client.send(msg)
        probe_id = 0  # an outstanding DatasetInfoRequest: is our session still known there?
        next_probe = time.monotonic() + PROVIDER_CHECK_S
        missing_since: float | None = None
        while True:
            reply = client.recv(CHECK_S)
            if reply is not None and reply.id == request_id:
                if isinstance(reply, Error) and reply.code == Unavailable.code:  # it is stopping: "ask again"
                    raise _Restarted({}, f"provider {provider['name']} answered: {reply.message}")
                return cast(Evaluation, client.check(reply))  # Evaluate's declared reply, as request() trusts it
            if reply is not None and reply.id == probe_id:
                probe_id = 0
                if isinstance(reply, Error) and reply.code == AuthRequired.code:
                    raise _Restarted(provider, f"provider {provider['name']} restarted and lost the evaluation")
            now = time.monotonic()
            if now >= deadline:
                raise PeerTimeout(f"provider {provider['name']} did not score the test split in time")
            check()
            if now < next_probe:
                continue
            next_probe = now + PROVIDER_CHECK_S
            listed = _listed(link, msg.dataset, provider["name"], request_timeout_s)
            if listed is None:
                missing_since = missing_since or now
                if now - missing_since >= provider_wait_s:
                    raise Unavailable(f"provider {provider['name']} went away during the test evaluation")
                continue
            missing_since = None
            if listed.get("endpoint", provider["endpoint"]) != provider["endpoint"]:
                raise _Restarted(listed, f"provider {provider['name']} restarted at {listed['endpoint']}")
            if not probe_id:
                probe_id = client.send(DatasetInfoRequest(dataset=msg.dataset))


def score_saved(
    blob: bytes,
    job: str,
    spec: JobSpec,
    provider: dict,
    *,
    link: Link,
    identity: Identity,
    settings: Settings,
    check: Callable[[], None],
) -> Evaluation:
    """Saved weights (``blob``: safetensors bytes, e.g. an entrypoint job's ``job.save_model``) scored
    on the dataset's private test split by a live replica of its provider (``provider``, the one
    read from, when the router does not answer), by ``spec.evaluator`` when set, else by the built-in
    ``spec.model``; calls ``check`` while it waits (:func:`score_on_provider`). The provider reports
    the score to the router itself; the trainer's copy is for its logs and result.

    A provider that rate-limits the evaluation is asked again, within :data:`EVALUATE_TIMEOUT_S`.
    Raises the provider's typed error, :class:`PeerTimeout` or :class:`Unavailable`.
    """
    try:  # a live replica: the provider read from at the start may have gone since
        live = link.request(Resolve(dataset=spec.dataset), timeout_s=settings.request_timeout_s)
        provider = pick_provider(live.providers, identity.host_id)
    except BusError as err:
        log.warning("job %s: evaluating on %s (the router did not answer: %s)", job, provider["name"], err)
    msg = Evaluate(dataset=spec.dataset, job=job, model=dict(model_spec(spec)), frames=[blob])
    deadline = time.monotonic() + EVALUATE_TIMEOUT_S
    while True:
        try:
            return score_on_provider(
                msg,
                provider,
                identity,
                link=link,
                request_timeout_s=settings.request_timeout_s,
                provider_wait_s=settings.provider_wait_s,
                check=check,
                timeout_s=max(1.0, deadline - time.monotonic()),
            )
        except RateLimited as err:
            if time.monotonic() + RATE_LIMITED_WAIT_S >= deadline:
                raise Unavailable(f"provider {provider['name']} kept refusing the test evaluation: {err}") from err
            log.info("job %s: %s; asking again in %.0f s", job, err, RATE_LIMITED_WAIT_S)
            _wait(RATE_LIMITED_WAIT_S, check)
            msg.id = 0


def score_final(
    model: nn.Module,
    job: str,
    spec: JobSpec,
    provider: dict,
    *,
    link: Link,
    identity: Identity,
    settings: Settings,
    check: Callable[[], None],
) -> Evaluation:
    """A task's final test evaluation: ``model``'s weights, as safetensors, scored by
    :func:`score_saved` (the job's evaluator when it names one)."""
    blob = save_safetensors({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})
    return score_saved(blob, job, spec, provider, link=link, identity=identity, settings=settings, check=check)


def _wait(seconds: float, check: Callable[[], None]) -> None:
    """Sleep ``seconds``, calling ``check`` (commands, the watchdog) every :data:`CHECK_S`."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        time.sleep(min(CHECK_S, left))
        check()


def _listed(link, dataset: str, name: str, timeout_s: float) -> dict | None:
    """The router's entry for provider ``name`` of ``dataset``: None when it lists no such provider,
    ``{}`` when it cannot say (the router is away: the provider may well be there)."""
    try:
        providers = link.request(Resolve(dataset=dataset), timeout_s=timeout_s).providers
    except NotFound:
        return None
    except BusError as err:
        log.debug("cannot ask the router about provider %s: %s", name, err)
        return {}
    return next((p for p in providers if p["name"] == name), None)
