"""Strict test environment: one backend per pytest process (KERAS_BACKEND), warnings
are errors (pyproject), a clean Keras session and fixed seeds for every test."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()


@pytest.fixture(autouse=True)
def _clean_session():
    # No forced gc.collect() (free_memory): a full collection over the heap that hundreds
    # of tests left behind costs seconds per test on TensorFlow; Python's own gc still runs.
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    yield


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    return x, y


def to_np(v):
    return keras.ops.convert_to_numpy(v)


def slots_by_key(optimizer):
    """``{entry key: numpy array}`` for every optimizer variable."""
    from keras_stable_state.optimizer import optimizer_entries

    if hasattr(optimizer, "entries"):
        entries = optimizer.entries()
    else:
        entries = optimizer_entries(optimizer, allow_order_keys=True)  # a bare optimizer: no model
    return {e.key: to_np(e.variable) for e in entries}
