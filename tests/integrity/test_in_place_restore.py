"""Restore in place (``all_or_nothing=False``, and ``StableCheckpoint`` resuming a model that
never trained): the file is proven whole before anything is assigned, every array lands
in its variable exactly, and a failure after the proof marks the model until a restore
succeeds.

Values are compared by position (``model.weights`` then the optimizer's variables) with
arrays taken before the save, not through the library's keys.
"""

import os
import shutil

import keras
import numpy as np
import pytest
from conftest import BACKEND, to_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state.errors import CorruptCheckpointError, StateError
from keras_stable_state.format import proven
from keras_stable_state.format.proven import FileArray, close_files, read_proven
from keras_stable_state.format.writer import reseal

SETTINGS = settings(
    max_examples=6,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# The models: the kit's Dense chain on 16 features with Adam(1e-3), built (``mlp(16, widths,
# seed=..., optimizer="plain", learning_rate=1e-3, build=True)``): arrays of 64 KiB and more for
# wide hidden layers, packed small ones for narrow ones.


def _all(model):
    return list(model.weights) + list(model.optimizer.variables)


def _trained_state(model, seed):
    """Give every variable and slot distinct values (and a step count); return them by position."""
    rng = np.random.default_rng(seed)
    for v in _all(model):
        shape = tuple(v.shape)
        if "int" in str(v.dtype):
            v.assign(np.asarray(rng.integers(1, 1000), dtype=str(v.dtype)))
        else:
            v.assign(rng.normal(size=shape).astype(keras.backend.standardize_dtype(v.dtype)))
    return [to_np(v).copy() for v in _all(model)]


def _assert_equal(expected, model):
    got = [to_np(v) for v in _all(model)]
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        assert np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)), (
            f"variable {i} differs"
        )


WIDTHS = st.lists(st.sampled_from([2, 8, 300, 1100, 1500]), min_size=1, max_size=4)


@SETTINGS
@given(widths=WIDTHS, seed=st.integers(0, 2**16))
def test_in_place_restore_puts_every_array_back(tmp_path_factory, widths, seed):
    folder = tmp_path_factory.mktemp("inplace")
    writer = mlp(16, widths, seed=seed, optimizer="plain", learning_rate=1e-3, build=True)
    saved = _trained_state(writer, seed)
    path = str(folder / "s.h5")
    kss.save_training_state(path, writer)
    # other initial values
    reader = mlp(16, widths, seed=seed + 1, optimizer="plain", learning_rate=1e-3, build=True)
    report = kss.restore_training_state(path, reader, all_or_nothing=False)
    assert report.matched and not report.by_order
    _assert_equal(saved, reader)


def test_a_keras_archive_is_read_where_it_lies(tmp_path):
    """A ``.keras`` training state: its record member and Keras' weights member (the model's
    arrays, shared with ``model.save``'s layout) are stored, so their large arrays are left
    in the archive and read from there into the variables, like an ``.h5`` record's."""
    path = str(tmp_path / "s.keras")
    writer = mlp(16, [1100, 1500], seed=13, optimizer="plain", learning_rate=1e-3, build=True)
    saved = _trained_state(writer, 13)
    kss.save_training_state(path, writer)
    record = read_proven(path)
    try:
        deferred = {
            section: [k for k, a in getattr(record, section).items() if isinstance(a, FileArray)]
            for section in ("model", "optimizer")
        }
        assert deferred["model"] and deferred["optimizer"], deferred  # both members read where they lie
    finally:
        close_files(record)
    reader = mlp(16, [1100, 1500], seed=14, optimizer="plain", learning_rate=1e-3, build=True)
    kss.restore_training_state(path, reader, all_or_nothing=False)
    _assert_equal(saved, reader)


