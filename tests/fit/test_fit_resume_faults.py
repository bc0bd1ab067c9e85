"""Regression tests of issue 14's StableCheckpoint faults: a LearningRateScheduler applied
twice on a mid-epoch resume (fault 4), a changed batch size or data size accepted
silently (fault 6), History keys split after a rebuild with auto-named outputs (fault 7),
a ``*.orbax`` directory filled with .h5 files (fault 8), and the manual
save_training_state route's data order (fault 9). Each interrupted run is preempted with
StopAt, the session cleared, and a fresh model resumes it."""

import re
import warnings

import keras
import numpy as np
import pytest
import resume_matrix as rm
from conftest import LrLog, StopAt
from kit import mlp

import keras_stable_state as kss
from keras_stable_state._fit import position

rng = np.random.default_rng(3)
X = rng.normal(size=(80, 6)).astype("float32")  # 10 batches of 8 per epoch
Y = (X @ rng.normal(size=(6, 1))).astype("float32")


def _fit(
    directory,
    *,
    stop=None,
    extra=(),
    epochs=3,
    x=X,
    y=Y,
    batch_size=8,
    ckpt_kw=None,
    order=None,
    loss_scale=False,
):
    """A fresh model's fit with a StableCheckpoint (save every 3 batches by default);
    ``stop=(epoch, batch)`` preempts it. Returns (model, checkpoint, history or None)."""
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)

    def sgd():
        inner = keras.optimizers.SGD(1e-2)
        return keras.optimizers.LossScaleOptimizer(inner) if loss_scale else inner

    m = mlp(6, 8, activation="relu", inner=sgd)
    kw = {"save_freq": 3, **(ckpt_kw or {})}
    ckpt = kss.StableCheckpoint(directory, **kw)
    cbs = [ckpt, *extra] if order is None else order(ckpt)
    if stop is not None:
        cbs.append(StopAt(*stop))
    try:
        h = m.fit(x, y, epochs=epochs, batch_size=batch_size, shuffle=True, verbose=0, callbacks=cbs)
    except RuntimeError as err:
        assert stop is not None and str(err) == "preempted", err
        h = None
    return m, ckpt, h


def _assert_same_weights(a, b):
    for u, v in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7)


# -- fault 4 --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "given,loss_scale",
    [(False, False), (True, False), (False, True)],
    ids=["not-given", "given-in-callbacks", "loss-scale-optimizer"],
)
def test_fault4_learning_rate_scheduler_not_applied_twice_on_mid_epoch_resume(tmp_path, given, loss_scale):
    def run(directory, stop=None):
        sched = keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.7)
        log = LrLog()
        kw = {"callbacks": {"sched": sched}} if given else None
        m, ckpt, _ = _fit(directory, stop=stop, extra=[sched, log], ckpt_kw=kw, loss_scale=loss_scale)
        return m, ckpt, log

    ref, _, ref_log = run(tmp_path / "ref")
    run(tmp_path / "run", stop=(1, 5))  # last save: global step 15 = epoch 1, batch 5
    with warnings.catch_warnings():
        warnings.simplefilter("error", kss.InexactResumeWarning)  # none for the scheduler
        res, ckpt, res_log = run(tmp_path / "run")
    assert ckpt.restore_report is not None
    np.testing.assert_allclose(res_log.seen[(1, 5)], 1e-2 * 0.7**2, rtol=1e-6)  # 0.0049, not 0.00343
    for key in [(1, 5), (1, 9), (2, 0), (2, 9)]:
        assert res_log.seen[key] == ref_log.seen[key], key
    assert int(res.optimizer.iterations) == int(ref.optimizer.iterations) == 30
    _assert_same_weights(ref, res)


