"""The optimizers a model tracks, and the ``StableOptimizer`` an optimizer is or wraps."""

from __future__ import annotations

import gc
from collections.abc import Iterable

import keras
import numpy as np

from keras_stable_state import _keras_compat
from keras_stable_state._identity.keys import MAIN
from keras_stable_state._numpy import to_numpy
from keras_stable_state._optimizer import wrapper
from keras_stable_state._optimizer.wrapper import StableOptimizer
from keras_stable_state.errors import StateError

__all__ = ["check_bound_passed", "stable_optimizer_in", "tracked_optimizers"]


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


def _reachable(optimizers: Iterable[object]) -> set[int]:
    """The ids of ``optimizers`` and of every optimizer they wrap (``inner_optimizer``, a
    ``MultiOptimizer``'s groups)."""
    seen: set[int] = set()
    stack = list(optimizers)
    while stack:
        opt = stack.pop()
        if not isinstance(opt, keras.optimizers.Optimizer) or id(opt) in seen:
            continue
        seen.add(id(opt))
        stack.append(getattr(opt, "inner_optimizer", None))
        stack.extend(_keras_compat.sub_optimizers(opt) or [])
    return seen


def _steps(optimizer: keras.optimizers.Optimizer) -> int:
    return int(np.asarray(to_numpy(optimizer.iterations)).reshape(-1)[0])


def _subclasses(cls: type) -> set[type]:
    """``cls`` and every class derived from it (defined so far)."""
    found: set[type] = set()
    stack = [cls]
    while stack:
        kind = stack.pop()
        if kind not in found:
            found.add(kind)
            stack.extend(kind.__subclasses__())
    return found


def _stepped_unsaved(model: keras.Model, saved: list[object]) -> list[keras.optimizers.Optimizer]:
    """The optimizers that stepped (``iterations > 0``), train ``model``'s variables and are
    not (inside) one of ``saved``: every ``StableOptimizer`` bound to ``model``; and, where the
    save writes no optimizer at all, every Keras optimizer built on the model's variables
    (found among the objects Python's collector tracks: a custom loop's ``Adam`` of an
    uncompiled model, held by the loop alone)."""
    reach = _reachable(saved)
    left = [opt for opt in list(wrapper.BOUND) if opt.bound_model() is model and id(opt) not in reach]
    if not saved:
        ids = {id(v) for v in model.trainable_variables}
        # the bound StableOptimizers are above; an unbound one keys nothing
        kinds = _subclasses(keras.optimizers.Optimizer) - _subclasses(StableOptimizer)
        left += [
            obj
            # type() in a set: a fraction of the cost of isinstance over every object (which
            # also reads __class__, computed by some objects: torch's deprecated attributes warn)
            for obj in gc.get_objects()
            if type(obj) in kinds and any(id(v) in ids for v in _keras_compat.built_variables(obj))
        ]
    return [opt for opt in left if _steps(opt) > 0]


def check_bound_passed(model: keras.Model, saved: Iterable[object], verb: str) -> None:
    """Refuse a save of ``model`` that leaves out an optimizer that trains it and has stepped
    (``iterations > 0``), whose slots and iteration count would not be saved: a
    [`StableOptimizer`][keras_stable_state.StableOptimizer] bound to it
    (``StableOptimizer(inner, model=model)``, ``bind(model)``) that is not (inside) one of
    ``saved`` (the optimizers the save writes), or, where ``saved`` is empty, a Keras
    optimizer built on the model's trainable variables (a custom loop's, the model not
    compiled with it).

    Raises:
        StateError: naming the optimizer and the fix, ``optimizer=``.
    """
    left = _stepped_unsaved(model, list(saved))
    if not left:
        return
    opt = left[0]
    steps = _steps(opt)
    raise StateError(
        f"The optimizer {opt.name!r} ({type(opt).__name__}) trains model {model.name!r} and has stepped {steps} "
        f"times, but {verb} was not given it (the model is not compiled with it): its slots and iteration count "
        f"would not be saved, and a resume would restart them fresh. Pass it: {verb}(..., optimizer=opt) "
        "(a CheckpointManager: mgr.save(step, model, optimizer=opt)), and the same optimizer= to the restore.",
        key=opt.name,
        expected="optimizer=<the optimizer that trains the model>",
        received=None,
    )
