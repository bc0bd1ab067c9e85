"""The public surface: __all__ is pinned, errors share one base, configs round-trip."""

import keras
import pytest
from kit import ROOT

import keras_stable_state as kss

PUBLIC = [
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


# keras_stable_state.format: what a tool that reads training states needs (open and read,
# the record and entry types, the format's name and version, the dtypes).
FORMAT_PUBLIC = [
    "CheckpointFile",
    "DTYPES",
    "Entry",
    "FORMAT",
    "FORMAT_VERSION",
    "SECTIONS",
    "StateRecord",
    "StockWeights",
    "dtype_name",
    "numpy_dtype",
    "open_file",
    "read_bytes",
    "read_file",
]


def test_all_is_pinned():
    assert sorted(kss.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(kss, name) is not None


def test_the_file_formats_all_is_pinned():
    from keras_stable_state import format

    assert sorted(format.__all__) == sorted(FORMAT_PUBLIC)
    for name in FORMAT_PUBLIC:
        assert getattr(format, name) is not None


@pytest.mark.parametrize(
    "cls,builtin",
    [
        (kss.KeyFormatError, ValueError),
        (kss.BindingError, ValueError),
        (kss.ContractError, ValueError),
        (kss.DtypeMismatchError, TypeError),
        (kss.CheckpointFormatError, ValueError),
        (kss.NewerFormatError, ValueError),
        (kss.CorruptCheckpointError, OSError),
        (kss.CheckpointInUseError, OSError),
        (kss.MalformedKeyError, OSError),
        (kss.MalformedKeyError, ValueError),
        (kss.ScheduleMismatchError, ValueError),
        (kss.StorageBackendError, ImportError),
        (kss.StorageError, OSError),
        (kss.StoragePermissionError, PermissionError),
        (kss.StoragePermissionError, kss.StorageError),
    ],
)
def test_errors_share_one_base_and_a_builtin(cls, builtin):
    assert issubclass(cls, kss.StateError) and issubclass(cls, builtin)


def test_malformed_key_error_is_corrupt_and_key_format():
    assert issubclass(kss.MalformedKeyError, kss.CorruptCheckpointError)
    assert issubclass(kss.MalformedKeyError, kss.KeyFormatError)


def test_stable_optimizer_config_round_trip():
    sched = keras.optimizers.schedules.ExponentialDecay(1e-2, 10, 0.5)
    opt = kss.StableOptimizer(keras.optimizers.AdamW(sched, weight_decay=0.01, clipnorm=1.0), name="stable")
    config = keras.saving.serialize_keras_object(opt)
    assert config["registered_name"] == "keras_stable_state>StableOptimizer"
    back = keras.saving.deserialize_keras_object(config)
    assert isinstance(back, kss.StableOptimizer) and back.name == "stable"
    assert type(back.inner_optimizer) is type(opt.inner_optimizer)
    assert back.inner_optimizer.get_config() == opt.inner_optimizer.get_config()


def test_stable_optimizer_accepts_identifier_and_refuses_base_options():
    assert isinstance(kss.StableOptimizer("adam").inner_optimizer, keras.optimizers.Adam)
    with pytest.raises(ValueError, match=r"does not take `clipnorm`.*Received: clipnorm=1.0"):
        kss.StableOptimizer(keras.optimizers.Adam(), clipnorm=1.0)
    with pytest.raises(ValueError, match="cannot wrap another StableOptimizer"):
        kss.StableOptimizer(kss.StableOptimizer("adam"))


def test_learning_rate_and_iterations_are_the_inner_optimizers():
    opt = kss.StableOptimizer(keras.optimizers.SGD(0.5))
    opt.learning_rate = 0.25
    assert float(keras.ops.convert_to_numpy(opt.inner_optimizer.learning_rate)) == 0.25
    assert opt.iterations is opt.inner_optimizer.iterations


def test_every_public_name_has_a_reference_entry():
    import pathlib

    reference = (pathlib.Path(ROOT) / "docs" / "reference.md").read_text()
    missing = [name for name in PUBLIC if f"::: keras_stable_state.{name}\n" not in reference]
    assert missing == []
    for name in PUBLIC:
        doc = getattr(kss, name).__doc__ or ""
        assert "Example" in doc, f"{name} has no example in its docstring"
