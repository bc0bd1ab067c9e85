"""Regression tests for the users' cases in ../shared/cases (01, 02, 03), on every backend.

Each asserts the right value from ../shared/cases/README.md with our API, and a
variation of the input, so the kind of fault is covered, not only that script.
"""

import warnings

import keras
import numpy as np
import pytest
from conftest import LrLog, slots_by_key, to_np
from kit import StopAt, mlp

import keras_stable_state as kss

rng = np.random.default_rng(0)
X = rng.normal(size=(32, 4)).astype("float32")
Y = rng.normal(size=(32, 1)).astype("float32")


# -- 01: positional slot swap -------------------------------------------------
class NetV1(keras.Model):
    def __init__(self, named=True, **kw):
        super().__init__(**kw)
        n = (lambda s: s) if named else (lambda s: None)
        self.branch_a = keras.layers.Dense(4, name=n("branch_a"))
        self.branch_b = keras.layers.Dense(4, name=n("branch_b"))
        self.head = keras.layers.Dense(1, name=n("head"))

    def call(self, x):
        return self.head(self.branch_a(x) * 0.3 + self.branch_b(x) * 1.7)


class NetV2(NetV1):  # refactor: branch_b declared first, same math
    def __init__(self, named=True, **kw):
        keras.Model.__init__(self, **kw)
        n = (lambda s: s) if named else (lambda s: None)
        self.branch_b = keras.layers.Dense(4, name=n("branch_b"))
        self.branch_a = keras.layers.Dense(4, name=n("branch_a"))
        self.head = keras.layers.Dense(1, name=n("head"))


@pytest.mark.parametrize("named", [True, False], ids=["user-named", "auto-named"])
@pytest.mark.parametrize("ext", ["keras", "h5"])
@pytest.mark.parametrize(
    "make_opt", [lambda: keras.optimizers.Adam(1e-2), lambda: keras.optimizers.RMSprop(1e-2, momentum=0.9)]
)
def test_01_slots_follow_their_variable_after_refactor(tmp_path, named, ext, make_opt):
    keras.utils.set_random_seed(1)
    a = NetV1(named)
    a.compile(optimizer=kss.StableOptimizer(make_opt(), model=a), loss="mse")
    a.fit(X, Y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    path = tmp_path / f"ckpt.{ext}"
    kss.save_training_state(path, a)

    b = NetV2(named)
    b.compile(optimizer=kss.StableOptimizer(make_opt(), model=b), loss="mse")
    b(X[:1])
    # the refactor really permutes the trainable variables (the fault's precondition)
    assert b.trainable_variables[0] is b.branch_b.kernel and a.trainable_variables[0] is a.branch_a.kernel
    report = kss.restore_training_state(path, b)
    assert not report.by_order
    saved, got = slots_by_key(a.optimizer), slots_by_key(b.optimizer)
    assert saved.keys() == got.keys()
    for k in saved:
        np.testing.assert_array_equal(got[k], saved[k], err_msg=k)
    # checked with Keras' own slot index, independent of our keys
    ia, ib = a.optimizer.inner_optimizer, b.optimizer.inner_optimizer
    for name in ("branch_a", "branch_b"):
        va, vb = getattr(a, name).kernel, getattr(b, name).kernel
        np.testing.assert_array_equal(
            to_np(ib._velocities[ib._get_variable_index(vb)]),
            to_np(ia._velocities[ia._get_variable_index(va)]),
        )
    # one more step: bit for bit equal to one more step of the original run
    a.train_on_batch(X[:8], Y[:8])
    b.train_on_batch(X[:8], Y[:8])
    for name in ("branch_a", "branch_b", "head"):
        la, lb = getattr(a, name), getattr(b, name)
        np.testing.assert_array_equal(to_np(la.kernel), to_np(lb.kernel))
        np.testing.assert_array_equal(to_np(la.bias), to_np(lb.bias))


def test_01_model_save_load_model_round_trip_after_refactor(tmp_path):
    """Same fault through model.save / load_model: slots load by key, not position."""
    keras.utils.set_random_seed(1)
    a = NetV1()
    a.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=a), loss="mse")
    a.fit(X, Y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    a.save(tmp_path / "m.keras")
    # load the file into the refactored class: weights by attribute, slots by key
    b = NetV2()
    b.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=b), loss="mse")
    b(X[:1])
    b.optimizer.build(b.trainable_variables)
    b.load_weights(tmp_path / "m.keras")
    saved, got = slots_by_key(a.optimizer), slots_by_key(b.optimizer)
    for k in saved:
        np.testing.assert_array_equal(got[k], saved[k], err_msg=k)


