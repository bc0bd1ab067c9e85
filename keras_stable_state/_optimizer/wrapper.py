"""Optimizer variables keyed by the model variable they belong to.

Every Keras optimizer keeps its slots in lists aligned with the variables it
was built with (``self._momentums[self._get_variable_index(v)]``, see
``keras/src/optimizers/adam.py``); ``optimizer_entries`` reads that alignment,
so a slot is attributed to its model variable without touching the training
step. :class:`StableOptimizer` wraps any Keras optimizer, delegates every step
to it and saves/loads its variables by key inside ``.keras`` files.
"""

from __future__ import annotations

import dataclasses
import re
import weakref

import keras
import numpy as np

from keras_stable_state import _keras_compat as compat
from keras_stable_state._identity import keys
from keras_stable_state._identity.keys import MAIN, entry_prefix, parse_entry_key
from keras_stable_state._identity.registry import VariableRegistry
from keras_stable_state._numpy import numpy_copy, to_numpy
from keras_stable_state.errors import BindingError, StateError

__all__ = [
    "StableOptimizer",
    "OptimizerEntry",
    "optimizer_entries",
    "parse_entry_key",
    "tracked_optimizers",
]

# The key grammar (entry keys, optimizer names, parse_entry_key) lives in keys.py.
_BASE_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


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


def optimizer_tree(optimizer, prefix=""):
    """Yield ``(prefix, optimizer)`` for the optimizer and every optimizer it wraps."""
    if isinstance(optimizer, StableOptimizer):
        yield from optimizer_tree(optimizer.inner_optimizer, prefix)
        return
    yield prefix, optimizer
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(inner, keras.optimizers.Optimizer):
        yield from optimizer_tree(inner, f"{prefix}inner_optimizer/")
    subs = compat.sub_optimizers(optimizer)
    if isinstance(optimizer, keras.optimizers.MultiOptimizer) and subs:
        for i, sub in enumerate(subs):
            yield from optimizer_tree(sub, f"{prefix}optimizers/{i}/")


# Attributes every optimizer keeps that are not per-variable slots (the tracked variables
# themselves and the variables it was built with).
_NOT_SLOTS = frozenset({"_variables", "_trainable_variables", "_tracker"})
_ACCEPTED_CONTAINERS = (
    "keep slots in a list aligned with the variables the optimizer was built with "
    "(`self._m = [self.add_variable_from_reference(v, 'm') for v in var_list]`), in a dict keyed "
    "by `variable.path` or `self._var_key(variable)`, in a list of `(variable, slot)` pairs, or create "
    "each with `add_variable_from_reference(variable, name)` so its name names its variable"
)


def _mangled(ref) -> str | None:
    """The prefix ``add_variable_from_reference`` gives a slot of ``ref``: its path with ``/`` -> ``_``."""
    path = getattr(ref, "path", None)
    return None if path is None else str(path).replace("/", "_") + "_"


