"""The order and stream place of fit's input across a resume: shuffled NumPy inputs on every
backend and across backends (issue 14, faults 2 and 5), and tf.data streams that outlive an
epoch with repeat() and steps_per_epoch (fault 3)."""

import os
import random
import re
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from conftest import BACKEND, StopAt
from kit import TESTS, mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state.format.writer import reseal

rng = np.random.default_rng(4)
X = rng.normal(size=(44, 5)).astype("float32")  # 6 batches of 8, the last one of 4
Y = (X @ rng.normal(size=(5, 1))).astype("float32")
W = rng.uniform(0.5, 2.0, size=(44,)).astype("float32")


def _weights(m):
    return [keras.ops.convert_to_numpy(v) for v in m.weights] + [
        keras.ops.convert_to_numpy(v) for v in m.optimizer.variables
    ]


def fit_arrays(directory, *, stop=None, seed=0, shuffle=True, x=X, save_freq=2, tf_seed=True, **fit_kw):
    """A shuffled NumPy fit with sample weights and a StableCheckpoint; ``seed=None`` leaves the
    process unseeded, ``tf_seed=False`` seeds NumPy and Python only (TensorFlow's shuffle then
    has no global seed: StableCheckpoint draws the order with NumPy). Returns ``(weights by
    position, history)``, or ``None`` when stopped."""
    if seed is not None and tf_seed:
        keras.utils.set_random_seed(seed)
    elif seed is not None:
        np.random.seed(seed)
        random.seed(seed)
        if keras.backend.backend() == "torch":
            import torch

            torch.manual_seed(seed)
    m = mlp(5, 8, activation="relu")
    callbacks = [kss.StableCheckpoint(directory, save_freq=save_freq)] + ([StopAt(*stop)] if stop else [])
    try:
        h = m.fit(
            x,
            Y[: len(x)],
            sample_weight=W[: len(x)],
            batch_size=8,
            epochs=3,
            shuffle=shuffle,
            verbose=0,
            callbacks=callbacks,
            **fit_kw,
        )
    except RuntimeError as err:
        assert stop is not None and str(err) == "preempted", err
        return None
    return _weights(m), h.history


def _assert_same(ref, res, tol=0.0):
    assert len(ref) == len(res)
    for i, (a, b) in enumerate(zip(ref, res, strict=True)):
        assert a.shape == b.shape, i
        diff = float(np.max(np.abs(a.astype("float64") - b.astype("float64")))) if a.size else 0.0
        assert diff <= tol, f"variable {i} differs by {diff}"


_REF = {}


def _reference(tmp_path_factory, **kw):
    key = tuple(sorted(kw.items()))
    if key not in _REF:
        _REF[key] = fit_arrays(tmp_path_factory.mktemp("ref"), **kw)
    return _REF[key]


@pytest.mark.parametrize(
    "stop,resume_seed",
    [((1, 3), 123), ((1, 5), None), ((0, 2), 0)],
    ids=["mid-epoch-other-seed", "last-batch-unseeded", "first-epoch-same-seed"],
)
def test_shuffled_numpy_resume_is_exact_whatever_the_resuming_process_is_seeded_with(
    tmp_path, tmp_path_factory, stop, resume_seed
):
    ref_weights, ref_history = _reference(tmp_path_factory)
    fit_arrays(tmp_path, stop=stop)
    keras.backend.clear_session(free_memory=False)
    weights, history = fit_arrays(tmp_path, seed=resume_seed)
    _assert_same(ref_weights, weights)
    assert history == ref_history


