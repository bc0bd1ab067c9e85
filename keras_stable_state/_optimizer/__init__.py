"""Optimizer state keyed by the model variable each slot belongs to.

Modules, low to high: :mod:`.attribution` (which model variable a slot belongs
to), :mod:`.entries` (every variable of an optimizer, keyed), :mod:`.wrapper`
(``StableOptimizer``), :mod:`.tracking` (the optimizers a model tracks),
:mod:`.groups` (parameter groups and accumulation windows), :mod:`.slots`
(saving every tracked optimizer), :mod:`.slot_restore` (restoring them),
:mod:`.accumulator` (``GradientAccumulator``). Importing the package imports
:mod:`.slot_restore`, which gives ``StableOptimizer`` its keyed restore.
"""

from keras_stable_state._optimizer.accumulator import GradientAccumulator
from keras_stable_state._optimizer.entries import (
    OptimizerEntry,
    keyed_optimizer_entries,
    optimizer_classes,
    optimizer_entries,
    optimizer_tree,
)
from keras_stable_state._optimizer.slot_restore import (
    drop_reason,
    plan_optimizer_arrays,
    plan_optimizers,
    restore_optimizer_arrays,
)
from keras_stable_state._optimizer.slots import save_optimizers
from keras_stable_state._optimizer.tracking import stable_optimizer_in, tracked_optimizers
from keras_stable_state._optimizer.wrapper import StableOptimizer

__all__ = [
    "GradientAccumulator",
    "OptimizerEntry",
    "StableOptimizer",
    "drop_reason",
    "keyed_optimizer_entries",
    "optimizer_classes",
    "optimizer_entries",
    "optimizer_tree",
    "plan_optimizer_arrays",
    "plan_optimizers",
    "restore_optimizer_arrays",
    "save_optimizers",
    "stable_optimizer_in",
    "tracked_optimizers",
]