class _Slots:
    """Which model variable each slot of one optimizer belongs to, found without
    relying on order: aligned lists, dicts keyed by variable, lists of pairs, and
    the names ``add_variable_from_reference`` gives."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.refs = compat.built_variables(optimizer)
        self.by_var = {}  # id(slot variable) -> (ref, slot name)
        self.conflicts = []  # (slot variable, [(ref, slot name), ...]) found twice, differently
        self._ref_ids = {id(v): v for v in self.refs}
        self._by_var_key = {}
        for ref in self.refs:
            try:
                self._by_var_key[compat.var_key(optimizer, ref)] = ref
            except (AttributeError, TypeError):  # an optimizer without Keras' _var_key
                pass
        self._by_path = {}
        for ref in self.refs:
            self._by_path.setdefault(str(getattr(ref, "path", "")), []).append(ref)
        own = (compat.iterations_variable(optimizer), compat.learning_rate_variable(optimizer))
        self._own = {id(v) for v in own if v is not None}
        if self.refs:
            self._walk()

    def _add(self, var, ref, slot):
        if var is None or id(var) in self._own or id(var) in self._ref_ids:
            return
        found = self.by_var.get(id(var))
        if found is None:
            self.by_var[id(var)] = (ref, slot)
        elif found[0] is not ref:
            self.conflicts.append((var, [found, (ref, slot)]))

    def _ref_of_key(self, key):
        """The built variable a dict key stands for (the variable, its id, or its path)."""
        if isinstance(key, keras.Variable) and id(key) in self._ref_ids:
            return key
        if isinstance(key, int) and key in self._ref_ids:
            return self._ref_ids[key]
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
                    isinstance(x, tuple) and len(x) == 2 and any(id(y) in self._ref_ids for y in x)
                    for x in value
                ):
                    for a, b in value:  # a list of (variable, slot) or (slot, variable) pairs
                        ref, var = (a, b) if id(a) in self._ref_ids else (b, a)
                        if isinstance(var, keras.Variable):
                            self._add(var, ref, slot)
                    continue
                if len(value) == n and all(x is None or isinstance(x, keras.Variable) for x in value):
                    if any(x is not None and id(x) in self._ref_ids for x in value):
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
                f"belongs to is ambiguous. Give the layers distinct names, or {_ACCEPTED_CONTAINERS}.",
                key=name,
            )
        ref, prefix = hits[0]
        return ref, name[len(prefix) :]


def _global_name(optimizer, var, index) -> str:
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


def optimizer_entries(
    optimizer, registry: VariableRegistry | None = None, *, name=None, allow_order_keys=False
):
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
        A list of :class:`OptimizerEntry`, one per variable in
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
    top = optimizer.inner_optimizer if isinstance(optimizer, StableOptimizer) else optimizer
    if not optimizer.built:
        raise StateError(
            f"Optimizer {optimizer.name!r} is not built, so it has no slots to key. "
            "Call `optimizer.build(model.trainable_variables)` first.",
        )
    if registry is None:
        if not allow_order_keys:
            raise BindingError(_unbound_message(optimizer), key=optimizer.name)
        registry = VariableRegistry.from_model(None, compat.built_variables(top))
    head = entry_prefix(name)
    by_id = {}
    ordered = []
    model_vars = set()  # model variables an optimizer tracks by holding them (pairs): not its state
    for prefix, opt in optimizer_tree(optimizer):
        slots = _Slots(opt)
        model_vars |= set(slots._ref_ids)
        if slots.conflicts:
            var, found = slots.conflicts[0]
            raise BindingError(
                f"Optimizer variable {var.name!r} of {type(opt).__name__} is held as a slot of two "
                f"model variables, {[str(getattr(r, 'path', r)) for r, _ in found]}; it cannot be "
                f"restored onto one of them. Please {_ACCEPTED_CONTAINERS}.",
                key=str(var.name),
            )
        used, unnamed = {}, []
        for index, var in enumerate(compat.own_variables(opt)):
            if id(var) in by_id or id(var) in model_vars:
                continue
            hit = slots.by_var.get(id(var))
            if hit is None and id(var) not in slots._own:
                hit = slots.by_name(var)
            if hit is not None:
                ref, slot = hit
                vkey = registry.key_of(ref)
                if not vkey.named:
                    ordered.append(ref)
                by_id[id(var)] = OptimizerEntry(keys.slot_key(vkey, f"{head}{prefix}{slot}"), var, ref)
                continue
            gname = _global_name(opt, var, index)
            used.setdefault(gname, []).append(var)
            unnamed.append((gname, var))
        shared = {g: vs for g, vs in used.items() if len(vs) > 1}
        if shared:
            raise BindingError(
                f"{type(opt).__name__} holds optimizer variables that share a name and belong to no "
                f"model variable it can find: {sorted((g, len(vs)) for g, vs in shared.items())} "
                "(name, count). Matching them would depend on their order, which changes when the "
                f"model's variables come out in another order. Please {_ACCEPTED_CONTAINERS}.",
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


def _unbound_message(optimizer) -> str:
    return (
        f"Optimizer {optimizer.name!r} ({type(optimizer).__name__}) is not bound to a model, so its "
        "slots have no stable keys. Bind it explicitly: `StableOptimizer(inner, model=model)` or "
        "`optimizer.bind(model)` (save_training_state, restore_training_state and StableCheckpoint bind "
        "the model they are given). To key slots by registration order instead, pass "
        "allow_order_keys=True (a restore then matches them by position, and its report says so)."
    )


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


def stable_optimizer_in(optimizer):
    """The :class:`StableOptimizer` an optimizer is or wraps (Keras' mixed-precision
    ``LossScaleOptimizer`` wraps the compiled one), or ``None``."""
    seen = set()
    while isinstance(optimizer, keras.optimizers.Optimizer) and id(optimizer) not in seen:
        if isinstance(optimizer, StableOptimizer):
            return optimizer
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def routing(optimizer, registry) -> dict:
    """``{prefix: {variable key: group index}}`` for every ``MultiOptimizer`` in the optimizer.

    The group of a variable is the index of the sub-optimizer it is routed to
    (``optimizer.optimizers[i]``); its slots are keyed ``...#optimizers/<i>/<slot>``.
    """
    out = {}
    for prefix, opt in optimizer_tree(optimizer):
        if isinstance(opt, keras.optimizers.MultiOptimizer) and opt.built:
            out[prefix] = {
                str(registry.key_of(v)): compat.group_of(opt, v)
                for v in compat.built_variables(opt)
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
            iterations = compat.iterations_variable(opt)
            position = int(to_numpy(iterations)) % int(k) if opt.built else 0
            out[prefix] = {"steps": int(k), "position": position}
    return out


def _hand_over(wrapper):
    """Hand the save/load of every optimizer inside the wrapper (the inner optimizer, a
    LossScaleOptimizer's inner one, a MultiOptimizer's groups) to the wrapper's keyed store:
    Keras' saving walk visits them too and would save and load them by position. Used on
    their own (taken out of the wrapper), they raise (see ``_keras_compat.hand_over``)."""
    compat.hand_over([opt for _, opt in optimizer_tree(wrapper.inner_optimizer)], wrapper.name)


# The keyed restore StableOptimizer.load_own_variables uses: slots.restore_optimizer_arrays,
# registered by keras_stable_state._optimizer.slots (imported with the package), so that this module
# does not import the modules that match slots (they import this one).
_keyed_restore = None


def register_keyed_restore(restore) -> None:
    """Set the function ``restore(optimizer, model, arrays, *, keyed, strict)`` that
    :meth:`StableOptimizer.load_own_variables` restores with (``slots`` registers
    ``restore_optimizer_arrays``)."""
    global _keyed_restore
    _keyed_restore = restore


def _check_bindable(optimizer, model, variables):
    """Refuse binding ``model`` to an optimizer built on variables the model does not hold."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            "StableOptimizer binds to a keras.Model (the model whose variables it trains). "
            f"Received: model={model!r} (of type {type(model).__name__})"
        )
    have = {id(v) for v in model.variables}
    outside = [str(getattr(v, "path", v.name)) for v in variables if id(v) not in have]
    if outside:
        raise BindingError(
            f"Cannot bind optimizer {optimizer.name!r} to model {model.name!r}: it is built on variables "
            f"the model does not hold: {outside}. Bind the model that holds every variable the optimizer "
            "trains (the whole model, not a sub-model).",
            key=outside[0],
            expected=f"variables of model {model.name!r}",
            received=outside,
        )


