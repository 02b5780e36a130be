"""Built-in models, loading a user's own (``module:factory``), and the training objective: shared by
trainer and provider.

Every model is built from the dataset's DatasetInfo (input shape, number of classes, ``kind``), so the
same spec builds the same architecture on the trainer that trains it and the provider that evaluates it.

How a batch becomes predictions and targets depends on the dataset's ``kind`` and lives in one place,
:func:`predictions`, used by both the trainer's step (:func:`batch_loss`) and :func:`evaluate`:

- ``image`` (any fixed-size sample with a class label): ``model(x)`` is ``(B, classes)`` logits, the
  targets are ``y``. Integer samples reach the model as float (:func:`as_float`: uint8 / 255).
- ``tokens`` (samples of ``seq_len + 1`` tokens, no labels): the model reads ``x[:, :-1]`` as int64
  ids and returns ``(B, seq_len, vocab)`` logits; the targets are ``x[:, 1:]`` (next-token loss over
  every position). A user's ``module:factory`` model for a token dataset follows the same contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

from libbus.errors import BadRequest
from libbus.loader.tensors import as_float  # public in libbus; re-exported here for the services
from services.model_data import FIELDS, IMAGE_FIELD, LABEL_FIELD, TOKENS, dataset_kind, xy_info
from services.usercode import import_allowed

__all__ = [
    "FIELDS",
    "IMAGE_FIELD",
    "LABEL_FIELD",
    "MODELS",
    "TOKENS",
    "TinyLM",
    "as_float",
    "batch_loss",
    "build_model",
    "dataset_kind",
    "evaluate",
    "predictions",
    "xy",
    "xy_info",
]


def xy(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as ``(x, y)``: a named-field batch's ``image`` and ``label`` (see :func:`xy_info`)."""
    if isinstance(batch, Mapping):
        return batch[IMAGE_FIELD], batch[LABEL_FIELD]
    x, y = batch
    return x, y


def _refuse_tokens(model: str, info: Mapping[str, Any]) -> None:
    if dataset_kind(info) == TOKENS:
        raise BadRequest(
            f"model {model!r} classifies fixed-size samples, but this is a token dataset "
            f"(sample_shape {info.get('sample_shape')}); use model 'tiny-lm' for tokens"
        )


def _mlp(info: Mapping[str, Any], hidden: int = 256) -> nn.Module:
    _refuse_tokens("mlp", info)
    features = math.prod(info["sample_shape"])
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden // 2),
        nn.ReLU(),
        nn.Linear(hidden // 2, info["num_classes"]),
    )


def _cnn(info: Mapping[str, Any], width: int = 16) -> nn.Module:
    _refuse_tokens("cnn", info)
    shape = info["sample_shape"]
    if len(shape) != 3:
        raise BadRequest(f"model 'cnn' needs image samples (C, H, W); this dataset's are {shape}")
    channels = shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, width * 2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(width * 2 * 16, 64),
        nn.ReLU(),
        nn.Linear(64, info["num_classes"]),
    )


