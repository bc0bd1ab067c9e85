"""Which model variable each slot of one optimizer belongs to, found without relying on order.

Every Keras optimizer keeps its slots in lists aligned with the variables it
was built with (``self._momentums[self._get_variable_index(v)]``, see
``keras/src/optimizers/adam.py``); `SlotOwners` reads that alignment,
and also dicts keyed by variable, lists of ``(variable, slot)`` pairs and the
names ``add_variable_from_reference`` gives, so a slot is attributed to its
model variable without touching the training step.
"""

from __future__ import annotations

import re

import keras

from keras_stable_state import _keras_compat
from keras_stable_state.errors import BindingError

__all__ = ["ACCEPTED_CONTAINERS", "SlotOwners", "global_name"]

# Attributes every optimizer keeps that are not per-variable slots (the tracked variables
# themselves and the variables it was built with).
_NOT_SLOTS = frozenset({"_variables", "_trainable_variables", "_tracker"})
ACCEPTED_CONTAINERS = (
    "keep slots in a list aligned with the variables the optimizer was built with "
    "(`self._m = [self.add_variable_from_reference(v, 'm') for v in var_list]`), in a dict keyed "
    "by `variable.path` or `self._var_key(variable)`, in a list of `(variable, slot)` pairs, or create "
    "each with `add_variable_from_reference(variable, name)` so its name names its variable"
)


def _mangled(ref) -> str | None:
    """The prefix ``add_variable_from_reference`` gives a slot of ``ref``: its path with ``/`` -> ``_``."""
    path = getattr(ref, "path", None)
    return None if path is None else str(path).replace("/", "_") + "_"


class SlotOwners:
    """Which model variable each slot of one optimizer belongs to, found without
    relying on order: aligned lists, dicts keyed by variable, lists of pairs, and
    (`by_name`) the names ``add_variable_from_reference`` gives.

    Args:
        optimizer: One optimizer (not the ones it wraps; see ``entries.optimizer_tree``).

    Attributes:
        refs: The variables the optimizer was built with, in its order.
        ref_ids: ``{id(variable): variable}`` of ``refs``: model variables the
            optimizer holds (e.g. in ``(variable, slot)`` pairs) are not its state.
        own_ids: ``id`` of the optimizer's ``iterations`` and learning-rate
            variables, never slots.
        by_var: ``{id(slot variable): (model variable, slot name)}``.
        conflicts: ``(slot variable, [(model variable, slot name), ...])`` for
            each slot found for two different model variables.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.refs = _keras_compat.built_variables(optimizer)
        self.by_var = {}  # id(slot variable) -> (ref, slot name)
        self.conflicts = []  # (slot variable, [(ref, slot name), ...]) found twice, differently
        self.ref_ids = {id(v): v for v in self.refs}
        self._by_var_key = {}
        for ref in self.refs:
            try:
                self._by_var_key[_keras_compat.var_key(optimizer, ref)] = ref
            except (AttributeError, TypeError):  # an optimizer without Keras' _var_key
                pass
        self._by_path = {}
        for ref in self.refs:
            self._by_path.setdefault(str(getattr(ref, "path", "")), []).append(ref)
        own = (_keras_compat.iterations_variable(optimizer), _keras_compat.learning_rate_variable(optimizer))
        self.own_ids = {id(v) for v in own if v is not None}
        if self.refs:
            self._walk()

    def _add(self, var, ref, slot):
        if var is None or id(var) in self.own_ids or id(var) in self.ref_ids:
            return
        found = self.by_var.get(id(var))
        if found is None:
            self.by_var[id(var)] = (ref, slot)
        elif found[0] is not ref:
            self.conflicts.append((var, [found, (ref, slot)]))

    def _ref_of_key(self, key):
        """The built variable a dict key stands for (the variable, its id, or its path)."""
        if isinstance(key, keras.Variable) and id(key) in self.ref_ids:
            return key
        if isinstance(key, int) and key in self.ref_ids:
            return self.ref_ids[key]
        if isinstance(key, int) and key in self._by_var_key:  # Keras' `_var_key` (TensorFlow: _unique_id)
            return self._by_var_key[key]
        if isinstance(key, str):
            refs = self._by_path.get(key, [])
            return refs[0] if len(refs) == 1 else None
        return None

    def _walk(self):
        n = len(self.refs)
        for attr, value in sorted(vars(self.optimizer).items()):
            if attr in _NOT_SLOTS:
                continue
            slot = attr.lstrip("_")
            if isinstance(value, (list, tuple)) and value:
                if all(
                    isinstance(x, tuple) and len(x) == 2 and any(id(y) in self.ref_ids for y in x)
                    for x in value
                ):
                    for a, b in value:  # a list of (variable, slot) or (slot, variable) pairs
                        ref, var = (a, b) if id(a) in self.ref_ids else (b, a)
                        if isinstance(var, keras.Variable):
                            self._add(var, ref, slot)
                    continue
                if len(value) == n and all(x is None or isinstance(x, keras.Variable) for x in value):
                    if any(x is not None and id(x) in self.ref_ids for x in value):
                        continue
                    for ref, var in zip(self.refs, value, strict=True):  # aligned with the built list
                        self._add(var, ref, slot)
            elif isinstance(value, dict) and value:
                for key, var in value.items():
                    ref = self._ref_of_key(key)
                    if ref is not None and isinstance(var, keras.Variable):
                        self._add(var, ref, slot)

    def by_name(self, var):
        """``(ref, slot name)`` from a name ``add_variable_from_reference`` made, or ``None``;
        raises if two built variables' paths give that name."""
        name = str(var.name)
        hits = [(ref, p) for ref in self.refs if (p := _mangled(ref)) and name.startswith(p) and name != p]
        if not hits:
            return None
        longest = max(len(p) for _, p in hits)
        hits = [(ref, p) for ref, p in hits if len(p) == longest]
        if len(hits) > 1:
            raise BindingError(
                f"Optimizer variable {name!r} of {type(self.optimizer).__name__} is named after a model "
                f"variable, but {[str(r.path) for r, _ in hits]} all give that name, so which one it "
                f"belongs to is ambiguous. Give the layers distinct names, or {ACCEPTED_CONTAINERS}.",
                key=name,
            )
        ref, prefix = hits[0]
        return ref, name[len(prefix) :]


def global_name(optimizer, var, index) -> str:
    """A stable name for an optimizer's own variable.

    Its variable name when the optimizer chose one (``iteration``,
    ``learning_rate``, ``step_counter``); for an unnamed variable, whose name
    Keras numbers with a process-global counter (``variable_3``, e.g. Nadam's
    ``_u_product``), the attribute holding it, else its registration index.
    """
    name = str(var.name).rsplit("/", 1)[-1]
    if not re.fullmatch(r"variable(_[0-9]+)?", name):
        return name
    for attr, value in sorted(vars(optimizer).items()):
        if value is var:
            return attr.lstrip("_")
    return f"variable@{index}"
