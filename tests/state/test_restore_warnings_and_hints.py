"""Issue 14: no warnings from a restore (fault 10); the RestoreReport's learning-rate hint
only where it applies and its iterations-counter warning (fault 11)."""

import warnings

import keras
import numpy as np
import pytest
from conftest import BACKEND, StopAt, to_np
from kit import mlp

import keras_stable_state as kss

rng = np.random.default_rng(2)
X = rng.normal(size=(48, 6)).astype("float32")
Y = (X @ rng.normal(size=(6, 1))).astype("float32")


# -- fault 10: no warnings from the package's own calls --------------------------------------
def _adam_accumulating_ema():  # windows of 2 accumulated micro-steps, an EMA of the weights
    return keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2, use_ema=True, ema_overwrite_frequency=4)


def _accumulating_ema_fit(directory, stop=None):
    keras.backend.clear_session(free_memory=False)
    m = mlp(6, 8, activation="relu", seed=0, optimizer="plain", inner=_adam_accumulating_ema, metrics=["mae"])
    m.compile(
        optimizer=kss.StableOptimizer(m.optimizer, model=m), loss="mse", metrics=["mae"]
    )  # the same Adam, wrapped
    callbacks = [kss.StableCheckpoint(directory, save_freq=3)] + ([StopAt(*stop)] if stop else [])
    try:
        m.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    except RuntimeError as err:
        assert stop is not None and str(err) == "preempted", err
    return m, callbacks[0]


def test_fault10_restore_with_accumulation_and_ema_emits_no_warning(tmp_path):
    m, _ = _accumulating_ema_fit(tmp_path / "run", stop=(1, 3))  # saved at step 9 (mid-window), then stopped
    acc = [v for v in m.optimizer.variables if "gradient_accumulator" in v.path]
    assert acc and any(np.any(to_np(v)) for v in acc)  # an open accumulation window was saved
    path = kss.StableCheckpoint(tmp_path / "run").checkpoints()[0]
    # a fresh model with a plain Adam: restore_training_state on its own
    dst = mlp(
        6, 8, activation="relu", seed=0, optimizer="plain", inner=_adam_accumulating_ema, metrics=["mae"]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = kss.restore_training_state(path, dst, include_rng=False)
    assert report.built_optimizer
    ema = [v for v in dst.optimizer.variables if v.path.endswith("_average")]
    assert ema and all(np.any(to_np(v)) for v in ema)
    # and the whole resumed fit (restore, metric values, skipped batches, saves) warns of nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if BACKEND == "torch":
            # Keras' own Optimizer.get_config reads a learning-rate variable with np.array
            # (keras/src/backend/common/variables.py), which NumPy 2 warns about on Torch:
            # Keras' code, reached by every model.save, not the package's.
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"keras\.src\.")
        res, ckpt = _accumulating_ema_fit(tmp_path / "run")
    assert ckpt.restore_report is not None
    assert int(to_np(res.optimizer.iterations)) == 6  # 12 micro-steps, windows of 2


# -- fault 11: the keep_learning_rate hint, the iterations counter near its limit -------------
def _saved(tmp_path, lr_at_save=None, iterations=None):
    src = mlp(6, 8, activation="relu", seed=0, optimizer="plain", learning_rate=1e-3, metrics=["mae"])
    src.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    if lr_at_save is not None:
        src.optimizer.learning_rate.assign(lr_at_save)  # as ReduceLROnPlateau does
    if iterations is not None:
        src.optimizer.iterations.assign(iterations)
    kss.save_training_state(tmp_path / "s.h5", src)
    return tmp_path / "s.h5"


def test_fault11_resume_with_a_changed_learning_rate_does_not_suggest_keep_learning_rate(tmp_path):
    path = _saved(tmp_path, lr_at_save=5e-4)
    report = kss.restore_training_state(
        path, mlp(6, 8, activation="relu", seed=0, optimizer="plain", learning_rate=1e-3, metrics=["mae"])
    )
    assert not report.transfer
    assert [(k, a) for k, _, _, a in report.learning_rates] == [("optimizer#learning_rate", "replaced")]
    assert "compiled 0.001 replaced by saved 0.0005" in str(report)
    assert "keep_learning_rate" not in str(report)
    # StableCheckpoint's resume: the same
    ckpt_dir = tmp_path / "ckpt"
    m = mlp(6, 8, activation="relu", seed=0, optimizer="plain", learning_rate=1e-3, metrics=["mae"])
    lowered = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 5e-4)  # at epoch 0's begin
    m.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[kss.StableCheckpoint(ckpt_dir), lowered])
    ckpt = kss.StableCheckpoint(ckpt_dir)
    m = mlp(6, 8, activation="relu", seed=0, optimizer="plain", learning_rate=1e-3, metrics=["mae"])
    m.fit(X, Y, batch_size=16, epochs=2, verbose=0, callbacks=[ckpt])
    assert ckpt.restore_report.learning_rates and not ckpt.restore_report.transfer
    assert "keep_learning_rate" not in str(ckpt.restore_report)


@pytest.mark.parametrize(
    "options", [{"strict": False}, {"rename": [(r"^path:", "path:")]}], ids=["strict_false", "rename"]
)
def test_fault11_transfer_restore_suggests_keep_learning_rate(tmp_path, options):
    path = _saved(tmp_path)
    report = kss.restore_training_state(
        path,
        mlp(6, 8, activation="relu", seed=0, optimizer="plain", learning_rate=1e-4, metrics=["mae"]),
        **options,
    )
    assert report.transfer
    assert report.learning_rates[0][3] == "replaced"
    assert "compiled 0.0001 replaced by saved 0.001 (pass keep_learning_rate=True" in str(report)


@pytest.mark.parametrize("offset", [1000, 2**31 // 50], ids=["near", "far"])
def test_fault11_iterations_counter_near_int32_limit_is_reported(tmp_path, offset):
    value = 2**31 - 1 - offset
    path = _saved(tmp_path, iterations=value)
    dst = mlp(6, 8, activation="relu", seed=0, optimizer="plain", learning_rate=1e-3, metrics=["mae"])
    report = kss.restore_training_state(path, dst)
    assert int(to_np(dst.optimizer.iterations)) == value
    dtype = keras.backend.standardize_dtype(dst.optimizer.iterations.dtype)
    assert dtype == ("int64" if BACKEND == "tensorflow" else "int32")
    if dtype == "int32" and offset == 1000:
        assert report.counters_near_limit == [("optimizer#iteration", value, 2**31 - 1, "int32")]
        assert f"optimizer#iteration = {value} is within 1000 steps of its int32 maximum" in str(report)
    else:  # an int64 counter (TensorFlow), or 2% below the int32 maximum
        assert report.counters_near_limit == []
        assert "maximum" not in str(report)
