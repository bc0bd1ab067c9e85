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
import json
import re
import sys
import weakref

import keras
import numpy as np

from keras_stable_state.errors import BindingError, StateError
from keras_stable_state.identity import VariableKey, VariableRegistry

__all__ = ["StableOptimizer", "OptimizerEntry", "optimizer_entries", "parse_entry_key"]

GLOBAL = "optimizer"
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


def parse_entry_key(text: str):
    """Split an optimizer entry key into ``(VariableKey | None, slot name)``.

    Raises:
        KeyFormatError: if the variable part of a slot key is malformed.
        BindingError: if the key has no ``#`` separator.
    """
    owner, sep, slot = text.rpartition("#")
    if not sep or not slot:
        raise BindingError(
            f"Malformed optimizer entry key {text!r}: expected '<variable key>#<slot>' or "
            "'optimizer#<name>'. The file is damaged or was not written by keras_stable_state.",
            key=text,
        )
    if owner == GLOBAL:
        return None, slot
    return VariableKey.parse(owner), slot


def _tree(optimizer, prefix=""):
    """Yield ``(prefix, optimizer)`` for the optimizer and every optimizer it wraps."""
    if isinstance(optimizer, StableOptimizer):
        yield from _tree(optimizer.inner_optimizer, prefix)
        return
    yield prefix, optimizer
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(inner, keras.optimizers.Optimizer):
        yield from _tree(inner, f"{prefix}inner_optimizer/")
    subs = getattr(optimizer, "_inner_optimizers", None)
    if isinstance(optimizer, keras.optimizers.MultiOptimizer) and subs:
        for i, sub in enumerate(subs):
            yield from _tree(sub, f"{prefix}optimizers/{i}/")


# Lists every optimizer keeps that are not per-variable slots (the tracked variables
# themselves and the variables it was built with).
_NOT_SLOTS = frozenset({"_variables", "_trainable_variables"})


def _slot_lists(optimizer):
    """``(slot name, list)`` for every attribute list aligned with the built variables."""
    refs = list(getattr(optimizer, "_trainable_variables", []) or [])
    if not refs:
        return
    ref_ids = {id(v) for v in refs}
    own = {
        id(v) for v in (getattr(optimizer, "_iterations", None), getattr(optimizer, "_learning_rate", None))
    }
    for attr, value in sorted(vars(optimizer).items()):
        if attr in _NOT_SLOTS:
            continue
        if not isinstance(value, (list, tuple)) or len(value) != len(refs):
            continue
        if not all(x is None or isinstance(x, keras.Variable) for x in value):
            continue
        if all(x is None for x in value) or any(x is not None and id(x) in ref_ids | own for x in value):
            continue
        yield attr.lstrip("_"), refs, value


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


def optimizer_entries(optimizer, registry: VariableRegistry | None = None) -> list:
    """Key every variable of a built optimizer.

    Args:
        optimizer: A built ``keras.optimizers.Optimizer`` (any kind, wrapped or not).
        registry: Keys for the model variables the optimizer was built with;
            default: ordered keys over the optimizer's own variable list.

    Returns:
        A list of :class:`OptimizerEntry`, one per variable in
        ``optimizer.variables``, in that order.

    Raises:
        StateError: if the optimizer is not built, or holds a variable that is
            neither one of its own nor aligned with a model variable.
    """
    top = optimizer.inner_optimizer if isinstance(optimizer, StableOptimizer) else optimizer
    if not optimizer.built:
        raise StateError(
            f"Optimizer {optimizer.name!r} is not built, so it has no slots to key. "
            "Call `optimizer.build(model.trainable_variables)` first.",
        )
    if registry is None:
        registry = VariableRegistry.from_model(None, top._trainable_variables)
    by_id = {}
    for prefix, opt in _tree(optimizer):
        for slot, refs, values in _slot_lists(opt):
            for ref, var in zip(refs, values, strict=True):
                if var is not None and id(var) not in by_id:
                    by_id[id(var)] = OptimizerEntry(f"{registry.key_of(ref)}#{prefix}{slot}", var, ref)
        used = {}
        for index, var in enumerate(opt._variables):
            if id(var) not in by_id:
                name = _global_name(opt, var, index)
                n = used[name] = used.get(name, -1) + 1
                by_id[id(var)] = OptimizerEntry(f"{GLOBAL}#{prefix}{name}{'' if n == 0 else f'_{n}'}", var)
    entries = []
    for var in optimizer.variables:
        if id(var) not in by_id:
            raise StateError(
                f"Optimizer variable {var.path!r} of {type(optimizer).__name__} is neither the "
                "optimizer's own nor aligned with a model variable, so it cannot be keyed. "
                "Please report this optimizer to keras_stable_state.",
                key=var.path,
            )
        entries.append(by_id[id(var)])
    return entries


