"""Scoring a model on a split that never leaves this node. Weights are loaded safely: safetensors
only, never unpickled.

A model is scored by a built-in (``{"name": "mlp", "kwargs": {...}}``: the model is built here and
loaded with the weights) or by an evaluator the provider's operator installed
(``{"evaluator": "pkg.mod:function", "kwargs": {...}}``: its module must be allowed by the provider's
``evaluator_modules`` setting, checked before anything is imported). An evaluator is called as::

    function(state_dict: dict[str, torch.Tensor], batches: Iterable, info: dict, **kwargs) -> Mapping[str, float]

``batches`` yields ``(x, y)`` tensor pairs on an x/y dataset, or ``{field: tensor}`` dicts on a
named-field one; ``info`` is the dataset's DatasetInfo plus ``split``, ``num_samples`` and
``loss_clip``. It returns at least ``loss`` (mean per-sample loss, each sample's clipped at
``loss_clip``) and ``accuracy`` (in [0, 1]); at most :data:`MAX_EXTRA_METRICS` more, each a mean over
samples in [0, 1]. What is released of them is decided by :mod:`.score_release`.

Every evaluation runs under a :class:`Bound`: it ends (between two chunks of the split) when its
deadline passes, its caller goes away, or the provider stops.
"""

from __future__ import annotations

import inspect
import math
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from torch import nn

from libbus.constants import EVAL_LOSS_CLIP, MAX_BATCH_BYTES
from libbus.errors import BadRequest, Forbidden, Internal, Timeout, Unavailable
from services.models import MODELS, build_model, dataset_kind, predictions, xy
from services.usercode import import_allowed

from .evalgate import Bound
from .sources import Source
from .sources.base import SourceInfo

__all__ = ["EVAL_CHUNK", "MAX_EXTRA_METRICS", "Prepared", "Scores", "evaluate_weights", "prepare", "score"]

EVAL_CHUNK = 512
#: Bound on the logits one evaluation chunk may produce (float32 elements: 128 MiB). A token sample
#: yields a row of vocabulary logits per position, so long sequences over a big vocabulary need far
#: smaller chunks than images do.
EVAL_LOGITS_BUDGET = 1 << 25
#: Metrics an evaluator may return besides ``loss`` and ``accuracy`` (each one released costs
#: privacy budget: docs/security.md).
MAX_EXTRA_METRICS = 4


@dataclass
class Scores:
    """What a scoring found, before release: mean loss, accuracy, samples read, extra metrics."""

    loss: float
    accuracy: float
    n: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Prepared:
    """A checked evaluation, ready to score: a built model or an evaluator with its state dict."""

    model: nn.Module | None
    evaluator: Callable | None
    state: dict[str, torch.Tensor]
    kwargs: dict


def prepare(model_spec: dict, blob: bytes, info: SourceInfo, evaluator_modules: Collection[str]) -> Prepared:
    """Load safetensors ``blob`` and make what scores it (:func:`.evalgate.check_model_spec` passed).

    A built-in model's shape is first built on the meta device, which allocates nothing, and must fit
    in the weights that came with it; then it is built and loaded. Raises :class:`BadRequest`.
    """
    kwargs = model_spec.get("kwargs", {})
    if "name" in model_spec and model_spec["name"] not in MODELS:
        # module:factory would import and run code named by a remote peer: not on this node.
        raise Forbidden(
            f"this provider builds built-in models only ({', '.join(MODELS)}), not {model_spec['name']!r}; "
            "code its operator installed scores other models: name one of its evaluator_modules (model.evaluator)"
        )
    try:
        state = load_safetensors(blob)
    except Exception as err:
        raise BadRequest(f"weights are not a valid safetensors blob: {err}") from err
    if "evaluator" in model_spec:
        ref = model_spec["evaluator"]
        found = import_allowed(ref, evaluator_modules, f"evaluator {ref!r}", setting="evaluator_modules")
        if not inspect.isfunction(found):
            raise BadRequest(f"evaluator {ref!r} is not a function")
        return Prepared(None, found, state, kwargs)
    name = model_spec["name"]
    # The model's size comes from the peer's kwargs (`hidden = 10**7` is 68 bytes on the wire): it
    # must fit in the weights that came with it (load_state_dict needs every tensor).
    with torch.device("meta"):
        shape = build_model(name, info, kwargs)
    needed = sum(t.numel() * t.element_size() for t in shape.state_dict().values())
    if needed > len(blob):
        raise BadRequest(
            f"weights do not fit model {name!r}: with kwargs {kwargs} it needs {needed} bytes of weights, "
            f"{len(blob)} were sent (nothing was built)"
        )
    model = build_model(name, info, kwargs)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise BadRequest(f"weights do not fit model {name!r}: {str(err).splitlines()[0]}") from err
    return Prepared(model, None, state, kwargs)


