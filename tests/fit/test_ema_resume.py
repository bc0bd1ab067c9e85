"""EMA weights swapped into the model by ``SwapEMAWeights(swap_on_epoch=True)`` across an
epoch-boundary resume (found by the resume-conformance matrix)."""

import keras
import numpy as np
import pytest
from conftest import StopAt

import keras_stable_state as kss

rng = np.random.default_rng(6)
X = rng.normal(size=(32, 4)).astype("float32")
Y = (X @ rng.normal(size=(4, 1))).astype("float32")


def _fit(directory, *, stop=None, seed=0, order="ckpt-first", passed=True, save_freq="epoch"):
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(1)])
    m.compile(
        optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.9), model=m),
        loss="mse",
    )
    swap = keras.callbacks.SwapEMAWeights(swap_on_epoch=True)
    ckpt = kss.StableCheckpoint(directory, save_freq=save_freq, callbacks={"swap": swap} if passed else None)
    callbacks = [ckpt, swap] if order == "ckpt-first" else [swap, ckpt]
    callbacks += [StopAt(*stop)] if stop else []
    try:
        m.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    except RuntimeError as err:
        assert stop is not None and str(err) == "preempted", err
        return None
    return [keras.ops.convert_to_numpy(v) for v in m.weights + m.optimizer.variables]


@pytest.mark.parametrize("order", ["ckpt-first", "swap-first"])
@pytest.mark.parametrize(
    "stop,save_freq", [((2, 0), "epoch"), ((1, 2), 2)], ids=["epoch-boundary", "mid-epoch"]
)
@pytest.mark.slow
def test_swap_ema_weights_on_epoch_resumes_exactly(tmp_path, order, stop, save_freq):
    ref = _fit(tmp_path / "ref", order=order, save_freq=save_freq)
    keras.backend.clear_session(free_memory=False)
    _fit(tmp_path / "run", stop=stop, order=order, save_freq=save_freq)
    keras.backend.clear_session(free_memory=False)
    res = _fit(tmp_path / "run", seed=4, order=order, save_freq=save_freq)
    for i, (a, b) in enumerate(zip(ref, res, strict=True)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=f"variable {i}")


@pytest.mark.slow
def test_swap_ema_weights_not_given_is_saved_all_the_same(tmp_path):
    """Not named in StableCheckpoint(callbacks=...), its flag is saved as ``SwapEMAWeights/0``
    (issue 33): the epoch-boundary resume is as exact, and nothing is warned."""
    ref = _fit(tmp_path / "ref", passed=False)
    keras.backend.clear_session(free_memory=False)
    _fit(tmp_path / "run", stop=(2, 0), passed=False)
    keras.backend.clear_session(free_memory=False)
    res = _fit(tmp_path / "run", seed=4, passed=False)
    for i, (a, b) in enumerate(zip(ref, res, strict=True)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=f"variable {i}")