class _Block(nn.Module):
    """ResNet's basic block: two 3×3 convolutions with batch norm, plus the (projected) input."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` (same layers and parameter count at ``width=64``), written here because
    torchvision has no CPU build on PyPI. The global average pool takes images of any size ≥ 32×32
    (smaller ones work too: the stride only runs out)."""

    def __init__(self, channels: int, num_classes: int, width: int = 64):
        super().__init__()
        widths = [width, width * 2, width * 4, width * 8]
        self.stem = nn.Sequential(
            nn.Conv2d(channels, width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks, cin = [], width
        for i, cout in enumerate(widths):
            stride = 1 if i == 0 else 2
            blocks += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def _resnet18(info: Mapping[str, Any], width: int = 64) -> nn.Module:
    _refuse_tokens("resnet18", info)
    shape = info["sample_shape"]
    if len(shape) != 3:
        raise BadRequest(f"model 'resnet18' needs image samples (C, H, W); this dataset's are {shape}")
    return ResNet18(shape[0], info["num_classes"], width)


class TinyLM(nn.Module):
    """A small causal transformer language model: token ids ``(B, T)`` → next-token logits ``(B, T, vocab)``.

    Token embedding plus learned positions, ``layers`` pre-norm transformer blocks under a causal mask
    (position ``t`` sees positions ``<= t`` only), a final norm and a linear head. ``T`` may be anything
    up to ``seq_len``.
    """

    def __init__(
        self,
        vocab: int,
        seq_len: int,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 2,
        ff: int = 4,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        nn.init.normal_(self.pos, std=0.02)
        block = nn.TransformerEncoderLayer(
            d_model,
            heads,
            dim_feedforward=ff * d_model,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        # nested tensors only serve padding masks, which a causal LM on fixed-length sequences lacks
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.seq_len:
            raise ValueError(f"tiny-lm was built for sequences of at most {self.seq_len} tokens, got {length}")
        h = self.embed(tokens) + self.pos[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device, dtype=h.dtype)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def _tiny_lm(
    info: Mapping[str, Any], d_model: int = 64, heads: int = 4, layers: int = 2, ff: int = 4, dropout: float = 0.0
) -> nn.Module:
    if dataset_kind(info) != TOKENS:
        raise BadRequest(
            f"model 'tiny-lm' needs a token dataset (kind 'tokens'); this one is "
            f"{dataset_kind(info)!r} with samples {info.get('sample_shape')}: use 'mlp' or 'cnn'"
        )
    vocab = info.get("vocab_size") or info["num_classes"]
    seq_len = info.get("seq_len") or info["sample_shape"][0] - 1
    if seq_len < 1:
        raise BadRequest(f"token dataset has seq_len {seq_len}; tiny-lm needs at least 1")
    if d_model % heads:
        raise BadRequest(f"tiny-lm: d_model ({d_model}) must be a multiple of heads ({heads})")
    return TinyLM(vocab, seq_len, d_model=d_model, heads=heads, layers=layers, ff=ff, dropout=dropout)


MODELS = {"mlp": _mlp, "cnn": _cnn, "resnet18": _resnet18, "tiny-lm": _tiny_lm}


def build_model(
    name: str, info: Mapping[str, Any], kwargs: Mapping[str, Any] | None = None, *, allowed: Collection[str] = ()
) -> nn.Module:
    """The model ``name`` for a dataset described by ``info`` (DatasetInfo fields).

    ``name`` is a built-in (``mlp``, ``cnn``, ``resnet18`` for labelled samples, ``tiny-lm`` for token datasets)
    or ``package.module:factory``, a callable taking ``(info, **kwargs)`` (the job's ``model_kwargs``: data,
    never a setting of this node) and returning an
    ``nn.Module``, whose module must be in ``allowed`` (the trainer's ``job_modules``; see
    :mod:`services.usercode`). Raises :class:`BadRequest` for an unknown model, a module the node does
    not allow, arguments it does not take, or a built-in that does not fit the dataset's kind.
    """
    if info.get("num_classes", 0) < 1:
        raise BadRequest("classification models need a dataset with num_classes >= 1")
    factory: Callable[..., object]
    if name in MODELS:
        factory, info = MODELS[name], xy_info(info)
    elif ":" in name:
        found = import_allowed(name, allowed, f"model {name!r}", setting="job_modules")
        if not callable(found):
            raise BadRequest(f"model {name!r}: {type(found).__name__} is not callable")
        factory = found
    else:
        raise BadRequest(f"unknown model {name!r}; built-ins are {', '.join(MODELS)}, or give package.module:factory")
    kwargs = dict(kwargs or {})
    try:
        model = factory(info, **kwargs)
    except TypeError as err:
        raise BadRequest(f"model {name!r}: bad arguments {kwargs}: {err}") from err
    if not isinstance(model, nn.Module):
        raise BadRequest(f"model {name!r}: factory returned {type(model).__name__}, not a torch Module")
    return model


def predictions(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``model`` on a batch: ``(logits (N, classes), targets (N,))``, one row per prediction.

    ``kind`` is the dataset's DatasetInfo ``kind``; see the module doc for what each kind predicts.
    For tokens, N is batch × seq_len; otherwise it is the batch size.
    """
    if kind == TOKENS:
        # Token tensors arrive as uint16/uint32 (the wire dtype); embeddings and cross-entropy need int64.
        tokens = x.long()
        logits = model(tokens[:, :-1])
        return logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    return model(as_float(x)), y


def batch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean cross-entropy of ``model`` on one batch, for its training step (see :func:`predictions`)."""
    logits, targets = predictions(model, x, y, kind)
    return nn.functional.cross_entropy(logits, targets)


@torch.no_grad()
def evaluate(model: nn.Module, batches, kind: str = "image") -> tuple[float, float, int]:
    """Mean cross-entropy loss, accuracy and sample count of ``model`` over ``(x, y)`` batches.

    Loss and accuracy are per prediction (per next token for ``kind="tokens"``); the count is of
    samples (sequences for tokens).
    """
    model.eval()
    total_loss, correct, predicted, n = 0.0, 0, 0, 0
    for batch in batches:
        x, y = xy(batch)
        logits, targets = predictions(model, x, y, kind)
        total_loss += nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        correct += int((logits.argmax(1) == targets).sum().item())
        predicted += len(targets)
        n += len(x)
    if predicted == 0:
        return 0.0, 0.0, n
    return total_loss / predicted, correct / predicted, n