# -- 02: auto-name shift ----------------------------------------------------------
@pytest.mark.parametrize("ext", ["keras", "h5"])
def test_02_rebuilt_model_restores_fully_despite_autoname_shift(tmp_path, ext):
    x, y = X[:16, :3], Y[:16]
    first = mlp(3, 4, inner=keras.optimizers.Adam)
    first.fit(x, y, epochs=1, batch_size=8, verbose=0)
    kss.save_training_state(tmp_path / f"s.{ext}", first)
    second = mlp(3, 4, inner=keras.optimizers.Adam)
    second.fit(x[:8], y[:8], epochs=1, batch_size=8, verbose=0)  # builds its optimizer too
    assert [v.path for v in first.trainable_variables] != [v.path for v in second.trainable_variables]
    report = kss.restore_training_state(tmp_path / f"s.{ext}", second)
    assert len(report.by_name) == len(first.variables) + len(first.optimizer.variables)
    for a, b in zip(first.get_weights(), second.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    saved, got = slots_by_key(first.optimizer), slots_by_key(second.optimizer)
    for k in saved:
        np.testing.assert_array_equal(got[k], saved[k], err_msg=k)


def test_02_restore_that_matches_nothing_raises(tmp_path):
    first = mlp(3, 4, inner=keras.optimizers.Adam)
    first(X[:1, :3])
    kss.save_training_state(tmp_path / "s.h5", first)
    other = NetV1()
    other.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(), model=other), loss="mse")
    other(X[:1])
    with pytest.raises(kss.StateError, match="missing|No saved model variable matches"):
        kss.restore_training_state(tmp_path / "s.h5", other)
    with pytest.raises(kss.BindingError, match=r"No saved model variable in .* matches this model"):
        kss.restore_training_state(tmp_path / "s.h5", other, strict=False)


# -- 03: unbuilt optimizer skip ---------------------------------------------------
def _adam_cosine():  # case 03's optimizer: Adam over a cosine decay
    return keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=40))


@pytest.mark.parametrize("ext", ["keras", "h5"])
def test_03_compile_then_restore_restores_every_slot_iterations_and_lr(tmp_path, ext):
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    ref = mlp(5, 8, activation="relu", inner=_adam_cosine)
    ref.fit(x, y, epochs=4, batch_size=8, verbose=0, shuffle=False)  # 32 steps
    kss.save_training_state(tmp_path / f"ckpt.{ext}", ref)
    resumed = mlp(5, 8, activation="relu", inner=_adam_cosine)
    assert not resumed.optimizer.built
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # never a warn-and-skip
        report = kss.restore_training_state(tmp_path / f"ckpt.{ext}", resumed)
    assert report.built_optimizer and not report.left_fresh
    assert int(resumed.optimizer.iterations) == 32
    assert float(to_np(resumed.optimizer.learning_rate)) == float(to_np(ref.optimizer.learning_rate))
    saved, got = slots_by_key(ref.optimizer), slots_by_key(resumed.optimizer)
    assert saved.keys() == got.keys()
    for k in saved:
        np.testing.assert_array_equal(got[k], saved[k], err_msg=k)
    ref.train_on_batch(x[:8], y[:8])
    resumed.train_on_batch(x[:8], y[:8])
    for a, b in zip(ref.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@keras.saving.register_keras_serializable(package="tests")
class CustomCompileNet(keras.Model):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.d1 = keras.layers.Dense(8, activation="relu")
        self.d2 = keras.layers.Dense(1)

    def call(self, x):
        return self.d2(self.d1(x))

    def compile(self, optimizer="adam", **kw):
        super().compile(optimizer=optimizer, loss="mse", **kw)


def test_03_custom_compile_model_keeps_its_optimizer_state(tmp_path):
    x, y = X[:, :3], Y
    net = CustomCompileNet()
    net.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=net))
    net.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    kss.save_training_state(tmp_path / "net.keras", net)
    back = CustomCompileNet()
    back.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=back))
    back(x[:1])
    kss.restore_training_state(tmp_path / "net.keras", back)
    assert int(back.optimizer.iterations) == int(net.optimizer.iterations) == 8
    saved, got = slots_by_key(net.optimizer), slots_by_key(back.optimizer)
    for k in saved:
        np.testing.assert_array_equal(got[k], saved[k], err_msg=k)


