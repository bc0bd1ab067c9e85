"""Optimizer state keyed by the model variable each slot belongs to.

Modules, low to high: `.attribution` (which model variable a slot belongs
to), `.entries` (every variable of an optimizer, keyed), `.groups` (parameter
groups and accumulation windows), `.matching` (saved slots to live ones, by key,
shape and dtype checked: a plan and notes), `.wrapper` (``StableOptimizer``, whose
``load_own_variables`` assigns what `.matching` planned), `.tracking` (the
optimizers a model tracks), `.slots` (saving every tracked optimizer),
`.accumulator` (``GradientAccumulator``). Reading a checkpoint record's optimizer
state and listing the notes in a ``RestoreReport`` is the restore core's,
`keras_stable_state._core.slot_restore`.
"""

from keras_stable_state._optimizer.accumulator import GradientAccumulator, provider_calls
from keras_stable_state._optimizer.entries import (
    OptimizerEntry,
    keyed_optimizer_entries,
    optimizer_classes,
    optimizer_entries,
    optimizer_tree,
)
from keras_stable_state._optimizer.slots import save_optimizers
from keras_stable_state._optimizer.tracking import stable_optimizer_in, tracked_optimizers
from keras_stable_state._optimizer.wrapper import StableOptimizer

__all__ = [
    "GradientAccumulator",
    "OptimizerEntry",
    "StableOptimizer",
    "keyed_optimizer_entries",
    "optimizer_classes",
    "optimizer_entries",
    "optimizer_tree",
    "provider_calls",
    "save_optimizers",
    "stable_optimizer_in",
    "tracked_optimizers",
]
