"""``StableOptimizer``: any Keras optimizer, its slots saved and loaded by variable key.

[`StableOptimizer`][keras_stable_state.StableOptimizer] wraps any Keras optimizer, delegates every step to it
and saves/loads its variables by key (`optimizer_entries`)
inside ``.keras`` files.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from keras_stable_state import _keras_compat
from keras_stable_state._identity import keys
from keras_stable_state._identity.registry import VariableRegistry
from keras_stable_state._numpy import numpy_copy
from keras_stable_state._optimizer.entries import optimizer_entries, optimizer_tree, unbound_message
from keras_stable_state._optimizer.matching import match_slots
from keras_stable_state.errors import BindingError

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from keras_stable_state._optimizer.entries import OptimizerEntry

__all__ = ["StableOptimizer", "bind_unchecked"]

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


def _hand_over(wrapper: StableOptimizer) -> None:
    """Hand the save/load of every optimizer inside the wrapper (the inner optimizer, a
    LossScaleOptimizer's inner one, a MultiOptimizer's groups) to the wrapper's keyed store:
    Keras' saving walk visits them too and would save and load them by position. Used on
    their own (taken out of the wrapper), they raise (see ``_keras_compat.hand_over``)."""
    _keras_compat.hand_over([opt for _, opt in optimizer_tree(wrapper.inner_optimizer)], wrapper.name)


def bind_unchecked(optimizer: StableOptimizer, model: keras.Model) -> None:
    """Key the slots of ``optimizer`` (a [`StableOptimizer`][keras_stable_state.StableOptimizer]) by ``model``'s paths,
    without the checks of [`StableOptimizer.bind`][keras_stable_state.StableOptimizer.bind] and without restoring state a
    load left pending: ``save_training_state`` and ``restore_training_state`` bind the
    model they are given, then check the optimizer's variables against it and their
    ``variables=`` themselves."""
    optimizer._model_ref = weakref.ref(model)
    BOUND.add(optimizer)


def _assign_all(plan: list[tuple[keras.Variable, Any]]) -> None:
    """Assign every ``(variable, value)`` of a checked plan (`match_slots`), in order; if an
    assignment raises, put back the values from before (host copies, taken before the
    first assignment) of every variable already assigned, and of the failing one if it
    changed, then re-raise: the slots are restored all or nothing."""
    kept = [numpy_copy(var) for var, _ in plan]
    done = 0
    try:
        for var, value in plan:
            var.assign(value)
            done += 1
    except BaseException:
        failing, old = plan[done][0], kept[done]
        for (var, _), value in zip(plan[:done], kept, strict=False):
            var.assign(value)
        if not np.array_equal(numpy_copy(failing), old, equal_nan=old.dtype.kind == "f"):
            failing.assign(old)
        raise


BOUND: weakref.WeakSet[StableOptimizer] = weakref.WeakSet()
"""Every ``StableOptimizer`` bound to a model in this process (nothing is kept alive): a save
of that model that leaves one out is refused (`keras_stable_state._optimizer.tracking.check_bound_passed`)."""


def _check_bindable(optimizer: StableOptimizer, model: object, variables: Sequence[Any]) -> None:
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


def _check_loss_scaling(optimizer: StableOptimizer, model: object) -> None:
    """Refuse a ``StableOptimizer`` around a ``LossScaleOptimizer`` that ``compile`` wrapped in a
    second one (under the ``mixed_float16`` policy Keras wraps every optimizer that is not a
    ``LossScaleOptimizer``): the loss would be scaled twice."""
    outer = getattr(model, "optimizer", None)
    scaler = keras.optimizers.LossScaleOptimizer
    if (
        isinstance(outer, scaler)
        and outer.inner_optimizer is optimizer
        and isinstance(optimizer.inner_optimizer, scaler)
    ):
        raise BindingError(
            f"Model {getattr(model, 'name', model)!r} was compiled with StableOptimizer(LossScaleOptimizer(...)) "
            "under the mixed_float16 policy, and Keras wrapped it in a second LossScaleOptimizer: the "
            "loss is scaled twice, unlike the same model compiled without keras_stable_state. Compile "
            "with StableOptimizer(inner) (Keras adds the loss scaling) or "
            "LossScaleOptimizer(StableOptimizer(inner), ...).",
            key=optimizer.name,
            expected="one LossScaleOptimizer",
            received="LossScaleOptimizer(StableOptimizer(LossScaleOptimizer(...)))",
        )


@keras.saving.register_keras_serializable(package="keras_stable_state")
class StableOptimizer(keras.optimizers.Optimizer):  # type: ignore[misc]  # Keras is untyped (Any)
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
    passed as ``model=`` or to [`bind`][keras_stable_state.StableOptimizer.bind].
    [`keras_stable_state.save_training_state`][keras_stable_state.save_training_state],
    [`restore_training_state`][keras_stable_state.restore_training_state] and
    [`StableCheckpoint`][keras_stable_state.StableCheckpoint] bind the model they are given
    (for ``StableCheckpoint``: the ``fit`` model, whose ``model.optimizer`` this
    is). Nothing is guessed from the calling code. An optimizer that is not
    bound refuses to save its slots (``model.save`` raises
    [`BindingError`][keras_stable_state.BindingError] naming the fix) unless
    ``allow_order_keys=True``. After ``keras.saving.load_model`` the loaded
    state waits for ``model.optimizer.bind(model)`` (or a ``StableCheckpoint``);
    a training step before that raises instead of training from fresh slots.

    Args:
        inner_optimizer: A ``keras.optimizers.Optimizer`` instance (or an
            identifier accepted by ``keras.optimizers.get``).
        model: The ``keras.Model`` whose variables this optimizer trains
            (same as calling [`bind`][keras_stable_state.StableOptimizer.bind]). Not part of the config.
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

    Examples:
        >>> opt = StableOptimizer(keras.optimizers.Adam(1e-3), model=model)
        >>> model.compile(optimizer=opt, loss="mse"); model.fit(x, y)
        >>> opt.entries()[2].key
        'path:layers/dense/kernel#momentums'
        >>> model.save("m.keras")
        >>> loaded = keras.saving.load_model("m.keras")
        >>> loaded.optimizer.bind(loaded)   # slots load by key
    """

    # Read by entries.unwrap / optimizer_tree: the slots are the inner optimizer's, no prefix of this one.
    wraps_transparently = True

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        name: str | None = None,
        *,
        model: keras.Model | None = None,
        allow_order_keys: bool = False,
        **kwargs: Any,
    ) -> None:
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
        self._model_ref: weakref.ref[keras.Model] | None = None
        self._pending_store: dict[str, NDArray[Any]] | None = None
        if model is not None:
            self.bind(model)

    # -- delegation: the training step is the inner optimizer's ---------------
    @property
    def variables(self) -> list[keras.Variable]:
        """The inner optimizer's variables.

        Raises:
            BindingError: while state loaded by ``load_model`` waits for [`bind`][keras_stable_state.StableOptimizer.bind]
                (before a training step could read fresh slots).
        """
        if getattr(self, "_pending_store", None) is not None:
            self._check_pending()
        variables: list[keras.Variable] = self.inner_optimizer.variables
        return variables

    @property
    def iterations(self) -> keras.Variable:
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        if hasattr(self, "inner_optimizer"):
            self.inner_optimizer.learning_rate = value

    def build(self, var_list: Sequence[keras.Variable]) -> None:
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
        _keras_compat.set_built_variables(self, var_list)
        self.built = True
        self._load_pending()

    def _check_pending(self) -> None:
        if self._pending_store is not None:
            raise BindingError(
                f"StableOptimizer {self.name!r} holds loaded state (from keras.saving.load_model or "
                "load_weights) keyed by the stable paths of its model that is not applied yet (the "
                "optimizer is not bound to a model, or its last bind refused the state), so its "
                "variables would be fresh slots. Call `model.optimizer.bind(model)` after loading (a "
                "StableCheckpoint in fit does it).",
                key=self.name,
            )

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[keras.Variable] | None = None) -> Any:
        """Apply gradients with the inner optimizer.

        Raises:
            BindingError: if state loaded by ``load_model`` still waits for [`bind`][keras_stable_state.StableOptimizer.bind].
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

    def stateless_apply(
        self, optimizer_variables: Sequence[Any], grads: Sequence[Any], trainable_variables: Sequence[Any]
    ) -> tuple[list[Any], list[Any]]:
        """The inner optimizer's ``stateless_apply``.

        Raises:
            BindingError: if state loaded by ``load_model`` still waits for [`bind`][keras_stable_state.StableOptimizer.bind].
        """
        if self._pending_store is not None:
            self._check_pending()
        applied: tuple[list[Any], list[Any]] = self.inner_optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        return applied

    def scale_loss(self, loss: Any) -> Any:
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: Sequence[keras.Variable]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def exclude_from_weight_decay(
        self, var_list: Sequence[keras.Variable] | None = None, var_names: Sequence[str] | None = None
    ) -> None:
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    # -- identity ---------------------------------------------------------------
    def bind(self, model: keras.Model) -> StableOptimizer:
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
                not hold (naming them), the loaded state does not fit, or ``compile``
                wrapped this optimizer around a ``LossScaleOptimizer`` in a second one
                (``mixed_float16``: the loss would be scaled twice).
        """
        _check_loss_scaling(self, model)
        if self.built:
            _check_bindable(self, model, _keras_compat.built_variables(self.inner_optimizer))
        elif not isinstance(model, keras.Model):
            _check_bindable(self, model, [])
        bind_unchecked(self, model)
        self._load_pending()
        return self

    def bound_model(self) -> keras.Model | None:
        """The model whose paths key the slots (see [`bind`][keras_stable_state.StableOptimizer.bind]), or ``None``."""
        return None if self._model_ref is None else self._model_ref()

    def entries(
        self, registry: VariableRegistry | None = None, *, name: str | None = None
    ) -> list[OptimizerEntry]:
        """`optimizer_entries` keyed by the bound model (see [`bind`][keras_stable_state.StableOptimizer.bind]).

        Raises:
            BindingError: if the optimizer is not bound (and ``allow_order_keys``
                is False), or see `optimizer_entries`.
        """
        allow = self.allow_order_keys
        if registry is None:
            model = self.bound_model()
            if model is None and not allow:
                raise BindingError(unbound_message(self), key=self.name)
            registry = VariableRegistry.from_model(model, _keras_compat.built_variables(self.inner_optimizer))
        return optimizer_entries(self, registry, name=name, allow_order_keys=allow)

    # -- .keras serialization -----------------------------------------------------
    def save_own_variables(self, store: dict[str, Any]) -> None:
        """Write every optimizer variable with its key (``.keras`` / ``.weights.h5``).

        Datasets ``"0"``, ``"1"``, ... hold the arrays; ``"keys"`` holds their
        keys as UTF-8 JSON bytes (uint8).

        Raises:
            BindingError: if the optimizer is not bound to a model (and
                ``allow_order_keys`` is False): bind it first.
        """
        _keras_compat.arm([opt for _, opt in optimizer_tree(self.inner_optimizer)], "save")
        if not self.built:
            return
        entries = self.entries()
        store["keys"] = keys.encode_key_list(e.key for e in entries)
        for i, entry in enumerate(entries):
            store[str(i)] = numpy_copy(entry.variable)

    def load_own_variables(self, store: dict[str, Any]) -> None:
        """Restore variables by key; a store without keys is restored by position.

        If the optimizer is not built or not bound yet, the state is kept and
        restored when it builds and is bound ([`bind`][keras_stable_state.StableOptimizer.bind]); a training step
        before that raises [`BindingError`][keras_stable_state.BindingError].

        Raises:
            BindingError, MalformedKeyError, DtypeMismatchError: when the
                stored slots do not match the optimizer (see
                `keras_stable_state._optimizer.matching.match_slots`); nothing
                is assigned then.
        """
        _keras_compat.arm([opt for _, opt in optimizer_tree(self.inner_optimizer)], "load")
        self._pending_store = {k: np.array(store[k]) for k in store.keys()}
        self._load_pending()

    def _load_pending(self) -> None:
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

    def _load_keyed(self, store: dict[str, NDArray[Any]]) -> None:
        names = list(store.keys())
        arrays: dict[str, NDArray[Any]] | list[NDArray[Any]]
        if "keys" in names:
            arrays = {k: np.asarray(store[str(i)]) for i, k in enumerate(keys.decode_key_list(store["keys"]))}
            keyed = True
        else:
            by_position = {int(k): np.asarray(store[k]) for k in names}
            arrays = [by_position[i] for i in sorted(by_position)]
            keyed = False
        plan, _ = match_slots(self, self.bound_model(), arrays, keyed=keyed, strict=True)
        _assign_all(plan)

    # -- config ---------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        config = {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
        }
        if self.allow_order_keys:
            config["allow_order_keys"] = True
        return config

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None
    ) -> StableOptimizer:
        config = dict(config)
        config["inner_optimizer"] = keras.saving.deserialize_keras_object(
            config["inner_optimizer"], custom_objects=custom_objects
        )
        return cls(**config)