def test_03_load_weights_into_unbuilt_stable_optimizer_defers_until_build(tmp_path):
    """Keras' own recipe (compile, load_weights) with our optimizer: state is kept and applied at build."""
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    ref = mlp(5, 8, activation="relu", inner=_adam_cosine)
    ref.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    ref.save_weights(tmp_path / "ckpt.weights.h5")
    resumed = mlp(5, 8, activation="relu", inner=_adam_cosine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_weights(tmp_path / "ckpt.weights.h5")
    resumed.optimizer.build(resumed.trainable_variables)
    assert int(resumed.optimizer.iterations) == 16
    saved, got = slots_by_key(ref.optimizer), slots_by_key(resumed.optimizer)
    for k in saved:
        np.testing.assert_array_equal(got[k], saved[k], err_msg=k)


# -- 06: callback state lost on resume ---------------------------------------------
def _session06(directory, interrupt=None):
    """A fresh 'process': new model, new callbacks, same checkpoint directory."""
    keras.utils.set_random_seed(0)
    x, y = X[:16, :3], Y[:16]
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    m.compile(optimizer=kss.StableOptimizer(keras.optimizers.SGD(1e-6), model=m), loss="mse")  # plateau
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1.0)
    rlr = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=2, factor=0.5, min_delta=1.0)
    best = keras.callbacks.ModelCheckpoint(
        str(directory) + "_best.keras", monitor="loss", save_best_only=True
    )
    log = LrLog()
    cbs = [kss.StableCheckpoint(directory, callbacks=[es, rlr, best, log]), es, rlr, best, log] + (
        [interrupt] if interrupt else []
    )
    try:
        history = m.fit(x, y, epochs=30, batch_size=16, verbose=0, callbacks=cbs)
    except RuntimeError:
        history = None
    return m, history, log, best, es


def test_06_resumed_run_stops_at_same_epoch_with_same_lrs_and_best(tmp_path):
    m1, h1, log1, best1, es1 = _session06(tmp_path / "a")
    _, none, log_i, _, _ = _session06(tmp_path / "b", interrupt=StopAt(epoch=3))
    assert none is None and sorted(log_i.lrs) == [0, 1, 2, 3]
    m2, h2, log2, best2, es2 = _session06(tmp_path / "b")
    assert min(log2.lrs) == 3  # really resumed, not restarted
    assert h2.epoch == h1.epoch and len(h1.epoch) < 30  # same stop epoch; History is whole
    assert es2.stopped_epoch == es1.stopped_epoch
    lrs = {**log_i.lrs, **log2.lrs}
    assert lrs == log1.lrs
    assert float(to_np(m2.optimizer.learning_rate)) == float(to_np(m1.optimizer.learning_rate))
    assert best2.best == best1.best
    np.testing.assert_array_equal(h2.history["loss"], h1.history["loss"])


# -- 08: mid-epoch backup replays batches -------------------------------------------
def _run08(directory, extra=()):
    keras.utils.set_random_seed(0)
    data = np.random.default_rng(0)
    x = data.normal(size=(40, 3)).astype("float32")  # 5 batches of 8 per epoch
    y = data.normal(size=(40, 1)).astype("float32")
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    m.compile(optimizer=kss.StableOptimizer(keras.optimizers.SGD(1e-2), model=m), loss="mse")
    try:
        m.fit(
            x, y, epochs=3, batch_size=8, shuffle=False, verbose=0,
            callbacks=[kss.StableCheckpoint(directory, save_freq=2, callbacks=extra), *extra],
        )  # fmt: skip
    except RuntimeError:
        pass
    return m


def test_08_mid_epoch_checkpoint_applies_each_batch_once(tmp_path):
    ref = _run08(tmp_path / "ref")
    interrupted = _run08(tmp_path / "int", extra=[StopAt(epoch=1, batch=3)])
    assert int(interrupted.optimizer.iterations) == 8
    res = _run08(tmp_path / "int")
    assert int(ref.optimizer.iterations) == int(res.optimizer.iterations) == 15  # stock Keras: 18
    for a, b in zip(ref.get_weights(), res.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
