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


def test_a_built_in_jobs_params_are_its_spec_fields_as_the_built_in_loop_reads_them():
    """``job.params`` of a built-in job: every name of BUILTIN_PARAMS, with the spec's own values (a
    name added to one and not the other would reach the loop missing, or unnamed in busctl's tables)."""
    from libbus.jobs.spec import BUILTIN_PARAMS

    spec = JobSpec.from_dict({"dataset": "mnist", "lr": 0.25, "epochs": 3, "model_from": "job-1"})
    params = spec.builtin_params()
    assert tuple(params) == BUILTIN_PARAMS
    assert params["lr"] == 0.25 and params["epochs"] == 3 and params["model_from"] == "job-1"
    assert params["model"] == spec.model and params["seed"] == spec.seed