class _Reader:
    """The split in chunks, checking the bound before each one and counting the samples read."""

    def __init__(self, source: Source, split: str, info: SourceInfo, bound: Bound, xy: bool):
        self.source, self.split, self.bound, self.xy = source, split, bound, xy
        self.n = 0
        if xy:  # sample elements x classes bounds the logits of one sample (tokens: (seq_len + 1) x vocab)
            per_sample = math.prod(info["sample_shape"]) * max(1, info["num_classes"])
            self.chunk = max(1, min(EVAL_CHUNK, EVAL_LOGITS_BUDGET // per_sample))
        else:
            self.chunk = max(1, min(EVAL_CHUNK, MAX_BATCH_BYTES // max(1, source.sample_nbytes)))

    def __iter__(self) -> Iterator:
        total = self.source.num_samples(self.split)
        for start in range(0, total, self.chunk):
            self.bound.check()
            indices = np.arange(start, min(total, start + self.chunk), dtype=np.int64)
            if self.xy:
                x, y = self.source.read(self.split, indices)
                batch: object = (torch.from_numpy(x), torch.from_numpy(y))
            else:
                batch = {k: _tensor(v) for k, v in self.source.read_fields(self.split, indices).items()}
            self.n += len(indices)
            yield batch
        self.bound.check()


def _tensor(value):
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    return value  # variable fields (lists of arrays), bytes or text: as the source gives them


@torch.no_grad()
def _builtin(model: nn.Module, batches: _Reader, kind: str) -> tuple[float, float]:
    """Mean cross-entropy (each prediction's clipped at :data:`EVAL_LOSS_CLIP`: one sample can move it
    by a bounded amount, a diverged model's NaN reads as the clip) and accuracy, per prediction."""
    model.eval()
    total_loss, correct, predicted = 0.0, 0, 0
    for batch in batches:
        x, y = xy(batch)
        logits, targets = predictions(model, x, y, kind)
        losses = nn.functional.cross_entropy(logits.float(), targets, reduction="none")
        losses = torch.nan_to_num(losses, nan=EVAL_LOSS_CLIP, posinf=EVAL_LOSS_CLIP).clamp(0.0, EVAL_LOSS_CLIP)
        total_loss += float(losses.sum().item())
        correct += int((logits.argmax(1) == targets).sum().item())
        predicted += len(targets)
    if predicted == 0:
        return 0.0, 0.0
    return total_loss / predicted, correct / predicted


def score(prepared: Prepared, source: Source, split: str, info: SourceInfo, bound: Bound, *, xy: bool) -> Scores:
    """Score ``prepared`` on ``split`` of ``source`` within ``bound``.

    Raises :class:`BadRequest` when an evaluator's result breaks the contract (module docstring),
    :class:`Internal` when it raises, and what :meth:`Bound.check` raises.
    """
    reader = _Reader(source, split, info, bound, xy)
    if prepared.model is not None:
        loss, accuracy = _builtin(prepared.model, reader, dataset_kind(info))  # named fields: image and label
        return Scores(loss, accuracy, reader.n)
    if prepared.evaluator is None:
        raise Internal("an evaluation prepared neither a model nor an evaluator")
    ref = f"{prepared.evaluator.__module__}:{prepared.evaluator.__name__}"
    details = {**info, "split": split, "num_samples": source.num_samples(split), "loss_clip": EVAL_LOSS_CLIP}
    try:
        with torch.no_grad():
            result = prepared.evaluator(prepared.state, reader, details, **prepared.kwargs)
    except (Timeout, Unavailable):
        raise
    except Exception as err:
        raise Internal(f"evaluator {ref} failed: {type(err).__name__}: {err}") from err
    return _checked(result, ref, reader.n)


def _checked(result: object, ref: str, n: int) -> Scores:
    """An evaluator's result as :class:`Scores`, or :class:`BadRequest` naming what is wrong."""
    if not isinstance(result, Mapping) or "loss" not in result or "accuracy" not in result:
        raise BadRequest(f"evaluator {ref} must return a mapping with at least loss and accuracy, got {result!r:.200}")
    values: dict[str, float] = {}
    for key, value in result.items():
        if not isinstance(key, str) or not key.isidentifier() or len(key) > 64:
            raise BadRequest(f"evaluator {ref} returned a metric name {key!r:.80}; names are identifiers")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"evaluator {ref}: metric {key} is {type(value).__name__}, not a number")
        values[key] = float(value)
    extra = {k: v for k, v in values.items() if k not in ("loss", "accuracy")}
    if len(extra) > MAX_EXTRA_METRICS:
        raise BadRequest(
            f"evaluator {ref} returned {len(extra)} metrics besides loss and accuracy; at most {MAX_EXTRA_METRICS}"
        )
    return Scores(values["loss"], values["accuracy"], n, extra)


def evaluate_weights(
    source: Source,
    split: str,
    model_spec: dict,
    blob: bytes,
    info: SourceInfo,
    stop: threading.Event | None = None,
    evaluator_modules: Collection[str] = (),
    timeout_s: float = float("inf"),
) -> tuple[float, float, int]:
    """``(loss, accuracy, n)`` of ``blob`` scored by ``model_spec`` on ``split``, exactly as the
    provider computes them before release (a script's or a test's check of a provider's answer)."""
    prepared = prepare(model_spec, blob, info, evaluator_modules)
    scores = score(prepared, source, split, info, Bound(time.monotonic() + timeout_s, timeout_s, stop), xy=source.xy)
    return scores.loss, scores.accuracy, scores.n
