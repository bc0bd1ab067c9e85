"""keras_stable_state: training that resumes exactly, on TensorFlow, JAX and PyTorch.

Public API (see ``README.md`` and ``docs/``; ``make docs`` builds the site)::

    import keras_stable_state as kss
    kss.StableOptimizer(inner)
    kss.TrainableContract.capture(model).validate(model)
    kss.save_training_state(path, model)
    kss.restore_training_state(path, model) -> kss.RestoreReport
    kss.CheckpointManager(directory, max_to_keep=3)  # save(step, model), restore(model)
    kss.training_state_to_bytes(model) -> bytes
    kss.restore_training_state_from_bytes(data, model) -> kss.RestoreReport

The names of ``__all__`` load on first use (PEP 562), so that
``keras_stable_state.cli`` and ``keras_stable_state.format`` import without
Keras. When Keras is already imported, they load at once, so that the classes
registered with ``keras.saving.register_keras_serializable`` (``StableOptimizer``,
the mappers) are known to ``keras.saving.load_model``; otherwise they register on
the first use of any name here (``kss.StableOptimizer``, ``from keras_stable_state
import ...``).
"""

import importlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same names, for type checkers and the API reference (griffe)
    from keras_stable_state._core import PendingRestore, restore_training_state, save_training_state
    from keras_stable_state._core.in_memory import restore_training_state_from_bytes, training_state_to_bytes
    from keras_stable_state._core.mappers import CastMapper, QuantizeMapper, StateMapper
    from keras_stable_state._core.report import RestoreReport
    from keras_stable_state._engines.background import SaveHandle
    from keras_stable_state._fit import StableCheckpoint
    from keras_stable_state._identity.contract import TrainableContract
    from keras_stable_state._identity.registry import VariableKey, VariableRegistry
    from keras_stable_state._manager.manager import CheckpointManager
    from keras_stable_state._manager.records import CheckpointMetadata
    from keras_stable_state._optimizer import GradientAccumulator, StableOptimizer
    from keras_stable_state._state.sampler import ResumableSampler
    from keras_stable_state.errors import (
        BindingError,
        CheckpointFormatError,
        CheckpointInUseError,
        ContractError,
        CorruptCheckpointError,
        DtypeMismatchError,
        InexactResumeWarning,
        KeyFormatError,
        MalformedKeyError,
        NewerFormatError,
        ScheduleMismatchError,
        StateError,
        StorageBackendError,
        StorageError,
        StoragePermissionError,
        UnreadableCheckpointWarning,
    )

__version__ = "0.1.0"

__all__ = [
    "BindingError",
    "CastMapper",
    "CheckpointFormatError",
    "CheckpointInUseError",
    "CheckpointManager",
    "CheckpointMetadata",
    "ContractError",
    "CorruptCheckpointError",
    "DtypeMismatchError",
    "GradientAccumulator",
    "KeyFormatError",
    "MalformedKeyError",
    "NewerFormatError",
    "PendingRestore",
    "QuantizeMapper",
    "RestoreReport",
    "ResumableSampler",
    "SaveHandle",
    "ScheduleMismatchError",
    "StableCheckpoint",
    "StableOptimizer",
    "StateError",
    "StateMapper",
    "StorageBackendError",
    "StorageError",
    "StoragePermissionError",
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

# name -> the module defining it
_SOURCES = {
    "PendingRestore": "_core",
    "restore_training_state": "_core",
    "save_training_state": "_core",
    "restore_training_state_from_bytes": "_core.in_memory",
    "training_state_to_bytes": "_core.in_memory",
    "CastMapper": "_core.mappers",
    "QuantizeMapper": "_core.mappers",
    "StateMapper": "_core.mappers",
    "RestoreReport": "_core.report",
    "SaveHandle": "_engines.background",
    "InexactResumeWarning": "errors",
    "StableCheckpoint": "_fit",
    "CheckpointManager": "_manager.manager",
    "CheckpointMetadata": "_manager.manager",
    "UnreadableCheckpointWarning": "errors",
    "TrainableContract": "_identity.contract",
    "VariableKey": "_identity.registry",
    "VariableRegistry": "_identity.registry",
    "GradientAccumulator": "_optimizer",
    "StableOptimizer": "_optimizer",
    "ScheduleMismatchError": "errors",
    "ResumableSampler": "_state.sampler",
    "BindingError": "errors",
    "CheckpointFormatError": "errors",
    "CheckpointInUseError": "errors",
    "ContractError": "errors",
    "CorruptCheckpointError": "errors",
    "DtypeMismatchError": "errors",
    "KeyFormatError": "errors",
    "MalformedKeyError": "errors",
    "NewerFormatError": "errors",
    "StorageBackendError": "errors",
    "StorageError": "errors",
    "StoragePermissionError": "errors",
    "StateError": "errors",
}


def _load_all() -> None:
    """Import every module of ``_SOURCES`` and bind its names here (registers the Keras serializables)."""
    for name, module in _SOURCES.items():
        globals()[name] = getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __getattr__(name: str) -> object:
    if name in _SOURCES:
        # All at once: any public name brings the Keras serializables along.
        _load_all()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if "keras" in sys.modules:
    _load_all()
