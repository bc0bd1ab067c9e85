"""Optimizer variables keyed by the model variable they belong to.

`optimizer_entries` keys every variable of a built optimizer (and of the
optimizers it wraps, `optimizer_tree`): a slot by the key of the model
variable `SlotOwners` finds
it belongs to, an optimizer's own variable by its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import keras

from keras_stable_state import _keras_compat
from keras_stable_state._identity import keys
from keras_stable_state._identity.keys import EXTRA, VariableKey, entry_prefix
from keras_stable_state._identity.registry import ModelIndex, VariableRegistry
from keras_stable_state._optimizer.attribution import ACCEPTED_CONTAINERS, SlotOwners, global_name
from keras_stable_state.errors import BindingError, StateError

__all__ = [
    "OptimizerEntry",
    "keyed_optimizer_entries",
    "optimizer_classes",
    "optimizer_entries",
    "optimizer_registry",
    "optimizer_tree",
    "unbound_message",
    "unwrap",
]


@dataclasses.dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer variable and what it belongs to.

    Attributes:
        key: ``"<variable key>#<slot>"`` for a slot (e.g.
            ``"path:layers/dense/kernel#momentums"``) or ``"optimizer#<name>"``
            for a variable of the optimizer itself (``"optimizer#iteration"``).
        variable: The optimizer variable.
        reference: The model variable a slot belongs to, ``None`` for globals.
    """

    key: str
    variable: object
    reference: object = None

    @property
    def is_slot(self) -> bool:
        return self.reference is not None


def unwrap(optimizer):
    """The optimizer a ``StableOptimizer`` wraps, else ``optimizer`` itself.

    A ``StableOptimizer`` is transparent: its slots are its inner optimizer's, keyed
    without a prefix of its own. It is known by its class attribute
    ``wraps_transparently = True``, so that this module need not import the wrapper
    (which imports this one).
    """
    if getattr(type(optimizer), "wraps_transparently", False):
        return optimizer.inner_optimizer
    return optimizer


