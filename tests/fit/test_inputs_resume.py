"""Exact resume with steps_per_execution > 1 and with parallel and stateful inputs
(PyDataset workers, on_epoch_end shuffling, tf.data reshuffling)."""

import keras
import numpy as np
import pytest
from conftest import BACKEND, StopAt

import keras_stable_state as kss

rng = np.random.default_rng(1)
X = rng.normal(size=(80, 6)).astype("float32")  # 10 batches of 8 per epoch
Y = (X @ rng.normal(size=(6, 1))).astype("float32")
EPOCHS = 2
STEPS = 10 * EPOCHS


def _fit(directory, inputs, *, stop=None, spe=1, save_freq=4, ckpt_callbacks=None, shuffle=True):
    """One ``fit`` of a small model with Dropout, shuffle=True and a StableCheckpoint; a
    ``stop=(epoch, batch)`` preempts it there. ``inputs()`` makes fresh fit inputs."""
    keras.utils.set_random_seed(0)
    m = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(1),
        ]
    )
    m.compile(
        optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=m),
        loss="mse",
        steps_per_execution=spe,
    )
    ckpt = None
    if directory is not None:  # None: the run a user has without the library
        ckpt = kss.StableCheckpoint(directory, save_freq=save_freq, max_to_keep=2, callbacks=ckpt_callbacks)
    extra = [] if stop is None else [StopAt(*stop)]
    try:
        m.fit(
            **inputs(), epochs=EPOCHS, shuffle=shuffle, verbose=0, callbacks=[c for c in (ckpt, *extra) if c]
        )
    except RuntimeError as err:
        assert stop is not None and str(err) == "preempted", err
    return m, ckpt


def _weights(m):
    return [np.array(w) for w in m.get_weights()]


_REFERENCES = {}  # one uninterrupted run per kind of input, shared by the tests below


def _reference(tmp_path_factory, name, inputs, **kw):
    """The weights after an uninterrupted ``_fit`` of ``inputs`` without the library (no
    ``StableCheckpoint``; ``name`` tells the kind of input and options apart), trained once per module: the tests only compare with it.
    ``test_the_uninterrupted_run_repeats_itself`` checks that such a run is deterministic."""
    key = (name, kw.get("spe", 1), kw.get("shuffle", True))
    if key not in _REFERENCES:
        ref, _ = _fit(None, inputs, **kw)
        assert int(ref.optimizer.iterations) == STEPS
        _REFERENCES[key] = _weights(ref)
    return _REFERENCES[key]


def _assert_resume_exact(tmp_path, reference, inputs, stops, **kw):
    """Preempted at each ``(stop, saved_at)`` of ``stops`` in turn (each run but the first
    resumes from the previous one's newest checkpoint, which is at global step ``saved_at``),
    then resumed to the end: equal to the uninterrupted ``reference`` weights."""
    for stop, saved_at in stops:
        _, stopped = _fit(tmp_path, inputs, stop=stop, **kw)
        assert stopped.checkpoints()[0].endswith(f"ckpt-{saved_at:010d}.h5")
    res, ckpt = _fit(tmp_path, inputs, **kw)
    assert ckpt.restore_report is not None  # really resumed, not restarted
    assert int(res.optimizer.iterations) == STEPS
    for a, b in zip(reference, _weights(res), strict=True):
        np.testing.assert_array_equal(a, b)
    return ckpt


def _arrays():
    return dict(x=X, y=Y, batch_size=8)


# -- steps_per_execution ------------------------------------------------------------------
needs_spe = pytest.mark.skipif(
    BACKEND == "torch", reason="Keras refuses steps_per_execution > 1 on the torch backend itself"
)


@needs_spe
def test_steps_per_execution_resumes_exactly_at_an_epoch_boundary(tmp_path, tmp_path_factory):
    ref = _reference(tmp_path_factory, "arrays", _arrays, spe=4)
    ckpt = _assert_resume_exact(tmp_path, ref, _arrays, [((1, 0), 10)], spe=4, save_freq="epoch")
    assert ckpt._position.epoch == EPOCHS


@needs_spe
def test_steps_per_execution_resumes_exactly_at_an_execution_boundary(tmp_path, tmp_path_factory):
    # 10 batches per epoch: executions [0-3] [4-7] [8-9]; save_freq=4 saves after global
    # steps 4, 8, 14, 18...; stopping as epoch 1's execution at batch 8 begins resumes from
    # the save taken there (epoch 1, step 8): two executions are drawn and skipped.
    ref = _reference(tmp_path_factory, "arrays", _arrays, spe=4)
    _assert_resume_exact(tmp_path, ref, _arrays, [((1, 8), 18)], spe=4, save_freq=4)


@needs_spe
def test_save_freq_inside_an_execution_is_refused_at_train_begin(tmp_path):
    with pytest.raises(kss.StateError, match=r"save_freq=6.*steps_per_execution=4.*multiple of 4"):
        _fit(tmp_path, _arrays, spe=4, save_freq=6)
    assert not list(tmp_path.glob("ckpt-*"))


@needs_spe
def test_checkpoint_inside_an_execution_is_refused_naming_steps_per_execution(tmp_path):
    _fit(tmp_path, _arrays, stop=(1, 3), spe=1, save_freq=2)  # newest save: epoch 1, step 2
    with pytest.raises(kss.StateError, match=r"after batch 2 of epoch 1.*steps_per_execution=4"):
        _fit(tmp_path, _arrays, spe=4, save_freq=4)