@pytest.mark.parametrize("shuffle", [True, "batch"])
def test_without_a_tensorflow_seed_the_numpy_drawn_order_resumes_exactly(tmp_path, tmp_path_factory, shuffle):
    """NumPy and Python seeded, TensorFlow's global seed unset: on TensorFlow the callback draws
    the order with NumPy (fit's own is not replayable); elsewhere fit's own draw. Resumed in a
    process seeded otherwise, with TensorFlow's seed set this time."""
    ref_weights, ref_history = _reference(tmp_path_factory, tf_seed=False, shuffle=shuffle)
    fit_arrays(tmp_path, stop=(1, 3), tf_seed=False, shuffle=shuffle)
    keras.backend.clear_session(free_memory=False)
    weights, history = fit_arrays(tmp_path, seed=31, shuffle=shuffle)
    _assert_same(ref_weights, weights)
    assert history == ref_history


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="TensorFlow's global seed decides fit's order there alone"
)
@pytest.mark.parametrize("stop", [(1, 3), (1, 0)], ids=["mid-epoch", "epoch-boundary"])
def test_a_seeded_tensorflow_run_resumed_without_a_global_seed_draws_the_saved_seeds_orders(
    tmp_path, tmp_path_factory, stop
):
    """Keras' TensorFlow pipeline draws each epoch's order from the global seed it was traced
    under: a process without one traces it under the checkpoint's seed again, so the later
    epochs are the uninterrupted run's (no warning: the suite makes it an error)."""
    import tensorflow as tf

    ref_weights, ref_history = _reference(tmp_path_factory)
    fit_arrays(tmp_path, stop=stop)
    keras.backend.clear_session(free_memory=False)
    np.random.seed(5)
    tf.random.set_seed(None)
    try:
        weights, history = fit_arrays(tmp_path, seed=None)
    finally:
        keras.utils.set_random_seed(0)
    _assert_same(ref_weights, weights)
    assert history == ref_history


@pytest.mark.slow
def test_shuffle_batch_resumes_exactly(tmp_path, tmp_path_factory):
    ref_weights, _ = _reference(tmp_path_factory, shuffle="batch")
    fit_arrays(tmp_path, stop=(1, 3), shuffle="batch")
    keras.backend.clear_session(free_memory=False)
    weights, _ = fit_arrays(tmp_path, seed=7, shuffle="batch")
    _assert_same(ref_weights, weights)


@pytest.mark.slow
def test_two_preemptions_in_one_epoch_resume_exactly(tmp_path, tmp_path_factory):
    ref_weights, _ = _reference(tmp_path_factory, save_freq=1)
    fit_arrays(tmp_path, stop=(1, 1), save_freq=1)
    keras.backend.clear_session(free_memory=False)
    fit_arrays(tmp_path, stop=(1, 4), seed=5, save_freq=1)
    keras.backend.clear_session(free_memory=False)
    weights, _ = fit_arrays(tmp_path, seed=None, save_freq=1)
    _assert_same(ref_weights, weights)


def test_the_epoch_order_is_saved_as_a_permutation_of_the_samples(tmp_path):
    fit_arrays(tmp_path, stop=(1, 3))
    newest = sorted(os.listdir(tmp_path))[-1]
    record = format.read_file(os.path.join(tmp_path, newest))
    data = record.extra["providers"]["data"]
    perm = record.arrays[data["permutation"]["__array__"]]
    assert sorted(perm.tolist()) == list(range(len(X)))
    assert perm.tolist() != list(range(len(X)))  # shuffled
    assert data["stream_offset"] == 0


def test_a_mid_epoch_resume_with_another_number_of_samples_is_refused_naming_both(tmp_path):
    fit_arrays(tmp_path, stop=(1, 3))
    keras.backend.clear_session(free_memory=False)
    with pytest.raises(kss.StateError, match="num_samples saved 44, now 40"):
        fit_arrays(tmp_path, x=X[:40])


def test_shuffled_arrays_with_steps_per_epoch_warn_at_train_begin(tmp_path):
    with pytest.warns(kss.InexactResumeWarning, match="with steps_per_epoch"):
        fit_arrays(tmp_path, steps_per_epoch=2)


