"""Issue 14, fault 1: a mid-epoch resume of a model compiled with metrics, weighted
metrics or a loss per output (TensorFlow builds them only at the first trace)."""

import json
import shutil
import warnings

import keras
import numpy as np
import pytest
from conftest import StopAt
from kit import assert_same_state, inexact_warnings, run_on_backend

import keras_stable_state as kss

rng = np.random.default_rng(4)
X = rng.normal(size=(48, 6)).astype("float32")  # 6 batches of 8 per epoch
Y = (X @ rng.normal(size=(6, 1))).astype("float32")
W = rng.uniform(0.5, 2.0, size=(48,)).astype("float32")
EPOCHS = 3


# Its own model: how each kind is compiled (metrics, weighted metrics, a loss per output) is the case.
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


def _batches(kind, sizes=(8,) * 6):
    """The batches of ``_inputs(kind)`` in order, forever, of ``sizes`` samples each: a
    generator input, whose batch size TensorFlow's traced train step does not know."""
    data = _inputs(kind)
    starts = np.cumsum((0, *sizes))
    while True:
        for i, j in zip(starts[:-1], starts[1:], strict=True):
            yield tuple(
                {k: v[i:j] for k, v in d.items()} if isinstance(d, dict) else d[i:j]
                for d in (data["x"], data["y"])
            )


