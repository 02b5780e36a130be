"""A job's checkpoint state as tensors and plain data, stored without pickle.

:func:`encode_state` splits a nested state (dicts, lists, tuples, numbers, strings, ``None``,
tensors, numpy arrays, and objects with a ``state_dict()`` such as a model or an optimizer) into
a flat ``{name: tensor}`` map, which goes into a safetensors file, and a JSON skeleton that says
where each tensor sits. :func:`decode_state` puts them back together. Restoring a checkpoint thus
parses JSON and safetensors only: nothing from the file is unpickled or called.

Key types survive the round trip (an optimizer's ``state`` is keyed by ``int``), as do tuples
and non-finite floats. Anything else is refused at :func:`encode_state` with its path in the
state, not discovered at resume.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from libbus.errors import BadRequest

__all__ = ["StateError", "decode_state", "encode_state"]

#: How deep a state may nest (a model's state dict inside an optimizer's inside a dict is 4).
MAX_DEPTH = 32


class StateError(BadRequest):
    """A state that cannot be stored (an object that is neither plain data nor a tensor) or a
    stored one that does not decode."""


def encode_state(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """``(tensors, skeleton)``: the tensors of ``state`` by name, and JSON-able rest."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}  # the same tensor object twice (tied weights) is stored once
    storages: set[tuple[int, int]] = set()

    def tensor(value: torch.Tensor) -> dict:
        if id(value) in seen:
            return {"$t": seen[id(value)]}
        t = value.detach().cpu().contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key in storages or t.data_ptr() != t.untyped_storage().data_ptr() or t.nbytes != key[1]:
            t = t.clone()  # a view of a storage stored already, or part of one: safetensors keeps whole ones
        storages.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        name = str(len(tensors))
        tensors[name] = t
        seen[id(value)] = name
        return {"$t": name}

    def walk(value: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise StateError(f"state nests deeper than {MAX_DEPTH} levels at {path}")
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"$f": repr(value)}
        if isinstance(value, torch.Tensor):
            return tensor(value)
        if isinstance(value, np.ndarray):
            if value.dtype == object:
                raise StateError(f"state at {path}: a numpy array of Python objects cannot be stored")
            return {"$n": tensor(torch.from_numpy(np.ascontiguousarray(value)))["$t"]}
        if isinstance(value, np.generic):
            return walk(value.item(), path, depth)
        if isinstance(value, dict):
            items = []
            for k, v in value.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise StateError(f"state at {path}: key {k!r} is a {type(k).__name__}; keys are str or int")
                items.append([k, walk(v, f"{path}[{k!r}]", depth + 1)])
            return {"$d": items}
        if isinstance(value, (list, tuple)):
            out = [walk(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
            return {"$tuple": out} if isinstance(value, tuple) else out
        state_dict = getattr(value, "state_dict", None)
        if callable(state_dict):  # a model, an optimizer, a scheduler, a GradScaler: their state
            return walk(state_dict(), path, depth)
        raise StateError(
            f"state at {path} is a {type(value).__name__}: a checkpoint holds tensors, numpy arrays, "
            "numbers, strings, lists, tuples and dicts (or objects with a state_dict())"
        )

    return tensors, walk(state, "state", 0)


def decode_state(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    """The state :func:`encode_state` split (objects with a ``state_dict()`` come back as that dict)."""

    def walk(value: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise StateError(f"stored state nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, list):
            return [walk(v, depth + 1) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) != 1:
            raise StateError(f"stored state has an unknown entry {sorted(value)}")
        ((tag, body),) = value.items()
        if tag == "$t" or tag == "$n":
            if body not in tensors:
                raise StateError(f"stored state names tensor {body!r}, which is not in the file")
            return tensors[body] if tag == "$t" else tensors[body].numpy()
        if tag == "$f":
            if body not in ("nan", "inf", "-inf"):
                raise StateError(f"stored state has float {body!r}")
            return float(body)
        if tag == "$tuple":
            return tuple(walk(v, depth + 1) for v in body)
        if tag == "$d":
            out = {}
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], (str, int)):
                    raise StateError("stored state has a malformed dict entry")
                out[pair[0]] = walk(pair[1], depth + 1)
            return out
        raise StateError(f"stored state has an unknown tag {tag!r}")

    return walk(skeleton, 0)