# -- PyDataset: worker threads and on_epoch_end shuffling ------------------------------
class _Batches(keras.utils.PyDataset):
    """Batches of 8 in index order (``fit(shuffle=True)`` shuffles the batch indices)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def __len__(self):
        return len(X) // 8

    def __getitem__(self, i):
        s = slice(i * 8, (i + 1) * 8)
        return X[s], Y[s]


class _EpochShuffled(_Batches):
    """Shuffles its samples in ``on_epoch_end`` (the Keras docs' pattern); keeps the order
    with ``get_state()`` / ``set_state()``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.order = np.arange(len(X))

    def on_epoch_end(self):
        self.order = np.random.permutation(len(X))

    def __getitem__(self, i):
        idx = self.order[i * 8 : (i + 1) * 8]
        return X[idx], Y[idx]

    def get_state(self):
        return {"order": self.order.copy()}

    def set_state(self, state):
        self.order = np.array(state["order"])


class _EpochShuffledNoState(_EpochShuffled):
    get_state = None
    set_state = None


# Preempted at epoch 1's first batch (resumed from the epoch boundary, save at step 10),
# then, in the resumed run, at epoch 1's 8th batch (resumed mid-epoch from step 15): a
# wrong first resume leaves wrong weights (or input state) in the second one's checkpoint.
_TWO_STOPS = [((1, 0), 10), ((1, 7), 15)]


def _workers():
    return dict(x=_Batches(workers=2))


def _epoch_shuffled():
    return dict(x=_EpochShuffled(workers=2))


def test_pydataset_with_two_worker_threads_resumes_exactly(tmp_path, tmp_path_factory):
    ref = _reference(tmp_path_factory, "workers", _workers, save_freq=5)
    _assert_resume_exact(tmp_path, ref, _workers, _TWO_STOPS, save_freq=5)


# JAX warns that forking a multithreaded process may deadlock (Keras forks the workers)
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("shuffle", [True, False], ids=["fit-shuffle", "no-shuffle"])
def test_pydataset_with_worker_processes_resumes_exactly(shuffle, tmp_path, tmp_path_factory):
    """Keras' worker queue serves each epoch's first batches from what the epoch before
    fetched (its on_epoch_end order, its shuffle), and the first epoch's from fit's
    model-building draw: a resumed process carries the saved ones instead of its own."""

    def processes():
        return dict(x=_EpochShuffled(workers=2, use_multiprocessing=True))

    ref = _reference(tmp_path_factory, f"processes-{shuffle}", processes, save_freq=5, shuffle=shuffle)
    ckpt = _assert_resume_exact(tmp_path, ref, processes, _TWO_STOPS, save_freq=5, shuffle=shuffle)
    assert "state:prefetched" in ckpt.restore_report.restored_state


def test_pydataset_shuffling_in_on_epoch_end_resumes_exactly(tmp_path, tmp_path_factory):
    ref = _reference(tmp_path_factory, "epoch-shuffled", _epoch_shuffled, save_freq=5)
    ckpt = _assert_resume_exact(tmp_path, ref, _epoch_shuffled, _TWO_STOPS, save_freq=5)
    assert "state:input" in ckpt.restore_report.restored_state


def test_the_uninterrupted_run_repeats_itself(tmp_path, tmp_path_factory):
    """The references above are deterministic (worker threads and on_epoch_end shuffling
    included): otherwise a resume could not be compared with them."""
    ref = _reference(tmp_path_factory, "epoch-shuffled", _epoch_shuffled, save_freq=5)
    again, _ = _fit(tmp_path, _epoch_shuffled, save_freq=5)
    for a, b in zip(ref, _weights(again), strict=True):
        np.testing.assert_array_equal(a, b)


def test_pydataset_shuffling_in_on_epoch_end_without_state_warns_naming_it(tmp_path):
    with pytest.warns(kss.InexactResumeWarning, match=r"_EpochShuffledNoState.*on_epoch_end"):
        _fit(tmp_path, lambda: dict(x=_EpochShuffledNoState()), stop=(0, 0))  # warned at train begin


def test_input_state_missing_from_the_checkpoint_is_refused(tmp_path):
    _fit(tmp_path, lambda: dict(x=_Batches()), stop=(1, 0), save_freq=5)
    with pytest.raises(kss.StateError, match=r"_EpochShuffled defines get_state\(\)/set_state\(\).*no input"):
        _fit(tmp_path, lambda: dict(x=_EpochShuffled()), save_freq=5)


# -- tf.data ------------------------------------------------------------------------------
def test_tf_data_reshuffling_each_iteration_is_no_longer_warned_about(tmp_path):
    """tf.data's iterator checkpoint is saved (tests/fit/test_fit_tf_data_state.py): no warning."""
    tf = pytest.importorskip("tensorflow", reason="tf.data inputs need TensorFlow installed")

    def inputs(reshuffle):
        ds = tf.data.Dataset.from_tensor_slices((X, Y))
        return dict(x=ds.shuffle(80, seed=1, reshuffle_each_iteration=reshuffle).batch(8))

    _fit(tmp_path / "a", lambda: inputs(True), shuffle=False, stop=(0, 0))  # warnings are errors: none here
    _fit(tmp_path / "b", lambda: inputs(False), shuffle=False, stop=(0, 0))


@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2)], ids=["workers-then-none", "none-then-workers"])
def test_a_resume_with_other_pydataset_workers_warns_naming_them(saved, resumed, tmp_path):
    _fit(tmp_path, lambda: dict(x=_Batches(workers=saved)), stop=(1, 0), save_freq=5)
    with pytest.warns(kss.InexactResumeWarning, match=r"PyDataset read by workers.*same workers"):
        _fit(tmp_path, lambda: dict(x=_Batches(workers=resumed)), save_freq=5)
