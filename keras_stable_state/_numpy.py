"""Variables as NumPy arrays, without the warnings of ``keras.ops.convert_to_numpy``.

A leaf module (it imports nothing of this package but the multi-process helpers, `keras_stable_state._processes`), used by
the restore core (`keras_stable_state._core.apply`), the state providers
(`keras_stable_state._state`) and the callbacks.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_stable_state import _processes


def to_numpy(variable: Any) -> np.ndarray:
    """A variable's value as a NumPy array (``bfloat16`` via ml_dtypes).

    On TensorFlow and Torch the value is converted with its own ``.numpy()``: Keras'
    ``convert_to_numpy`` goes through ``np.array(value)``, which warns (NumPy 2 ``copy=``
    protocol) on ``tf.Variable`` and ``torch.Tensor``. A JAX array sharded across
    several processes is gathered whole on every process (a collective: every
    process must call this for the same variables in the same order).
    """
    value = getattr(variable, "value", variable)
    backend = keras.backend.backend()
    if backend == "tensorflow" and hasattr(value, "numpy"):
        return value.numpy()
    if backend == "torch":
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            import ml_dtypes
            import torch

            return tensor.to(torch.float32).numpy().astype(ml_dtypes.bfloat16)
        return tensor.numpy()
    if backend == "jax" and _processes.process_count() > 1 and hasattr(value, "sharding"):
        return _processes.gather(value)
    return keras.ops.convert_to_numpy(value)


def numpy_copy(variable: Any) -> np.ndarray:
    """`to_numpy`, as an array of its own: a copy where the conversion shares the
    variable's memory (Torch's ``.numpy()``), which a later assignment would change."""
    return private_copy(to_numpy(variable))


def private_copy(array: np.ndarray) -> np.ndarray:
    """``array`` itself when nothing else can hold its memory (an array that owns it and is
    no view: JAX's and TensorFlow's conversions copy already), else a copy (Torch's
    ``.numpy()`` shares the tensor's memory, which an assignment changes)."""
    if type(array) is np.ndarray and array.flags.owndata and array.base is None:
        return array
    return np.array(array, copy=True)
