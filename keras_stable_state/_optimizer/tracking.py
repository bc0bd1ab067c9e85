"""The optimizers a model tracks, and the ``StableOptimizer`` an optimizer is or wraps."""

from __future__ import annotations

import keras

from keras_stable_state._identity.keys import MAIN
from keras_stable_state._optimizer.wrapper import StableOptimizer

__all__ = ["stable_optimizer_in", "tracked_optimizers"]


def tracked_optimizers(model) -> dict:
    """Every optimizer a model tracks, by name.

    ``"optimizer"`` for ``model.optimizer`` (set by ``compile``), then each
    attribute of the model holding an optimizer, by attribute name
    (``"d_optimizer"``, ``"g_optimizer"`` of a GAN with a custom
    ``train_step``), and ``"<attribute>/<key>"`` for optimizers in a dict or
    list attribute. An optimizer reached twice keeps its first name.

    Returns:
        ``{name: optimizer}``, ``model.optimizer`` first, then by attribute name.
    """
    found, seen = {}, set()

    def add(name, opt):
        if isinstance(opt, keras.optimizers.Optimizer) and id(opt) not in seen:
            seen.add(id(opt))
            found[name] = opt

    add(MAIN, getattr(model, "optimizer", None))
    attrs = [
        (attr, value)
        for attr, value in sorted(vars(model).items())
        # not Keras' tracker, nor TensorFlow's trackable bookkeeping (`_self_unconditional_...`)
        if not attr.startswith(("__", "_self_")) and attr not in ("optimizer", "_tracker")
    ]
    for attr, value in attrs:
        if isinstance(value, keras.optimizers.Optimizer):
            add(attr.lstrip("_") or attr, value)
    optimizer_type = keras.optimizers.Optimizer
    for attr, value in attrs:
        name = attr.lstrip("_") or attr
        # The name is only formatted for an optimizer (a dict key may be any object).
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, optimizer_type):
                    add(f"{name}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if isinstance(v, optimizer_type):
                    add(f"{name}.{i}", v)
    return found


def stable_optimizer_in(optimizer: object) -> StableOptimizer | None:
    """The [`StableOptimizer`][keras_stable_state.StableOptimizer] an optimizer is or wraps (Keras' mixed-precision
    ``LossScaleOptimizer`` wraps the compiled one), or ``None``."""
    seen = set()
    while isinstance(optimizer, keras.optimizers.Optimizer) and id(optimizer) not in seen:
        if isinstance(optimizer, StableOptimizer):
            return optimizer
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None
