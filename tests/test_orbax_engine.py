"""The '.orbax' engine in one process, on every backend: exact round trip and resume,
our checks (keys, shapes, hashes), the missing extra, and the shard-summable hash."""

import builtins
import os
import shutil

import keras
import numpy as np
import pytest
from conftest import to_np
from hypothesis import given, settings
from hypothesis import strategies as st

import keras_stable_state as kss
from keras_stable_state._engines import orbax as _orbax_engine

orbax = pytest.importorskip(
    "orbax.checkpoint", reason="orbax-checkpoint (the [orbax] extra) is not installed"
)


def _model(units=3):
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(units, name="hidden"), keras.layers.Dense(1)]
    )
    model.compile(optimizer="adam", loss="mse")
    return model


def _arrays(model):
    return [np.array(to_np(v)) for v in model.variables + model.optimizer.variables]


def _fresh(units=3):
    model = _model(units)
    model.build((None, 4))
    model.optimizer.build(model.trainable_variables)
    return model


def test_round_trip_and_resume_exactly(tmp_path, data):
    x, y = data
    model = _model()
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    path = tmp_path / "run.orbax"
    kss.save_training_state(path, model)
    kss.save_training_state(path, model)  # over an existing one
    saved = _arrays(model)
    assert sorted(os.listdir(tmp_path)) == ["run.orbax"]
    assert sorted(os.listdir(path)) == ["arrays", "state.h5"]
    model.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)

    other = _fresh()
    report = kss.restore_training_state(str(path), other)
    assert len(report.matched) == len(saved) and not report.left_fresh
    for a, b in zip(saved, _arrays(other), strict=True):
        np.testing.assert_array_equal(b, a)
    other.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    for a, b in zip(_arrays(model), _arrays(other), strict=True):
        np.testing.assert_array_equal(b, a)


def test_shape_mismatch_names_the_key(tmp_path):
    path = tmp_path / "run.orbax"
    kss.save_training_state(path, _fresh(3))
    with pytest.raises(kss.ContractError, match="hidden"):
        kss.restore_training_state(path, _fresh(5))


def test_extra_saved_key_is_refused(tmp_path):
    path = tmp_path / "run.orbax"
    bigger = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, name="hidden"), keras.layers.Dense(1)]
    )
    bigger.add(keras.layers.Dense(1, name="head"))
    bigger.compile(optimizer="adam", loss="mse")
    bigger.optimizer.build(bigger.trainable_variables)
    kss.save_training_state(path, bigger, model_state="all", optimizer=None)
    with pytest.raises(kss.StateError, match="head"):
        kss.restore_training_state(path, _fresh(), optimizer=None)


def test_changed_bytes_fail_the_hash(tmp_path):
    path = tmp_path / "run.orbax"
    model = _fresh()
    kss.save_training_state(path, model)
    kernel = np.array(to_np(model.get_layer("hidden").kernel))
    # Another state, its arrays moved under the first one's sealed index: same shapes, other bytes.
    model.get_layer("hidden").kernel.assign(kernel + 1.0)
    kss.save_training_state(tmp_path / "other.orbax", model)
    shutil.rmtree(path / "arrays")
    shutil.copytree(tmp_path / "other.orbax" / "arrays", path / "arrays")
    before = _arrays(target := _fresh())
    with pytest.raises(kss.CorruptCheckpointError, match="hidden/kernel"):
        kss.restore_training_state(path, target)
    for a, b in zip(before, _arrays(target), strict=True):  # nothing assigned
        np.testing.assert_array_equal(b, a)


def test_directory_without_record_is_refused(tmp_path):
    (tmp_path / "empty.orbax").mkdir()
    with pytest.raises(kss.CheckpointFormatError, match="state.h5"):
        kss.restore_training_state(tmp_path / "empty.orbax", _fresh())


def test_missing_extra_names_it(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_orbax(name, *args, **kwargs):
        if name.startswith("orbax"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_orbax)
    with pytest.raises(kss.StateError, match=r"keras-stable-state\[orbax\]"):
        kss.save_training_state(tmp_path / "run.orbax", _fresh())
    assert not (tmp_path / "run.orbax").exists()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    dtype=st.sampled_from(["float32", "int64", "uint8", "float16", "bool"]),
    cut=st.integers(0, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_hash_of_blocks_adds_up_and_sees_one_changed_element(shape, dtype, cut, seed):
    rng = np.random.default_rng(seed)
    whole = (rng.normal(size=shape) * 10).astype(dtype)
    shape = tuple(shape)
    total = _orbax_engine.block_hash(whole, (0,) * len(shape), shape, "path:k", dtype)
    if shape:
        cut = min(cut, shape[0])
        parts = [(whole[:cut], (0,) * len(shape)), (whole[cut:], (cut,) + (0,) * (len(shape) - 1))]
        summed = sum(_orbax_engine.block_hash(b, s, shape, "path:k", dtype) for b, s in parts) % 2**64
        assert summed == total
        swapped = whole.reshape(-1).copy()
        flat = swapped.copy()
        flat.view(np.uint8)[0] ^= 1  # one bit of the first element (no overflow, no rounding)
        assert (
            _orbax_engine.block_hash(flat.reshape(shape), (0,) * len(shape), shape, "path:k", dtype) != total
        )
    assert _orbax_engine.block_hash(whole, (0,) * len(shape), shape, "path:other", dtype) != total