def test_train_begin_warnings_point_out_of_the_package(tmp_path):
    """The warnings of the input and of the callbacks at train begin keep their stacklevel
    (StableCheckpoint split by job, issue 15): they point at the caller of the callback hook,
    outside keras_stable_state, as before the split."""
    package = os.path.dirname(kss.__file__) + os.sep
    m = mlp(5, 8, activation="relu")
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=9)

    def fit(epochs, named):
        callbacks = [kss.StableCheckpoint(tmp_path, callbacks=named), es]
        m.fit(X, Y, batch_size=8, epochs=epochs, steps_per_epoch=2, verbose=0, callbacks=callbacks)

    with pytest.warns(kss.InexactResumeWarning, match="with steps_per_epoch"):
        fit(1, {"gone": es})  # a checkpoint with the state of a callback named "gone"
    with pytest.warns(kss.InexactResumeWarning) as caught:
        fit(2, None)
    found = {"with steps_per_epoch": [], "holds the state of the callbacks ['gone']": []}
    for w in caught:
        for part, files in found.items():
            if part in str(w.message):
                files.append(w.filename)
    assert all(found.values()), found
    assert not [f for files in found.values() for f in files if f.startswith(package)], found


def _writer_backend():
    return {"tensorflow": "jax", "jax": "torch", "torch": "tensorflow"}[BACKEND]