def test_a_damaged_member_of_a_keras_archive_is_refused_before_anything_is_assigned(tmp_path):
    """Keras' weights member changed after the save: its xxh3-128 (in the sealed index) fails
    before anything is read into a variable."""
    import zipfile

    path = str(tmp_path / "s.keras")
    writer = mlp(16, [1100], seed=15, optimizer="plain", learning_rate=1e-3, build=True)
    _trained_state(writer, 15)
    kss.save_training_state(path, writer)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("model.weights.h5")
    record = read_proven(path)
    target = next(a for a in record.model.values() if isinstance(a, FileArray))
    close_files(record)
    assert info.header_offset < target.offset < info.header_offset + 100 + info.file_size
    _flip_byte(path, target.offset + 7)
    reader = mlp(16, [1100], seed=16, optimizer="plain", learning_rate=1e-3, build=True)
    before = [to_np(v).copy() for v in _all(reader)]
    with pytest.raises(CorruptCheckpointError, match="model.weights.h5"):
        kss.restore_training_state(path, reader, all_or_nothing=False)
    _assert_equal(before, reader)


@pytest.mark.skipif(BACKEND != "jax", reason="the two reused host buffers are JAX's path for large arrays")
def test_jax_large_arrays_through_two_reused_buffers(tmp_path, monkeypatch):
    """Every array an in-place restore reads on JAX (64 KiB and more) goes through two reused
    host buffers, each read into again once JAX's copy out of it is done: each lands in its
    own variable (a buffer overwritten before its copy finished would put one array's values
    into another's variable)."""
    from keras_stable_state._core import in_place

    assert in_place._JAX_COPY_ABOVE <= proven.DEFER_ABOVE  # the placer takes every array read in place
    placed = []
    real = in_place._JaxPlacer.assign

    def counted(self, var, array):
        done = real(self, var, array)
        placed.append(done)
        return done

    monkeypatch.setattr(in_place._JaxPlacer, "assign", counted)
    writer = mlp(16, [1100, 1500, 1100], seed=11, optimizer="plain", learning_rate=1e-3, build=True)
    saved = _trained_state(writer, 11)
    path = str(tmp_path / "s.h5")
    kss.save_training_state(path, writer)
    reader = mlp(16, [1100, 1500, 1100], seed=12, optimizer="plain", learning_rate=1e-3, build=True)
    kss.restore_training_state(path, reader, all_or_nothing=False)
    assert sum(placed) >= 9  # three kernels of 64 KiB and more, each with two Adam slots
    _assert_equal(saved, reader)


@pytest.mark.parametrize("name, dtype", [("b.h5", "bfloat16"), ("b.h5", "float16"), ("b.keras", None)])
def test_other_dtypes_and_keras_archives_restore_in_place_too(tmp_path, name, dtype):
    """bfloat16 (no NumPy view of a Torch tensor: assigned as the all-or-nothing restore
    does, one variable at a time) and float16 variables; a ``.keras`` archive."""
    writer = mlp(16, [1100], seed=1, dtype=dtype, optimizer="plain", learning_rate=1e-3, build=True)
    saved = _trained_state(writer, 1)
    path = str(tmp_path / name)
    kss.save_training_state(path, writer)
    reader = mlp(16, [1100], seed=2, dtype=dtype, optimizer="plain", learning_rate=1e-3, build=True)
    kss.restore_training_state(path, reader, all_or_nothing=False)
    _assert_equal(saved, reader)


def test_the_large_arrays_are_left_in_the_file(tmp_path):
    path = str(tmp_path / "s.h5")
    model = mlp(16, [1100, 8], seed=3, optimizer="plain", learning_rate=1e-3, build=True)
    kss.save_training_state(path, model)
    record = read_proven(path)
    try:
        deferred = [a for a in record.model.values() if isinstance(a, FileArray)]
        small = [a for a in record.model.values() if isinstance(a, np.ndarray)]
        assert deferred and small  # the 16x1100 kernel is in the file; the biases were read
        assert all(a.nbytes >= proven.DEFER_ABOVE for a in deferred)
        assert all(a.nbytes < proven.DEFER_ABOVE for a in small)
    finally:
        close_files(record)
    with pytest.raises(ValueError, match="no open file"):
        np.asarray(deferred[0])