def test_fault4_other_on_epoch_begin_callbacks_are_warned_about(tmp_path):
    _fit(tmp_path, stop=(1, 5))

    class Shift(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            pass

        def get_state(self):  # stateless: only its on_epoch_begin is in question here
            return {}

        def set_state(self, state):
            pass

    shift = Shift()
    with pytest.warns(kss.InexactResumeWarning, match=r"Shift .*inside epoch 1 \(after batch 5\)") as rec:
        _fit(tmp_path, extra=[shift])
    assert "repeatable_epoch_begin = True" in str(rec[0].message)
    # declared repeatable: no warning
    shift.repeatable_epoch_begin = True
    _fit(tmp_path / "again", stop=(1, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", kss.InexactResumeWarning)
        _fit(tmp_path / "again", extra=[shift])


def test_fault4_scheduler_listed_before_checkpoint_is_warned_at_epoch_boundary_resume(tmp_path):
    def order(sched):
        return lambda ckpt: [sched, ckpt]

    sched = keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.7)
    _fit(tmp_path, stop=(1, 0), ckpt_kw={"save_freq": "epoch"}, order=order(sched))
    sched = keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.7)
    with pytest.warns(
        kss.InexactResumeWarning, match="LearningRateScheduler is listed before StableCheckpoint"
    ):
        _fit(tmp_path, ckpt_kw={"save_freq": "epoch"}, order=order(sched))


# -- fault 6 --------------------------------------------------------------------------------
def test_fault6_changed_batch_size_mid_epoch_is_refused_naming_saved_and_live(tmp_path):
    _fit(tmp_path, stop=(1, 5))
    with pytest.raises(kss.StateError, match=r"batch_size saved 8, now 16.*steps saved 10, now 5") as err:
        _fit(tmp_path, batch_size=16)
    assert 'on_data_change="restart_epoch"' in str(err.value)
    assert err.value.expected == {"batch_size": 8, "steps": 10}


def test_fault6_changed_sample_count_mid_epoch_is_refused(tmp_path):
    _fit(tmp_path, stop=(1, 5))
    with pytest.raises(kss.StateError, match=r"num_samples saved 80, now 72"):
        _fit(tmp_path, x=X[:72], y=Y[:72])


def test_fault6_restart_epoch_trains_the_interrupted_epoch_from_its_first_batch(tmp_path):
    _fit(tmp_path, stop=(1, 5))  # saved at global step 15, batch 5 of epoch 1
    log = LrLog()
    with pytest.warns(kss.InexactResumeWarning, match="epoch 1 is trained again from its first batch"):
        m, ckpt, h = _fit(tmp_path, batch_size=16, extra=[log], ckpt_kw={"on_data_change": "restart_epoch"})
    assert ckpt.restore_report is not None
    assert sorted(k for k in log.seen if k[0] == 1) == [(1, b) for b in range(5)]  # all 5 new batches
    assert int(m.optimizer.iterations) == 15 + 5 + 5  # epochs 1 and 2 with 5 batches each
    assert h.epoch == [0, 1, 2] and len(h.history["loss"]) == 3


def test_fault6_changed_batch_size_at_epoch_boundary_warns(tmp_path):
    _fit(tmp_path, stop=(1, 0), ckpt_kw={"save_freq": "epoch"})
    with pytest.warns(kss.InexactResumeWarning, match=r"batch_size saved 8, now 16"):
        m, _, h = _fit(tmp_path, batch_size=16, ckpt_kw={"save_freq": "epoch"})
    assert int(m.optimizer.iterations) == 10 + 2 * 5
    assert h.epoch == [0, 1, 2]


def test_fault6_checkpoint_without_data_facts_still_resumes_exactly(tmp_path, monkeypatch):
    ref, _, _ = _fit(tmp_path / "ref")
    original = position.Position.get_state

    def old_format(self):  # a checkpoint written before the data facts were saved
        out = original(self)
        out.pop("data", None)
        return out

    monkeypatch.setattr(position.Position, "get_state", old_format)
    _fit(tmp_path / "run", stop=(1, 5))
    monkeypatch.setattr(position.Position, "get_state", original)
    res, ckpt, _ = _fit(tmp_path / "run")
    assert ckpt.restore_report is not None
    _assert_same_weights(ref, res)


def test_stable_checkpoint_validates_on_data_change(tmp_path):
    with pytest.raises(ValueError, match="on_data_change"):
        kss.StableCheckpoint(tmp_path, on_data_change="ignore")
    assert kss.StableCheckpoint(tmp_path, on_data_change="restart_epoch").get_config()["on_data_change"] == (
        "restart_epoch"
    )


# -- fault 7 --------------------------------------------------------------------------------
def _two_outputs(decoys=0):
    for _ in range(decoys):  # layers built first shift the auto-generated names
        keras.layers.Dense(1)
    inp = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inp)
    m = keras.Model(inp, [keras.layers.Dense(1)(hidden), keras.layers.Dense(1)(hidden)])
    m.compile(optimizer=kss.StableOptimizer(keras.optimizers.SGD(1e-2), model=m), loss=["mse", "mse"])
    return m


def test_fault7_history_keys_follow_the_live_output_names_after_a_rebuild(tmp_path):
    def run(directory, decoys, stop=None):
        keras.backend.clear_session(free_memory=False)
        keras.utils.set_random_seed(0)
        m = _two_outputs(decoys)
        cbs = [kss.StableCheckpoint(directory, save_freq="epoch")] + ([StopAt(*stop)] if stop else [])
        try:
            h = m.fit(X, [Y, -Y], epochs=3, batch_size=8, shuffle=True, verbose=0, callbacks=cbs)
        except RuntimeError:
            h = None
        return m, h

    ref, ref_h = run(tmp_path / "ref", 0)
    run(tmp_path / "run", 0, stop=(1, 0))
    res, h = run(tmp_path / "run", 6)
    saved_names, live_names = list(ref.output_names), list(res.output_names)
    assert saved_names != live_names  # the decoys shifted the auto names
    assert h.epoch == [0, 1, 2]
    expected = dict(ref_h.history)
    for old, new in zip(saved_names, live_names, strict=True):
        expected = {
            k.replace(old + "_", new + "_", 1) if k.startswith(old + "_") else k: v
            for k, v in expected.items()
        }
    assert sorted(h.history) == sorted(expected)
    for key, values in expected.items():
        assert len(h.history[key]) == 3, key
        np.testing.assert_allclose(h.history[key], values, rtol=1e-5, err_msg=key)
    assert not any(name in key for key in h.history for name in saved_names if name not in live_names)