def _fit(kind, directory=None, stop=None, metrics=None, shuffle=True, generator=False, sizes=(8,) * 6):
    """A fresh session and model, fit 3 epochs with (``directory``) or without a
    StableCheckpoint saving every 3 batches; ``stop=(epoch, batch)`` preempts it there.
    ``generator=True`` feeds the same batches from a Python generator, of ``sizes``."""
    keras.backend.clear_session(free_memory=False)
    m = _model(kind, metrics)
    callbacks = [] if directory is None else [kss.StableCheckpoint(directory, save_freq=3, max_to_keep=2)]
    callbacks += [] if stop is None else [StopAt(*stop)]
    data = (
        dict(x=_batches(kind, sizes), steps_per_epoch=len(sizes), shuffle=False)
        if generator
        else dict(**_inputs(kind), batch_size=8, shuffle=shuffle)
    )
    try:
        history = m.fit(**data, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    except RuntimeError as err:
        assert stop is not None and str(err) == "preempted", err
        return m, None
    return m, history


def _assert_same_training(a, b, hist_a, hist_b):
    assert_same_state(a, b)
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


def test_fault1_mid_epoch_resume_of_per_output_losses_from_a_generator_equals_uninterrupted(tmp_path):
    # TensorFlow counts a generator's batches, not samples, in the per-output loss means.
    ref, ref_history = _fit("two_outputs", tmp_path / "ref", generator=True)
    _fit("two_outputs", tmp_path / "run", stop=(1, 5), generator=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kss.InexactResumeWarning)
        res, res_history = _fit("two_outputs", tmp_path / "run", generator=True)
    _assert_same_training(ref, res, ref_history, res_history)


# TensorFlow counts batches for a generator, JAX and Torch samples.
WRITER = {"tensorflow": "jax", "jax": "torch", "torch": "tensorflow"}[keras.backend.backend()]


UNEVEN = (6, 8, 8, 8, 8, 10)  # 22 samples in the 3 batches before the save at step 3: not 3 equal ones


SIZES = {"equal-batches": (8,) * 6, "unequal-batches": UNEVEN}


def _on_writer(tmp_path_factory, runs):
    """``(folder, {name: reference})``: one child process on WRITER runs, for each ``name:
    (code, reference)`` of ``runs``, the statements ``code`` (which may use ``{folder}``, this
    name's folder) and then the expression ``reference``, whose value comes back through JSON."""
    root = tmp_path_factory.mktemp("writer")
    code = "import json, keras\nrefs = {}\n"
    for name, (lines, reference) in runs.items():
        code += lines.format(folder=repr(str(root / name))) + f"\nrefs[{name!r}] = {reference}\n"
    out = run_on_backend(WRITER, "test_compiled_metrics_resume", code + "print(json.dumps(refs))")
    return root, json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def written_on_writer(tmp_path_factory):
    """``(folder, {name: History of the writer's uninterrupted fit without the library})``: per
    name of `SIZES`, a fit preempted at (1, 5) on WRITER in ``folder / name`` (one child process
    writes all)."""
    return _on_writer(
        tmp_path_factory,
        {
            name: (
                f"t._fit('two_outputs', {{folder}}, stop=(1, 5), generator=True, sizes={sizes!r})",
                f"t._fit('two_outputs', generator=True, sizes={sizes!r})[1].history",
            )
            for name, sizes in SIZES.items()
        },
    )


@pytest.mark.slow
@pytest.mark.frameworks(WRITER)
@pytest.mark.parametrize("name", sorted(SIZES))
def test_fault1_cross_backend_resume_converts_per_output_loss_means_counted_otherwise(
    tmp_path, written_on_writer, name
):
    """TensorFlow counts a generator's batches in the per-output loss means, JAX and Torch
    samples: a mid-epoch checkpoint written on one side and resumed on the other has its means
    converted when the epoch's batches so far were equal (the resumed History equals the
    writer's uninterrupted one), and is warned about when they were not."""
    root, references = written_on_writer
    sizes = SIZES[name]
    shutil.copytree(root / name, tmp_path / "run")
    reference = references[name]  # the writer's, uninterrupted, no library
    differ = "tensorflow" in (WRITER, keras.backend.backend())
    (res, history), found = inexact_warnings(
        lambda: _fit("two_outputs", tmp_path / "run", generator=True, sizes=sizes)
    )
    assert int(res.optimizer.iterations) == 6 * EPOCHS
    if differ and sizes == UNEVEN:
        assert len(found) == 1, found
        assert f"written on {WRITER}" in found[0] and "compile_loss/a_loss" in found[0], found[0]
        assert "unequal numbers of samples" in found[0] and "save_freq='epoch'" in found[0]
        return
    assert found == []
    # The resumed epoch in this backend's units: over equal batches, the mean of their means
    # is the mean over their samples, so it equals the writer's (up to the backends' float sums)
    for name in ("a_loss", "b_loss", "loss"):
        np.testing.assert_allclose(history.history[name], reference[name], rtol=1e-4, err_msg=name)


def _fit_arrays(directory=None, stop=None, batch_size=10):
    """``two_outputs`` on its 48 samples of arrays in batches of ``batch_size`` (at 10 the last
    batch holds 8), 3 epochs, with a StableCheckpoint saving at each epoch's end in
    ``directory`` (none when ``None``: stock Keras); ``stop=(epoch, batch)`` preempts it there."""
    keras.backend.clear_session(free_memory=False)
    m = _model("two_outputs")
    callbacks = [] if directory is None else [kss.StableCheckpoint(directory, save_freq="epoch")]
    callbacks += [] if stop is None else [StopAt(*stop)]
    try:
        history = m.fit(
            **_inputs("two_outputs"),
            batch_size=batch_size,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    except RuntimeError as err:
        assert stop is not None and str(err) == "preempted", err
        return m, None
    return m, history


BATCH_SIZES = {"unequal-batches": 10, "equal-batches": 8}


@pytest.fixture(scope="module")
def epoch_checkpoints_of_writer(tmp_path_factory):
    """``(folder, {name: (weights, History)})``: per name of `BATCH_SIZES`, `_fit_arrays`
    preempted at the start of epoch 1 on WRITER in ``folder / name`` (its newest checkpoint:
    epoch 0's end), and the writer's uninterrupted fit without the library (its weights by
    position, as nested lists, and its History), one child process doing all."""
    return _on_writer(
        tmp_path_factory,
        {
            name: (
                f"t._fit_arrays({{folder}}, stop=(1, 0), batch_size={size})\n"
                f"m, h = t._fit_arrays(batch_size={size})",
                "([keras.ops.convert_to_numpy(w).tolist() for w in m.weights], h.history)",
            )
            for name, size in BATCH_SIZES.items()
        },
    )


@pytest.mark.slow
@pytest.mark.frameworks(WRITER)
@pytest.mark.parametrize("name", sorted(BATCH_SIZES))
def test_an_epoch_boundary_resume_across_tensorflow_of_unequal_batches_warns_about_per_output_losses(
    tmp_path, epoch_checkpoints_of_writer, name
):
    """TensorFlow's fit averages each output's loss over batches where the batch size is not
    static (a partial last batch), JAX's and Torch's over samples: a resume across TensorFlow
    of unequal batches warns that the later epochs' per-output History differs (matrix seed
    25, torch case 17, was SILENT); of equal batches, or between JAX and Torch, it does not.
    Either way the weights and the total loss equal the writer's uninterrupted run without the
    library (up to the backends' float sums), and where the warning is given the per-output
    losses of the resumed epochs really differ from it."""
    root, references = epoch_checkpoints_of_writer
    weights, reference = references[name]
    batch_size = BATCH_SIZES[name]
    shutil.copytree(root / name, tmp_path / "run")
    (res, history), found = inexact_warnings(lambda: _fit_arrays(tmp_path / "run", batch_size=batch_size))
    assert history is not None and int(res.optimizer.iterations) == EPOCHS * -(-48 // batch_size)
    assert len(res.weights) == len(weights)
    for i, (live, saved) in enumerate(zip(res.weights, weights, strict=True)):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(live), saved, rtol=1e-4, atol=1e-5, err_msg=str(i)
        )
    # The History holds every epoch (the saved epoch 0 and the resumed epochs 1 and 2)
    np.testing.assert_allclose(history.history["loss"], reference["loss"], rtol=1e-4, err_msg="loss")
    warned = [m for m in found if "reports a loss per output" in m]
    differ = "tensorflow" in (WRITER, keras.backend.backend()) and name == "unequal-batches"
    for output in ("a_loss", "b_loss"):
        np.testing.assert_allclose(history.history[output][0], reference[output][0], rtol=1e-4)
        close = np.allclose(history.history[output][1:], reference[output][1:], rtol=1e-4)
        assert close != differ, (output, history.history[output], reference[output])
    if differ:
        assert len(warned) == 1, found
        assert f"written on {WRITER}" in warned[0] and "'a_loss', 'b_loss'" in warned[0], warned[0]
        assert "training: 48 samples in batches of 10" in warned[0], warned[0]
    else:
        assert warned == [], warned