def _find_model(var_list):
    """The nearest ``keras.Model`` in the calling frames that owns every variable in ``var_list``.

    ``Model.fit`` and ``Model.compile_from_config`` call ``optimizer.build`` as
    ``self.optimizer.build(self.trainable_variables)``; a custom loop usually
    holds its model in a local. Returns ``None`` when no such model is found.
    """
    want = {id(v) for v in var_list}
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return None
        for value in list(frame.f_locals.values()):
            if isinstance(value, keras.Model):
                have = {id(v) for v in value.variables}
                if want <= have:
                    return value
        frame = frame.f_back
    return None


def _saved_by_wrapper(store):
    """Save/load hook of a wrapped inner optimizer: its state is in the wrapper's store."""
    return None


@keras.saving.register_keras_serializable(package="keras_stable_state")
class StableOptimizer(keras.optimizers.Optimizer):
    """Wraps any Keras optimizer and saves its slots by variable key.

    Used exactly like the optimizer it wraps::

        model.compile(optimizer=StableOptimizer(keras.optimizers.AdamW(1e-3)), loss="mse")

    Every training step is the inner optimizer's own (``apply``,
    ``stateless_apply`` and ``scale_loss`` delegate; ``variables`` is the inner
    optimizer's list), so wrapping adds nothing to the step. When it builds, it
    learns which slot belongs to which model variable, and inside ``.keras``
    files it saves and loads slots by key instead of by position.

    The model that gives variables their keys is found when the optimizer
    builds (the model calling ``build`` from ``fit``/``compile_from_config``, or
    a model held by the calling code); :func:`keras_stable_state.save_training_state`,
    :func:`~keras_stable_state.restore_training_state` and ``bind(model)`` set it
    explicitly. Without a model, slots are keyed by registration order.

    Args:
        inner_optimizer: A ``keras.optimizers.Optimizer`` instance (or an
            identifier accepted by ``keras.optimizers.get``).
        name: Optional name.

    Raises:
        ValueError: if base-optimizer options (``clipnorm``, ``use_ema``...)
            are passed here; set them on the inner optimizer.
        StateError: from ``load_own_variables`` (``BindingError``,
            ``DtypeMismatchError``) when a loaded file does not match; never a
            warn-and-skip.

    Example:
        >>> opt = StableOptimizer(keras.optimizers.Adam(1e-3))
        >>> model.compile(optimizer=opt, loss="mse"); model.fit(x, y)
        >>> opt.entries()[2].key
        'path:layers/dense/kernel#momentums'
        >>> model.save("m.keras"); keras.saving.load_model("m.keras")   # slots load by key
    """

    def __init__(self, inner_optimizer, name=None, **kwargs):
        for arg, default in _BASE_DEFAULTS.items():
            value = kwargs.pop(arg, default)
            if value != default:
                raise ValueError(
                    f"StableOptimizer does not take `{arg}`; set it on the inner optimizer. "
                    f"Received: {arg}={value!r}"
                )
        if kwargs:
            raise ValueError(f"StableOptimizer does not take arguments {sorted(kwargs)}.")
        super().__init__(learning_rate=0.0, name=name)
        inner = keras.optimizers.get(inner_optimizer)
        if isinstance(inner, StableOptimizer):
            raise ValueError("StableOptimizer cannot wrap another StableOptimizer.")
        # Keras' saving walk also visits `inner_optimizer` and would save and load
        # it by position after this wrapper restored it by key. While wrapped, the
        # inner optimizer's own save/load is handed to the wrapper (this instance only).
        inner.save_own_variables = _saved_by_wrapper
        inner.load_own_variables = _saved_by_wrapper
        self.inner_optimizer = inner
        self._model_ref = None
        self._pending_store = None

    # -- delegation: the training step is the inner optimizer's ---------------
    @property
    def variables(self):
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
        var_list = list(var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self._trainable_variables = var_list[:]
        self.built = True
        if self._model_ref is None:
            model = _find_model(var_list)
            if model is not None:
                self._model_ref = weakref.ref(model)
        if self._pending_store is not None:
            pending, self._pending_store = self._pending_store, None
            self._load_keyed(pending)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "StableOptimizer is not built: pass `trainable_variables` or call "
                    "`optimizer.build(model.trainable_variables)` first."
                )
            self.build(trainable_variables)
        return self.inner_optimizer.apply(grads, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
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

        Args:
            model: The ``keras.Model`` whose trainable variables this optimizer
                updates.
        """
        self._model_ref = weakref.ref(model)
        return self

    def bound_model(self):
        """The model whose paths key the slots (see :meth:`bind`), or ``None``."""
        return None if self._model_ref is None else self._model_ref()

    def entries(self, registry=None) -> list:
        """:func:`optimizer_entries` keyed by the bound model (see :meth:`bind`)."""
        if registry is None:
            registry = VariableRegistry.from_model(
                self.bound_model(), self.inner_optimizer._trainable_variables
            )
        return optimizer_entries(self, registry)

    # -- .keras serialization -----------------------------------------------------
    def save_own_variables(self, store):
        """Write every optimizer variable with its key (``.keras`` / ``.weights.h5``).

        Datasets ``"0"``, ``"1"``, ... hold the arrays; ``"keys"`` holds their
        keys as UTF-8 JSON bytes (uint8).
        """
        if not self.built:
            return
        entries = self.entries()
        keys = [e.key for e in entries]
        store["keys"] = np.frombuffer(json.dumps(keys).encode(), dtype=np.uint8).copy()
        for i, entry in enumerate(entries):
            store[str(i)] = keras.ops.convert_to_numpy(entry.variable.value)

    def load_own_variables(self, store):
        """Restore variables by key; a store without keys is restored by position.

        If the optimizer is not built yet, the state is kept and restored when
        it builds.

        Raises:
            BindingError, ContractError, DtypeMismatchError: see
                :func:`keras_stable_state.checkpoint.apply_optimizer_arrays`.
        """
        if not self.built:
            self._pending_store = {k: np.array(store[k]) for k in store.keys()}
            return
        self._load_keyed(store)

    def _load_keyed(self, store):
        from keras_stable_state import checkpoint

        names = list(store.keys())
        if "keys" in names:
            keys = json.loads(np.asarray(store["keys"], dtype=np.uint8).tobytes().decode())
            arrays = {k: np.asarray(store[str(i)]) for i, k in enumerate(keys)}
            keyed = True
        else:
            arrays = {int(k): np.asarray(store[k]) for k in names}
            arrays = [arrays[i] for i in sorted(arrays)]
            keyed = False
        checkpoint.restore_optimizer_arrays(self, self.bound_model(), arrays, keyed=keyed, strict=True)

    # -- config ---------------------------------------------------------------
    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["inner_optimizer"] = keras.saving.deserialize_keras_object(
            config["inner_optimizer"], custom_objects=custom_objects
        )
        return cls(**config)
