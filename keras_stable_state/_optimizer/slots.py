"""The slots of every optimizer a model tracks, keyed on save.

``model.optimizer`` and optimizer attributes (`save_optimizers`), each
built first when it is not (`ensure_built`, `build_for`: on the
model's trainable variables, or on the variables it was saved with), and
refused when it trains variables outside the model (`check_inside`).
Restoring matches saved slots to live ones in `keras_stable_state._optimizer.matching`;
``restore_training_state`` plans them in `keras_stable_state._core.slot_restore`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import keras

from keras_stable_state import _keras_compat
from keras_stable_state._identity.keys import MAIN
from keras_stable_state._identity.registry import ModelIndex
from keras_stable_state._numpy import to_numpy
from keras_stable_state._optimizer.entries import (
    optimizer_classes,
    optimizer_entries,
    optimizer_registry,
    optimizer_tree,
    unwrap,
)
from keras_stable_state._optimizer.groups import accumulation, build_routed, routing
from keras_stable_state._optimizer.tracking import stable_optimizer_in
from keras_stable_state._optimizer.wrapper import bind_unchecked
from keras_stable_state.errors import BindingError, StateError

__all__ = [
    "build_for",
    "check_counter",
    "check_inside",
    "check_not_nested",
    "ensure_built",
    "save_optimizers",
]


def check_inside(optimizer, model, extras, verb):
    """Refuse an optimizer that trains variables neither in ``model`` nor in ``extras``."""
    inside = {id(v) for v in model.variables} | {id(v) for v in extras.values()}
    outside = [v for v in _keras_compat.built_variables(unwrap(optimizer)) if id(v) not in inside]
    if not outside:
        return
    paths = [str(getattr(v, "path", v.name)) for v in outside]
    names = [re.sub(r"[/#\s]", "_", str(v.name).rsplit("/", 1)[-1]) or "name" for v in outside]
    hint = ", ".join(f"'{n}': {n}" for n in names[:3]) + (", ..." if len(names) > 3 else "")
    raise BindingError(
        f"Optimizer {optimizer.name!r} trains {len(outside)} variable(s) outside model {model.name!r}: "
        f"{paths}. Their values would not be saved with the model and their slots could only be "
        "keyed by registration order, so they are refused. Variables of no model (a temperature, "
        f"a loss weight): pass them by name, {verb}(..., variables={{{hint}}}), and the same "
        "`variables=` to both save_training_state and restore_training_state. Variables of an "
        f"outer model that contains {model.name!r}: use that model, with prefix='layers/<name>' "
        f"to restore a state saved from {model.name!r} alone.",
        key=paths[0],
        expected=f"variables of model {model.name!r} or in `variables`",
        received=paths,
    )


def build_for(name, opt, model, meta, report, where, extras=None, index=None):
    """Build an unbuilt optimizer: ``model.optimizer`` on the model's trainable variables,
    any other on the variables it was saved with; a ``MultiOptimizer`` routed as saved
    (``index``: the restore's `ModelIndex` of ``model``, whose walk keys them)."""
    if opt.built:
        return
    index = ModelIndex.of(model, index)
    if name == MAIN:
        # Never fewer variables than the model trains (not the nested model of a wrapper).
        check_not_nested(opt, model)
        variables = [*model.trainable_variables, *(v for v in (extras or {}).values() if v.trainable)]
    else:
        saved = (meta or {}).get("variables")
        if not isinstance(saved, list):
            raise BindingError(
                f"Optimizer {name!r} is not built and {where} does not say which variables it trains; "
                f"build it on them (`model.{name}.build(model.<part>.trainable_variables)`) before "
                "restoring.",
                key=name,
            )
        by_key = {str(k): v for k, v in index.registry().entries}
        absent = [k for k in saved if k not in by_key]
        if absent:
            raise BindingError(
                f"Optimizer {name!r} is not built, and the variables it was saved with in {where} are "
                f"not all in the model (missing: {absent}); build it on the variables it trains "
                f"(`model.{name}.build(...)`) before restoring.",
                key=absent[0],
            )
        variables = [by_key[k] for k in saved]
    saved_routing = (meta or {}).get("routing") or {}
    registry = index.registry(variables)
    for prefix, multi in optimizer_tree(opt):
        if isinstance(multi, keras.optimizers.MultiOptimizer) and not multi.built and prefix in saved_routing:
            build_routed(multi, variables, registry, saved_routing[prefix])
    opt.build(variables)
    if report is not None:
        report.built_optimizer = True


def save_optimizers(
    optimizers: dict[str, Any],
    model: Any,
    allow_order_keys: bool,
    extras: dict[str, Any] | None = None,
    convert: Callable[[Any], Any] = to_numpy,
    index: ModelIndex | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyed arrays of every optimizer (each variable passed through ``convert``), and per
    optimizer: classes, variables, groups, windows (keyed from ``index``, the save's
    `ModelIndex` of ``model``, when given)."""
    arrays, meta = {}, {}
    for name, opt in optimizers.items():
        if not opt.built and name != MAIN:
            meta[name] = {"classes": optimizer_classes(opt), "built": False}
            continue
        ensure_built(opt, model, extras=extras)
        if stable_optimizer_in(opt) is not None:
            bind_unchecked(stable_optimizer_in(opt), model)  # bound to the model given
        allow = allow_order_keys or getattr(opt, "allow_order_keys", False)
        if not allow:
            check_inside(opt, model, extras or {}, "save_training_state")
        registry = optimizer_registry(opt, model, extras, index)
        counters = {
            id(c): c
            for _, o in optimizer_tree(opt)
            if (c := _keras_compat.iterations_variable(o)) is not None
        }
        for entry in optimizer_entries(opt, registry, name=name, allow_order_keys=allow):
            if id(entry.variable) in counters:
                check_counter(entry.key, entry.variable, opt)
            # Converted when written, one at a time (storage.StateRecord takes callables).
            arrays[entry.key] = functools.partial(convert, entry.variable)
        meta[name] = {
            "classes": optimizer_classes(opt),
            "variables": [
                str(registry.key_of(v)) for v in _keras_compat.built_variables(unwrap(opt)) if v in registry
            ],
            "routing": routing(opt, registry),
            "accumulation": accumulation(opt),
        }
    return arrays, meta


def check_counter(key, counter, optimizer) -> None:
    """Refuse to save the ``iterations`` counter ``counter`` (saved as ``key``) of
    ``optimizer`` once it is negative: Keras keeps it as ``int32`` on JAX and Torch, and
    past 2**31 - 1 steps it wraps to -2**31 without a word."""
    count = int(to_numpy(counter))
    if count >= 0:
        return
    dtype = keras.backend.standardize_dtype(counter.dtype)
    raise StateError(
        f"Cannot save the training state: the iteration counter {key} of optimizer {optimizer.name!r} "
        f"({type(optimizer).__name__}) is {count}, negative: it is a {dtype} on the "
        f"{keras.backend.backend()} backend and wrapped around past its maximum, so learning-rate "
        "schedules and Adam's bias correction are already broken and a resume would continue from "
        "the wrapped count. Resume from the last checkpoint saved before it wrapped and stop before "
        "the counter's maximum (StableCheckpoint warns at train begin), or train on TensorFlow, "
        "whose counter is int64.",
        key=key,
        expected="an iteration count >= 0",
        received=count,
    )


def ensure_built(optimizer, model, report=None, extras=None):
    if optimizer.built:
        return
    if not model.built:
        raise StateError(
            f"Optimizer {optimizer.name!r} is not built and model {model.name!r} is not built either, "
            "so there are no variables to attach slots to. Build the model first (call it on a batch "
            "or `model.build(input_shape)`).",
        )
    check_not_nested(optimizer, model)
    optimizer.build([*model.trainable_variables, *(v for v in (extras or {}).values() if v.trainable)])
    if report is not None:
        report.built_optimizer = True


def check_not_nested(optimizer, model):
    """Refuse to build ``optimizer`` on a model that is a layer of another model."""
    if optimizer is not getattr(model, "optimizer", None) and _keras_compat.called_as_layer(model):
        raise BindingError(
            f"Optimizer {optimizer.name!r} is not built, and model {model.name!r} is used as a layer "
            "inside another model (it was called on that model's inputs). Building the optimizer here "
            f"would build it on the {len(model.trainable_variables)} trainable variables of "
            f"{model.name!r} only, and the outer model's next fit would fail on its other variables. "
            "Restore into the outer model, which trains every variable: "
            f"restore_training_state(path, outer_model, prefix='layers/{model.name}') for a state "
            f"saved from {model.name!r} alone; or build the optimizer on the outer model first "
            "(optimizer.build(outer_model.trainable_variables)).",
            key=None,
            expected="an optimizer built on the outer model, or the outer model",
            received=model.name,
        )
