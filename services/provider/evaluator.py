"""Scoring a model on a split that never leaves this node. Weights are loaded safely: safetensors
only, never unpickled."""

from __future__ import annotations

import math
import threading

import numpy as np
import torch
from safetensors.torch import load as load_safetensors

from libbus.errors import BadRequest, Forbidden, Unavailable
from services.models import MODELS, build_model, dataset_kind, evaluate

from .sources import Source

__all__ = ["EVAL_CHUNK", "evaluate_weights"]

EVAL_CHUNK = 512
#: Bound on the logits one evaluation chunk may produce (float32 elements: 128 MiB). A token sample
#: yields a row of vocabulary logits per position, so long sequences over a big vocabulary need far
#: smaller chunks than images do.
EVAL_LOGITS_BUDGET = 1 << 25


def evaluate_weights(
    source: Source, split: str, model_spec: dict, blob: bytes, info: dict, stop: threading.Event | None = None
) -> tuple[float, float, int]:
    """Build ``model_spec`` for ``info``, load safetensors ``blob`` into it, score it on ``split``.

    Raises :class:`BadRequest` for a malformed spec, unreadable weights or weights that do not fit,
    and :class:`Unavailable` when ``stop`` is set (the provider is stopping) before it is done.
    """
    name = model_spec.get("name")
    kwargs = model_spec.get("kwargs", {})
    if not isinstance(name, str) or not isinstance(kwargs, dict):
        raise BadRequest('Evaluate.model must be {"name": str, "kwargs": {...}}')
    if name not in MODELS:
        # module:factory would import and run code named by a remote peer: not on this node.
        raise Forbidden(f"this provider evaluates built-in models only ({', '.join(MODELS)}), not {name!r}")
    try:
        state = load_safetensors(blob)
    except Exception as err:
        raise BadRequest(f"weights are not a valid safetensors blob: {err}") from err
    # The model's size comes from the peer's kwargs (`hidden = 10**7` is 68 bytes on the wire): its shape
    # is built first on the meta device, which allocates nothing, and must fit in the weights that came
    # with it (load_state_dict needs every tensor, so real weights are never smaller than the model).
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
    n = source.num_samples(split)
    # sample elements x classes bounds the logits of one sample (tokens: (seq_len + 1) x vocab)
    per_sample = math.prod(info["sample_shape"]) * max(1, info["num_classes"])
    chunk = max(1, min(EVAL_CHUNK, EVAL_LOGITS_BUDGET // per_sample))

    def batches():
        for start in range(0, n, chunk):
            if stop is not None and stop.is_set():  # a SIGTERM must not wait for a whole split
                raise Unavailable("the provider is stopping; evaluation abandoned: ask again")
            x, y = source.read(split, np.arange(start, min(n, start + chunk), dtype=np.int64))
            yield torch.from_numpy(x), torch.from_numpy(y)

    return evaluate(model, batches(), dataset_kind(info))
