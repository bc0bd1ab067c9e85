"""The variable lists optimizers keep, ``MultiOptimizer``'s routing tables, the hand-over of
a wrapped optimizer's save/load to ``StableOptimizer``, and undoing an optimizer build.

The save/load methods of an optimizer wrapped by ``StableOptimizer`` are
replaced here (`hand_over`): while wrapped, its state is saved and
loaded by key by the wrapper; used on its own after being taken out of the
wrapper, they raise a [`StateError`][keras_stable_state.StateError].
"""

from __future__ import annotations

from typing import Any

import keras

from keras_stable_state.errors import StateError

__all__ = [
    "arm",
    "build_routed",
    "built_variables",
    "group_of",
    "hand_over",
    "iterations_variable",
    "learning_rate_variable",
    "own_variables",
    "set_built_variables",
    "snapshot_unbuilt",
    "sub_optimizers",
    "var_key",
]


def built_variables(optimizer) -> list:
    """The variables ``optimizer`` was built with (``_trainable_variables``), ``[]`` if none."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def set_built_variables(optimizer, variables) -> None:
    """Record ``variables`` as those ``optimizer`` is built with (what Keras' ``build`` sets)."""
    optimizer._trainable_variables = list(variables)


def own_variables(optimizer) -> list:
    """Every variable ``optimizer`` itself tracks (``_variables``): slots and its own."""
    return list(optimizer._variables)


def iterations_variable(optimizer):
    return getattr(optimizer, "_iterations", None)


def learning_rate_variable(optimizer: Any) -> Any:
    """The learning-rate variable (``None`` for a schedule, or an optimizer without one)."""
    return getattr(optimizer, "_learning_rate", None)


def var_key(optimizer, variable):
    """Keras' ``_var_key`` (the key its optimizers index per-variable tables by)."""
    return optimizer._var_key(variable)


def sub_optimizers(optimizer):
    """A ``MultiOptimizer``'s groups (``_inner_optimizers``), or ``None``."""
    return getattr(optimizer, "_inner_optimizers", None)


def group_of(multi, variable) -> int:
    """The index of the group a built ``MultiOptimizer`` routes ``variable`` to."""
    return int(multi._var_to_optimizer_idx[multi._var_key(variable)])


def build_routed(multi, variables, group_for) -> None:
    """Build a ``MultiOptimizer`` with each variable in the group ``group_for(variable)``
    names (an index into its groups; ``None``: its pattern decides)."""
    subs = multi._inner_optimizers
    multi._var_to_optimizer_idx = {}
    multi._trainable_variables_indices = {}
    per_group = [[] for _ in subs]
    for i, var in enumerate(variables):
        idx = group_for(var)
        if idx is None:
            idx = subs.index(multi._optimizer_map(var))
        multi._var_to_optimizer_idx[multi._var_key(var)] = idx
        multi._trainable_variables_indices[multi._var_key(var)] = i
        per_group[idx].append(var)
    for sub, group in zip(subs, per_group, strict=True):
        if group:
            sub.build(group)
    super(keras.optimizers.MultiOptimizer, multi).build(variables)


class _WrappedHook:
    """``save_own_variables`` / ``load_own_variables`` of an optimizer inside a
    ``StableOptimizer``. Keras' saving walk reaches it right after the wrapper, which
    saved or loaded its state by key and armed this hook: it then does nothing. Called
    unarmed, the optimizer is being saved or loaded on its own (taken out of the
    wrapper), where it would silently save or load nothing: it raises."""

    def __init__(self, optimizer, wrapper_name, verb):
        self.name = f"{optimizer.name!r} ({type(optimizer).__name__})"
        self.wrapper_name = wrapper_name
        self.verb = verb
        self.armed = False

    def __call__(self, store):
        if self.armed:
            self.armed = False
            return None
        raise StateError(
            f"Optimizer {self.name} was wrapped by StableOptimizer {self.wrapper_name!r}, which "
            f"{self.verb}s its state by key; it cannot {self.verb} its state on its own (its "
            f"{self.verb}_own_variables belongs to the wrapper), so {'saving' if self.verb == 'save' else 'loading'} "
            "it outside the wrapper would silently leave its slots out. Compile the model with the "
            "StableOptimizer, or with a new optimizer of its own (`type(opt).from_config(opt.get_config())`).",
            key=self.name,
            expected=f"StableOptimizer {self.wrapper_name!r}",
            received=self.name,
        )


def hand_over(optimizers, wrapper_name) -> None:
    """Replace the save/load methods of ``optimizers`` (every optimizer inside a
    ``StableOptimizer``) with hooks that only the wrapper arms (`arm`)."""
    for opt in optimizers:
        for verb in ("save", "load"):
            if not isinstance(opt.__dict__.get(f"{verb}_own_variables"), _WrappedHook):
                setattr(opt, f"{verb}_own_variables", _WrappedHook(opt, wrapper_name, verb))


def arm(optimizers, verb) -> None:
    """Let the next ``<verb>_own_variables`` call of each of ``optimizers`` (from Keras'
    saving walk, right after the wrapper's) pass."""
    for opt in optimizers:
        hook = opt.__dict__.get(f"{verb}_own_variables")
        if isinstance(hook, _WrappedHook):
            hook.armed = True


# -- undoing an optimizer build -------------------------------------------------------------
def _optimizer_tree(optimizer) -> list:
    """``optimizer`` and every optimizer it holds (an inner optimizer, MultiOptimizer's groups)."""
    found, todo = [], [optimizer]
    while todo:
        opt = todo.pop()
        if any(opt is f for f in found):
            continue
        found.append(opt)
        for value in vars(opt).values():
            items = value if isinstance(value, list | tuple) else [value]
            todo += [v for v in items if isinstance(v, keras.optimizers.Optimizer)]
    return found


def _containers(obj) -> list:
    """``(container, copy of its items)`` for the lists, dicts and sets in ``obj.__dict__``
    (Keras' tracked lists and TensorFlow's dependency lists among them) and the tracker's id sets."""
    kept = []
    values = list(vars(obj).values())
    tracker = vars(obj).get("_tracker")
    if tracker is not None:
        values += list(getattr(tracker, "stored_ids", {}).values())
    for value in values:
        for kind in (list, dict, set):
            if isinstance(value, kind):
                # TensorFlow's _DictWrapper is a proxy (wrapt) of a plain dict: keep the dict.
                if not issubclass(type(value), kind) and issubclass(
                    type(getattr(value, "__wrapped__", None)), kind
                ):
                    value = value.__wrapped__
                kept.append((value, kind(value)))
                # TensorFlow's ListWrapper / DictWrapper keep their items in a plain `_storage`.
                inner = getattr(value, "__dict__", {}).values()
                kept += [(c, type(c).copy(c)) for c in inner if type(c) in (list, dict, set)]
    return kept


def snapshot_unbuilt(optimizers):
    """A callable that puts every unbuilt optimizer of ``optimizers`` (and the optimizers
    it holds) back as it is now: unbuilt, without the variables a build created.

    ``Optimizer.build`` only adds attributes, replaces a few (``built``,
    ``_trainable_variables``) and appends to the variable lists and the tracker's
    id sets; the snapshot keeps the attribute dict and the items of every list,
    dict and set in it, and the undo puts them back in place (bypassing Keras'
    attribute tracking). Built optimizers are not touched.
    """
    saved = []
    for top in optimizers:
        if top is None or getattr(top, "built", True):
            continue
        for opt in _optimizer_tree(top):
            saved.append((opt, dict(vars(opt)), _containers(opt)))

    def undo():
        for opt, attrs, containers in saved:
            state = vars(opt)
            for name in [n for n in state if n not in attrs]:
                del state[name]
            state.update(attrs)
            for container, items in containers:
                type(items).clear(container)
                (list.extend if isinstance(items, list) else type(items).update)(container, items)

    return undo
