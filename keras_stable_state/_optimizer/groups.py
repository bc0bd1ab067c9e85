"""Parameter groups (``MultiOptimizer`` routing) and gradient-accumulation windows.

Recorded per optimizer on save (`routing`, `accumulation`); on
restore an unbuilt ``MultiOptimizer`` is built routed as saved
(`build_routed`) and a changed window or routing is refused
(`check_windows_and_groups`).
"""

from __future__ import annotations

import re

import keras

from keras_stable_state import _keras_compat
from keras_stable_state._identity.keys import MAIN, file_label
from keras_stable_state._identity.registry import ModelIndex
from keras_stable_state._numpy import to_numpy
from keras_stable_state._optimizer.entries import optimizer_registry, optimizer_tree
from keras_stable_state.errors import BindingError

__all__ = ["accumulation", "build_routed", "check_windows_and_groups", "refuse_regrouped", "routing"]


def routing(optimizer, registry) -> dict:
    """``{prefix: {variable key: group index}}`` for every ``MultiOptimizer`` in the optimizer.

    The group of a variable is the index of the sub-optimizer it is routed to
    (``optimizer.optimizers[i]``); its slots are keyed ``...#optimizers/<i>/<slot>``.
    """
    out = {}
    for prefix, opt in optimizer_tree(optimizer):
        if isinstance(opt, keras.optimizers.MultiOptimizer) and opt.built:
            out[prefix] = {
                str(registry.key_of(v)): _keras_compat.group_of(opt, v)
                for v in _keras_compat.built_variables(opt)
                if v in registry
            }
    return out


def accumulation(optimizer) -> dict:
    """``{prefix: {"steps": k, "position": micro-steps into the open window}}`` for every
    optimizer in the tree with ``gradient_accumulation_steps``."""
    out = {}
    for prefix, opt in optimizer_tree(optimizer):
        k = getattr(opt, "gradient_accumulation_steps", None)
        if k:
            iterations = _keras_compat.iterations_variable(opt)
            position = int(to_numpy(iterations)) % int(k) if opt.built else 0
            out[prefix] = {"steps": int(k), "position": position}
    return out


def build_routed(multi, variables, registry, groups):
    """Build a ``MultiOptimizer`` routing each variable to the group it was saved in
    (its pattern decides only for variables the file has no group for)."""
    n = len(_keras_compat.sub_optimizers(multi) or ())
    if not n or any(not isinstance(g, int) or not 0 <= g < n for g in groups.values()):
        return  # a callable selector adds its groups while building: route by it, compare later
    _keras_compat.build_routed(multi, variables, lambda var: groups.get(str(registry.key_of(var))))


def check_windows_and_groups(name, opt, model, meta, where, index=None):
    """Refuse a changed accumulation window or parameter-group routing, naming it (``index``:
    the restore's `ModelIndex` of ``model``, whose walk keys the variables)."""
    label = "model.optimizer" if name == MAIN else f"optimizer {name!r}"
    saved_acc = meta.get("accumulation") or {}
    live_acc = accumulation(opt)
    for prefix in sorted(set(saved_acc) | set(live_acc)):
        saved_k = (saved_acc.get(prefix) or {}).get("steps")
        live_k = (live_acc.get(prefix) or {}).get("steps")
        if saved_k != live_k:
            position = (saved_acc.get(prefix) or {}).get("position", 0)
            window = (
                f"The checkpoint was taken {position} micro-step(s) into an accumulation window of "
                f"{saved_k}: those accumulated gradients belong to a window of {saved_k}. "
                if position
                else ""
            )
            raise BindingError(
                f"{label}{' (' + prefix.rstrip('/') + ')' if prefix else ''} in {where} was saved with "
                f"gradient_accumulation_steps={saved_k}, the live one has gradient_accumulation_steps="
                f"{live_k}. {window}The iteration counter counts micro-steps, so the update count, the "
                "learning-rate schedule and the bias corrections would change too. Build the optimizer "
                f"with gradient_accumulation_steps={saved_k} to resume this checkpoint.",
                key="gradient_accumulation_steps",
                expected=saved_k,
                received=live_k,
            )
    saved_routing = meta.get("routing") or {}
    if not saved_routing:
        return
    index = ModelIndex.of(model, index)
    registry = optimizer_registry(opt, model, index=index)
    live_routing = routing(opt, registry)
    moved = []
    for prefix, groups in sorted(saved_routing.items()):
        live = live_routing.get(prefix, {})
        multi = dict(optimizer_tree(opt)).get(prefix)
        subs = list(_keras_compat.sub_optimizers(multi) or [])
        for key, group in sorted(groups.items()):
            now = live.get(key)
            if now is not None and now != group:
                var = registry.variable_of(index.keys.parse(key))
                sub = type(subs[now]).__name__ if now < len(subs) else "?"
                moved.append(
                    f"{key}: saved in group {group}, the live MultiOptimizer routes it to group {now} "
                    f"({sub}; its pattern sees variable.path {str(getattr(var, 'path', '?'))!r})"
                )
    if moved:
        raise BindingError(
            f"The parameter groups of {label} differ from the ones saved in {where}: "
            + "; ".join(moved)
            + ". Each group's slots (and its learning rate and clipping) would be applied to other "
            "variables. MultiOptimizer routes by `variable.path`, which holds Keras' auto-generated layer "
            "names: name the layers your patterns match (see docs: parameter groups), or restore into an "
            "optimizer that is not built yet (the restore then routes every variable to its saved group).",
            key=moved[0].split(":")[0] + ":" + moved[0].split(":")[1],
            expected=saved_routing,
            received=live_routing,
        )


def refuse_regrouped(key, live_key, live_by_key, optimizer, where):
    """A saved slot of group ``optimizers/<i>/`` whose variable the live MultiOptimizer has
    in another group: refuse naming the routing change."""
    pattern = re.compile(r"optimizers/[0-9]+/")
    if not pattern.search(live_key):
        return
    shape = pattern.sub("optimizers/*/", live_key)
    elsewhere = [k for k in live_by_key if pattern.sub("optimizers/*/", k) == shape]
    if not elsewhere:
        return
    saved_group = pattern.search(live_key).group(0)
    live_group = pattern.search(elsewhere[0]).group(0)
    var = live_by_key[elsewhere[0]].reference
    raise BindingError(
        f"Parameter groups differ: {key} in {file_label(where)} was saved in group {saved_group.rstrip('/')}, "
        f"but the live MultiOptimizer routes its variable to group {live_group.rstrip('/')} ({elsewhere[0]}); "
        f"its pattern sees variable.path {str(getattr(var, 'path', '?'))!r}. Each group's slots, learning "
        "rate and clipping would be applied to other variables. MultiOptimizer routes by `variable.path`, "
        "which holds Keras' auto-generated layer names: name the layers your patterns match (see docs: "
        "parameter groups), or restore with kss.restore_training_state into an optimizer that is not "
        "built yet (it then routes every variable to its saved group).",
        key=key,
        expected=saved_group.rstrip("/"),
        received=live_group.rstrip("/"),
    )
