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

Each public name is imported under ``if TYPE_CHECKING:`` below, where type
checkers and the API reference (griffe) read it, and listed with its module in the
lazy table ``_SOURCES`` (``__all__`` is its keys); a test checks that the two
agree. The names load on first use (PEP 562), so that
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

# The public names: ``name as name`` marks a re-export for type checkers (PEP 484); each is
# also in ``_SOURCES`` below, with the same module.
# (isort is off here: it would split an import of several ``name as name`` into one per name.)
if TYPE_CHECKING:
    # isort: off
    from keras_stable_state._core import (
        PendingRestore as PendingRestore,
        restore_training_state as restore_training_state,
        save_training_state as save_training_state,
    )
    from keras_stable_state._core.in_memory import (
        restore_training_state_from_bytes as restore_training_state_from_bytes,
        training_state_to_bytes as training_state_to_bytes,
    )
    from keras_stable_state._core.mappers import (
        CastMapper as CastMapper,
        QuantizeMapper as QuantizeMapper,
        StateMapper as StateMapper,
    )
    from keras_stable_state._core.report import RestoreReport as RestoreReport
    from keras_stable_state._engines.background import SaveHandle as SaveHandle
    from keras_stable_state._fit import StableCheckpoint as StableCheckpoint
    from keras_stable_state._identity.contract import TrainableContract as TrainableContract
    from keras_stable_state._identity.registry import (
        VariableKey as VariableKey,
        VariableRegistry as VariableRegistry,
    )
    from keras_stable_state._manager.manager import CheckpointManager as CheckpointManager
    from keras_stable_state._manager.records import CheckpointMetadata as CheckpointMetadata
    from keras_stable_state._optimizer import (
        GradientAccumulator as GradientAccumulator,
        StableOptimizer as StableOptimizer,
    )
    from keras_stable_state._state.sampler import ResumableSampler as ResumableSampler
    from keras_stable_state.errors import (
        BindingError as BindingError,
        CheckpointFormatError as CheckpointFormatError,
        CheckpointInUseError as CheckpointInUseError,
        ContractError as ContractError,
        CorruptCheckpointError as CorruptCheckpointError,
        DtypeMismatchError as DtypeMismatchError,
        InexactResumeWarning as InexactResumeWarning,
        KeyFormatError as KeyFormatError,
        MalformedKeyError as MalformedKeyError,
        NewerFormatError as NewerFormatError,
        ScheduleMismatchError as ScheduleMismatchError,
        StateError as StateError,
        StorageBackendError as StorageBackendError,
        StorageError as StorageError,
        StoragePermissionError as StoragePermissionError,
        UnreadableCheckpointWarning as UnreadableCheckpointWarning,
    )
    # isort: on

__version__ = "0.1.0"


# name -> the module defining it (relative to this package): the imports under
# ``if TYPE_CHECKING:`` above, name by name, written out rather than read from this file's
# source at import (an install without sources, a zip import or a frozen application has
# none); tests/docs/test_structure.py checks that the two agree.
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
    "StableCheckpoint": "_fit",
    "TrainableContract": "_identity.contract",
    "VariableKey": "_identity.registry",
    "VariableRegistry": "_identity.registry",
    "CheckpointManager": "_manager.manager",
    "CheckpointMetadata": "_manager.records",
    "GradientAccumulator": "_optimizer",
    "StableOptimizer": "_optimizer",
    "ResumableSampler": "_state.sampler",
    "BindingError": "errors",
    "CheckpointFormatError": "errors",
    "CheckpointInUseError": "errors",
    "ContractError": "errors",
    "CorruptCheckpointError": "errors",
    "DtypeMismatchError": "errors",
    "InexactResumeWarning": "errors",
    "KeyFormatError": "errors",
    "MalformedKeyError": "errors",
    "NewerFormatError": "errors",
    "ScheduleMismatchError": "errors",
    "StateError": "errors",
    "StorageBackendError": "errors",
    "StorageError": "errors",
    "StoragePermissionError": "errors",
    "UnreadableCheckpointWarning": "errors",
}
__all__ = sorted(_SOURCES)


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