@pytest.mark.skipif(
    BACKEND != "torch",
    reason="Torch parameters are read into as they are; JAX arrays are "
    "immutable and TensorFlow's buffers are not reachable from NumPy (their assignment is "
    "checked by value in the other tests)",
)
def test_torch_parameters_keep_their_memory(tmp_path):
    path = str(tmp_path / "s.h5")
    writer = mlp(16, [1100, 1500], seed=4, optimizer="plain", learning_rate=1e-3, build=True)
    saved = _trained_state(writer, 4)
    kss.save_training_state(path, writer)
    reader = mlp(16, [1100, 1500], seed=5, optimizer="plain", learning_rate=1e-3, build=True)
    big = [v for v in _all(reader) if int(np.prod(v.shape)) * 4 >= proven.DEFER_ABOVE]
    before = [(v.value.data_ptr(), v.value._version) for v in big]
    kss.restore_training_state(path, reader, all_or_nothing=False)
    after = [(v.value.data_ptr(), v.value._version) for v in big]
    assert [p for p, _ in after] == [p for p, _ in before]  # the same memory, read into
    assert all(a > b for (_, a), (_, b) in zip(after, before, strict=True))  # as an in-place copy_
    _assert_equal(saved, reader)


def _flip_byte(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_a_file_changed_after_the_proof_marks_the_model(tmp_path, monkeypatch):
    path, good = str(tmp_path / "s.h5"), str(tmp_path / "good.h5")
    writer = mlp(16, [1100, 1500], seed=6, optimizer="plain", learning_rate=1e-3, build=True)
    saved = _trained_state(writer, 6)
    kss.save_training_state(path, writer)
    shutil.copy(path, good)
    reader = mlp(16, [1100, 1500], seed=7, optimizer="plain", learning_rate=1e-3, build=True)
    reads = []
    real = FileArray.read_into

    def changed_on_disk(self, out):  # another process writes into the file after the proof
        reads.append(self.key)
        if len(reads) == 3:
            _flip_byte(path, self.offset + self.nbytes // 2)
        return real(self, out)

    monkeypatch.setattr(FileArray, "read_into", changed_on_disk)
    with pytest.raises(CorruptCheckpointError, match="2 variable\\(s\\) were already assigned") as err:
        kss.restore_training_state(path, reader, all_or_nothing=False)
    assert err.value.key == reads[2] and "after it was proven whole" in str(err.value)
    monkeypatch.undo()
    x, y = np.zeros((4, 16), "float32"), np.zeros((4, 1), "float32")
    with pytest.raises(StateError, match="partly restored"):
        reader.fit(x, y, epochs=1, verbose=0)
    with pytest.raises(StateError, match="partly restored"):
        kss.save_training_state(str(tmp_path / "out.h5"), reader)
    kss.restore_training_state(good, reader, all_or_nothing=False)  # a restore that succeeds lifts it
    _assert_equal(saved, reader)
    reader.fit(x, y, epochs=1, verbose=0)
    kss.save_training_state(str(tmp_path / "out.h5"), reader)


def test_an_io_error_at_every_read_marks_the_model_naming_what_was_assigned(tmp_path, monkeypatch):
    """An I/O error at the k-th array read, for every k: a ``CorruptCheckpointError`` naming
    that array and the k variables already assigned; those variables hold the saved values
    and the others their own (compared by position), and the model refuses ``fit`` and
    ``save_training_state`` until a restore succeeds."""
    import errno

    path = str(tmp_path / "s.h5")
    writer = mlp(16, [1100, 1500], seed=21, optimizer="plain", learning_rate=1e-3, build=True)
    saved = _trained_state(writer, 21)
    kss.save_training_state(path, writer)
    real = proven._pread_into
    reads = []  # a restore that succeeds, its reads counted

    def counted(fd, view, offset):
        reads.append(offset)
        return real(fd, view, offset)

    monkeypatch.setattr(proven, "_pread_into", counted)
    kss.restore_training_state(
        path, mlp(16, [1100, 1500], seed=22, optimizer="plain", build=True), all_or_nothing=False
    )
    monkeypatch.undo()
    assert len(reads) >= 6  # two large kernels, each with two Adam slots
    x, y = np.zeros((4, 16), "float32"), np.zeros((4, 1), "float32")
    for k in range(len(reads)):
        reader = mlp(16, [1100, 1500], seed=22, optimizer="plain", learning_rate=1e-3, build=True)
        before = [to_np(v).copy() for v in _all(reader)]
        calls = []

        def failing(fd, view, offset, k=k, calls=calls):
            calls.append(offset)
            if len(calls) == k + 1:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, view, offset)

        monkeypatch.setattr(proven, "_pread_into", failing)
        with pytest.raises(
            CorruptCheckpointError, match=f"cannot be read.*{k} variable\\(s\\) were already assigned"
        ):
            kss.restore_training_state(path, reader, all_or_nothing=False)
        monkeypatch.undo()
        got = [to_np(v) for v in _all(reader)]
        assigned = [i for i, (a, b) in enumerate(zip(saved, got, strict=True)) if np.array_equal(a, b)]
        kept = [i for i, (a, b) in enumerate(zip(before, got, strict=True)) if np.array_equal(a, b)]
        assert len(assigned) == k and sorted(assigned + kept) == list(range(len(got))), (k, assigned, kept)
        with pytest.raises(StateError, match="partly restored"):
            reader.fit(x, y, epochs=1, verbose=0)
        with pytest.raises(StateError, match="partly restored"):
            kss.save_training_state(str(tmp_path / "out.h5"), reader)
        kss.restore_training_state(path, reader, all_or_nothing=False)
        _assert_equal(saved, reader)


def _damage_first_optimizer_array(path):
    """Flip a byte inside the first large optimizer array of the record at ``path``; its key."""
    record = read_proven(path)
    target = next(a for a in record.optimizer.values() if isinstance(a, FileArray))
    close_files(record)
    _flip_byte(path, target.offset + 5)
    return target.key


def test_a_damaged_file_is_refused_before_anything_is_assigned(tmp_path):
    """A byte of an array changed: the seal (over every byte) fails before anything is read."""
    path = str(tmp_path / "s.h5")
    writer = mlp(16, [1100], seed=8, optimizer="plain", learning_rate=1e-3, build=True)
    _trained_state(writer, 8)
    kss.save_training_state(path, writer)
    _damage_first_optimizer_array(path)
    reader = mlp(16, [1100], seed=9, optimizer="plain", learning_rate=1e-3, build=True)
    before = [to_np(v).copy() for v in _all(reader)]
    with pytest.raises(CorruptCheckpointError, match="seal"):
        kss.restore_training_state(path, reader, all_or_nothing=False)
    _assert_equal(before, reader)
    reader.fit(np.zeros((4, 16), "float32"), np.zeros((4, 1), "float32"), epochs=1, verbose=0)


def test_a_file_sealed_again_over_a_changed_array_fails_at_that_array_and_marks_the_model(tmp_path):
    """The seal made again over the changed bytes (not a file our writer makes): the proof
    passes, the array's own xxh3-64 fails when it is read. The arrays before it were
    assigned (the model's weights come first), so the model is marked; the all-or-nothing
    restore checks every array before assigning and changes nothing."""
    path = str(tmp_path / "s.h5")
    writer = mlp(16, [1100], seed=8, optimizer="plain", learning_rate=1e-3, build=True)
    _trained_state(writer, 8)
    kss.save_training_state(path, writer)
    key = _damage_first_optimizer_array(path)
    reseal(path)
    untouched = mlp(16, [1100], seed=9, optimizer="plain", learning_rate=1e-3, build=True)
    before = [to_np(v).copy() for v in _all(untouched)]
    with pytest.raises(CorruptCheckpointError) as err:
        kss.restore_training_state(path, untouched)  # all or nothing
    assert err.value.key == key
    _assert_equal(before, untouched)

    reader = mlp(16, [1100], seed=9, optimizer="plain", learning_rate=1e-3, build=True)
    with pytest.raises(CorruptCheckpointError, match="already assigned") as err:
        kss.restore_training_state(path, reader, all_or_nothing=False)
    assert err.value.key == key and "xxh3-64" in str(err.value)
    with pytest.raises(StateError, match="partly restored"):
        reader.fit(np.zeros((4, 16), "float32"), np.zeros((4, 1), "float32"), epochs=1, verbose=0)


def test_in_place_cannot_be_deferred(tmp_path):
    path = str(tmp_path / "s.h5")
    kss.save_training_state(path, mlp(16, [8], seed=10, optimizer="plain", learning_rate=1e-3, build=True))
    with pytest.raises(ValueError, match="all_or_nothing=False"):
        kss.restore_training_state(
            path,
            mlp(16, [8], seed=11, optimizer="plain", learning_rate=1e-3, build=True),
            all_or_nothing=False,
            defer=True,
        )
    with pytest.raises(TypeError, match="all_or_nothing"):
        kss.restore_training_state(
            path,
            mlp(16, [8], seed=11, optimizer="plain", learning_rate=1e-3, build=True),
            all_or_nothing="no",
        )


class _Pointers(keras.callbacks.Callback):
    """Records the Torch data pointers of the large variables at train begin (after the
    StableCheckpoint before it restored)."""

    def __init__(self, variables):
        super().__init__()
        self.variables, self.seen = variables, None

    def on_train_begin(self, logs=None):
        self.seen = [v.value.data_ptr() for v in self.variables]

    def get_state(self):
        return {}  # stateless

    def set_state(self, state):
        pass


@pytest.mark.skipif(
    BACKEND != "torch",
    reason="where the restore lands is observable on Torch only "
    "(a parameter read into keeps its memory); the resume's values are checked on every "
    "backend by the resume tests",
)
@pytest.mark.parametrize("trained", [False, True], ids=["just-built", "trained-before"])
def test_stable_checkpoint_restores_in_place_into_a_model_that_never_trained(tmp_path, trained):
    folder = str(tmp_path / "ckpt")
    x = np.random.default_rng(0).normal(size=(32, 16)).astype("float32")
    y = x[:, :1]
    writer = mlp(16, [1100], seed=12, optimizer="plain", learning_rate=1e-3, build=True)
    writer.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(folder)])
    reader = mlp(16, [1100], seed=13, optimizer="plain", learning_rate=1e-3, build=True)
    if trained:
        reader.fit(x, y, epochs=1, batch_size=8, verbose=0)
    big = [v for v in _all(reader) if int(np.prod(v.shape)) * 4 >= proven.DEFER_ABOVE]
    before = [v.value.data_ptr() for v in big]
    probe = _Pointers(big)
    reader.fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(folder), probe])
    same = [a == b for a, b in zip(probe.seen, before, strict=True)]
    assert all(same) if not trained else not any(same)
    assert os.path.isdir(folder)