def optimizer_tree(optimizer: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(prefix, optimizer)`` for the optimizer and every optimizer it wraps
    (a ``StableOptimizer`` itself is skipped, see `unwrap`)."""
    if unwrap(optimizer) is not optimizer:
        yield from optimizer_tree(unwrap(optimizer), prefix)
        return
    yield prefix, optimizer
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(inner, keras.optimizers.Optimizer):
        yield from optimizer_tree(inner, f"{prefix}inner_optimizer/")
    subs = _keras_compat.sub_optimizers(optimizer)
    if isinstance(optimizer, keras.optimizers.MultiOptimizer) and subs:
        for i, sub in enumerate(subs):
            yield from optimizer_tree(sub, f"{prefix}optimizers/{i}/")


def optimizer_entries(
    optimizer: Any,
    registry: VariableRegistry | None = None,
    *,
    name: str | None = None,
    allow_order_keys: bool = False,
) -> list[OptimizerEntry]:
    """Key every variable of a built optimizer.

    Slots are attributed to their model variable whatever container the
    optimizer keeps them in: lists aligned with the variables it was built
    with (every Keras optimizer), dicts keyed by the variable, its id or its
    ``path``, lists of ``(variable, slot)`` pairs, and otherwise the name
    ``add_variable_from_reference`` gave the slot. A variable that none of these
    attributes and whose name another variable of the optimizer shares is
    refused by name: telling them apart would depend on their order.

    Args:
        optimizer: A built ``keras.optimizers.Optimizer`` (any kind, wrapped or not).
        registry: Keys for the model variables the optimizer was built with;
            default: registration-order keys over the optimizer's own variable
            list (only with ``allow_order_keys=True``).
        name: The optimizer's name among several (``"g_optimizer"``); its slot
            keys then read ``"<variable key>#@g_optimizer/<slot>"``. ``None`` or
            ``"optimizer"``: no prefix.
        allow_order_keys: Accept slots keyed by registration order
            (``order:<i>#<slot>``) for variables the registry has no stable path
            for. Off by default: such a key matches whichever variable is at
            that position when restored.

    Returns:
        A list of `OptimizerEntry`, one per variable in
        ``optimizer.variables``, in that order (model variables an optimizer
        tracks because it holds them, e.g. in ``(variable, slot)`` pairs, are
        not its state and are left out).

    Raises:
        StateError: if the optimizer is not built, or holds a variable that is
            neither one of its own nor attributed to a model variable.
        BindingError: if a slot would get a registration-order key and
            ``allow_order_keys`` is False (naming the variables), if a slot is
            found for two different variables, or if two unattributed variables
            share a name (an order-dependent match; naming them).
    """
    top = unwrap(optimizer)
    if not optimizer.built:
        raise StateError(
            f"Optimizer {optimizer.name!r} is not built, so it has no slots to key. "
            "Call `optimizer.build(model.trainable_variables)` first.",
        )
    if registry is None:
        if not allow_order_keys:
            raise BindingError(unbound_message(optimizer), key=optimizer.name)
        registry = VariableRegistry.from_model(None, _keras_compat.built_variables(top))
    head = entry_prefix(name)
    by_id = {}
    ordered = []
    model_vars = set()  # model variables an optimizer tracks by holding them (pairs): not its state
    for prefix, opt in optimizer_tree(optimizer):
        slots = SlotOwners(opt)
        model_vars |= set(slots.ref_ids)
        if slots.conflicts:
            var, found = slots.conflicts[0]
            raise BindingError(
                f"Optimizer variable {var.name!r} of {type(opt).__name__} is held as a slot of two "
                f"model variables, {[str(getattr(r, 'path', r)) for r, _ in found]}; it cannot be "
                f"restored onto one of them. Please {ACCEPTED_CONTAINERS}.",
                key=str(var.name),
            )
        used, unnamed = {}, []
        for index, var in enumerate(_keras_compat.own_variables(opt)):
            if id(var) in by_id or id(var) in model_vars:
                continue
            hit = slots.by_var.get(id(var))
            if hit is None and id(var) not in slots.own_ids:
                hit = slots.by_name(var)
            if hit is not None:
                ref, slot = hit
                vkey = registry.key_of(ref)
                if not vkey.named:
                    ordered.append(ref)
                by_id[id(var)] = OptimizerEntry(keys.slot_key(vkey, f"{head}{prefix}{slot}"), var, ref)
                continue
            gname = global_name(opt, var, index)
            used.setdefault(gname, []).append(var)
            unnamed.append((gname, var))
        shared = {g: vs for g, vs in used.items() if len(vs) > 1}
        if shared:
            raise BindingError(
                f"{type(opt).__name__} holds optimizer variables that share a name and belong to no "
                f"model variable it can find: {sorted((g, len(vs)) for g, vs in shared.items())} "
                "(name, count). Matching them would depend on their order, which changes when the "
                f"model's variables come out in another order. Please {ACCEPTED_CONTAINERS}.",
                key=sorted(shared)[0],
            )
        for gname, var in unnamed:
            by_id[id(var)] = OptimizerEntry(keys.global_key(f"{head}{prefix}{gname}"), var)
    if ordered and not allow_order_keys:
        paths = sorted({str(getattr(r, "path", r)) for r in ordered})
        raise BindingError(
            f"Slots of {type(top).__name__} belong to variables {paths} that the bound model does not "
            "reach, so they have no stable key and would be keyed by registration order (a restore "
            "would put them on whatever variable sits at that position). Bind the model that holds "
            "these variables (the whole model, not a sub-model), or pass allow_order_keys=True to "
            "key them by order (the restore report lists them).",
            key=paths[0],
            expected="variables of the bound model",
            received=paths,
        )
    entries = []
    for var in optimizer.variables:
        if id(var) in model_vars and id(var) not in by_id:
            continue
        if id(var) not in by_id:
            raise StateError(
                f"Optimizer variable {var.path!r} of {type(optimizer).__name__} is neither the "
                "optimizer's own nor aligned with a model variable, so it cannot be keyed. "
                "Please report this optimizer to keras_stable_state.",
                key=var.path,
            )
        entries.append(by_id[id(var)])
    return entries


def unbound_message(optimizer) -> str:
    """Why an unbound optimizer's slots cannot be keyed, and how to bind it."""
    return (
        f"Optimizer {optimizer.name!r} ({type(optimizer).__name__}) is not bound to a model, so its "
        "slots have no stable keys. Bind it explicitly: `StableOptimizer(inner, model=model)` or "
        "`optimizer.bind(model)` (save_training_state, restore_training_state and StableCheckpoint bind "
        "the model they are given). To key slots by registration order instead, pass "
        "allow_order_keys=True (a restore then matches them by position, and its report says so)."
    )


def optimizer_classes(optimizer) -> list:
    """``["AdamW"]``, ``["LossScaleOptimizer", "inner_optimizer/Adam"]``: the classes that
    decide how slots are used (a ``StableOptimizer`` wrapper is transparent)."""
    return [f"{prefix}{type(opt).__name__}" for prefix, opt in optimizer_tree(optimizer)]


def optimizer_registry(optimizer, model, extras=None, index=None):
    """Keys for the variables the optimizer was built with: the model's stable paths,
    ``var:<name>`` for the caller's ``extras``, registration order for the rest (from the
    walk of ``index``, the call's `ModelIndex` of ``model``, when given)."""
    registry = ModelIndex.of(model, index).registry(_keras_compat.built_variables(unwrap(optimizer)))
    if not extras:
        return registry
    names = {id(v): VariableKey(EXTRA, name) for name, v in extras.items()}
    return registry.rekeyed([(names.get(id(v), key), v) for key, v in registry.entries])


def keyed_optimizer_entries(optimizer, model, extras=None, **kwargs) -> list:
    """`optimizer_entries` keyed by ``model``'s paths and ``extras``' names."""
    return optimizer_entries(optimizer, optimizer_registry(optimizer, model, extras), **kwargs)
