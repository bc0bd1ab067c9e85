"""``GradientAccumulator``: weighted gradient windows for custom training loops."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from keras_stable_state._identity import keys
from keras_stable_state._identity.registry import ModelIndex, VariableRegistry
from keras_stable_state._numpy import numpy_copy, to_numpy
from keras_stable_state.errors import BindingError, StateError, listed

__all__ = ["GradientAccumulator", "provider_calls"]


class GradientAccumulator:
    """Sums weighted gradients over a window of micro-steps, saved by variable key.

    For each trainable variable it keeps a float sum of ``weight * gradient``
    (same shape and dtype as the variable), plus the window's total weight
    (float32 scalar) and micro-step count (int32 scalar). [`gradients`][keras_stable_state.GradientAccumulator.gradients]
    returns ``sum / total_weight``, the weighted mean over the window, so an
    accumulated step equals one step on the concatenated batch when each
    micro-batch's weight is its number of samples.

    Usable from every backend's custom loop: stateful ([`accumulate`][keras_stable_state.GradientAccumulator.accumulate], for
    ``tf.GradientTape`` and Torch autograd loops) or stateless
    ([`stateless_accumulate`][keras_stable_state.GradientAccumulator.stateless_accumulate] on ``[v.value for v in acc.variables]``, for
    jitted JAX loops). Its state is a provider for
    [`keras_stable_state.save_training_state`][keras_stable_state.save_training_state] (``state={"acc": acc}``):
    sums are saved under the variables' keys (``path:layers/dense/kernel#grad_sum``).

    Args:
        model: The ``keras.Model`` whose variables give the keys.
        variables: Variables to accumulate for; default
            ``model.trainable_variables`` when built.

    Examples:
        >>> acc = GradientAccumulator(model)
        >>> acc.accumulate(grads, weight=len(x_batch))
        >>> if acc.count == 4:
        ...     optimizer.apply(acc.gradients(), model.trainable_variables); acc.reset()
    """

    def __init__(self, model: keras.Model, variables: Sequence[keras.Variable] | None = None) -> None:
        self.model = model
        self._given = None if variables is None else list(variables)
        self.built = False

    def build(self, variables: Sequence[keras.Variable] | None = None) -> None:
        """Create the sums (zeros) for ``variables`` (default: as given, or the model's trainable ones)."""
        variables = list(variables or self._given or self.model.trainable_variables)
        self.targets = variables
        self.sums = [
            keras.Variable(
                np.zeros(v.shape, dtype=keras.backend.standardize_dtype(v.dtype)),
                trainable=False,
                name="grad_sum",
            )
            for v in variables
        ]
        self.total_weight = keras.Variable(np.zeros((), "float32"), trainable=False, name="total_weight")
        self.micro_steps = keras.Variable(np.zeros((), "int32"), trainable=False, name="micro_steps")
        self.built = True

    @property
    def variables(self) -> list[keras.Variable]:
        """The accumulator's variables: the sums, then total weight and micro-step count."""
        if not self.built:
            self.build()
        return [*self.sums, self.total_weight, self.micro_steps]

    @property
    def count(self) -> int:
        """Micro-steps accumulated in the current window."""
        return int(to_numpy(self.micro_steps)) if self.built else 0

    def accumulate(self, grads: Sequence[Any], weight: float = 1.0) -> None:
        """Add ``weight * grads`` to the window (stateful: TensorFlow, Torch, eager JAX)."""
        if not self.built:
            self.build()
        for s, g in zip(self.sums, grads, strict=True):
            s.assign_add(keras.ops.cast(g, s.dtype) * keras.ops.cast(weight, s.dtype))
        self.total_weight.assign_add(keras.ops.cast(weight, "float32"))
        self.micro_steps.assign_add(1)

    def stateless_accumulate(
        self, values: Sequence[Any], grads: Sequence[Any], weight: float = 1.0
    ) -> list[Any]:
        """Pure version of [`accumulate`][keras_stable_state.GradientAccumulator.accumulate] on ``values`` (as ordered in [`variables`][keras_stable_state.GradientAccumulator.variables])."""
        n = len(self.sums)
        sums = [
            s + keras.ops.cast(g, s.dtype) * keras.ops.cast(weight, s.dtype)
            for s, g in zip(values[:n], grads, strict=True)
        ]
        return [*sums, values[n] + keras.ops.cast(weight, "float32"), values[n + 1] + 1]

    def gradients(self, values: Sequence[Any] | None = None) -> list[Any]:
        """The weighted mean gradient of the window (``values``: stateless state)."""
        values = values if values is not None else [v.value for v in self.variables]
        n = len(self.sums)
        return [s / keras.ops.cast(values[n], s.dtype) for s in values[:n]]

    def reset(self) -> None:
        """Start a new window."""
        for v in self.variables:
            v.assign(keras.ops.zeros(v.shape, v.dtype))

    # -- state provider ------------------------------------------------------------
    def _registry(self, index: ModelIndex | None) -> VariableRegistry:
        return ModelIndex.of(self.model, index).registry(self.targets)

    def get_state(self) -> dict[str, Any]:
        """Sums by variable key, total weight and micro-step count.

        Raises:
            StateError: if a variable with pending (non-zero) gradients is no
                longer trainable: saving would carry gradients nothing will apply.
        """
        return self._get_state(None)

    def _get_state(self, index: ModelIndex | None) -> dict[str, Any]:
        """`get_state`, the variables keyed from ``index`` (a save's or restore's) when it
        indexes this accumulator's model."""
        if not self.built:
            self.build()
        registry = self._registry(index)
        trainable = {id(v) for v in self.model.trainable_variables}
        sums = {}
        for var, s in zip(self.targets, self.sums, strict=True):
            value = numpy_copy(s)
            key = str(registry.key_of(var))
            if id(var) not in trainable and np.any(value):
                raise StateError(
                    f"The gradient accumulator holds pending gradients for {key}, which is no longer "
                    "trainable. Apply or reset the window (acc.reset()) before freezing the layer, "
                    "then save.",
                    key=key,
                )
            sums[keys.slot_key(key, "grad_sum")] = value
        return {
            "sums": sums,
            "total_weight": float(to_numpy(self.total_weight)),
            "micro_steps": self.count,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Put back a state from [`get_state`][keras_stable_state.GradientAccumulator.get_state] (all checked before any assignment).

        Raises:
            BindingError: if a saved key matches no variable, or shapes differ.
        """
        self._set_state(state, None)

    def _set_state(self, state: dict[str, Any], index: ModelIndex | None) -> None:
        """`set_state`, the variables keyed and the keys parsed by ``index`` (a restore's)
        when it indexes this accumulator's model."""
        if not self.built:
            self.build()
        index = ModelIndex.of(self.model, index)
        registry = self._registry(index)
        saved = {index.keys.parse(keys.split_entry_key(k)[0] or ""): v for k, v in state["sums"].items()}
        bound, unmatched = registry.bind((k, None, None) for k in saved)
        if unmatched or len(bound) != len(self.targets):
            raise BindingError(
                f"Saved accumulator sums {listed(sorted(map(str, unmatched)))} match no variable, or variables "
                f"{listed(sorted(str(registry.key_of(v)) for v in self.targets if registry.key_of(v) not in bound))} "
                "have no saved sum. Restore into the model the accumulator was saved with.",
                key=str(unmatched[0]) if unmatched else None,
            )
        plan = []
        position = {id(v): i for i, v in enumerate(self.targets)}
        for key, value in saved.items():
            var = bound[key][0]
            target = self.sums[position[id(var)]]
            if tuple(np.shape(value)) != tuple(target.shape):
                raise BindingError(
                    f"Saved accumulator sum for {key} has shape {np.shape(value)}, expected {tuple(target.shape)}.",
                    key=str(key),
                )
            plan.append((target, value))
        for target, value in plan:
            target.assign(value)
        self.total_weight.assign(np.float32(state["total_weight"]))
        self.micro_steps.assign(np.int32(state["micro_steps"]))


def provider_calls(provider: Any, index: ModelIndex) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """``(get_state, set_state)`` of a ``state`` provider for one save or restore: a
    `GradientAccumulator` of the indexed model keys its sums from ``index`` (the call's one
    walk); any other provider's own methods."""
    if isinstance(provider, GradientAccumulator) and provider.model is index.model:
        return functools.partial(provider._get_state, index), functools.partial(
            provider._set_state, index=index
        )
    return provider.get_state, provider.set_state
