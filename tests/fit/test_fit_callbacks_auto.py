"""Callbacks without configuration (issue 33, item 4): every callback of the ``fit`` whose
state is known (Keras' own) or self-described (``get_state``/``set_state``) is saved and
restored by ``StableCheckpoint`` without being named, keyed ``"<ClassName>/<i>"`` by its
position among the fit's callbacks of that class; a fit whose callbacks differ from the
checkpoint's is warned about, naming the keys; a user callback without state still warns."""

import os

import keras
import numpy as np
import pytest
from kit import StopAt, assert_same_state, mlp

import keras_stable_state as kss

X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")
EPOCHS = 8
PACKAGE = os.path.dirname(kss.__file__) + os.sep  # the warnings point out of it, at the fit


class EpochHalver(keras.callbacks.Callback):
    """Adds ``step`` to its counter at each epoch end and halves the learning rate when the
    counter reaches a multiple of ``every``: its counter (its state) decides when."""

    def __init__(self, every, step=1):
        super().__init__()
        self.every, self.step, self.seen = every, step, 0

    def on_epoch_end(self, epoch, logs=None):
        before = self.seen
        self.seen += self.step
        if self.seen // self.every > before // self.every:
            lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            self.model.optimizer.learning_rate = lr * 0.5

    def get_state(self):
        return {"seen": self.seen}

    def set_state(self, state):
        self.seen = int(state["seen"])


class Tally(keras.callbacks.Callback):
    """A user callback with state but no ``get_state``/``set_state``: nothing can read it."""

    def __init__(self):
        super().__init__()
        self.epochs = 0

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1


def _callbacks():
    """The stateful callbacks of one fit, none named: two EarlyStopping (the first never
    sees an improvement after epoch 0 and stops at the end of epoch 3; the second sees
    every epoch improve), a ReduceLROnPlateau that reduces after every epoch without
    improvement, a LearningRateScheduler, and two EpochHalver whose counters differ."""
    return [
        keras.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1e9),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1e9, cooldown=1),
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9 if epoch % 2 else lr),
        EpochHalver(every=3),
        keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=0.0),
        EpochHalver(every=4, step=2),
    ]


def _state_of(cb):
    """What each kind of callback decides with, by attribute."""
    names = ("wait", "best", "stopped_epoch", "best_epoch", "cooldown_counter", "seen")
    return {n: getattr(cb, n) for n in names if hasattr(cb, n)}


def _fit(directory, callbacks, *, stop=None, seed=0, save_freq="epoch", named=None):
    """A fit of ``EPOCHS`` epochs with ``callbacks`` after a ``StableCheckpoint`` of
    ``directory`` (none for ``None``), stopped by ``stop``; the model is made under ``seed``."""
    model = mlp(seed=seed)
    ckpt = None
    cbs = list(callbacks)
    if directory is not None:
        ckpt = kss.StableCheckpoint(directory, save_freq=save_freq, callbacks=named)
        cbs.insert(0, ckpt)
    if stop is not None:
        cbs.append(stop)
    try:
        history = model.fit(X, Y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=cbs)
    except RuntimeError as err:
        assert stop is not None and str(err) == stop.message
        history = None
    return model, ckpt, history


@pytest.mark.parametrize("where", ["epoch", "mid-epoch"])
def test_unnamed_callbacks_resume_like_an_uninterrupted_fit(tmp_path, where):
    ref_cbs = _callbacks()
    ref, _, ref_history = _fit(None, ref_cbs)
    # The first EarlyStopping stops the run at the end of epoch 3, after the resume below.
    assert ref_history.epoch == [0, 1, 2, 3] and ref_cbs[0].stopped_epoch == 3

    stop, save_freq = (StopAt(epoch=2), "epoch") if where == "epoch" else (StopAt(epoch=2, batch=5), 3)
    _fit(tmp_path, _callbacks(), stop=stop, save_freq=save_freq)
    cbs = _callbacks()
    model, ckpt, history = _fit(tmp_path, cbs, seed=1, save_freq=save_freq)  # no warning: none is unsaved

    assert [_state_of(cb) for cb in cbs] == [_state_of(cb) for cb in ref_cbs]
    assert cbs[0].stopped_epoch == 3
    assert history.epoch == ref_history.epoch
    assert history.history == ref_history.history  # the loss and learning rate of every epoch
    assert_same_state(model, ref)
    restored = sorted(s for s in ckpt.restore_report.restored_state if s.startswith("callback:"))
    keys = ["EarlyStopping/0", "EarlyStopping/1", "EpochHalver/0", "EpochHalver/1", "History/0"]
    keys += ["LearningRateScheduler/0", "ReduceLROnPlateau/0"]
    assert restored == [f"callback:{k}" for k in sorted(keys)]