@pytest.fixture(scope="module")
def other_backend(tmp_path_factory):
    """One child process on :func:`_writer_backend` writes what the two cross-backend tests
    below resume: a mid-epoch checkpoint of a shuffled fit and that fit's end (``ckpt``,
    ``ref.npz``), and one epoch of a model with Dropout (``dropout``)."""
    root = tmp_path_factory.mktemp("other_backend")
    script = os.path.join(TESTS, "scripts", "shuffled_writer.py")
    env = dict(os.environ, KERAS_BACKEND=_writer_backend(), TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, script, str(root / "ckpt"), str(root / "ref.npz"), str(root / "dropout")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def _writer_draws_with_numpy():
    """Whether the writer's shuffled orders are NumPy's (JAX's fit; TensorFlow's without a global
    seed, which the writer script leaves unset), which any backend draws on; Torch's fit draws
    them from Torch's generator."""
    return _writer_backend() in ("jax", "tensorflow")


@pytest.mark.slow
@pytest.mark.frameworks(_writer_backend())
def test_a_shuffled_checkpoint_written_on_another_backend_resumes_on_the_same_samples(other_backend):
    ref = np.load(other_backend / "ref.npz")
    if not _writer_draws_with_numpy():
        writer = _writer_backend()
        with pytest.warns(
            kss.InexactResumeWarning, match=rf"ordered by {writer}'s fit .* resumes on {BACKEND}"
        ):
            fit_arrays(other_backend / "ckpt", seed=99)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", kss.InexactResumeWarning)  # no random layer: no warning
        weights, _ = fit_arrays(other_backend / "ckpt", seed=99)
    _assert_same([ref[f"arr_{i}"] for i in range(len(ref.files))], weights, tol=1e-5)


@pytest.mark.slow
@pytest.mark.frameworks(_writer_backend())
def test_a_cross_backend_resume_of_a_model_with_dropout_warns_naming_the_layer(other_backend):
    writer = _writer_backend()
    m = mlp(5, 8, activation="relu", dropout=0.3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.fit(
            X,
            Y,
            epochs=2,
            batch_size=8,
            verbose=0,
            callbacks=[kss.StableCheckpoint(other_backend / "dropout")],
        )
    found = [str(w.message) for w in caught if issubclass(w.category, kss.InexactResumeWarning)]
    assert any(re.search(rf"written on {writer}.*\['dropout", text) for text in found), found
    assert len(found) == (1 if _writer_draws_with_numpy() else 2), found  # + the order's source (Torch)


# -- tf.data streams that outlive an epoch -------------------------------------------------
def _stream_fit(directory, *, stop=None, seed=0, save_freq=2, repeat=True, steps_per_epoch=4):
    import tensorflow as tf

    if seed is not None:
        keras.utils.set_random_seed(seed)
    # random draws after the stream is reached must be the same too
    m = mlp(5, 8, activation="relu", dropout=0.3)
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)  # 6 batches
    ds = ds.repeat() if repeat else ds
    callbacks = [kss.StableCheckpoint(directory, save_freq=save_freq)] + ([StopAt(*stop)] if stop else [])
    try:
        m.fit(ds, epochs=4, steps_per_epoch=steps_per_epoch, shuffle=False, verbose=0, callbacks=callbacks)
    except RuntimeError as err:
        assert stop is not None and str(err) == "preempted", err
        return None
    return _weights(m)


@pytest.mark.parametrize(
    "stop,save_freq",
    [((2, 1), 2), ((2, 0), "epoch"), ((1, 3), 1), ((3, 2), 3)],
    ids=["mid-epoch", "epoch-boundary", "last-batch", "late"],
)
@pytest.mark.slow
@pytest.mark.frameworks("tensorflow")  # a tf.data input
def test_repeat_with_steps_per_epoch_resumes_at_the_place_in_the_stream(tmp_path, stop, save_freq):
    ref = _stream_fit(tmp_path / "ref", save_freq=save_freq)
    keras.backend.clear_session(free_memory=False)
    _stream_fit(tmp_path / "run", stop=stop, save_freq=save_freq)
    keras.backend.clear_session(free_memory=False)
    _assert_same(ref, _stream_fit(tmp_path / "run", seed=3, save_freq=save_freq))


@pytest.mark.slow
@pytest.mark.frameworks("tensorflow")  # a tf.data input
def test_a_finite_stream_longer_than_steps_per_epoch_resumes_at_its_place(tmp_path):
    # 6 batches read 3 per epoch: epoch 1 reads batches 3-5, then Keras starts the stream over.
    kw = dict(repeat=False, save_freq=1, steps_per_epoch=3)
    ref = _stream_fit(tmp_path / "ref", **kw)
    keras.backend.clear_session(free_memory=False)
    _stream_fit(tmp_path / "run", stop=(1, 1), **kw)
    keras.backend.clear_session(free_memory=False)
    _assert_same(ref, _stream_fit(tmp_path / "run", seed=3, **kw))


@pytest.mark.slow
def test_a_forged_epoch_order_is_refused_naming_its_record(tmp_path):
    import h5py
    from _records import edit_array

    fit_arrays(tmp_path, stop=(1, 3))
    newest = os.path.join(tmp_path, sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt-"))[-1])
    with h5py.File(newest, "r+") as f:
        edit_array(f, "providers/data/permutation", lambda a: np.zeros_like(a))  # not a permutation
    reseal(newest)
    keras.backend.clear_session(free_memory=False)
    with pytest.raises(kss.CorruptCheckpointError, match=r"providers/data/permutation is not a permutation"):
        fit_arrays(tmp_path)


def _fit_mixed(directory, *, stop=None, seed=0):
    """Shuffled NumPy fit under mixed_float16 with LossScaleOptimizer, EMA, gradient
    accumulation, Dropout and a compiled metric (fault 2's "the same with ...")."""
    if seed is not None:
        keras.utils.set_random_seed(seed)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        m = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )
        inner = keras.optimizers.Adam(1e-2, use_ema=True, gradient_accumulation_steps=2)
        opt = keras.optimizers.LossScaleOptimizer(kss.StableOptimizer(inner, model=m), initial_scale=2.0**8)
        m.compile(optimizer=opt, loss="mse", metrics=["mae"])
        callbacks = [kss.StableCheckpoint(directory, save_freq=3)] + ([StopAt(*stop)] if stop else [])
        try:
            h = m.fit(X, Y, batch_size=8, epochs=3, shuffle=True, verbose=0, callbacks=callbacks)
        except RuntimeError as err:
            assert stop is not None and str(err) == "preempted", err
            return None
        return _weights(m), h.history
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow
def test_shuffled_resume_with_mixed_precision_ema_and_accumulation_is_exact(tmp_path):
    ref_weights, ref_history = _fit_mixed(tmp_path / "ref")
    keras.backend.clear_session(free_memory=False)
    _fit_mixed(tmp_path / "run", stop=(1, 4))
    keras.backend.clear_session(free_memory=False)
    weights, history = _fit_mixed(tmp_path / "run", seed=None)
    _assert_same(ref_weights, weights)
    assert history == ref_history
