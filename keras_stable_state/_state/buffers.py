"""The buffers of wrapped Torch modules as layer state (`keras_stable_state._state.layers`).

A ``keras.layers.TorchModuleWrapper`` turns its module's parameters into Keras variables,
but not its buffers (BatchNorm's running statistics and ``num_batches_tracked``, any
registered buffer), which Keras' own ``save_weights`` keeps through the module's
``state_dict``. They are saved per wrapping layer, keyed by its stable path and the
buffer's name, and copied back in place. Only on the Torch backend (torch is imported
only there).
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from keras_stable_state.errors import BindingError, listed

__all__ = ["BUFFERS", "BufferStep", "buffer_steps", "buffers_state", "torch_buffers"]

BUFFERS = "buffers"


@dataclasses.dataclass
class BufferStep:
    """One assignment of a restore (the shape ``apply_steps`` runs): ``snapshot()``
    returns ``(undo, changed)``."""

    name: str
    apply: object
    snapshot: object


def torch_buffers(layer) -> dict:
    """``{name: tensor}`` of every registered buffer of the module a
    ``keras.layers.TorchModuleWrapper`` wraps (BatchNorm's ``running_mean``,
    ``running_var``, ``num_batches_tracked``...; persistent or not), named as
    ``module.named_buffers()`` names them; ``{}`` for any other layer, and on
    another backend than Torch (nothing imports torch there)."""
    if keras.backend.backend() != "torch" or not isinstance(layer, keras.layers.TorchModuleWrapper):
        return {}
    module = getattr(layer, "module", None)
    return dict(module.named_buffers()) if module is not None else {}


def buffers_state(layer) -> dict:
    from keras_stable_state._numpy import to_numpy

    return {
        "kind": BUFFERS,
        "class": type(layer).__name__,
        "buffers": {name: np.array(to_numpy(t), copy=True) for name, t in torch_buffers(layer).items()},
    }


def buffer_steps(saved, layer, key, *, strict, report, where) -> list:
    """The steps copying the saved ``{name: array}`` into the buffers of ``layer``'s module,
    each checked first (shape and dtype); a live buffer without a saved value is listed in
    ``report.left_fresh`` (``buffer:<key>/<name>``), a saved one without a live buffer is
    refused under ``strict`` (else listed in ``report.dropped``).

    Raises:
        BindingError: naming the buffer, for another shape or dtype, or (``strict``) a
            saved buffer the module does not have.
    """
    live = torch_buffers(layer)
    unexpected = sorted(set(saved) - set(live))
    if unexpected and strict:
        raise BindingError(
            f"{where} holds buffers {listed(unexpected)} of the module wrapped by layer {key!r}, which "
            f"the live module ({type(layer.module).__name__}) does not have (it has {listed(sorted(live))}). "
            "Build the module as it was saved, or pass strict=False to leave them out (listed in "
            "report.dropped).",
            key=f"buffer:{key}/{unexpected[0]}",
            expected=sorted(saved),
            received=sorted(live),
        )
    for name in unexpected:
        report.drop(f"buffer:{key}/{name}", "no such buffer in the wrapped module")
    steps = []
    for name, tensor in live.items():
        label = f"buffer:{key}/{name}"
        if name not in saved:
            report.left_fresh.append(label)
            continue
        array = saved[name]
        dtype = str(tensor.dtype).replace("torch.", "")
        if tuple(array.shape) != tuple(tensor.shape) or array.dtype.name != dtype:
            raise BindingError(
                f"{where}: buffer {name!r} of the module wrapped by layer {key!r} was saved as "
                f"{array.dtype.name} of shape {tuple(array.shape)}, but the live one is {dtype} of shape "
                f"{tuple(tensor.shape)}. Build the module as it was saved.",
                key=label,
                expected=(tuple(array.shape), array.dtype.name),
                received=(tuple(tensor.shape), dtype),
            )
        steps.append(_tensor_step(label, tensor, array))
        report.restored_state.append(label)
    return steps


def _tensor_step(name, tensor, array) -> BufferStep:
    """A step copying ``array`` into the Torch ``tensor`` in place (the module keeps its
    buffer object); its undo copies the old values back."""
    import torch

    value = torch.from_numpy(np.array(array, copy=True))

    def apply():
        with torch.no_grad():
            tensor.copy_(value)

    def snapshot():
        old = tensor.detach().clone()

        def undo():
            with torch.no_grad():
                tensor.copy_(old)

        return undo, (lambda: not torch.equal(tensor, old))

    return BufferStep(name, apply, snapshot)
