"""keras_stable_state: training that resumes exactly, on TensorFlow, JAX and PyTorch.

Public API (see ``docs/`` and DESIGN.md)::

    import keras_stable_state as kss
    kss.StableOptimizer(inner)
    kss.TrainableContract.capture(model).validate(model)
    kss.save_training_state(path, model)
    kss.restore_training_state(path, model) -> kss.RestoreReport
    kss.training_state_to_bytes(model) -> bytes
    kss.restore_training_state_from_bytes(data, model) -> kss.RestoreReport
"""

from keras_stable_state._core.checkpoint import PendingRestore, restore_training_state, save_training_state
from keras_stable_state._core.in_memory import restore_training_state_from_bytes, training_state_to_bytes
from keras_stable_state._core.mappers import CastMapper, QuantizeMapper, StateMapper
from keras_stable_state._core.report import RestoreReport
from keras_stable_state._engines.background import SaveHandle
from keras_stable_state._fit import (
    InexactResumeWarning,
    StableCheckpoint,
    UnreadableCheckpointWarning,
)
from keras_stable_state._identity.contract import TrainableContract
from keras_stable_state._identity.registry import VariableKey, VariableRegistry
from keras_stable_state._optimizer.accumulator import GradientAccumulator
from keras_stable_state._optimizer.wrapper import StableOptimizer
from keras_stable_state._state.state import ScheduleMismatchError
from keras_stable_state.errors import (
    BindingError,
    CheckpointFormatError,
    CheckpointInUseError,
    ContractError,
    CorruptCheckpointError,
    DtypeMismatchError,
    KeyFormatError,
    MalformedKeyError,
    StateError,
)

__version__ = "0.1.0"

__all__ = [
    "BindingError",
    "CastMapper",
    "CheckpointFormatError",
    "CheckpointInUseError",
    "ContractError",
    "CorruptCheckpointError",
    "DtypeMismatchError",
    "GradientAccumulator",
    "KeyFormatError",
    "MalformedKeyError",
    "PendingRestore",
    "QuantizeMapper",
    "RestoreReport",
    "SaveHandle",
    "ScheduleMismatchError",
    "StableCheckpoint",
    "StableOptimizer",
    "StateError",
    "StateMapper",
    "TrainableContract",
    "UnreadableCheckpointWarning",
    "InexactResumeWarning",
    "VariableKey",
    "VariableRegistry",
    "restore_training_state",
    "restore_training_state_from_bytes",
    "save_training_state",
    "training_state_to_bytes",
]