def _fit_data():
    x = np.random.default_rng(0).normal(size=(32, 16)).astype("float32")
    return x, x[:, :1]


@pytest.mark.parametrize("older", [True, False], ids=["older-checkpoint", "none-older"])
def test_stable_checkpoint_falls_back_when_the_newest_changes_after_the_proof(tmp_path, monkeypatch, older):
    """The newest checkpoint changes on disk between its proof and its read: it is moved
    aside as damaged and the older one restored (lifting the mark); with none older,
    fit refuses to train the partly restored model."""
    folder = str(tmp_path / "ckpt")
    x, y = _fit_data()
    writer = mlp(16, [1100], seed=14, optimizer="plain", learning_rate=1e-3, build=True)
    ckpt = kss.StableCheckpoint(folder, save_freq=4, max_to_keep=5)
    writer.fit(x, y, epochs=2 if older else 1, batch_size=8, verbose=0, callbacks=[ckpt])
    paths = ckpt.manager.checkpoints()
    if not older:
        for path in paths[1:]:
            os.remove(path)
        paths = paths[:1]
    expected = format.read_file(paths[1] if older else paths[0])
    newest = paths[0]
    real, reads = FileArray.read_into, []

    def changed_on_disk(self, out):
        reads.append(self._file.path)
        if self._file.path == newest and len(reads) == 2:
            _flip_byte(newest, self.offset + 3)
        return real(self, out)

    monkeypatch.setattr(FileArray, "read_into", changed_on_disk)
    reader = mlp(16, [1100], seed=15, optimizer="plain", learning_rate=1e-3, build=True)
    resumed = kss.StableCheckpoint(folder, save_freq=4, max_to_keep=5)
    if not older:
        with (
            pytest.warns(kss.UnreadableCheckpointWarning),
            pytest.raises(StateError, match="partly restored"),
        ):
            reader.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[resumed])
        return
    stopper = _StopAtTrainBegin()
    with pytest.warns(kss.UnreadableCheckpointWarning):
        reader.fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[resumed, stopper])
    assert [p for p, _ in resumed.skipped_checkpoints] == [newest]
    assert stopper.values is not None
    for key, array in expected.model.items():  # the older checkpoint's values, as restored
        assert any(np.array_equal(array, v) for v in stopper.values), key


