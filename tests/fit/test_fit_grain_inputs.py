"""grain inputs of ``fit`` (``MapDataset``, ``IterDataset``, ``grain.DataLoader``) resume
exactly with ``StableCheckpoint`` on every backend. grain draws every order and random
map from seeds given in the pipeline (it refuses a ``shuffle`` or ``random_map``
without one), and Keras' grain adapter iterates the dataset from its start each epoch
(``keras/src/trainers/data_adapters/grain_dataset_adapter.py``), so the replay of an
interrupted epoch (its batches drawn again and skipped) reads the same batches; with
``steps_per_epoch`` over a repeated dataset, the stream's place is reached the same way.
Each case: an uninterrupted fit, then fits preempted once or twice and resumed with a
fresh model and another seed, compared bit for bit (weights, optimizer variables, History)."""

import re

import keras
import numpy as np
import pytest
from kit import assert_resumes_exactly, assert_same_state, fit_input, inexact_warnings, run_on_backend

# Keras' own, at the end of each epoch of an input of unknown length (grain's, to Keras).
pytestmark = pytest.mark.filterwarnings("ignore:Your input ran out of data:UserWarning")
grain = pytest.importorskip("grain", reason="grain inputs need grain installed (the [grain] extra)")

N, BATCH, EPOCHS = 48, 8, 3  # 6 batches per epoch
rng = np.random.default_rng(5)
X = rng.normal(size=(N, 4)).astype("float32")
Y = (X @ rng.normal(size=(4, 1))).astype("float32")


class _Source:
    """A random-access data source (``__len__``, ``__getitem__``) of ``(x, y)`` samples."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return X[i], Y[i]


def _noisy(sample, rng):
    x, y = sample
    return (x + 0.01 * rng.normal(size=4)).astype("float32"), y


def _map_dataset():
    return grain.MapDataset.source(_Source()).shuffle(seed=7).random_map(_noisy, seed=3).batch(BATCH)


def _iter_dataset():
    options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
    return grain.MapDataset.source(_Source()).shuffle(seed=7).to_iter_dataset(options).batch(BATCH)


def _data_loader():
    sampler = grain.samplers.IndexSampler(
        N, shuffle=True, seed=5, num_epochs=1, shard_options=grain.sharding.NoSharding()
    )
    return grain.DataLoader(
        data_source=_Source(), sampler=sampler, operations=[grain.transforms.Batch(BATCH)], worker_count=0
    )


def _repeated():
    return grain.MapDataset.source(_Source()).shuffle(seed=7).repeat().batch(BATCH)


# name -> (make the input, fit's other arguments)
INPUTS = {
    "map-dataset": (_map_dataset, {}),
    "iter-dataset": (_iter_dataset, {}),
    "data-loader": (_data_loader, {}),
    "steps-per-epoch-over-repeat": (_repeated, {"steps_per_epoch": N // BATCH}),
}
# (preempted at (epoch, batch), the global step of the newest checkpoint then); save_freq=2.
STOPS = {
    "mid-epoch": [((1, 3), 8)],
    "boundary-then-mid-epoch": [((1, 0), 6), ((2, 5), 16)],
}
_REFERENCES = {}


def _reference(tmp_path_factory, name):
    make, kw = INPUTS[name]
    if name not in _REFERENCES:
        model, _ = fit_input(
            tmp_path_factory.mktemp("ref"), lambda s: make(), 0, epochs=EPOCHS, shuffle=False, **kw
        )
        # TensorFlow counts one more optimizer iteration per epoch of unknown length (the step
        # that finds the end): 21 there, 18 elsewhere; the resumed runs count alike.
        assert int(model.optimizer.iterations) >= EPOCHS * N // BATCH
        _REFERENCES[name] = model
    return _REFERENCES[name]


# Every input killed mid-epoch once, and at an epoch boundary then mid-epoch; the repeated
# stream only the second way (its kill inside the epoch is the first way's: each iterator of
# a repeated MapDataset prefetches through grain's default 16 threads and 500 elements, which
# makes it the costliest input here, about 8 CPU-s a case on every backend).
CASES = [
    pytest.param(n, s, marks=[pytest.mark.slow] if n.startswith("steps") else [])
    for n in sorted(INPUTS)
    for s in sorted(STOPS)
    if not (n.startswith("steps") and s == "mid-epoch")
]


@pytest.mark.pairwise("stops")  # each input: once mid-epoch on some backends, twice on the others
@pytest.mark.parametrize(("name", "stops"), CASES)
def test_grain_input_resumes_exactly(tmp_path, tmp_path_factory, name, stops):
    make, kw = INPUTS[name]
    reference = _reference(tmp_path_factory, name)
    assert_resumes_exactly(
        tmp_path, reference, lambda s: make(), STOPS[stops], epochs=EPOCHS, shuffle=False, **kw
    )


def test_the_grain_references_repeat_themselves(tmp_path, tmp_path_factory):
    """Each epoch of a grain input is the same pass (Keras iterates it from its start) and two
    runs are equal: a resume compared with the reference compares like with like."""
    again, _ = fit_input(tmp_path, lambda s: _map_dataset(), 0, epochs=EPOCHS, shuffle=False)
    assert_same_state(_reference(tmp_path_factory, "map-dataset"), again)


# TensorFlow's fit counts one more optimizer step in each epoch of an input of unknown length
# (the step that finds its end), the other backends do not: a checkpoint written on one side of
# TensorFlow and resumed on the other is warned about (the writer runs in a child process).
WRITER = {"tensorflow": "jax", "jax": "tensorflow", "torch": "tensorflow"}[keras.backend.backend()]


@pytest.mark.frameworks(WRITER)
def test_a_grain_resume_across_tensorflow_warns_that_the_step_counts_differ(tmp_path):
    run_on_backend(
        WRITER,
        "test_fit_grain_inputs",
        f"t.fit_input({str(tmp_path)!r}, lambda s: t._map_dataset(), 0, (1, 3), epochs=t.EPOCHS, shuffle=False)",
    )
    (_, ckpt), found = inexact_warnings(
        lambda: fit_input(tmp_path, lambda s: _map_dataset(), 0, epochs=EPOCHS, shuffle=False)
    )
    assert any(
        re.search(rf"written on {WRITER} .*no known length.*one more optimizer step", m) for m in found
    ), found
    assert ckpt.restore_report is not None
