"""A checkpoint never changes the run it watches (issue 33, item 5): an uninterrupted ``fit``
with ``StableCheckpoint`` equals, bit for bit, the same ``fit`` without it (every weight,
optimizer variable and History value, compared by position), for each kind of input ``fit``
accepts, on every backend. The reference is the run a user has without the library: a plain
Keras optimizer, no callback."""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from kit import mlp

import keras_stable_state as kss

rng = np.random.default_rng(11)
X = rng.normal(size=(46, 5)).astype("float32")  # 6 batches of 8, the last one of 6
Y = (X @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(46, 1))).astype("float32")
W = rng.uniform(0.5, 2.0, size=(46,)).astype("float32")


class ShuffledSequence(keras.utils.PyDataset):
    """A PyDataset that reshuffles at each epoch end with NumPy's global generator, and says
    so with get_state()/set_state()."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.order = np.arange(len(X))

    def __len__(self):
        return -(-len(X) // 8)

    def __getitem__(self, i):
        idx = self.order[i * 8 : (i + 1) * 8]
        return X[idx], Y[idx]

    def on_epoch_end(self):
        self.order = np.random.permutation(len(X))

    def get_state(self):
        return {"order": self.order}

    def set_state(self, state):
        self.order = np.asarray(state["order"])


def _generator():
    while True:
        for s in range(0, len(X), 8):
            yield X[s : s + 8], Y[s : s + 8]


def _input(kind):
    """``(args, fit keyword arguments)`` of one input kind, made fresh for each run."""
    if kind.startswith("numpy"):
        shuffle = {"numpy": True, "numpy-batch": "batch", "numpy-unshuffled": False}[kind]
        return (X, Y), {"sample_weight": W, "batch_size": 8, "shuffle": shuffle}
    if kind == "tf.data":
        import tensorflow as tf

        ds = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(46, seed=3, reshuffle_each_iteration=False)
        return (ds.batch(8),), {"shuffle": False}
    if kind == "PyDataset":
        return (ShuffledSequence(),), {"shuffle": False}
    if kind == "PyDataset-threads":
        # Keras' worker queue carries the batches fetched ahead into the next epoch (and
        # those of fit's model-building draw into the first): kept as Keras serves them
        return (ShuffledSequence(workers=2),), {"shuffle": True}
    if kind == "generator":
        return (_generator(),), {"steps_per_epoch": 6, "shuffle": False}
    if kind.startswith("DataLoader"):
        import torch

        torch.manual_seed(23)  # keras.utils.set_random_seed seeds Torch on the Torch backend only
        data = torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))
        gen = torch.Generator().manual_seed(5) if kind == "DataLoader-generator" else None
        return (torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=gen),), {
            "shuffle": False
        }
    if kind == "grain":
        grain = pytest.importorskip("grain")
        ds = grain.MapDataset.source(list(zip(X, Y, strict=False))).shuffle(seed=9).batch(8).repeat()
        return (ds,), {"shuffle": False, "steps_per_epoch": 6}
    raise AssertionError(kind)


def _fit(kind, directory=None, save_freq=2):
    keras.utils.set_random_seed(17)
    model = mlp(5, 8, activation="relu", dropout=0.25, optimizer="plain")
    args, kwargs = _input(kind)
    callbacks = [kss.StableCheckpoint(directory, save_freq=save_freq)] if directory is not None else []
    history = model.fit(*args, epochs=3, verbose=0, callbacks=callbacks, **kwargs)
    state = [keras.ops.convert_to_numpy(v) for v in model.weights + model.optimizer.variables]
    return state, history.history


_KINDS = [
    pytest.param("numpy", id="numpy-shuffled"),
    pytest.param("numpy-batch", id="numpy-shuffle-batch"),
    pytest.param("numpy-unshuffled", id="numpy-unshuffled"),
    pytest.param(
        "tf.data",
        marks=[] if BACKEND == "tensorflow" else [pytest.mark.frameworks("tensorflow")],
        id="tf.data",
    ),
    pytest.param("PyDataset", id="PyDataset"),
    pytest.param("PyDataset-threads", id="PyDataset-worker-threads"),
    pytest.param("generator", id="generator"),
    pytest.param(
        "DataLoader",
        marks=[] if BACKEND == "torch" else [pytest.mark.frameworks("torch")],
        id="torch-DataLoader",
    ),
    pytest.param(
        "DataLoader-generator",
        marks=[] if BACKEND == "torch" else [pytest.mark.frameworks("torch")],
        id="torch-DataLoader-generator",
    ),
    pytest.param("grain", id="grain"),
]


_PLAIN = {}  # kind -> the run without the library (`_fit(kind)`), shared by both save_freq


@pytest.mark.parametrize("save_freq", [2, "epoch"], ids=["every-2-batches", "every-epoch"])
@pytest.mark.parametrize("kind", _KINDS)
def test_a_run_with_stable_checkpoint_equals_the_run_without_it(kind, save_freq, tmp_path):
    if kind not in _PLAIN:
        _PLAIN[kind] = _fit(kind)
    reference, ref_history = _PLAIN[kind]
    keras.backend.clear_session(free_memory=False)
    watched, history = _fit(kind, tmp_path, save_freq)
    assert len(watched) == len(reference)
    for i, (a, b) in enumerate(zip(reference, watched, strict=True)):
        np.testing.assert_array_equal(b, a, err_msg=f"variable {i} ({kind}, save_freq={save_freq})")
    assert history == ref_history
    assert any(p.suffix == ".h5" for p in tmp_path.iterdir())  # it did save


@pytest.mark.parametrize(
    "options",
    [
        {"fit": {"validation_split": 0.25}},
        {"fit": {"validation_data": (X[:10], Y[:10])}, "ckpt": {"monitor": "val_loss", "keep_best": 1}},
        pytest.param(
            {"compile": {"steps_per_execution": 2}},
            marks=pytest.mark.skipif(
                BACKEND == "torch", reason="Keras allows steps_per_execution=1 only on Torch"
            ),
        ),
        {"ckpt": {"save_on_background": True}},
    ],
    ids=["validation-split", "validation-data-keep-best", "steps-per-execution-2", "background-saves"],
)
def test_the_same_holds_with_validation_executions_and_background_saves(options, tmp_path):
    def run(directory):
        keras.utils.set_random_seed(17)
        model = mlp(5, 8, activation="relu", dropout=0.25, optimizer="plain", **options.get("compile", {}))
        callbacks = (
            [kss.StableCheckpoint(directory, save_freq=2, **options.get("ckpt", {}))] if directory else []
        )
        history = model.fit(
            X, Y, batch_size=8, epochs=3, verbose=0, callbacks=callbacks, **options.get("fit", {})
        )
        return [
            keras.ops.convert_to_numpy(v) for v in model.weights + model.optimizer.variables
        ], history.history

    reference, ref_history = run(None)
    keras.backend.clear_session(free_memory=False)
    watched, history = run(tmp_path)
    for i, (a, b) in enumerate(zip(reference, watched, strict=True)):
        np.testing.assert_array_equal(b, a, err_msg=f"variable {i}")
    assert history == ref_history
