"""Optimizer state keyed by the model variable each slot belongs to.

Modules, low to high: `.attribution` (which model variable a slot belongs
to), `.entries` (every variable of an optimizer, keyed), `.wrapper`
(``StableOptimizer``), `.tracking` (the optimizers a model tracks),
`.groups` (parameter groups and accumulation windows), `.slots`
(saving every tracked optimizer), `.accumulator` (``GradientAccumulator``).
Restoring them reads a checkpoint record, so it lives in the restore core,
`keras_stable_state._core.slot_restore`, which registers ``StableOptimizer``'s
keyed restore when `keras_stable_state._core` is imported.
"""

from keras_stable_state._optimizer.accumulator import GradientAccumulator
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
    "save_optimizers",
    "stable_optimizer_in",
    "tracked_optimizers",
]
