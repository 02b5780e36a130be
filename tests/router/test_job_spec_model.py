"""A job's ``model`` is checked where the spec enters, as its ``entrypoint`` is: a built-in's name or
``package.module:factory`` naming a public name; anything else is refused naming the field and the
forms it takes, before any trainer is asked to import it."""

from __future__ import annotations

import pytest

from libbus.errors import BadRequest
from libbus.jobs.spec import JobSpec


@pytest.mark.parametrize("model", ["mlp", "tiny-lm", "resnet18", "my.models:build", "pydoc:pipepager"])
def test_built_in_names_and_module_factories_are_taken(model):
    assert JobSpec.from_dict({"dataset": "mnist", "model": model}).model == model


@pytest.mark.parametrize(
    "model",
    [
        "os:system; rm -rf /",
        "my.models:_private",
        "my.models:build:again",
        ":build",
        "my..models:build",
        "../evil:build",
        "my.models:",
        "",
        "mlp\x1b[2J",
        "a b",
        "m" * 200,
    ],
)
def test_anything_else_is_refused_naming_the_field(model):
    with pytest.raises(BadRequest, match="model must be a built-in name"):
        JobSpec.from_dict({"dataset": "mnist", "model": model})


def test_a_model_name_no_trainer_builds_is_refused_at_submit_with_did_you_mean():
    with pytest.raises(BadRequest, match="model must be a built-in name.*got 'banana'$"):
        JobSpec.from_dict({"dataset": "mnist", "model": "banana"})
    with pytest.raises(BadRequest, match="did you mean 'resnet18'"):
        JobSpec.from_dict({"dataset": "mnist", "model": "resnet-18"})


def test_the_built_in_names_are_the_models_a_trainer_builds():
    from libbus.jobs.spec import BUILTIN_MODELS
    from services.models import MODELS

    assert set(BUILTIN_MODELS) == set(MODELS)
