"""One noise key per question of a private test split: the noise is keyed by the weights' tensors
(names, dtypes, shapes, bytes: libbus/jobs/weights.py), not the file's bytes, so the same weights
under other safetensors metadata are the same question and get the same answer; averaging such
repeats learns nothing (docs/security.md §9)."""

from __future__ import annotations

import torch
from safetensors.torch import save as save_safetensors

from libbus.wire.messages import Evaluate

ALLOWED = ["tests.support.evaluators"]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(784, 10)
    return {"weight": layer.weight.detach().contiguous(), "bias": layer.bias.detach().contiguous()}


def test_the_same_tensors_under_other_metadata_draw_the_same_noise(start_provider, client_for):
    provider = start_provider(
        "mnist=mock://mnist?n=600",
        evaluator_modules=ALLOWED,
        eval_per_minute=0,
        eval_per_dataset_day=0,
        eval_epsilon=0.1,
    )
    client = client_for(provider.endpoint, timeout_s=60)
    model = {"evaluator": "tests.support.evaluators:linear"}

    def released(blob: bytes) -> tuple:
        reply = client.request(Evaluate(dataset="mnist", model=model, frames=[blob]))
        return reply.loss, reply.accuracy, reply.sha256

    weights = _weights(0)
    # an attacker re-labels one model again and again, each file's bytes (and sha256) new
    answers = [released(save_safetensors(weights, metadata={"job": f"j{i}", "note": "x" * i})) for i in range(4)]
    assert len({sha for _, _, sha in answers}) == 4  # four files
    assert len({(loss, acc) for loss, acc, _ in answers}) == 1, answers  # one question, one answer
    # other tensors are another question (noise of epsilon 0.1 on 120 samples: another draw)
    others = [released(save_safetensors(_weights(seed))) for seed in (1, 2, 3)]
    assert len({(loss, acc) for loss, acc, _ in [*answers[:1], *others]}) > 1
