"""Issue 14, fault 1: a mid-epoch resume of a model compiled with metrics, weighted
metrics or a loss per output (TensorFlow builds them only at the first trace)."""

import keras
import numpy as np
import pytest
from conftest import StopAt, to_np

import keras_stable_state as kss

rng = np.random.default_rng(4)
X = rng.normal(size=(48, 6)).astype("float32")  # 6 batches of 8 per epoch
Y = (X @ rng.normal(size=(6, 1))).astype("float32")
W = rng.uniform(0.5, 2.0, size=(48,)).astype("float32")
EPOCHS = 3


def _model(kind, metrics=None):
    keras.utils.set_random_seed(0)
    if kind == "two_outputs":
        inp = keras.Input((6,))
        h = keras.layers.Dense(8, activation="relu")(inp)
        outputs = {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)}
        m = keras.Model(inp, outputs)
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss={"a": "mse", "b": "mae"}, metrics=metrics)
        return m
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    compiled = {"metrics": ["mae"]} if kind == "metrics" else {"weighted_metrics": ["mae"]}
    m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", **(compiled if metrics is None else metrics))
    return m


def _inputs(kind):
    if kind == "two_outputs":
        return dict(x=X, y={"a": Y, "b": -Y})
    if kind == "weighted_metrics":
        return dict(x=X, y=Y, sample_weight=W)
    return dict(x=X, y=Y)


def _fit(kind, directory=None, stop=None, metrics=None, shuffle=True):
    """A fresh session and model, fit 3 epochs with (``directory``) or without a
    StableCheckpoint saving every 3 batches; ``stop=(epoch, batch)`` preempts it there."""
    keras.backend.clear_session(free_memory=False)
    m = _model(kind, metrics)
    callbacks = [] if directory is None else [kss.StableCheckpoint(directory, save_freq=3, keep=2)]
    callbacks += [] if stop is None else [StopAt(*stop)]
    try:
        history = m.fit(
            **_inputs(kind), batch_size=8, epochs=EPOCHS, shuffle=shuffle, verbose=0, callbacks=callbacks
        )
    except RuntimeError as err:
        assert stop is not None and str(err) == "preempted", err
        return m, None
    return m, history


def _assert_same_training(a, b, hist_a, hist_b):
    assert len(a.weights) == len(b.weights)
    for va, vb in zip(a.weights, b.weights, strict=True):
        np.testing.assert_array_equal(to_np(va), to_np(vb), err_msg=va.path)
    assert len(a.optimizer.variables) == len(b.optimizer.variables)
    for va, vb in zip(a.optimizer.variables, b.optimizer.variables, strict=True):
        np.testing.assert_array_equal(to_np(va), to_np(vb), err_msg=va.path)
    assert sorted(hist_a.history) == sorted(hist_b.history)
    for name in hist_a.history:
        assert len(hist_a.history[name]) == EPOCHS, name
        assert hist_a.history[name] == hist_b.history[name], name


KINDS = ["metrics", "weighted_metrics", "two_outputs"]


@pytest.mark.parametrize("kind", KINDS)
def test_fault1_mid_epoch_resume_with_compiled_metrics_equals_uninterrupted(tmp_path, kind):
    ref, ref_history = _fit(kind, tmp_path / "ref")
    assert len(ref.metrics_variables) > 2  # more than the loss tracker: the fault's case
    # last save at global step 9 = epoch 1, batch 3: a resume inside the epoch
    _fit(kind, tmp_path / "run", stop=(1, 5))
    res, res_history = _fit(kind, tmp_path / "run")
    assert int(res.optimizer.iterations) == int(ref.optimizer.iterations) == 6 * EPOCHS
    _assert_same_training(ref, res, ref_history, res_history)


@pytest.mark.parametrize("kind", KINDS)
def test_fault1_uninterrupted_fit_with_stable_checkpoint_equals_stock_fit(tmp_path, kind):
    # The metrics built before training (TensorFlow) change nothing of the training. Without
    # shuffling: with it, StableCheckpoint draws the order itself (NumPy, not tf.random).
    stock, stock_history = _fit(kind, shuffle=False)
    ours, our_history = _fit(kind, tmp_path / "ckpt", shuffle=False)
    _assert_same_training(stock, ours, stock_history, our_history)


def test_fault1_resume_compiled_with_other_metrics_is_still_refused(tmp_path):
    _fit("metrics", tmp_path / "run", stop=(1, 5))
    with pytest.raises(kss.StateError, match="compiled with other metrics"):
        _fit("metrics", tmp_path / "run", metrics={"metrics": ["mae", "mse"]})
