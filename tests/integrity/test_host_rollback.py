"""The all-or-nothing restore of a model on an accelerator keeps its rollback copy in host
memory (issue 32): the file is read as the in-place restore reads it, each replaced value
copied to the host first and put back if anything fails.

No accelerator is lent to these tests: the accelerator check is forced (``on_accelerator``
patched), so the path runs on the CPU, where JAX's device is the host and the variables'
device memory is counted through ``jax.live_arrays()``. Values are compared by position with
arrays taken before the save.
"""

import gc

import numpy as np
import pytest
from conftest import BACKEND, to_np
from kit import mlp
from test_in_place_restore import (
    _all,
    _assert_equal,
    _fit_data,
    _flip_byte,
    _StopAtTrainBegin,
    _trained_state,
)

import keras_stable_state as kss
from keras_stable_state import _core, format
from keras_stable_state.errors import CorruptCheckpointError
from keras_stable_state.format.proven import FileArray


@pytest.fixture
def accelerator(monkeypatch):
    """The model counts as living on an accelerator; the FileArray reads are recorded."""
    monkeypatch.setattr(_core.host_rollback, "on_accelerator", lambda model: True)
    reads, real = [], FileArray.read_into

    def recorded(self, out):
        reads.append(self.key)
        return real(self, out)

    monkeypatch.setattr(FileArray, "read_into", recorded)
    return reads


def _written(tmp_path, seed, name="s.h5"):
    path = str(tmp_path / name)
    writer = mlp(16, [1100, 1500], seed=seed, optimizer="plain", learning_rate=1e-3, build=True)
    saved = _trained_state(writer, seed)
    kss.save_training_state(path, writer)
    return path, saved


@pytest.mark.parametrize("name", ["s.h5", "s.keras"])
def test_a_trained_model_on_an_accelerator_is_restored_from_the_file_in_place(tmp_path, accelerator, name):
    path, saved = _written(tmp_path, 31, name)
    reader = mlp(16, [1100, 1500], seed=32, optimizer="plain", learning_rate=1e-3, build=True)
    _trained_state(reader, 33)  # a trained model: its values are worth keeping
    kss.restore_training_state(path, reader)  # all or nothing (the default)
    assert len(accelerator) >= 6  # the kernels and their Adam slots were read from the file
    _assert_equal(saved, reader)


def test_a_failure_puts_every_value_back_from_the_host_copies(tmp_path, accelerator, monkeypatch):
    """The file changes on disk after its proof, at the third array read: every variable
    already assigned (and the one read into) gets its old value back; the model is not
    marked and trains."""
    path, _ = _written(tmp_path, 34)
    reader = mlp(16, [1100, 1500], seed=35, optimizer="plain", learning_rate=1e-3, build=True)
    before = _trained_state(reader, 36)
    real = FileArray.read_into  # (the fixture's recorder)

    def changed_on_disk(self, out):
        if len(accelerator) == 2:
            _flip_byte(path, self.offset + self.nbytes // 2)
        return real(self, out)

    monkeypatch.setattr(FileArray, "read_into", changed_on_disk)
    with pytest.raises(CorruptCheckpointError):
        kss.restore_training_state(path, reader)
    assert len(accelerator) == 3
    _assert_equal(before, reader)
    reader.fit(*_fit_data(), epochs=1, batch_size=8, verbose=0)


def test_a_failure_after_the_arrays_read_in_place_puts_them_back(tmp_path, accelerator, monkeypatch):
    """The step after the arrays read in place (the optimizer's small arrays, assigned all or
    nothing) fails: the arrays read in place are put back from their host copies too."""
    from keras_stable_state._core import plan

    path, _ = _written(tmp_path, 37)
    reader = mlp(16, [1100, 1500], seed=38, optimizer="plain", learning_rate=1e-3, build=True)
    before = _trained_state(reader, 39)
    real = plan.apply_steps

    def failing(steps, where=None):
        raise RuntimeError("an assignment of the small arrays failed")

    monkeypatch.setattr(plan, "apply_steps", failing)
    with pytest.raises(RuntimeError, match="small arrays failed"):
        kss.restore_training_state(path, reader)
    assert accelerator
    monkeypatch.setattr(plan, "apply_steps", real)
    _assert_equal(before, reader)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's live arrays are the device memory counted on the CPU")
@pytest.mark.parametrize("forced", [True, False], ids=["host-rollback", "cpu-all-or-nothing"])
def test_device_memory_of_an_all_or_nothing_restore(tmp_path, monkeypatch, forced):
    """Counted on the variables' device (``jax.live_arrays()``) at every assignment: with the
    rollback copy on the host, at most the state and one variable's new value; the CPU's
    all-or-nothing restore (every new value placed before the first assignment, every old
    one kept) holds about two states there, which is why an accelerator does not take it."""
    import jax

    if forced:
        monkeypatch.setattr(_core.host_rollback, "on_accelerator", lambda model: True)
    path, saved = _written(tmp_path, 40)
    reader = mlp(16, [1100, 1500], seed=41, optimizer="plain", learning_rate=1e-3, build=True)
    _trained_state(reader, 42)
    state = sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in _all(reader))
    largest = max(int(np.prod(v.shape)) * 4 for v in _all(reader))
    variable_class = type(reader.weights[0])
    real, peaks = variable_class._direct_assign, []

    def counted(self, value):
        peaks.append(sum(a.nbytes for a in jax.live_arrays()))
        return real(self, value)

    gc.collect()  # arrays of earlier tests that only a collection frees are not counted
    baseline = sum(a.nbytes for a in jax.live_arrays())
    assert baseline >= state
    monkeypatch.setattr(variable_class, "_direct_assign", counted)
    kss.restore_training_state(path, reader)
    monkeypatch.setattr(variable_class, "_direct_assign", real)
    _assert_equal(saved, reader)
    extra = max(peaks) - baseline
    if forced:
        assert extra <= largest + 64 * 1024, (extra, largest, state)
    else:
        assert extra >= 0.9 * state, (extra, state)


def test_the_manager_and_stable_checkpoint_read_in_place_for_a_model_on_an_accelerator(tmp_path, accelerator):
    """``CheckpointManager.restore`` (all or nothing) and ``StableCheckpoint`` resuming a model
    that has trained read the newest checkpoint as the in-place restore does."""
    folder = str(tmp_path / "ckpt")
    x, y = _fit_data()
    writer = mlp(16, [1100], seed=43, optimizer="plain", learning_rate=1e-3, build=True)
    writer.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(folder, save_freq=4)])
    saved = [
        np.array(v) for v in format.read_file(kss.CheckpointManager(folder).checkpoints()[0]).model.values()
    ]
    reader = mlp(16, [1100], seed=44, optimizer="plain", learning_rate=1e-3, build=True)
    _trained_state(reader, 45)
    with kss.CheckpointManager(folder) as mgr:
        mgr.restore(reader)
    assert accelerator
    for array in saved:  # every saved model array is now a model weight
        assert any(np.array_equal(array, np.asarray(w)) for w in (to_np(v) for v in reader.weights))

    accelerator.clear()
    resumed = mlp(16, [1100], seed=46, optimizer="plain", learning_rate=1e-3, build=True)
    resumed.fit(x, y, epochs=1, batch_size=8, verbose=0)  # trained: all or nothing, the copy on the host
    stopper = _StopAtTrainBegin()
    resumed.fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(folder), stopper])
    assert accelerator
    for array in saved:  # the checkpoint's model arrays, as restored at train begin
        assert any(np.array_equal(array, v) for v in stopper.values)