def test_a_callback_named_and_in_the_fit_is_saved_once_under_its_name(tmp_path):
    """Named callbacks keep their names; one outside the fit call is saved too; the unnamed
    ones of the same class are keyed by position among the unnamed ones."""
    first = keras.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1e9)
    other = keras.callbacks.EarlyStopping(monitor="loss", patience=2)
    outside = EpochHalver(every=2)
    outside.seen = 5
    named = {"stop": first, "outside": outside}
    _fit(tmp_path, [other, first], stop=StopAt(epoch=2), named=named)
    first, other, outside = (
        keras.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1e9),
        keras.callbacks.EarlyStopping(monitor="loss", patience=2),
        EpochHalver(every=2),
    )
    _, ckpt, history = _fit(tmp_path, [other, first], named={"stop": first, "outside": outside})
    restored = sorted(s for s in ckpt.restore_report.restored_state if s.startswith("callback:"))
    assert restored == [
        "callback:EarlyStopping/0",
        "callback:History/0",
        "callback:outside",
        "callback:stop",
    ]
    assert outside.seen == 5  # never ran in a fit: its saved state came back
    assert first.stopped_epoch == 3 and history.epoch == [0, 1, 2, 3]


def test_callbacks_that_differ_from_the_checkpoint_are_warned_about_by_key(tmp_path):
    _fit(tmp_path / "a", _callbacks(), stop=StopAt(epoch=2))
    # One EarlyStopping fewer: the saved state of the second one is taken by nothing.
    cbs = [cb for cb in _callbacks() if not isinstance(cb, keras.callbacks.EarlyStopping)]
    cbs.insert(0, keras.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1e9))
    with pytest.warns(
        kss.InexactResumeWarning, match=r"holds the state of the callbacks \['EarlyStopping/1'\]"
    ) as caught:
        _, ckpt, _ = _fit(tmp_path / "a", cbs)
    assert ckpt.restore_report.dropped == ["callback:EarlyStopping/1"]
    assert [w.filename for w in caught if w.filename.startswith(PACKAGE)] == []

    # A checkpoint of named callbacks only (as versions before this one wrote them when the
    # others were not named) still resumes: the named one comes back, the new one is named.
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1e9)
    _fit(tmp_path / "b", [es], stop=StopAt(epoch=2), named={"es": es})
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1e9)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1)
    with pytest.warns(
        kss.InexactResumeWarning,
        match=r"holds no state for the callbacks \['ReduceLROnPlateau/0 \(best, cooldown_counter, wait\)'\]",
    ) as caught:
        _, ckpt, history = _fit(tmp_path / "b", [es, plateau], named={"es": es})
    assert [w.filename for w in caught if w.filename.startswith(PACKAGE)] == []
    assert "callback:es" in ckpt.restore_report.restored_state
    assert "callback:ReduceLROnPlateau/0" in ckpt.restore_report.left_fresh
    assert es.stopped_epoch == 3 and history.epoch == [0, 1, 2, 3]


def test_a_user_callback_without_state_still_warns_and_the_warning_points_out_of_the_package(tmp_path):
    _fit(tmp_path, [Tally()], stop=StopAt(epoch=1))
    with pytest.warns(kss.InexactResumeWarning, match=r"Tally of this fit has no get_state") as caught:
        _fit(tmp_path, [Tally()])
    assert [w.filename for w in caught if w.filename.startswith(PACKAGE)] == []


class _Unsavable(keras.callbacks.Callback):
    def get_state(self):
        return {"seen": 1, "log": open}  # a function: no JSON value

    def set_state(self, state):
        pass


def test_a_self_described_state_json_cannot_hold_is_refused_naming_its_record(tmp_path):
    """Saved without being named, a callback whose get_state() holds a value that is neither
    JSON nor an array is refused at the first save, naming its record and the field."""
    with pytest.raises(
        TypeError, match=r"'callbacks/_Unsavable/0' holds a builtin_function_or_method at '/log'"
    ):
        _fit(tmp_path, [_Unsavable()])
