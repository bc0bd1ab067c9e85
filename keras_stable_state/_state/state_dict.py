"""Torch's ``state_dict()`` / ``load_state_dict()`` convention as a state provider, and the
tree codec that keeps what JSON cannot tell apart.

`StateDictProvider` makes any object with ``state_dict()`` and ``load_state_dict()``
(``torch.optim.lr_scheduler.*``, a ``torch.utils.data`` sampler that has them, ...) a
provider of ``save_training_state(..., state={name: obj})``. `encode` and
`decode` turn such a tree into JSON values and NumPy arrays and back, keeping
what a plain JSON round trip loses: a ``torch.Tensor`` stays a tensor of its dtype
(``{"__tensor__": array}``), a tuple a tuple (``{"__tuple__": [...]}``), a dict with
keys other than strings its keys (``{"__items__": [[key, value], ...]}``).
The torch.optim optimizers' state (`keras_stable_state._optimizer.torch_optim`) uses
the same codec. Torch is never imported here unless the process has it loaded.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from keras_stable_state._numpy import private_copy
from keras_stable_state.errors import StateError

__all__ = ["StateDictProvider", "decode", "encode", "has_state_dict", "is_tensor", "qualified_name"]

TENSOR = "__tensor__"
TUPLE = "__tuple__"
ITEMS = "__items__"
_TAGS = (TENSOR, TUPLE, ITEMS)


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.Tensor`` (``False`` when no Torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def has_state_dict(obj: object) -> bool:
    """Whether ``obj`` has callable ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def qualified_name(obj: object) -> str:
    """``"torch.optim.lr_scheduler.StepLR"``: the module and name of ``obj``'s class."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def tensor_array(tensor: Any) -> np.ndarray:
    """A host copy of a ``torch.Tensor`` of its dtype (``bfloat16`` via ml_dtypes)."""
    import torch

    value = tensor.detach().cpu()
    if value.dtype == torch.bfloat16:
        import ml_dtypes

        return value.to(torch.float32).numpy().astype(ml_dtypes.bfloat16)
    return private_copy(value.numpy())


def array_tensor(array: Any) -> Any:
    """A ``torch.Tensor`` of its own memory holding ``array`` (of its dtype)."""
    import torch

    array = np.asarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return torch.from_numpy(np.array(array, copy=True))


def encode(value: Any) -> Any:
    """``value`` with tensors as ``{"__tensor__": array}`` (a host copy of its dtype), tuples as
    ``{"__tuple__": [...]}`` and dicts with keys other than ``str`` as
    ``{"__items__": [[key, value], ...]}``; other values as they are (the save then refuses
    any that is neither JSON nor an array, naming where it is)."""
    if is_tensor(value):
        return {TENSOR: tensor_array(value)}
    if isinstance(value, tuple):
        return {TUPLE: [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in _TAGS):
            return {k: encode(v) for k, v in value.items()}
        return {ITEMS: [[encode(k), encode(v)] for k, v in value.items()]}
    return value


def _key(value: Any) -> Any:
    return tuple(_key(v) for v in value) if isinstance(value, list) else value


def decode(value: Any) -> Any:
    """The inverse of `encode` (arrays joined back already): ``{"__tensor__": array}`` as a
    ``torch.Tensor`` of the array's dtype and memory of its own, on the CPU."""
    if isinstance(value, dict):
        if len(value) == 1:
            tag, inner = next(iter(value.items()))
            if tag == TENSOR:
                return array_tensor(inner)
            if tag == TUPLE and isinstance(inner, list):
                return tuple(decode(v) for v in inner)
            if tag == ITEMS and isinstance(inner, list):
                return {_key(decode(k)): decode(v) for k, v in inner}
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


class StateDictProvider:
    """A provider of ``save_training_state(..., state={name: obj})`` for an object with
    ``state_dict()`` and ``load_state_dict()``, such as a ``torch.optim.lr_scheduler``.

    Its state is ``{"class": "<module>.<class>", "state_dict": encode(obj.state_dict())}``;
    `validate_state` refuses a state saved from another class before anything is set.

    Args:
        obj: The object (kept, not copied).
        name: Its name in ``state``, for messages.
    """

    def __init__(self, obj: Any, name: str) -> None:
        self.obj = obj
        self.name = name

    def get_state(self) -> dict[str, Any]:
        return {"class": qualified_name(self.obj), "state_dict": encode(self.obj.state_dict())}

    def validate_state(self, state: Any) -> None:
        saved = state.get("class") if isinstance(state, dict) else None
        if saved != qualified_name(self.obj):
            raise StateError(
                f"The state of provider {self.name!r} was saved from a {saved} object, but "
                f"state[{self.name!r}] is a {qualified_name(self.obj)}. Pass the object of the class "
                "that was saved (the same scheduler, built on the same optimizer), or leave it out of "
                "`state`.",
                key=self.name,
                expected=saved,
                received=qualified_name(self.obj),
            )

    def set_state(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(decode(state["state_dict"]))
