"""Regression tests for edited records (issue 8, fault 2): an edited position or random state in
the newest StableCheckpoint file is refused by restore and by ``verify``, and training resumes
from the older checkpoint to the same numbers as an uninterrupted run."""

import os
import shutil
import zipfile

import _records
import h5py
import keras
import numpy as np
import pytest
from conftest import BACKEND, to_np

import keras_stable_state as kss
from keras_stable_state import cli
from keras_stable_state._fit import UnreadableCheckpointWarning
from keras_stable_state.format.record import MEMBER
from keras_stable_state.format.writer import reseal

RNG = np.random.default_rng(3)
X = RNG.normal(size=(24, 6)).astype("float32")
Y = RNG.normal(size=(24, 1)).astype("float32")
TOL = 1e-6 if BACKEND == "tensorflow" else 0.0


def _fit(directory, epochs):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    m.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    callbacks = [] if directory is None else [kss.StableCheckpoint(directory)]
    history = m.fit(X, Y, epochs=epochs, batch_size=8, shuffle=True, verbose=0, callbacks=callbacks)
    return m, history


def _edit_record(path, name, old: bytes, new: bytes):
    """Replace ``old`` by ``new`` (same length) in a JSON record and fix the record's own
    checksum, as a careless tool would: only the seal is left to notice."""
    with h5py.File(path, "r+") as f:
        raw = f[name][()].tobytes()
        assert old in raw, raw[:400]
        _records.write_json(f, name, raw.replace(old, new, 1))


def _flip_word(values):
    values[7] ^= 1
    return values


def _edit_rng_array(path):
    """Flip one word of NumPy's saved generator keys and fix that array's checksum."""
    with h5py.File(path, "r+") as f:
        _records.edit_array(f, "rng/numpy/keys", _flip_word)


@pytest.fixture(scope="module")
def three_epochs(tmp_path_factory):
    """A checkpoint folder after 3 epochs (each test edits its own copy)."""
    d = tmp_path_factory.mktemp("three_epochs") / "ckpts"
    _fit(d, epochs=3)
    return d


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Weights and losses of an uninterrupted 6-epoch run (the tests only compare with them),
    with a StableCheckpoint of its own: it draws the shuffle order itself."""
    m, history = _fit(tmp_path_factory.mktemp("uninterrupted") / "ckpts", epochs=6)
    return [to_np(w) for w in m.weights], history.history["loss"]


@pytest.mark.parametrize("edit", ["epoch", "step", "rng"])
def test_an_edited_newest_checkpoint_is_refused_and_training_resumes_from_the_older(
    tmp_path, capsys, edit, three_epochs, uninterrupted
):
    d = tmp_path / "ckpts"
    shutil.copytree(three_epochs, d)
    newest = os.path.join(d, sorted(n for n in os.listdir(d) if n.startswith("ckpt-"))[-1])
    if edit == "epoch":
        _edit_record(newest, "extra", b'"epoch": 3', b'"epoch": 8')
    elif edit == "step":
        _edit_record(newest, "extra", b'"global_step": 9', b'"global_step": 7')
    else:
        _edit_rng_array(newest)
    assert cli.main(["verify", newest]) == 1
    told = capsys.readouterr()
    assert told.out == "" and told.err.count("xxh3-128 seal") == 1  # one message, on stderr
    m0 = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    m0.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    with pytest.raises(kss.CorruptCheckpointError, match="xxh3-128 seal"):
        kss.restore_training_state(newest, m0)

    with pytest.warns(UnreadableCheckpointWarning, match="ckpt-0000000009.h5"):
        resumed, history = _fit(d, epochs=6)
    # History came back from the older checkpoint (epochs 0, 1); 2..5 were trained: none skipped or repeated
    assert history.epoch == [0, 1, 2, 3, 4, 5]
    straight_weights, straight_loss = uninterrupted
    np.testing.assert_allclose(history.history["loss"], straight_loss, rtol=0, atol=TOL)
    for a, b in zip(straight_weights, resumed.weights, strict=True):
        np.testing.assert_allclose(to_np(b), a, rtol=0, atol=TOL)


@pytest.mark.parametrize("ext", [".h5", ".keras"])
def test_a_resealed_file_without_its_last_optimizer_slot_is_refused_naming_it(tmp_path, capsys, ext):
    """Fuzz finding (jax, edit delete_dataset + reseal): with the last dataset of a group removed
    and the file resealed, the file is self-consistent (the seal detects damage, not forgery), so
    ``verify`` finds it intact; restore must still refuse it, naming the missing slot, and leave
    the model and optimizer as they were."""
    m, _ = _fit(None, epochs=1)
    path = str(tmp_path / f"state{ext}")
    kss.save_training_state(path, m)
    member = path
    if ext == ".keras":
        member = str(tmp_path / "member.h5")
        with zipfile.ZipFile(path) as zf:
            members = [(info, zf.read(info.filename)) for info in zf.infolist()]
        with open(member, "wb") as fh:
            fh.write(dict((i.filename, d) for i, d in members)[MEMBER])
    with h5py.File(member, "r+") as f:
        missing = _records.drop_last(f, "optimizer")
    if ext == ".keras":
        with open(member, "rb") as fh:
            data = fh.read()
        with zipfile.ZipFile(path, "w") as zf:
            for info, old in members:
                zf.writestr(info, data if info.filename == MEMBER else old)
    reseal(path)
    assert cli.main(["verify", path]) == 0  # intact: nothing in the file contradicts itself
    capsys.readouterr()

    for v in [*m.variables, *m.optimizer.variables]:  # live values other than the saved ones
        v.assign(to_np(v) + np.ones((), to_np(v).dtype))
    before = [to_np(v) for v in [*m.variables, *m.optimizer.variables]]
    with pytest.raises(kss.BindingError) as info:
        kss.restore_training_state(path, m)
    assert missing in str(info.value)
    for v, b in zip([*m.variables, *m.optimizer.variables], before, strict=True):
        np.testing.assert_array_equal(to_np(v), b)
