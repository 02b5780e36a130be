"""``user``: a transform stage whose code is a ``module:function`` the provider's operator installed.

    [[stages]]
    name = "jitter"
    input = "images"
    user = { function = "myaugment:jitter", splits = ["train"] }

Security. A pipeline stage runs code inside the provider, next to every dataset it serves and its
keys. So the code a ``user`` stage may run is decided by the provider's operator alone: the
module must be named in the provider's own settings (``user_modules``, from its config file,
environment or command line), and a name from anywhere else is refused before anything is
imported. A pipeline file names the function, but a pipeline file (or a dataset URI) may come from
someone who is not the operator — a dataset added at run time, a file in a shared directory — so
naming a module there grants nothing; nothing on the wire can name code at all. Only the exact
modules listed are importable (not their parents, not their siblings), and only a public function
at their top level (no dotted paths, no ``_private`` names).

The function is called once per sample with the sample's fields and a generator of its own::

    def jitter(fields: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"x": fields["x"] + rng.normal(0, 0.01, fields["x"].shape).astype(fields["x"].dtype)}

``fields`` holds ``x`` (the sample) and ``y`` (its label); the returned dict replaces those it
names. ``rng`` is ``numpy.random.default_rng`` seeded from ``(seed, epoch, split, stage, index)``:
the same sample of the same epoch gets the same numbers on every request, resend and replica,
which keeps a resumed run's batches byte for byte what they would have been. On splits not listed
in ``splits`` (default: train only) the stage passes samples through. An output whose shape or
dtype differs from the declared one (``sample_shape``/``dtype``, default: the input's) fails that
request with a clear error; the provider goes on serving.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Collection

import numpy as np

from libbus.errors import DatasetError

from ..base import SPLITS
from .stages import Chunk, RandomStage, Spec

__all__ = ["UserStage", "load_function"]


def load_function(ref: object, allowed: Collection[str], where: str) -> Callable:
    """The function ``ref`` (``"module:function"``) names, if ``module`` is in ``allowed``.

    Raises:
        DatasetError: a malformed reference, a module not allowed (nothing is imported then), or a
            module or function that cannot be found.
    """
    if not isinstance(ref, str) or ref.count(":") != 1:
        raise DatasetError(f"{where}: function must be 'module:function', got {ref!r}")
    module_name, func_name = ref.split(":")
    if module_name not in allowed:
        listed = ", ".join(sorted(allowed)) or "none"
        raise DatasetError(
            f"{where}: module {module_name!r} is not in this provider's user_modules ({listed}); "
            "only modules its operator lists in the provider's settings may run in a pipeline"
        )
    if not func_name.isidentifier() or func_name.startswith("_"):
        raise DatasetError(f"{where}: {func_name!r} is not a public function name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise DatasetError(f"{where}: cannot import {module_name!r}: {err}") from err
    func = getattr(module, func_name, None)
    if not inspect.isfunction(func):
        raise DatasetError(f"{where}: {module_name} has no function {func_name!r}")
    return func


class UserStage(RandomStage):
    """``user``: an operator-installed ``module:function`` per sample (see the module docstring)."""

    type = "user"
    params = {"function": None, "splits": ["train"], "sample_shape": None, "dtype": None}

    def __init__(self, name: str, config: dict, input_spec: Spec, seed: int, allowed: Collection[str] = ()):
        self.allowed = frozenset(allowed)
        super().__init__(name, config, input_spec, seed)
        try:
            self.function = load_function(self.config["function"], self.allowed, f"stage {name!r} (user)")
        except DatasetError as err:
            raise self.error(str(err).split(": ", 1)[1]) from err

    def check(self, spec: Spec) -> Spec:
        shape = self.config["sample_shape"]
        if shape is not None and (not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape)):
            raise self.error(f"sample_shape must be a list of positive integers, got {shape!r}")
        dtype = spec.dtype if self.config["dtype"] is None else self._dtype("dtype", "biuf")
        return Spec(
            tuple(shape) if shape is not None else spec.sample_shape,
            dtype,
            spec.label_shape,
            spec.label_dtype,
            spec.num_classes,
            spec.kind,
        )

    def apply(self, chunk: Chunk) -> None:
        before, labels = chunk.xy()
        if chunk.split not in self.splits:
            if self.spec.sample_shape != self.input_spec.sample_shape:
                raise DatasetError(f"changes the sample shape, so it must apply to {chunk.split} too")
            chunk.x = before.astype(self.spec.dtype, copy=False)
            return
        epoch = chunk.epoch if self.epoch is None else self.epoch
        x = np.empty((len(chunk.indices), *self.spec.sample_shape), self.spec.dtype)
        y = labels.copy()
        for row, index in enumerate(chunk.indices.tolist()):
            rng = np.random.default_rng((self.seed, epoch, SPLITS.index(chunk.split), self.key, index))
            out = self.function({"x": before[row].copy(), "y": labels[row].copy()}, rng)
            if not isinstance(out, dict):
                raise DatasetError(f"{self.config['function']} returned {type(out).__name__}, not a dict")
            sample = np.asarray(out.get("x", before[row]))
            if sample.shape != self.spec.sample_shape or sample.dtype != self.spec.dtype:
                raise DatasetError(
                    f"{self.config['function']} returned a sample of shape "
                    f"{sample.shape} {sample.dtype}; the stage declares {self.spec.sample_shape} {self.spec.dtype}"
                )
            x[row] = sample
            if "y" in out:
                y[row] = out["y"]
        chunk.x, chunk.y = x, y
        self.items_since_anchor += len(chunk.indices)
