"""Strict test environment: one backend per pytest process (KERAS_BACKEND), warnings
are errors (pyproject), a clean Keras session and fixed seeds for every test."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _jax_compilation_cache():
    """Every test builds fresh models, and JAX compiles each one's train step anew (about
    4 s each on a 2-core machine): JAX's persistent compilation cache, keyed by the
    computation, gives the same executable back from disk in a fraction of that. Set
    through the environment, so that the training subprocesses some tests start use it
    too. Eviction on (a size limit) makes JAX lock the folder, so that pytest-xdist workers
    never read an entry another one is still writing; without the ``filelock`` package that
    needs, no cache. ``KSS_JAX_CACHE_DIR=`` (empty) turns it off."""
    import importlib.util
    import tempfile

    folder = os.environ.get(
        "KSS_JAX_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"kss-test-jax-cache-{os.getuid()}")
    )
    if not folder or importlib.util.find_spec("filelock") is None:
        return
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", folder)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(512 * 2**20))


_jax_compilation_cache()

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


def hypothesis_examples(default):
    """``max_examples`` for a property test: ``default`` (small, for ``make test``), or
    ``KSS_HYPOTHESIS_EXAMPLES`` where a longer campaign sets it."""
    return int(os.environ.get("KSS_HYPOTHESIS_EXAMPLES", default))


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


class StopAt(keras.callbacks.Callback):
    """Raise (a preemption) when the batch (or execution) starting at ``batch`` of ``epoch`` begins."""

    repeatable_epoch_begin = True  # its on_epoch_begin only notes the epoch (StableCheckpoint's opt-out)

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), -1

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("preempted")