@keras.saving.register_keras_serializable(package="keras_stable_state")
class StableOptimizer(keras.optimizers.Optimizer):
    """Wraps any Keras optimizer and saves its slots by variable key.

    Used exactly like the optimizer it wraps, bound to the model whose
    variables it trains::

        opt = StableOptimizer(keras.optimizers.AdamW(1e-3), model=model)
        model.compile(optimizer=opt, loss="mse")

    Every training step is the inner optimizer's own (``apply``,
    ``stateless_apply`` and ``scale_loss`` delegate; ``variables`` is the inner
    optimizer's list), so wrapping adds nothing to the step. When it builds, it
    learns which slot belongs to which model variable, and inside ``.keras``
    files it saves and loads slots by key instead of by position.

    Binding is explicit: the model that gives variables their keys is the one
    passed as ``model=`` or to :meth:`bind`.
    :func:`keras_stable_state.save_training_state`,
    :func:`~keras_stable_state.restore_training_state` and
    :class:`~keras_stable_state.StableCheckpoint` bind the model they are given
    (for ``StableCheckpoint``: the ``fit`` model, whose ``model.optimizer`` this
    is). Nothing is guessed from the calling code. An optimizer that is not
    bound refuses to save its slots (``model.save`` raises
    :class:`~keras_stable_state.BindingError` naming the fix) unless
    ``allow_order_keys=True``. After ``keras.saving.load_model`` the loaded
    state waits for ``model.optimizer.bind(model)`` (or a ``StableCheckpoint``);
    a training step before that raises instead of training from fresh slots.

    Args:
        inner_optimizer: A ``keras.optimizers.Optimizer`` instance (or an
            identifier accepted by ``keras.optimizers.get``).
        model: The ``keras.Model`` whose variables this optimizer trains
            (same as calling :meth:`bind`). Not part of the config.
        allow_order_keys: Key slots of variables without a stable path (an
            unbound optimizer, or variables the bound model does not reach) by
            registration order (``order:<i>#<slot>``), and load such keys by
            position. Default ``False``: refused with ``BindingError``.
        name: Optional name.

    Raises:
        ValueError: if base-optimizer options (``clipnorm``, ``use_ema``...)
            are passed here; set them on the inner optimizer.
        TypeError: if ``model`` is not a ``keras.Model``.
        BindingError: from ``save_own_variables`` for an unbound optimizer
            (without ``allow_order_keys``); from ``bind``, ``apply`` and
            ``stateless_apply`` as documented there.
        StateError: from ``load_own_variables`` (``BindingError``,
            ``DtypeMismatchError``) when a loaded file does not match; never a
            warn-and-skip.

    Example:
        >>> opt = StableOptimizer(keras.optimizers.Adam(1e-3), model=model)
        >>> model.compile(optimizer=opt, loss="mse"); model.fit(x, y)
        >>> opt.entries()[2].key
        'path:layers/dense/kernel#momentums'
        >>> model.save("m.keras")
        >>> loaded = keras.saving.load_model("m.keras")
        >>> loaded.optimizer.bind(loaded)   # slots load by key
    """

    def __init__(self, inner_optimizer, name=None, *, model=None, allow_order_keys=False, **kwargs):
        for arg, default in _BASE_DEFAULTS.items():
            value = kwargs.pop(arg, default)
            if value != default:
                raise ValueError(
                    f"StableOptimizer does not take `{arg}`; set it on the inner optimizer. "
                    f"Received: {arg}={value!r}"
                )
        if kwargs:
            raise ValueError(f"StableOptimizer does not take arguments {sorted(kwargs)}.")
        if not isinstance(allow_order_keys, bool):
            raise TypeError(
                f"`allow_order_keys` must be True or False. Received: allow_order_keys={allow_order_keys!r}"
            )
        super().__init__(learning_rate=0.0, name=name)
        inner = keras.optimizers.get(inner_optimizer)
        if isinstance(inner, StableOptimizer):
            raise ValueError("StableOptimizer cannot wrap another StableOptimizer.")
        # Keras' saving walk also visits `inner_optimizer` (and the optimizers inside it)
        # and would save and load them by position after this wrapper restored them by
        # key. While wrapped, their own save/load is handed to the wrapper (these instances).
        self.inner_optimizer = inner
        _hand_over(self)
        self.allow_order_keys = allow_order_keys
        self._model_ref = None
        self._pending_store = None
        if model is not None:
            self.bind(model)

    # -- delegation: the training step is the inner optimizer's ---------------
    @property
    def variables(self):
        """The inner optimizer's variables.

        Raises:
            BindingError: while state loaded by ``load_model`` waits for :meth:`bind`
                (before a training step could read fresh slots).
        """
        if getattr(self, "_pending_store", None) is not None:
            self._check_pending()
        return self.inner_optimizer.variables

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        if hasattr(self, "inner_optimizer"):
            self.inner_optimizer.learning_rate = value

    def build(self, var_list):
        """Build the inner optimizer on ``var_list``.

        Raises:
            BindingError: if the optimizer is bound to a model that does not
                hold every variable of ``var_list``.
        """
        var_list = list(var_list)
        model = self.bound_model()
        if model is not None:
            _check_bindable(self, model, var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
            _hand_over(self)  # a selector may have added sub-optimizers
        self._trainable_variables = var_list[:]
        self.built = True
        self._load_pending()

    def _check_pending(self):
        if self._pending_store is not None:
            raise BindingError(
                f"StableOptimizer {self.name!r} holds loaded state (from keras.saving.load_model or "
                "load_weights) keyed by the stable paths of its model that is not applied yet (the "
                "optimizer is not bound to a model, or its last bind refused the state), so its "
                "variables would be fresh slots. Call `model.optimizer.bind(model)` after loading (a "
                "StableCheckpoint in fit does it).",
                key=self.name,
            )

    def apply(self, grads, trainable_variables=None):
        """Apply gradients with the inner optimizer.

        Raises:
            BindingError: if state loaded by ``load_model`` still waits for :meth:`bind`.
        """
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "StableOptimizer is not built: pass `trainable_variables` or call "
                    "`optimizer.build(model.trainable_variables)` first."
                )
            self.build(trainable_variables)
        if self._pending_store is not None:
            self._check_pending()
        return self.inner_optimizer.apply(grads, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """The inner optimizer's ``stateless_apply``.

        Raises:
            BindingError: if state loaded by ``load_model`` still waits for :meth:`bind`.
        """
        if self._pending_store is not None:
            self._check_pending()
        return self.inner_optimizer.stateless_apply(optimizer_variables, grads, trainable_variables)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    # -- identity ---------------------------------------------------------------
    def bind(self, model):
        """Key this optimizer's slots by ``model``'s stable variable paths.

        Checked: a built optimizer must train only variables of ``model``.
        State loaded before binding (``keras.saving.load_model``) is restored
        now, by key, all or nothing.

        Args:
            model: The ``keras.Model`` whose trainable variables this optimizer
                updates (the whole model, also when a custom loop holds it on
                ``self.model``).

        Returns:
            This optimizer.

        Raises:
            TypeError: if ``model`` is not a ``keras.Model``.
            BindingError: if the optimizer is built on variables ``model`` does
                not hold (naming them), or the loaded state does not fit.
        """
        if self.built:
            _check_bindable(self, model, compat.built_variables(self.inner_optimizer))
        elif not isinstance(model, keras.Model):
            _check_bindable(self, model, [])
        self._model_ref = weakref.ref(model)
        self._load_pending()
        return self

    def bound_model(self):
        """The model whose paths key the slots (see :meth:`bind`), or ``None``."""
        return None if self._model_ref is None else self._model_ref()

    def entries(self, registry=None, *, name=None) -> list:
        """:func:`optimizer_entries` keyed by the bound model (see :meth:`bind`).

        Raises:
            BindingError: if the optimizer is not bound (and ``allow_order_keys``
                is False), or see :func:`optimizer_entries`.
        """
        allow = self.allow_order_keys
        if registry is None:
            model = self.bound_model()
            if model is None and not allow:
                raise BindingError(_unbound_message(self), key=self.name)
            registry = VariableRegistry.from_model(model, compat.built_variables(self.inner_optimizer))
        return optimizer_entries(self, registry, name=name, allow_order_keys=allow)

    # -- .keras serialization -----------------------------------------------------
    def save_own_variables(self, store):
        """Write every optimizer variable with its key (``.keras`` / ``.weights.h5``).

        Datasets ``"0"``, ``"1"``, ... hold the arrays; ``"keys"`` holds their
        keys as UTF-8 JSON bytes (uint8).

        Raises:
            BindingError: if the optimizer is not bound to a model (and
                ``allow_order_keys`` is False): bind it first.
        """
        compat.arm([opt for _, opt in optimizer_tree(self.inner_optimizer)], "save")
        if not self.built:
            return
        entries = self.entries()
        store["keys"] = keys.encode_key_list(e.key for e in entries)
        for i, entry in enumerate(entries):
            store[str(i)] = numpy_copy(entry.variable)

    def load_own_variables(self, store):
        """Restore variables by key; a store without keys is restored by position.

        If the optimizer is not built or not bound yet, the state is kept and
        restored when it builds and is bound (:meth:`bind`); a training step
        before that raises :class:`~keras_stable_state.BindingError`.

        Raises:
            BindingError, ContractError, DtypeMismatchError: see
                :func:`keras_stable_state._optimizer.slots.restore_optimizer_arrays`.
        """
        compat.arm([opt for _, opt in optimizer_tree(self.inner_optimizer)], "load")
        self._pending_store = {k: np.array(store[k]) for k in store.keys()}
        self._load_pending()

    def _load_pending(self):
        if self._pending_store is None or not self.built:
            return
        if self.bound_model() is None and not self.allow_order_keys:
            return
        pending, self._pending_store = self._pending_store, None
        try:
            self._load_keyed(pending)
        except BaseException:
            self._pending_store = pending  # still not applied: training refuses to start fresh
            raise

    def _load_keyed(self, store):
        names = list(store.keys())
        if "keys" in names:
            arrays = {k: np.asarray(store[str(i)]) for i, k in enumerate(keys.decode_key_list(store["keys"]))}
            keyed = True
        else:
            arrays = {int(k): np.asarray(store[k]) for k in names}
            arrays = [arrays[i] for i in sorted(arrays)]
            keyed = False
        _keyed_restore(self, self.bound_model(), arrays, keyed=keyed, strict=True)

    # -- config ---------------------------------------------------------------
    def get_config(self):
        config = {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
        }
        if self.allow_order_keys:
            config["allow_order_keys"] = True
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["inner_optimizer"] = keras.saving.deserialize_keras_object(
            config["inner_optimizer"], custom_objects=custom_objects
        )
        return cls(**config)