class _StopAtTrainBegin(keras.callbacks.Callback):
    """Takes the model's weights at train begin (after the restore) and stops the fit."""

    def __init__(self):
        super().__init__()
        self.values = None

    def on_train_begin(self, logs=None):
        self.values = [to_np(v).copy() for v in self.model.weights]
        self.model.stop_training = True

    def get_state(self):
        return {}

    def set_state(self, state):
        pass


def test_the_manager_restores_the_latest_in_place_and_falls_back_when_it_changes(tmp_path, monkeypatch):
    """``CheckpointManager.restore(model, all_or_nothing=False)``: the newest checkpoint is read
    in place (its large arrays left in the file) and restored exactly; one that changes on disk
    after its proof is moved aside and the older one restored, which lifts the mark."""
    folder = str(tmp_path / "ckpt")
    writer = mlp(16, [1100], seed=17, optimizer="plain", learning_rate=1e-3, build=True)
    states = []
    with kss.CheckpointManager(folder, max_to_keep=3) as mgr:
        for step in (1, 2):
            states.append(_trained_state(writer, 17 + step))
            mgr.save(step, writer)
    deferred = []
    real = FileArray.read_into

    def recorded(self, out):
        deferred.append(self._file.path)
        return real(self, out)

    monkeypatch.setattr(FileArray, "read_into", recorded)
    reader = mlp(16, [1100], seed=20, optimizer="plain", learning_rate=1e-3, build=True)
    with kss.CheckpointManager(folder, max_to_keep=3) as mgr:
        mgr.restore(reader, all_or_nothing=False)
        assert mgr.restored_step == 2
    assert deferred and set(deferred) == {os.path.join(folder, "ckpt-0000000002.h5")}
    _assert_equal(states[1], reader)

    newest = os.path.join(folder, "ckpt-0000000002.h5")

    def changed_on_disk(self, out):
        if self._file.path == newest:
            _flip_byte(newest, self.offset + 3)
        return real(self, out)

    monkeypatch.setattr(FileArray, "read_into", changed_on_disk)
    again = mlp(16, [1100], seed=21, optimizer="plain", learning_rate=1e-3, build=True)
    with kss.CheckpointManager(folder, max_to_keep=3) as mgr, pytest.warns(kss.UnreadableCheckpointWarning):
        mgr.restore(again, all_or_nothing=False)
        assert mgr.restored_step == 1 and [p for p, _ in mgr.skipped_checkpoints] == [newest]
    _assert_equal(states[0], again)
    again.fit(*_fit_data(), epochs=1, batch_size=8, verbose=0)  # the mark was lifted
