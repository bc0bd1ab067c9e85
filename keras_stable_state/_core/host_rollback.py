"""The all-or-nothing restore of a model on an accelerator: its rollback copy in host memory.

On the CPU the all-or-nothing restore keeps every replaced value by reference and puts
every new value where the variables will use it before the first assignment
(`keras_stable_state._core.apply`): one extra state in all, which on an accelerator would
be device memory (the old values, and the new ones placed beside them), so a model whose
state fills more than half of the device could not be restored. For a model whose
variables are on an accelerator (`on_accelerator`), the restore instead reads the file
as the in-place restore does (`keras_stable_state._core.in_place`: proven whole, each large
array read from the file into its variable, one at a time) after copying the variable's
current value into host memory (`HostRollback.keep`); if anything fails, the copies are
assigned back (`HostRollback.put_back`). The device then holds at most the state and one
variable's new value (the in-place read's own cost), the host the rollback copy: one
state, and nothing else of the state's size.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_stable_state._numpy import private_copy, to_numpy

__all__ = ["HostRollback", "on_accelerator"]


def _device_kind(var: Any) -> str:
    """``"cpu"``, or the platform of the accelerator ``var`` lives on (``"gpu"``, ``"tpu"``...)."""
    backend = keras.backend.backend()
    value = getattr(var, "value", None)
    if backend == "jax":
        devices = getattr(value, "devices", None)
        platforms = {d.platform for d in devices()} if callable(devices) else {"cpu"}
        return next((p for p in sorted(platforms) if p != "cpu"), "cpu")
    if backend == "torch":
        device = getattr(value, "device", None)
        return "cpu" if device is None else device.type
    if backend == "tensorflow":
        name = str(getattr(value, "device", "") or getattr(var, "device", "") or "").upper()
        return next((p.lower() for p in ("GPU", "TPU") if f"/DEVICE:{p}" in name or f":{p}:" in name), "cpu")
    return "cpu"


def on_accelerator(model: Any) -> bool:
    """Whether a variable of ``model`` (its first and last weight, where Keras puts them all on
    one device) or of its optimizer lives on an accelerator (a GPU, a TPU)."""
    weights = list(getattr(model, "weights", []) or [])
    optimizer = getattr(model, "optimizer", None)
    slots = list(getattr(optimizer, "variables", []) or []) if optimizer is not None else []
    sample = weights[:1] + weights[-1:] + slots[-1:]
    return any(_device_kind(v) != "cpu" for v in sample)


class HostRollback:
    """Host copies of the values of the variables a restore assigns, taken one by one just
    before each assignment (`keep`), to put back if the restore fails (`put_back`)."""

    def __init__(self) -> None:
        self.kept: list[tuple[Any, np.ndarray]] = []

    def keep(self, var: Any) -> None:
        """Copy ``var``'s current value into new host memory (never a view of the variable's
        own memory, which the in-place read writes into)."""
        self.kept.append((var, private_copy(to_numpy(var))))

    def put_back(self) -> list[str]:
        """Assign every kept value back, the last kept first; the variables (path and error)
        that could not be put back."""
        failed = []
        for var, value in reversed(self.kept):
            try:
                var.assign(value)
            except Exception as err:  # noqa: BLE001 - every failure is reported by name to the caller
                failed.append(f"{getattr(var, 'path', None) or var.name} ({type(err).__name__}: {err})")
        self.kept.clear()
        return failed