def test_fault7_rename_history_keys_by_position():
    from keras_stable_state._state import rename_history_keys

    saved = {"loss": [1], "dense_1_loss": [2], "dense_10_loss": [3], "val_dense_10_mae": [4]}
    out = rename_history_keys(saved, ["dense_1", "dense_10"], ["head_a", "dense_1"])
    assert out == {"loss": [1], "head_a_loss": [2], "dense_1_loss": [3], "val_dense_1_mae": [4]}
    assert rename_history_keys(saved, None, ["a", "b"]) == saved  # an older checkpoint: unchanged
    assert rename_history_keys(saved, ["dense_1"], ["a", "b"]) == saved  # another count: unchanged


# -- fault 8 --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["run.orbax", "run.orbax/"])
def test_fault8_orbax_directory_holds_orbax_steps_not_h5_files(tmp_path, name):
    # A '*.orbax' directory's checkpoints are .orbax step directories (tests/manager/test_fit_orbax.py).
    pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint (the [orbax] extra) is not installed")
    ckpt = kss.StableCheckpoint(str(tmp_path) + "/" + name)
    assert not (tmp_path / "run.orbax").exists()  # made at train begin
    from keras_stable_state._manager.directory import path_of

    assert path_of(ckpt.directory, 7).endswith("ckpt-0000000007.orbax")


# -- fault 9 --------------------------------------------------------------------------------
def test_fault9_manual_route_report_says_only_stable_checkpoint_restores_the_order(tmp_path):
    m = mlp(6, 8, activation="relu", inner=lambda: keras.optimizers.SGD(1e-2))
    m.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    kss.save_training_state(tmp_path / "s.h5", m)
    keras.backend.clear_session(free_memory=False)
    fresh = mlp(6, 8, activation="relu", inner=lambda: keras.optimizers.SGD(1e-2))
    report = kss.restore_training_state(tmp_path / "s.h5", fresh)
    assert "rng" in report.restored_state
    assert re.search(r"only StableCheckpoint restores it", str(report))
    keras.backend.clear_session(free_memory=False)
    fresh = mlp(6, 8, activation="relu", inner=lambda: keras.optimizers.SGD(1e-2))
    report = kss.restore_training_state(tmp_path / "s.h5", fresh, include_rng=False)
    assert "data order" not in str(report)


def test_fault9_the_exact_way_epoch_end_checkpoints_with_shuffle(tmp_path):
    """What docs/how-to/resume-fit.md shows for epoch-end saves: StableCheckpoint with
    save_freq='epoch', killed between epochs, resumed by a fresh model."""
    ref, _, ref_h = _fit(tmp_path / "ref", ckpt_kw={"save_freq": "epoch"}, epochs=4)
    _fit(tmp_path / "run", stop=(2, 0), ckpt_kw={"save_freq": "epoch"}, epochs=4)
    res, ckpt, h = _fit(tmp_path / "run", ckpt_kw={"save_freq": "epoch"}, epochs=4)
    assert ckpt.restore_report is not None
    assert int(res.optimizer.iterations) == 40
    np.testing.assert_allclose(h.history["loss"], ref_h.history["loss"], rtol=1e-6)
    _assert_same_weights(ref, res)


# -- callbacks whose state the library cannot see (found by the resume matrix) ----------------
# The resume matrix's custom callback: halves the learning rate every second epoch it has seen,
# counting in a plain attribute (saved through get_state/set_state, or not).
def _EveryOtherEpoch():
    return rm.custom_callback(with_state=False)


def _EveryOtherEpochWithState():
    return rm.custom_callback(with_state=True)


@pytest.mark.parametrize("given", [False, True], ids=["not-given", "given-in-callbacks"])
def test_a_callback_without_get_state_is_warned_about_on_resume(tmp_path, given):
    _fit(tmp_path, stop=(1, 5), extra=[_EveryOtherEpoch()])
    cb = _EveryOtherEpoch()
    kw = {"callbacks": {"every": cb}} if given else None
    with pytest.warns(kss.InexactResumeWarning, match=r"EveryOtherEpoch of this fit has no get_state"):
        _fit(tmp_path, extra=[cb], ckpt_kw=kw)


def test_a_callback_with_get_state_resumes_exactly_without_a_warning(tmp_path):
    ref_cb = _EveryOtherEpochWithState()
    ref, _, _ = _fit(tmp_path / "ref", extra=[ref_cb], ckpt_kw={"callbacks": {"every": ref_cb}}, epochs=4)
    first = _EveryOtherEpochWithState()
    _fit(tmp_path / "run", stop=(2, 2), extra=[first], ckpt_kw={"callbacks": {"every": first}}, epochs=4)
    cb = _EveryOtherEpochWithState()
    with warnings.catch_warnings():
        warnings.simplefilter("error", kss.InexactResumeWarning)
        res, _, _ = _fit(tmp_path / "run", extra=[cb], ckpt_kw={"callbacks": {"every": cb}}, epochs=4)
    assert cb.seen == 4
    _assert_same_weights(ref, res)
